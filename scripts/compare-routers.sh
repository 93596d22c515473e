#!/usr/bin/env bash
# vllm-router against `kvx router`, side by side on the same machine in one run: what decides which
# router kvx documents for xPyD (docs/OPERATIONS.md, "Many engines and a router").
#
#   scripts/compare-routers.sh            # everything below (about 30 minutes on 2 vCPUs)
#   KVX_COMPARE=floods scripts/compare-routers.sh   # one part: floods, 1p1d, 2p1d or kill
#
# - floods: scripts/router_flood.py against each router, the same stub vLLM servers behind it:
#   1,000 and 10,000 connections that stay idle or send half a request's headers, held while a
#   legitimate client sends /health and completions; its success rate and latency, the router's
#   memory and descriptors.
# - 1p1d, 2p1d: scripts/bench-vllm.sh (guidellm against real vLLM, KVX_COMPARE_CONFIG, default
#   kvx-ucx) through each router with one and with two prefill servers: TTFT p50/p99 per level.
# - kill: 2P1D through each router, the second prefill server killed (SIGKILL) after 4 KV transfers of the first
#   concurrency level: how many requests failed, and for how long after the kill.
#
# Output under target/router-compare: floods.csv, <part>-<router>/bench-vllm.csv (and kill.csv),
# and summary.md with every table. The kvx binary is the release build (cargo build --release
# -p kvx-cli; KVX_BIN names another), as a deployment would run it; vllm-router is the pinned
# PyPI build (scripts/install-vllm-router.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/target/router-compare"
PARTS="${KVX_COMPARE:-floods 1p1d 2p1d kill}"
CONFIG="${KVX_COMPARE_CONFIG:-kvx-ucx}"
mkdir -p "$OUT"
KVX="${KVX_BIN:-}"
if [ -z "$KVX" ]; then
    (cd "$ROOT" && cargo build -q --release -p kvx-cli)
    KVX="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvx"
fi
VLLM_ROUTER=$("$ROOT/scripts/install-vllm-router.sh" | tail -1)
cmd_of() { [ "$1" = kvx ] && echo "$KVX" || echo "$VLLM_ROUTER"; }

for part in $PARTS; do
    case $part in
        floods)
            rm -f "$OUT/floods.csv"
            for router in vllm-router kvx; do
                python3 "$ROOT/scripts/router_flood.py" --router "$router" --cmd "$(cmd_of "$router")" \
                    --csv "$OUT/floods.csv" --log "$OUT/floods-$router.log"
            done ;;
        1p1d | 2p1d | kill)
            for router in vllm-router kvx; do
                env=(KVX_VLLM_ROUTER="$router" KVX_BIN="$KVX" KVX_BENCH_CONFIGS="$CONFIG" KVX_VLLM_OUT="$OUT/$part-$router")
                case $part in
                    2p1d) env+=(KVX_BENCH_PREFILLS=2) ;;
                    kill) env+=(KVX_BENCH_PREFILLS=2 KVX_BENCH_KILL_AFTER=4 KVX_BENCH_CONCURRENCY=4 KVX_BENCH_RATES=- KVX_BENCH_REQUESTS=48) ;;
                esac
                env "${env[@]}" "$ROOT/scripts/bench-vllm.sh" || echo "compare-routers: $part through $router: bench-vllm.sh failed" >&2
            done ;;
        *) echo "compare-routers: unknown part $part" >&2; exit 2 ;;
    esac
done

python3 - "$OUT" >"$OUT/summary.md" <<'PY'
import csv, os, sys
out = sys.argv[1]
def table(path, title):
    if not os.path.exists(path):
        return
    rows = list(csv.DictReader(open(path)))
    if not rows:
        return
    print(f"\n### {title}\n")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(r.values()) + " |")
table(f"{out}/floods.csv", "Floods (stub servers behind each router)")
for part in ("1p1d", "2p1d", "kill"):
    for router in ("vllm-router", "kvx"):
        table(f"{out}/{part}-{router}/bench-vllm.csv", f"{part} through {router}")
        table(f"{out}/{part}-{router}/kill.csv", f"{part} through {router}: the kill")
PY
cat "$OUT/summary.md"

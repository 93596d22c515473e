#!/usr/bin/env bash
# kvx-ucx (or kvx-tcp: --backend tcp) over TCP against Mooncake Transfer Engine's TCP transport on
# the same scattered blocks, round by round (kvx round, Mooncake round, kvx round, ...), with kvx
# bench's plain TCP stream from the same kvx rounds: prints size, kvx GB/s, Mooncake GB/s, stream
# GB/s, the median of the per-round kvx / Mooncake ratios (issue 14's goal: >= 1.5 at every size),
# the same for the stream (what a data path that sends from the pool and receives into the slot
# over one connection reaches) and both sides' CPU seconds per GB. A by-hand benchmark, not part of
# scripts/test.sh. Options go to scripts/bench_mooncake.py:
#   --backend ucx|tcp  --sizes 16K,64K,1M  --blocks 1000  --pool-blocks 2000  --rounds 5  --csv FILE
#   --stream-batch N (the stream moves N blocks per writev/readv: a kvx TCP data path's bound)
# Environment:
#   KVX_MOONCAKE_VENV  the venv (default .venv-mooncake, gitignored): created on first use with
#                      mooncake-transfer-engine 0.3.13, nvidia-cuda-runtime-cu12 and numpy
#   KVX_BIN            a kvx built with --features ucx (default: built here, release; kvx-tcp is
#                      in every build)
# Mooncake's wheel links libcuda.so.1 even for TCP; where the machine has no CUDA driver, a stub
# exporting the cu* functions engine.so links, each failing with CUDA_ERROR_NO_DEVICE, is compiled
# into the venv. Exits 77 with the reason when Mooncake cannot be installed or imported.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MOONCAKE_VERSION=0.3.13
VENV="${KVX_MOONCAKE_VENV:-$ROOT/.venv-mooncake}"

skip() {
    echo "bench-mooncake: SKIP: $*" >&2
    exit 77
}

if ! "$VENV/bin/python" -c 'import numpy, mooncake' 2>/dev/null; then
    echo "bench-mooncake: preparing $VENV (mooncake-transfer-engine $MOONCAKE_VERSION)" >&2
    python3 -m venv "$VENV" || skip "python3 -m venv failed (Debian: python3-venv)"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "mooncake-transfer-engine==$MOONCAKE_VERSION" nvidia-cuda-runtime-cu12 numpy ||
        skip "pip could not install mooncake-transfer-engine $MOONCAKE_VERSION (x86_64 Linux wheels only)"
fi
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
engine="$site/mooncake/engine.so"
[ -f "$engine" ] || skip "$engine is missing: not the mooncake-transfer-engine wheel this script knows"
cudart="$site/nvidia/cuda_runtime/lib"
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# (ldd's output first: under pipefail, `ldd | grep -q` fails when grep exits before ldd is done.)
linked="$(ldd "$engine")"
if grep -q 'libcuda.so.1 => not found' <<<"$linked"; then
    stub="$VENV/kvx-libcuda-stub"
    if [ ! -f "$stub/libcuda.so.1" ]; then
        command -v cc >/dev/null || skip "no libcuda.so.1 and no C compiler to build its stub"
        mkdir -p "$stub"
        {
            echo '/* libcuda.so.1 stub for Mooncake over TCP (scripts/bench-mooncake.sh): no device. */'
            for sym in $(nm -D --undefined-only "$engine" | awk '{print $2}' | grep -E '^cu[A-Z]'); do
                case "$sym" in
                    cuGetErrorName | cuGetErrorString)
                        echo "int $sym(int e, const char **s) { if (s) *s = \"CUDA_ERROR_NO_DEVICE (stub)\"; return 0; }" ;;
                    *) echo "int $sym(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }" ;;
                esac
            done
        } > "$stub/stub.c"
        cc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so.1" "$stub/stub.c" ||
            skip "could not build the libcuda.so.1 stub"
    fi
    export LD_LIBRARY_PATH="$stub:$LD_LIBRARY_PATH"
fi
import_error="$("$VENV/bin/python" -c 'from mooncake.engine import TransferEngine' 2>&1)" ||
    skip "mooncake.engine does not import: $(tail -n 1 <<<"$import_error")"

if [ -z "${KVX_BIN:-}" ]; then
    cargo build --release --quiet -p kvx-cli --features ucx
    KVX_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvx"
fi

# Mooncake's handshake and TCP listeners away from the ports the CI's vLLM test uses.
export MC_MIN_RPC_PORT="${MC_MIN_RPC_PORT:-17100}" MC_MAX_RPC_PORT="${MC_MAX_RPC_PORT:-17899}"
export UCX_LOG_LEVEL="${UCX_LOG_LEVEL:-fatal}"
log="$(mktemp -t kvx-bench-mooncake.XXXXXX.log)"
echo "bench-mooncake: Mooncake's logs in $log" >&2
exec "$VENV/bin/python" scripts/bench_mooncake.py --kvx "$KVX_BIN" --log "$log" "$@"

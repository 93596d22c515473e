#!/usr/bin/env bash
# kvx-nixl against NIXL's own Python API (the same NIXL library, the same scattered blocks, two
# processes each), at 16 KiB, 64 KiB and 1 MiB, with and without NIXL's progress thread: runs
# `cargo bench -p kvx-nixl --bench vs_python`, which prints kvx / Python per row from one run.
#   KVX_BENCH_REPS   alternating runs of each side per row (default 3)
# Needs the NIXL wheel (scripts/install-nixl.sh). NIXL's Python API needs numpy, which the wheel's
# venv leaves out (--no-deps): a second venv, .venv-nixl-bench, gets numpy and a .pth file that
# puts .venv-nixl's site-packages (the same nixl_cu12) on its path.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/nixl-env.sh
source scripts/nixl-env.sh

BENCH_VENV="$ROOT/.venv-nixl-bench"
if ! "$BENCH_VENV/bin/python" -c 'import numpy, nixl_cu12' 2>/dev/null; then
    echo "bench-nixl-python: preparing $BENCH_VENV (numpy; nixl_cu12 from .venv-nixl)"
    python3 -m venv "$BENCH_VENV"
    "$BENCH_VENV/bin/pip" install --quiet --disable-pip-version-check numpy
    wheel_site=("$ROOT"/.venv-nixl/lib/python3*/site-packages)
    bench_site=("$BENCH_VENV"/lib/python3*/site-packages)
    (cd "${wheel_site[0]}" && pwd -P) > "${bench_site[0]}/kvx-nixl-wheel.pth"
fi

export KVX_NIXL_PYTHON="$BENCH_VENV/bin/python"
exec cargo bench -p kvx-nixl --bench vs_python

#!/usr/bin/env bash
# Installs guidellm (the PyPI package vLLM's project publishes for benchmarking OpenAI-compatible
# servers) and matplotlib (for the plot) into a venv of their own OUTSIDE the clone, so repeated
# runs reuse it, and prints the path of its `guidellm` command (the last line).
# scripts/bench-vllm.sh drives the vLLM servers with it.
#
#   KVX_GUIDELLM_VENV     the venv (default $HOME/.cache/kvx/venv-guidellm)
#   KVX_GUIDELLM_VERSION  the version (default 0.8.1, the one the docs were measured with):
#                         pinned, because its command line and its JSON report change between
#                         versions and scripts/bench-vllm.sh reads both
#
# Idempotent: installs only when the venv lacks that version. Exits non-zero on any failure.
set -euo pipefail

VENV="${KVX_GUIDELLM_VENV:-$HOME/.cache/kvx/venv-guidellm}"
VERSION="${KVX_GUIDELLM_VERSION:-0.8.1}"
MATPLOTLIB=3.11.2
say() { echo "install-guidellm: $*" >&2; }

installed() {
    [ -x "$VENV/bin/guidellm" ] && "$VENV/bin/python" - "$VERSION" "$MATPLOTLIB" >/dev/null 2>&1 <<'PY'
import importlib.metadata as m, sys
assert m.version("guidellm") == sys.argv[1] and m.version("matplotlib") == sys.argv[2]
PY
}

if ! installed; then
    say "installing guidellm $VERSION and matplotlib $MATPLOTLIB in $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        mkdir -p "$(dirname "$VENV")"
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip --disable-pip-version-check install -q "guidellm==$VERSION" "matplotlib==$MATPLOTLIB"
    installed || { say "guidellm $VERSION is not usable in $VENV after the install"; exit 1; }
fi
"$VENV/bin/guidellm" --version >/dev/null || { say "$VENV/bin/guidellm --version failed"; exit 1; }
say "guidellm $VERSION ready"
echo "$VENV/bin/guidellm"

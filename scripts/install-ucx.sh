#!/usr/bin/env bash
# Installs what kvx-ucx needs to build and test: UCX >= 1.13 headers and libraries (libucx-dev),
# ucx_perftest (ucx-utils, for the benchmark), libclang (bindgen) and pkg-config.
# Idempotent: does nothing when everything is present. Needs root (or sudo) only when installing.
set -euo pipefail

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for pkg in libucx-dev ucx-utils libclang-dev pkg-config; do
    installed "$pkg" || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-ucx: UCX $(pkg-config --modversion ucx), ucx_perftest, libclang and pkg-config present"
    exit 0
fi

echo "install-ucx: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q "${missing[@]}"
pkg-config --atleast-version=1.13 ucx || { echo "install-ucx: UCX >= 1.13 still not found" >&2; exit 1; }
echo "install-ucx: UCX $(pkg-config --modversion ucx) installed"

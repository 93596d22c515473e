#!/usr/bin/env bash
# Installs what kvx-ucx needs to build and test: UCX >= 1.13 headers and libraries (libucx-dev),
# ucx_perftest (ucx-utils, for the benchmark), libclang (bindgen) and pkg-config.
# Idempotent: does nothing when everything is present. Needs root (or sudo) only when installing.
set -euo pipefail
# shellcheck source=scripts/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

apt_ensure install-ucx libucx-dev ucx-utils libclang-dev pkg-config
pkg-config --atleast-version=1.13 ucx || { echo "install-ucx: UCX >= 1.13 not found" >&2; exit 1; }
echo "install-ucx: UCX $(pkg-config --modversion ucx), ucx_perftest, libclang and pkg-config present"

#!/usr/bin/env bash
# Installs what etcd discovery needs to build and test: protoc (protobuf-compiler, for the etcd
# client's gRPC stubs in kvx-etcd) and the etcd server (etcd-server, started by the tests on free
# local ports). Idempotent: does nothing when both are present. Needs root (or sudo) only when
# installing.
set -euo pipefail
# shellcheck source=scripts/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

apt_ensure install-etcd protobuf-compiler etcd-server
if ! command -v protoc >/dev/null || ! command -v etcd >/dev/null; then
    echo "install-etcd: protoc or etcd not found" >&2
    exit 1
fi
echo "install-etcd: $(protoc --version) and etcd $(etcd --version | head -1 | awk '{print $3}') present"

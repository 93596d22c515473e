#!/usr/bin/env bash
# Installs what etcd discovery needs to build and test: protoc (protobuf-compiler, for the etcd
# client's gRPC stubs in kvx-etcd) and the etcd server (etcd-server, started by the tests on free
# local ports). Idempotent: does nothing when both are present. Needs root (or sudo) only when
# installing.
set -euo pipefail

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for pkg in protobuf-compiler etcd-server; do
    installed "$pkg" || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-etcd: $(protoc --version) and etcd $(etcd --version | head -1 | awk '{print $3}') present"
    exit 0
fi

echo "install-etcd: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q "${missing[@]}"
command -v protoc >/dev/null && command -v etcd >/dev/null \
    || { echo "install-etcd: protoc or etcd still not found" >&2; exit 1; }
echo "install-etcd: $(protoc --version) and etcd $(etcd --version | head -1 | awk '{print $3}') installed"

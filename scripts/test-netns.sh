#!/usr/bin/env bash
# `kvx prefill` and `kvx decode` on two network hosts: two network namespaces made for this run,
# joined by a veth pair with addresses from a /30 drawn per run, `lo` up in each, no default route
# and nothing else attached (no route out: only the two namespaces and their loopback are ever
# targets). Checks, each run bounded in time:
#   - kvx-ucx over UCX's TCP transport (prefill bound to its veth address), kvx-nixl (NIXL's
#     UCX backend) over TCP (prefill bound to 0.0.0.0, advertising its veth address), and kvx-tcp
#     (both engines bound to 0.0.0.0, each advertising its veth address: the prefill engine
#     connects back to the decode engine's agent to tell it of released holds): every request
#     finished, every byte verified, 0 blocks leaked on both sides, and the KV bytes crossed the
#     veth pair (its byte counters), so no shared-memory path (both namespaces share /dev/shm and
#     the process table) was taken instead;
#   - a prefill engine bound to its veth address but advertising 127.0.0.1: it warns at start, the
#     decode engine refuses every request's params (the misconfiguration named), and the prefill
#     engine still ends with 0 blocks leaked once its short leases expire;
#   - `kvx prefill --host 0.0.0.0` without `--advertise-host` is refused at start;
#   - kvx-ucx again with the engines finding each other through an etcd server in namespace A
#     (`--discovery etcd://`, no side-channel address in the params).
# The namespaces, the veth pair and the child processes go on every exit path.
#
# `scripts/test-netns.sh across COMMAND [ARGS..]` makes the same namespaces and runs COMMAND in A
# instead of the checks, with the benches' peers (kvx bench's target and TCP stream sender,
# bench_mooncake.py's Mooncake target) in B (`KVX_BENCH_PEER_WRAPPER`), each listening on its veth
# address (`KVX_BENCH_HOST`), and prints the bytes the veth pair carried to A, e.g.
#   scripts/test-netns.sh across target/release/kvx bench --backend tcp --transport tcp --stream-batch 16
#   KVX_BIN=target/release/kvx scripts/test-netns.sh across scripts/bench-mooncake.sh --backend tcp
#
# Usage: scripts/test-netns.sh [KVX]   (KVX: a kvx binary built with `--features ucx,nixl`;
#        default $KVX_BIN, else ${CARGO_TARGET_DIR:-target}/debug/kvx). Needs root (`ip netns`).
# Exits 77 when network namespaces cannot be made here (not root, no `ip`, no permission);
# scripts/test.sh counts that as a failure unless KVX_ALLOW_NO_NETNS=1.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly NO_NETNS=77
# Every process of a run ends within this many seconds (`timeout`), killed 5 s later at worst.
readonly RUN_LIMIT=120

across=()
if [ "${1:-}" = across ]; then
    shift
    across=("$@")
    [ ${#across[@]} -gt 0 ] || { echo "test-netns: across needs a command" >&2; exit 2; }
    set --
fi
kvx=${1:-${KVX_BIN:-${CARGO_TARGET_DIR:-target}/debug/kvx}}
if [ ${#across[@]} -eq 0 ]; then
    if [ ! -x "$kvx" ]; then
        echo "test-netns: no kvx binary at $kvx (cargo build -p kvx-cli --features ucx,nixl)" >&2
        exit 1
    fi
    kvx=$(realpath "$kvx")
fi
# kvx-nixl's libraries (the NIXL wheel in .venv-nixl).
# shellcheck source=scripts/nixl-env.sh
source scripts/nixl-env.sh

ns_a="kvx-a-$$"
ns_b="kvx-b-$$"
veth_a="kvxa$$"
veth_b="kvxb$$"
# A /30 of 10.0.0.0/8 drawn per run: .1 for A, .2 for B.
net="10.$((RANDOM % 256)).$((RANDOM % 256)).$(((RANDOM % 64) * 4))"
ip_a="${net%.*}.$((${net##*.} + 1))"
ip_b="${net%.*}.$((${net##*.} + 2))"
logs=$(mktemp -d)
children=()

cleanup() {
    local rc=$?
    # Once: a second Ctrl-C (a terminal, or `timeout`, signals the whole process group as well as
    # this shell) must not cut the cleanup short. It is bounded: every child runs under `timeout`.
    trap - EXIT
    trap '' INT TERM
    for pid in "${children[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${children[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    # Deleting a namespace deletes the veth end inside it, and with it the pair.
    ip netns delete "$ns_a" 2>/dev/null || true
    ip netns delete "$ns_b" 2>/dev/null || true
    ip link delete "$veth_a" 2>/dev/null || true
    rm -rf "$logs"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() { printf '\n--- %s\n' "$*"; }
fail() {
    echo "test-netns: FAILED: $*" >&2
    exit 1
}

if ! command -v ip >/dev/null; then
    echo "test-netns: the ip command (iproute2) is missing: cannot make network namespaces" >&2
    exit "$NO_NETNS"
fi
if ! why=$(ip netns add "$ns_a" 2>&1); then
    echo "test-netns: cannot make a network namespace here (root with CAP_SYS_ADMIN needed): $why" >&2
    exit "$NO_NETNS"
fi
ip netns add "$ns_b"
ip link add "$veth_a" netns "$ns_a" type veth peer name "$veth_b" netns "$ns_b"
ip -n "$ns_a" addr add "$ip_a/30" dev "$veth_a"
ip -n "$ns_b" addr add "$ip_b/30" dev "$veth_b"
for ns in "$ns_a" "$ns_b"; do
    ip -n "$ns" link set lo up
done
ip -n "$ns_a" link set "$veth_a" up
ip -n "$ns_b" link set "$veth_b" up
# A veth end has a carrier only a moment after both ends are up; UCX lists only running devices.
carrier() {
    [ "$(ip netns exec "$ns_a" cat "/sys/class/net/$veth_a/operstate")" = up ] &&
        [ "$(ip netns exec "$ns_b" cat "/sys/class/net/$veth_b/operstate")" = up ]
}
for _ in $(seq 100); do
    carrier && break
    sleep 0.05
done
carrier || fail "the veth pair has no carrier after 5 s"
echo "namespaces $ns_a ($veth_a $ip_a) and $ns_b ($veth_b $ip_b), /30, no other route"
if ip -n "$ns_a" route show default | grep -q . || ip -n "$ns_b" route show default | grep -q .; then
    fail "a namespace has a default route"
fi

# Bytes sent by A's end of the pair so far.
tx_bytes() { ip netns exec "$ns_a" cat "/sys/class/net/$veth_a/statistics/tx_bytes"; }

if [ ${#across[@]} -gt 0 ]; then
    step "${across[*]}: in $ns_a ($ip_a), the benches' peers in $ns_b ($ip_b)"
    rx_bytes() { ip netns exec "$ns_a" cat "/sys/class/net/$veth_a/statistics/rx_bytes"; }
    received=$(rx_bytes)
    ip netns exec "$ns_a" env KVX_BENCH_HOST="$ip_a" \
        KVX_BENCH_PEER_WRAPPER="ip netns exec $ns_b env KVX_BENCH_HOST=$ip_b" \
        timeout --kill-after=5 3600 "${across[@]}"
    echo "test-netns: the veth pair carried $(($(rx_bytes) - received)) bytes to the reader"
    exit 0
fi

# `start NS NAME [KEY=VALUE..] -- ARGS..`: `kvx ARGS..` in namespace NS with those variables
# added to the environment, stdout and stderr to $logs/NAME.{out,err}; its pid in $last.
start() {
    local ns=$1 name=$2
    shift 2
    local env=()
    while [ "$1" != -- ]; do
        env+=("$1")
        shift
    done
    shift
    ip netns exec "$ns" env "${env[@]}" timeout --kill-after=5 "$RUN_LIMIT" "$kvx" "$@" \
        >"$logs/$name.out" 2>"$logs/$name.err" &
    last=$!
    children+=("$last")
}

# Waits for pid $1 (bounded by its `timeout`); its exit status in $rc.
wait_for() {
    rc=0
    wait "$1" || rc=$?
}

show() {
    for f in "$@"; do
        echo "----- $f"
        cat "$logs/$f"
    done
}

# The value of summary row NAME in file $1 (`  blocks leaked          0`).
row() { sed -n "s/^  $2  *//p" "$logs/$1" | head -n 1; }

# Neither UCX (Debian's for kvx-ucx, the wheel's inside NIXL) may take a shared-memory or
# cross-memory-attach path (the namespaces share /dev/shm and the process table): TCP only, on
# the veth only. The variables for the process in namespace A ($1 = a) or B.
ucx_env() {
    local dev=$veth_b
    [ "$1" = a ] && dev=$veth_a
    echo "UCX_TLS=tcp UCX_NET_DEVICES=$dev UCX_LOG_LEVEL=error NIXL_LOG_LEVEL=WARN"
}

# Options of both processes of the next `transfer` (the discovery).
both=()
# Where the decode process of the next `transfer` binds (and what it advertises).
decode_bind=(--host "$ip_b")

# `transfer BACKEND PREFILL_HOST_ARGS..`: kvx-ucx, kvx-nixl or kvx-tcp across the pair, the prefill
# process bound as the arguments say, the decode process as `decode_bind`: every request and byte,
# 0 leaked, bytes on the veth.
transfer() {
    local backend=$1 requests=32
    shift
    step "$backend: kvx prefill in $ns_a ($* ${both[*]}), kvx decode in $ns_b"
    local before
    before=$(tx_bytes)
    # shellcheck disable=SC2046 # ucx_env's words
    start "$ns_a" "$backend-prefill" $(ucx_env a) -- prefill --backend "$backend" "$@" \
        --api-port 5600 --api-client "$ip_b" --timeout 100 "${both[@]}"
    local prefill=$last
    # shellcheck disable=SC2046
    start "$ns_b" "$backend-decode" $(ucx_env b) -- decode --backend "$backend" "${decode_bind[@]}" \
        --prefill "tcp://$ip_a:5600" --requests "$requests" --reconnect-timeout 30 --timeout 90 "${both[@]}"
    local decode=$last
    local rc_decode rc_prefill
    wait_for "$decode"
    rc_decode=$rc
    # A decode process that failed leaves its prefill process waiting: end it.
    [ "$rc_decode" = 0 ] || kill -TERM "$prefill" 2>/dev/null || true
    wait_for "$prefill"
    rc_prefill=$rc
    show "$backend-prefill.out" "$backend-decode.out"
    if [ "$rc_decode" != 0 ] || [ "$rc_prefill" != 0 ]; then
        show "$backend-prefill.err" "$backend-decode.err"
        fail "$backend: decode exited $rc_decode, prefill $rc_prefill"
    fi
    local sent=$(($(tx_bytes) - before))
    [ "$(row "$backend-decode.out" requests)" = "$requests ($requests finished, 0 failed)" ] ||
        fail "$backend: not every request finished"
    [ "$(row "$backend-decode.out" 'blocks mismatched')" = 0 ] || fail "$backend: wrong bytes"
    [ "$(row "$backend-decode.out" 'blocks leaked')" = 0 ] || fail "$backend: blocks leaked (both sides)"
    [ "$(row "$backend-prefill.out" 'blocks leaked')" = 0 ] || fail "$backend: the prefill side leaked"
    local moved verified
    moved=$(row "$backend-decode.out" 'bytes moved')
    verified=$(row "$backend-decode.out" 'blocks verified' | sed -n 's/.*(\(.*\) checked)/\1/p')
    if [ "$moved" != "$verified" ] || [ "$moved" = "0.0 MB" ]; then
        fail "$backend: moved $moved, verified $verified"
    fi
    # The decode engine READs: the KV leaves A through its end of the pair.
    local moved_bytes
    moved_bytes=$(awk -v mb="${moved% MB}" 'BEGIN { printf "%d", mb * 1e6 * 0.99 }')
    [ "$sent" -ge "$moved_bytes" ] || fail "$backend: $moved moved but only $sent bytes left $veth_a"
    echo "$backend: $requests requests, $verified verified, 0 leaked; $sent bytes over $veth_a"
}

transfer ucx --host "$ip_a"
# Bound on every interface of A (lo and the veth), advertising the veth's address.
transfer nixl --host 0.0.0.0 --advertise-host "$ip_a"
# kvx-tcp: both bound on every interface of their namespace, each advertising its veth address.
decode_bind=(--host 0.0.0.0 --advertise-host "$ip_b")
transfer tcp --host 0.0.0.0 --advertise-host "$ip_a"
decode_bind=(--host "$ip_b")

# The engines find each other through an etcd server on A's veth address (kvx-etcd): the params
# carry no side-channel host or port.
step "etcd in $ns_a on $ip_a:2379"
etcd_log="$logs/etcd.log"
ip netns exec "$ns_a" timeout --kill-after=5 "$RUN_LIMIT" etcd --name kvx-netns --data-dir "$logs/etcd" \
    --listen-client-urls "http://$ip_a:2379" --advertise-client-urls "http://$ip_a:2379" \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster kvx-netns=http://127.0.0.1:2380 >"$etcd_log" 2>&1 &
children+=("$!")
for _ in $(seq 300); do
    grep -q "ready to serve client requests" "$etcd_log" && break
    sleep 0.1
done
grep -q "ready to serve client requests" "$etcd_log" || { tail -20 "$etcd_log"; fail "etcd not ready after 30 s"; }
both=(--discovery "etcd://$ip_a:2379")
transfer ucx --host "$ip_a"
grep -q "handshakes through etcd://$ip_a:2379" "$logs/ucx-prefill.out" ||
    fail "the prefill engine did not publish through etcd"
both=()

step "misconfiguration: prefill binds $ip_a but advertises 127.0.0.1"
# Leases of 2 s: the holds the decode engine never reads expire soon after the refusals.
# shellcheck disable=SC2046
start "$ns_a" loop-prefill $(ucx_env a) -- prefill --backend ucx --host "$ip_a" --advertise-host 127.0.0.1 \
    --api-port 5600 --api-client "$ip_b" --lease 2 --timeout 60
prefill=$last
# shellcheck disable=SC2046
start "$ns_b" loop-decode $(ucx_env b) -- decode --backend ucx --host "$ip_b" --prefill "tcp://$ip_a:5600" \
    --requests 4 --lease 2 --reconnect-timeout 30 --timeout 60
decode=$last
wait_for "$decode"
rc_decode=$rc
wait_for "$prefill"
rc_prefill=$rc
show loop-prefill.out loop-prefill.err loop-decode.out loop-decode.err
grep -q "warning: advertising loopback address 127.0.0.1 while binding $ip_a" "$logs/loop-prefill.err" ||
    fail "the prefill engine did not warn about advertising loopback"
[ "$rc_decode" = 1 ] || fail "decode exited $rc_decode, not 1 (failed requests)"
refused=$(grep -c "failed: invalid peer data: misconfigured prefill engine: reached at $ip_a" \
    "$logs/loop-decode.err" || true)
[ "$refused" = 4 ] || fail "$refused of 4 requests refused as misconfigured"
[ "$(row loop-decode.out requests)" = "4 (0 finished, 4 failed)" ] || fail "requests not failed"
[ "$rc_prefill" = 0 ] || fail "prefill exited $rc_prefill"
[ "$(row loop-prefill.out 'blocks leaked')" = 0 ] || fail "the prefill side leaked"
[ "$(row loop-decode.out 'blocks leaked')" = 0 ] || fail "blocks leaked after the refusals"
echo "misconfiguration: warned, 4 of 4 requests refused, 0 leaked once the holds expired"

step "misconfiguration: prefill binds 0.0.0.0 without --advertise-host"
start "$ns_a" any-prefill -- prefill --host 0.0.0.0 --api-port 5600 --timeout 10
wait_for "$last"
show any-prefill.err
[ "$rc" = 2 ] || fail "kvx prefill --host 0.0.0.0 exited $rc, not 2 (refused)"
grep -q "invalid argument: --host 0.0.0.0 binds every interface.*--advertise-host" "$logs/any-prefill.err" ||
    fail "no clear refusal of --host 0.0.0.0"

step "network namespaces: all checks passed"

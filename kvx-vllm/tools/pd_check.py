"""Disaggregated prefill/decode check against two running vLLM servers (stdlib only).

For each prompt (random token ids, fresh per trial, so no cache can serve it):
  single: the decode server computes it alone (plain request)           -> TTFT, token ids
  pd:     prefill server (max_tokens=1, do_remote_decode) then the decode
          server with the returned kv_transfer_params (the proxy steps)  -> TTFT, token ids
          (with --router: one streamed request to the router, which does those steps)
and the two must be equal token for token (greedy), except at a near tie of the single
instance's two best logprobs (see `compare`), which is reported and counted. Then the evidence: the decode server's
external prefix-cache hits grew by the tokens it loaded, and the prefill server's KV-cache usage
is back to idle (blocks freed). Optionally a request whose transfer must fail (a prefill engine
that is not there): it must fail (policy "fail") or be recomputed to the same output
(policy "recompute"), within a bound.

With --mode push the prefill leg asks for a push (``transfer_mode: push``) and both legs carry
one X-Request-Id; after the warm-up (in order, whose answer says where the prefill engine is)
the proxy steps here send both legs at once. Then one more check: two prompts' P/D requests
under one X-Request-Id (a router reusing ids, or a client forging another's) must each get
their own prompt's output or fail, never the other's KV.

Writes one JSON line per request (with `t_sent`, its wall-clock send time, for pd_latency.py) and a
summary line; exits 1 on any mismatch or failed check.

With --probe LABEL it sends one prompt of --probe-len tokens only (no warm-up, no failure
check): single, then P/D, equal token for token (or a reported near tie), the decode engine's
external hits grown by exactly the prompt's full blocks (loaded remotely, not recomputed), and
the prefill engine's KV usage back to idle. scripts/test-vllm.sh probes before and after it
restarts the prefill server. One "PROBE {json}" line; exits 1 if a check fails.
"""
import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

TIMEOUT_S = 120


def post(url, body, headers=None):
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def stream(url, body, headers=None):
    """(ttft_s, token_ids, finish_reason, gaps) of a streamed completion; gaps[i] is the
    difference between the two highest logprobs at output token i (None if not reported)."""
    body = dict(body, stream=True, return_token_ids=True, logprobs=2)
    headers = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    ttft, ids, finish, gaps = None, [], None, []
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ch = json.loads(line[5:])
            if "error" in ch:
                raise RuntimeError(f"stream error: {ch['error']}")
            for c in ch.get("choices", []):
                if ttft is None and (c.get("text") or c.get("token_ids")):
                    ttft = time.perf_counter() - t0
                ids += c.get("token_ids") or []
                for top in (c.get("logprobs") or {}).get("top_logprobs") or []:
                    lps = sorted((top or {}).values(), reverse=True)
                    gaps.append(lps[0] - lps[1] if len(lps) >= 2 else None)
                finish = c.get("finish_reason") or finish
    return ttft, ids, finish, gaps


def metrics(base):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


class Client:
    def __init__(self, a):
        self.p, self.d, self.model, self.max_tokens = a.prefill, a.decode, a.model, a.max_tokens
        self.router, self.mode = a.router, a.mode
        # Push mode: the prefill engine's coordinates, learnt from its first answer (the warm-up).
        self.prefill_at = None

    def body(self, ids, max_tokens):
        return {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

    def single(self, ids):
        return stream(self.d + "/v1/completions", self.body(ids, self.max_tokens))

    def pd(self, ids):
        """(prefill_s, ttft_s, token_ids, kv_transfer_params) of one P/D request: through the
        router when there is one (it does both steps; the prefill time and the params stay
        inside it: None), else the proxy steps here."""
        if self.router:
            ttft, out, finish, _ = stream(self.router + "/v1/completions", self.body(ids, self.max_tokens))
            if ttft is None:
                raise RuntimeError(f"the router returned no tokens (finish_reason {finish})")
            return None, ttft, out, None
        if self.mode == "push" and self.prefill_at:
            return self.concurrent_steps(ids)
        return self.proxy_steps(ids)

    def prefill_body(self, ids):
        pb = self.body(ids, 1)
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
        if self.mode == "push":
            pb["kv_transfer_params"]["transfer_mode"] = "push"
        return pb

    def proxy_steps(self, ids):
        """The prefill leg, then the decode leg with the params it returned (in push mode too:
        the decode engine then registers its blocks after the prefill ended)."""
        # Push: both legs under one X-Request-Id, which vLLM's push connectors pair them by.
        headers = {"X-Request-Id": f"pd-{random.getrandbits(64):016x}"} if self.mode == "push" else None
        t0 = time.perf_counter()
        pr = post(self.p + "/v1/completions", self.prefill_body(ids), headers)
        t_prefill = time.perf_counter() - t0
        ktp = pr.get("kv_transfer_params")
        if self.mode == "push" and ktp:
            self.prefill_at = {k: ktp.get(k) for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size")}
        ttft_d, out, *_ = self.decode_only(ids, ktp, headers)
        return t_prefill, t_prefill + ttft_d, out, ktp

    def concurrent_steps(self, ids):
        """Push mode: both legs at once, under one X-Request-Id (vLLM's engines pair them by it);
        the decode leg names the prefill engine only (learnt from its first answer)."""
        headers = {"X-Request-Id": f"pd-{random.getrandbits(64):016x}"}
        answer = {}

        def prefill():
            t0 = time.perf_counter()
            try:
                answer["params"] = post(self.p + "/v1/completions", self.prefill_body(ids), headers).get("kv_transfer_params")
            except Exception as e:  # noqa: BLE001
                answer["err"] = e
            answer["s"] = time.perf_counter() - t0

        leg = threading.Thread(target=prefill)
        leg.start()
        ktp = dict(self.prefill_at, do_remote_prefill=True, do_remote_decode=False, transfer_mode="push")
        try:
            ttft, out, *_ = self.decode_only(ids, ktp, headers)
        finally:
            leg.join(TIMEOUT_S)
        if "err" in answer:
            raise RuntimeError(f"the prefill leg failed: {answer['err']!r}")
        return answer.get("s"), ttft, out, answer.get("params")

    def reused_id(self, prompts):
        """Push mode: P/D requests of different prompts sent under ONE X-Request-Id
        (a router reusing ids, or a client forging another's): each decode leg's output, or the
        exception it ended with. kvx writes a registration only into a decode request of the
        held request's prompt, so each must be its own prompt's output or a failure."""
        headers = {"X-Request-Id": f"pd-reused-{random.getrandbits(64):016x}"}
        ktp = dict(self.prefill_at, do_remote_prefill=True, do_remote_decode=False, transfer_mode="push")
        outs = [None] * len(prompts)

        def prefill(ids):
            try:
                post(self.p + "/v1/completions", self.prefill_body(ids), headers)
            except Exception:  # noqa: BLE001 (the decode leg's outcome is what counts)
                pass

        def decode(i, ids):
            try:
                outs[i] = self.decode_only(ids, ktp, headers)[1]
            except Exception as e:  # noqa: BLE001
                outs[i] = e

        # The prefill legs first (one hold keeps the id, the other is freed unpushed), then the
        # decode legs together: both register with the hold that kept it.
        for legs in ([threading.Thread(target=prefill, args=(ids,)) for ids in prompts],
                     [threading.Thread(target=decode, args=(i, ids)) for i, ids in enumerate(prompts)]):
            for leg in legs:
                leg.start()
            for leg in legs:
                leg.join(TIMEOUT_S + 10)
        return outs

    def decode_only(self, ids, ktp, headers=None):
        db = self.body(ids, self.max_tokens)
        db["kv_transfer_params"] = ktp
        ttft, out, finish, gaps = stream(self.d + "/v1/completions", db, headers)
        if ttft is None:
            raise RuntimeError(f"decode returned no tokens (finish_reason {finish})")
        return ttft, out, finish, gaps


TIE_NATS = 0.05


def compare(s_ids, s_gaps, p_ids, max_tokens):
    """(match, near_tie_at): the P/D output must equal the single instance's token for token.
    The one exception is a near tie: vLLM's P/D path recomputes the last prompt token on the
    decode engine with the decode kernel, so its bf16 logits differ from the single instance's
    in the third decimal (for every connector); where the single instance's two best logprobs at
    the first differing token are within TIE_NATS, either token is the greedy choice. Such a
    divergence is reported (near_tie_at) and counted, never hidden."""
    if len(p_ids) != max_tokens:
        return False, None
    if s_ids == p_ids:
        return True, None
    i = next((i for i, (x, y) in enumerate(zip(s_ids, p_ids)) if x != y), len(s_ids))
    gap = s_gaps[i] if i < len(s_gaps) else None
    return (True, i) if gap is not None and gap < TIE_NATS else (False, None)


def num_blocks(ktp):
    """Remote blocks named by kv_transfer_params (flat or nested per KV-cache group)."""
    ids = (ktp or {}).get("remote_block_ids") or []
    return sum(len(g) if isinstance(g, list) else 1 for g in ids)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else None


def external_hits(base):
    return metrics(base).get("vllm:external_prefix_cache_hits_total", 0)


def prefill_freed(base, timeout_s=30):
    """The prefill engine's KV-cache usage once it is 0, or the last value after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = metrics(base).get("vllm:kv_cache_usage_perc", -1)
        if usage == 0 or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def expected_loaded(n, a, full_blocks_only):
    """Tokens the decode engine should load for an n-token prompt: all of them, or with
    full_blocks_only its full blocks; with --window W (a model with a sliding-window group of W
    tokens, vLLM's hybrid allocator on) none when the prefill engine no longer holds a block that
    window needs. Having computed n tokens, the prefill engine keeps the blocks from token
    n + 1 - W on (vLLM's rule); the decode engine, having loaded k full-block tokens, needs those
    from token k + 1 - W on. They differ by a block exactly when n is one token short of a block
    boundary (n = 383, 511, ... for W 256 and blocks of 128): the decode engine then computes the
    prompt itself."""
    if not full_blocks_only:
        return n
    k = (n // a.block_size) * a.block_size
    if a.window and max(0, n + 1 - a.window) // a.block_size > max(0, k + 1 - a.window) // a.block_size:
        return 0
    return k


def probe(c, a, rng):
    """One prompt through the proxy steps, with the evidence that it loaded remotely."""
    n = a.probe_len
    ids = [rng.randrange(3, 2048) for _ in range(n)]
    out = {"probe": a.probe, "label": a.label, "prompt_len": n}
    ok = False
    try:
        _, s_ids, _, s_gaps = c.single(ids)
        h0 = external_hits(a.decode)
        t0 = time.perf_counter()
        _, p_ttft, p_ids, ktp = c.pd(ids)
        out["seconds"] = round(time.perf_counter() - t0, 2)
        out["pd_ttft_ms"] = round(p_ttft * 1e3, 1)
        out["match"], out["near_tie_at"] = compare(s_ids, s_gaps, p_ids, a.max_tokens)
        out["remote_engine_id"] = (ktp or {}).get("remote_engine_id")
        out["external_hits"] = external_hits(a.decode) - h0
        out["expected_external"] = expected_loaded(n, a, True)
        out["loaded_remotely"] = out["external_hits"] == out["expected_external"] > 0
        out["prefill_kv_usage_after"] = prefill_freed(a.prefill)
        ok = out["match"] and out["loaded_remotely"] and out["prefill_kv_usage_after"] == 0
    except Exception as e:  # noqa: BLE001
        out["err"] = repr(e)[:300]
    out["ok"] = ok
    print("PROBE " + json.dumps(out), flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--router", help="send the P/D requests through this router (vllm-router), which does the "
                    "proxy steps; single-instance requests and the failure check still go to --decode directly")
    ap.add_argument("--model", required=True)
    ap.add_argument("--lens", default="18,64,512,1024")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--full-blocks-only", action="store_true",
                    help="the connector moves full blocks only (kvx): expected external hits per prompt")
    ap.add_argument("--window", type=int, help="the model's sliding window (tokens) with vLLM's hybrid allocator "
                    "on: prompts whose window blocks the prefill engine dropped are not loaded (expected_loaded)")
    ap.add_argument("--failure-policy", choices=["fail", "recompute", "none"], default="none")
    ap.add_argument("--mode", choices=["pull", "push"], default="pull",
                    help="push: the prefill leg asks for a push; after the warm-up (sequential, whose answer names "
                    "the prefill engine) the proxy sends both legs at once (without --router)")
    ap.add_argument("--expected", help="JSON file of outputs from an earlier config: must be equal too")
    ap.add_argument("--save", help="write prompts and outputs here")
    ap.add_argument("--probe", help="send one prompt only, with this label (see the module's doc)")
    ap.add_argument("--probe-len", type=int, default=2 * 128 + 5)
    a = ap.parse_args()
    c = Client(a)
    rng = random.Random(a.seed)
    if a.probe:
        sys.exit(0 if probe(c, a, rng) else 1)
    ok = True
    # Warm-up (first handshake) with the proxy steps here, whose params of two blocks are the
    # template of the failure check (a router keeps them to itself); retried: NixlConnector's
    # first handshake can time out here. Two blocks and one token: the decode server's first
    # forward computes one token (the case that needs the AMX permission, docs/VLLM.md).
    # One prompt for every attempt: a retry must not shift the prompts after it, which every
    # config of a run must share for their outputs to be compared.
    template = None  # a real prefill response's kv_transfer_params (for the failure check)
    warm_up = [rng.randrange(3, 2048) for _ in range(2 * a.block_size + 1)]
    for attempt in range(3):
        try:
            template = c.proxy_steps(warm_up)[3]
            break
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"warmup_attempt": attempt, "err": repr(e)[:300]}), flush=True)
    m0 = metrics(a.decode)
    expected_external = 0
    records, ttft_pd, ttft_single, near_ties = [], [], [], 0
    for n in [int(x) for x in a.lens.split(",")]:
        for t in range(a.trials):
            ids = [rng.randrange(3, 2048) for _ in range(n)]
            s_ttft, s_ids, _, s_gaps = c.single(ids)
            t_sent = time.time()  # wall clock: pd_latency.py matches the servers' trace events to it
            try:
                t_pre, p_ttft, p_ids, ktp = c.pd(ids)
            except Exception as e:  # noqa: BLE001
                ok = False
                print(json.dumps({"label": a.label, "prompt_len": n, "trial": t, "match": None, "err": repr(e)[:300]}),
                      flush=True)
                continue
            if num_blocks(ktp) > num_blocks(template):
                template = ktp
            match, tie = compare(s_ids, s_gaps, p_ids, a.max_tokens)
            ok &= match
            near_ties += tie is not None
            ttft_pd.append(p_ttft)
            ttft_single.append(s_ttft)
            expected_external += expected_loaded(n, a, a.full_blocks_only)
            records.append({"prompt_ids": ids, "output_ids": p_ids})
            if s_ids != p_ids:
                gap = s_gaps[tie] if tie is not None and tie < len(s_gaps) else None
                print(json.dumps({"label": a.label, "prompt_len": n, "trial": t, "near_tie_at": tie,
                                  "single_top2_logprob_gap": gap,
                                  "single_ids": s_ids, "pd_ids": p_ids}), flush=True)
            print(json.dumps({"label": a.label, "prompt_len": n, "trial": t, "match": match,
                              "single_ttft_ms": round(s_ttft * 1e3, 1), "pd_prefill_ms": None if t_pre is None else round(t_pre * 1e3, 1),
                              "pd_ttft_ms": round(p_ttft * 1e3, 1), "t_sent": t_sent,
                              "kv_transfer_params": ktp if t == 0 else "..."}), flush=True)
    if a.expected:
        with open(a.expected) as f:
            exp = json.load(f)
        same = [r["output_ids"] for r in records] == [r["output_ids"] for r in exp]
        print(json.dumps({"label": a.label, "same_outputs_as": a.expected, "equal": same}), flush=True)
        ok &= same
    if a.save:
        with open(a.save, "w") as f:
            json.dump(records, f)
    # Evidence 1: the decode engine loaded the prompts' KV remotely.
    m1 = metrics(a.decode)
    ext_hits = m1.get("vllm:external_prefix_cache_hits_total", 0) - m0.get("vllm:external_prefix_cache_hits_total", 0)
    loaded_ok = ext_hits >= expected_external * 0.99 and ext_hits > 0
    ok &= loaded_ok
    # Evidence 2: the prefill engine freed every held block (KV-cache usage back to idle).
    deadline = time.monotonic() + 30
    while True:
        usage = metrics(a.prefill).get("vllm:kv_cache_usage_perc", -1)
        if usage == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    freed_ok = usage == 0
    ok &= freed_ok
    # Evidence 3: a transfer that cannot succeed. The decode engine gets transfer parameters of the
    # right shape (copied from a real prefill response) that name a prefill engine nobody serves:
    # no prefill request is made, so no prefill engine holds blocks for it.
    failure = None
    if a.failure_policy != "none" and num_blocks(template) >= 2:
        ids = [rng.randrange(3, 2048) for _ in range(2 * a.block_size + 5)]
        _, s_ids, *_ = c.single(ids)
        ktp = dict(template)
        if ktp.get("remote_port") is not None:
            ktp["remote_port"] = 1  # nothing listens there
        # No cached peer, and none under that id in a registry (kvx's etcd discovery: no port).
        ktp["remote_engine_id"] = "kvx-test-engine-that-does-not-exist"
        ktp["remote_request_id"] = f"kvx-test-missing-{rng.randrange(1 << 30)}"
        t0 = time.perf_counter()
        try:
            _, p_ids, *_ = c.decode_only(ids, ktp)
            outcome = "recomputed" if p_ids == s_ids else "wrong_output"
        except Exception as e:  # noqa: BLE001
            outcome = "failed"
            err = repr(e)[:200]
        dt = time.perf_counter() - t0
        want = "failed" if a.failure_policy == "fail" else "recomputed"
        failure = {"policy": a.failure_policy, "outcome": outcome, "seconds": round(dt, 1), "ok": outcome == want}
        if outcome == "failed":
            failure["error"] = err
        ok &= failure["ok"]
        # The engine still serves afterwards.
        ids = [rng.randrange(3, 2048) for _ in range(a.block_size + 3)]
        _, s_ids, _, s_gaps = c.single(ids)
        after = compare(s_ids, s_gaps, c.pd(ids)[2], a.max_tokens)[0]
        failure["serves_after"] = after
        ok &= after
    elif a.failure_policy != "none":
        ok = False  # no request got transfer parameters to build the failing one from
    # Evidence 4 (push): two requests under one id never get each other's KV.
    reused = None
    if a.mode == "push" and c.prefill_at:
        prompts = [[rng.randrange(3, 2048) for _ in range(2 * a.block_size + 5)] for _ in range(2)]
        singles = [c.single(ids)[1] for ids in prompts]
        t0 = time.perf_counter()
        outs = c.reused_id(prompts)
        kinds = ["own" if o == want else "failed" if isinstance(o, Exception) else "WRONG"
                 for o, want in zip(outs, singles)]
        reused = {"outcomes": kinds, "seconds": round(time.perf_counter() - t0, 1), "ok": "WRONG" not in kinds}
        ok &= reused["ok"]
    summary = {
        "label": a.label, "all_match": ok, "requests": len(ttft_pd), "near_ties": near_ties,
        "pd_ttft_p50_ms": round(statistics.median(ttft_pd) * 1e3, 1) if ttft_pd else None,
        "pd_ttft_p99_ms": round(pct(ttft_pd, 99) * 1e3, 1) if ttft_pd else None,
        "pd_ttft_max_ms": round(max(ttft_pd) * 1e3, 1) if ttft_pd else None,
        "single_ttft_p50_ms": round(statistics.median(ttft_single) * 1e3, 1) if ttft_single else None,
        "decode_external_hits": ext_hits, "expected_external": expected_external, "loaded_remotely": loaded_ok,
        "prefill_kv_usage_after": usage, "prefill_freed": freed_ok, "failure_check": failure,
        "reused_id_check": reused,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Where each disaggregated request's time to first token went (stdlib only).

Reads pd_check.py's request lines (each P/D request's wall-clock send time ``t_sent`` and its
TTFT) and the per-request events the connectors recorded under ``KVX_VLLM_TRACE_DIR``
(``kvx_vllm.trace``: kvx's connector, or ``tools/probe/nixl_probe.py`` for vLLM's NixlConnector),
and splits each request's TTFT into phases. pd_check sends one request at a time, so a request's
events are those between its send and its first token; its prefill request is the one whose
``p_done`` names its prompt length there, its decode request the ``d_arrived`` that names the
same prompt length (and the prefill request, where the params carry ``remote_request_id``).

Phases of one request (ms), from the client's send to its first token:

    to_prefill   send -> the prefill engine's scheduler has it (router, HTTP, tokenization)
    prefill      -> prefill done (queueing on the prefill engine, the forward, the one token)
    handoff      -> the decode engine's scheduler has it (response to the router, decode request)
    d_queue      -> the decode engine's step metadata names the load (vLLM's queue and scheduling)
    dispatch     -> the decode worker's step calls the connector with it (vLLM's executor: the
                    scheduler output reaching the worker process, the worker's step starting)
    admit        -> the connector's worker took the load (kvx: its lock, shared with its pump
                    thread; NixlConnector: the same moment)
    post         -> READ posted (the handshake, if one was needed)
    read         -> a step found the READ done
    confirm      -> the prefill engine confirmed its hold (kvx; NixlConnector has no such step)
    hand_back    -> the worker returned the load to vLLM as finished
    to_scheduler -> the decode scheduler learnt it
    decode       -> first token at the client (the decode step: scheduling, the forward of the
                    last prompt token, sampling, output, the stream back through the router)

The connector's share, as kvx measures it, in three parts: before the transfer (``prefill done
-> READ posted``: handoff + d_queue + dispatch + admit + post), the transfer (``READ``: read) and
after it (``READ done -> reported to the scheduler``: confirm + hand_back + to_scheduler); and
the connector's own part of it, from its worker's step with the load to the scheduler learning
it finished (admit + post + read + confirm + hand_back + to_scheduler). Every request above
twice the TTFT p50 is explained: the group of phases (prefill, queueing, connector, decode step)
that exceeds its median the most.

A push (kvx's push mode: the decode leg was sent with the prefill leg, registered its blocks, and
the prefill engine WRITEs them as its prefill ends) has its own phases after ``prefill``:

    hold         -> the prefill worker's step took the hold (vLLM's scheduler -> worker dispatch)
    write        -> the decode worker returned the load finished: the WRITE and its notification,
                    from the hold or from the decode worker's registration, whichever came later
    to_scheduler -> the decode scheduler learnt it
    decode       -> first token at the client

and its share runs from the prefill's end (or the registration, if it came later) to the decode
scheduler learning it: before the transfer ``prefill done -> hold taken``, the transfer ``hold
taken -> written``, after it ``written -> reported``; the connector's own part from the later of
the hold taken and the registration sent.

Prints one ``ATTRIBUTION {json}`` line and a readable report; exits 1 if no P/D request could be
attributed (no trace, or no request matched).
"""
import argparse
import glob
import json
import os
import statistics
import sys

from pd_check import pct

PHASES = ["to_prefill", "prefill", "handoff", "d_queue", "dispatch", "admit", "post", "read", "confirm", "hand_back",
          "to_scheduler", "decode"]
# Events bounding each phase, in order: a phase runs from the last event present before it.
BOUNDS = ["t_sent", "p_arrived", "p_done", "d_arrived", "d_meta", "d_step", "d_admitted", "d_posted", "d_read_done", "d_confirmed",
          "d_finished", "d_reported", "t_first"]
SHARE = {"before": ("p_done", "d_posted"), "transfer": ("d_posted", "d_read_done"),
         "after": ("d_read_done", "d_reported")}
# A push's phases, bounds and share (see the module's doc); "registered" is the later of the hold
# taken and the decode worker's registration, "started" the later of the prefill's end and it.
PUSH_PHASES = ["to_prefill", "prefill", "hold", "write", "to_scheduler", "decode"]
PUSH_BOUNDS = ["t_sent", "p_arrived", "p_done", "p_step", "d_finished", "d_reported", "t_first"]
PUSH_SHARE = {"before": ("p_done", "p_step"), "transfer": ("registered", "d_finished"),
              "after": ("d_finished", "d_reported")}
PUSH_TOTAL, PUSH_OWN = ("started", "d_reported"), ("registered", "d_reported")
# The part of the share the connector itself spends: from its worker's step with the load to the
# scheduler learning it finished (the rest of the share is the router's handoff and vLLM's
# scheduling and dispatch).
OWN = ("d_step", "d_reported")
GROUPS = {"prefill forward": ["prefill"],
          "queueing (router, schedulers, dispatch)": ["to_prefill", "handoff", "d_queue", "dispatch", "hold"],
          "connector": ["admit", "post", "read", "write", "confirm", "hand_back", "to_scheduler"],
          "decode step": ["decode"]}


def load_events(trace_dir):
    events = []
    for path in sorted(glob.glob(os.path.join(trace_dir, "*.jsonl"))):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a line cut short by a killed server
    return sorted(events, key=lambda e: e["t"])


def load_requests(path):
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("t_sent") is not None and r.get("pd_ttft_ms") is not None:
                out.append(r)
    return out


def times_of(req, events):
    """The wall-clock time of each bound of one request (those found), and its two request ids."""
    t0, t1, n = req["t_sent"], req["t_sent"] + req["pd_ttft_ms"] / 1e3, req["prompt_len"]
    inside = [e for e in events if t0 <= e["t"] <= t1]
    t = {"t_sent": t0, "t_first": t1}
    p = next((e for e in inside if e["event"] == "p_done" and e.get("prompt_tokens") == n), None)
    d = next((e for e in inside if e["event"] == "d_arrived" and e.get("prompt_tokens") == n
              and (p is None or names(e.get("remote_request_id"), p["req"]))), None)
    for ev, rid in (("p_arrived", p and p["req"]), ("p_done", p and p["req"]), ("p_step", p and p["req"])):
        hit = next((e for e in inside if e["event"] == ev and e["req"] == rid), None)
        if hit:
            t[ev] = hit["t"]
    if d:
        for e in inside:
            if e["req"] == d["req"] and e["event"].startswith("d_") and e["event"] not in t:
                t[e["event"]] = e["t"]
    return t, p and p["req"], d and d["req"]


def names(remote_request_id, prefill_req):
    """Whether a decode request's ``remote_request_id`` names the prefill request: its id, or
    (a push, both legs under one X-Request-Id) its id without vLLM's random suffix."""
    return remote_request_id is None or prefill_req in (remote_request_id,) or prefill_req.startswith(remote_request_id + "-")


def pushed(t):
    """Whether the request's KV was pushed: the prefill worker took a hold, the decode worker
    READ nothing."""
    return "p_step" in t and "d_posted" not in t


def split(t):
    """Phase durations (ms) from the bounds present; a missing bound folds its phase into the next."""
    phases, last = {}, t["t_sent"]
    names_, bounds = (PUSH_PHASES, PUSH_BOUNDS) if pushed(t) else (PHASES, BOUNDS)
    for name, bound in zip(names_, bounds[1:]):
        if bound in t:
            phases[name] = round((t[bound] - last) * 1e3, 1)
            last = t[bound]
        else:
            phases[name] = None
    return phases


def share(t):
    def ms(a, b):
        return round((t[b] - t[a]) * 1e3, 1) if a in t and b in t else None

    if pushed(t):
        t = dict(t)
        if "p_step" in t:
            t["registered"] = max(t["p_step"], t.get("d_step", t["p_step"]))
        if "p_done" in t:
            t["started"] = max(t["p_done"], t.get("d_step", t["p_done"]))
        out = {k: ms(a, b) for k, (a, b) in PUSH_SHARE.items()}
        out["total"], out["connector's own"] = ms(*PUSH_TOTAL), ms(*PUSH_OWN)
        return out
    out = {k: ms(a, b) for k, (a, b) in SHARE.items()}
    out["total"] = round(sum(out.values()), 1) if all(v is not None for v in out.values()) else None
    out["connector's own"] = ms(*OWN)
    return out


def stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"n": len(xs), "p50": round(statistics.median(xs), 1), "p99": round(pct(xs, 99), 1), "max": round(max(xs), 1)}


def group_ms(phases):
    return {g: round(sum(phases.get(p) or 0 for p in ps), 1) for g, ps in GROUPS.items()}


def attribute(label, requests, events):
    rows = []
    for i, r in enumerate(requests):
        t, p_id, d_id = times_of(r, events)
        moved = "d_posted" in t or (pushed(t) and "d_finished" in t)
        rows.append({"i": i, "prompt_len": r["prompt_len"], "ttft_ms": r["pd_ttft_ms"], "prefill_req": p_id,
                     "decode_req": d_id, "transfer": moved, "push": pushed(t), "phases": split(t), "share": share(t)})
    traced = [x for x in rows if x["prefill_req"] and x["decode_req"]]
    ttft = stats([x["ttft_ms"] for x in rows])
    phases = PUSH_PHASES if any(x["push"] for x in traced) else PHASES
    out = {"label": label, "requests": len(rows), "traced": len(traced),
           "with_transfer": sum(x["transfer"] for x in rows), "pushed": sum(x["push"] for x in rows),
           "ttft_ms": ttft, "phases_ms": {p: stats([x["phases"].get(p) for x in traced]) for p in phases},
           "share_ms": {k: stats([x["share"][k] for x in traced if x["transfer"]])
                        for k in list(SHARE) + ["total", "connector's own"]}}
    medians = {g: statistics.median([group_ms(x["phases"])[g] for x in traced]) for g in GROUPS} if traced else {}
    slow = []
    for x in rows:
        if ttft and x["ttft_ms"] > 2 * ttft["p50"]:
            groups = group_ms(x["phases"]) if x in traced else {}
            why = max(groups, key=lambda g: groups[g] - medians.get(g, 0)) if groups else "not traced"
            slow.append({**x, "groups_ms": groups, "dominant": why, "first": x["i"] == 0})
    out["above_2x_p50"] = slow
    slowest = max(rows, key=lambda x: x["ttft_ms"]) if rows else None
    if slowest:
        out["slowest"] = {**slowest, "groups_ms": group_ms(slowest["phases"])}
    return out


def fmt_phases(phases):
    return ", ".join(f"{k} {v}" for k, v in phases.items() if v is not None)


def report(a):
    t = a["ttft_ms"] or {}
    print(f"{a['label']}: {a['requests']} P/D requests ({a['traced']} traced, {a['with_transfer']} with a transfer, "
          f"{a['pushed']} of them pushed); "
          f"TTFT p50 {t.get('p50')} / p99 {t.get('p99')} / max {t.get('max')} ms")
    for k, s in a["share_ms"].items():
        if s:
            print(f"  connector share, {k}: p50 {s['p50']} / p99 {s['p99']} / max {s['max']} ms over {s['n']}")
    print("  phases p50 / p99 (ms): " + "; ".join(f"{p} {s['p50']}/{s['p99']}" for p, s in a["phases_ms"].items() if s))
    s = a.get("slowest")
    if s:
        print(f"  slowest: #{s['i']} ({s['prompt_len']} tok) {s['ttft_ms']} ms: {fmt_phases(s['phases'])}")
    for x in a["above_2x_p50"]:
        first = " (first request of the run)" if x["first"] else ""
        print(f"  above 2x p50: #{x['i']} ({x['prompt_len']} tok) {x['ttft_ms']} ms{first}: {x['dominant']} "
              f"({', '.join(f'{g} {v}' for g, v in x['groups_ms'].items())})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", required=True, help="pd_check.py's output (JSON lines)")
    ap.add_argument("--trace", required=True, help="the KVX_VLLM_TRACE_DIR the servers wrote")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    result = attribute(a.label, load_requests(a.requests), load_events(a.trace))
    report(result)
    print("ATTRIBUTION " + json.dumps(result), flush=True)
    sys.exit(0 if result["traced"] else 1)


if __name__ == "__main__":
    main()

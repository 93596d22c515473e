"""Drive a vLLM server that runs ``HmaProbeConnector`` (hma_probe.py) and summarize what it
recorded (stdlib only).

Sends, with exact token-id prompts (greedy, fixed seeds): a plain request A; a prefill-side
request B (``do_remote_decode``, 1 token: its response carries the held block ids per group);
decode-side requests (``do_remote_prefill``) with no local hit (C), a full-block local hit (A
again) and a partial one (A + 300 tokens); prefill-side requests of a few lengths around block
and window boundaries. Then prints one line per recorded call of each process
(``HMA_PROBE_OUT``): the KV-cache groups and tensors, each tensor given to
``register_kv_caches``, and per request the block ids of each group (``N0``: a null block, ``h``:
a hashed block).

Usage: python hma_drive.py --url http://127.0.0.1:18431 --probe-out DIR [--len 600]
"""
import argparse
import glob
import json
import os
import random
import urllib.request


def post(url: str, model: str, prompt: list[int], max_tokens: int, params: dict | None) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def drive(url: str, n: int) -> None:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]

    def prompt(seed: int, length: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(3, 2048) for _ in range(length)]

    a = prompt(1, n)
    steps = [
        ("plain A", a, 8, None),
        ("P-side B", prompt(2, n), 1, {"do_remote_decode": True}),
        ("D-side C (no local hit)", prompt(3, n), 8, {"do_remote_prefill": True}),
        ("D-side A (local hit)", a, 8, {"do_remote_prefill": True}),
        ("D-side A+300 (partial local hit)", a + prompt(4, 300), 8, {"do_remote_prefill": True}),
    ]
    steps += [(f"P-side {m}", prompt(10 + m, m), 1, {"do_remote_decode": True}) for m in (640, 641, 700, 257)]
    for tag, ids, max_tokens, params in steps:
        out = post(url, model, ids, max_tokens, params)
        held = (out.get("kv_transfer_params") or {}).get("remote_block_ids")
        print(f"{tag}: {len(ids)} tokens -> {out['choices'][0]['text'][:30]!r}, remote_block_ids {held}")


def summarize(probe_out: str) -> None:
    for path in sorted(glob.glob(os.path.join(probe_out, "*.jsonl"))):
        print("==", path)
        with open(path) as f:
            for line in f:
                summarize_event(json.loads(line))


def summarize_event(d: dict) -> None:
    event = d.pop("event")
    if "request_id" in d:
        d["request_id"] = d["request_id"][-8:]  # vLLM's suffix is enough to tell requests apart
    if event == "init":
        c = d["kv_cache_config"]
        print(f"init {d['role']} tp_rank {d['tp_rank']} engine_id {d['engine_id']} instance_id {d['instance_id']} "
              f"hma {d['hma_enabled']} num_blocks {c['num_blocks']} layout {c['kv_cache_layout']} "
              f"transfer_groups {d['transfer_group_ids']}")
        for t in c["kv_cache_tensors"]:
            print("  tensor", {k: t[k] for k in ("size", "layers", "layer_stride", "block_stride", "offset")})
        for i, g in enumerate(c["kv_cache_groups"]):
            s = g["kv_cache_spec"]
            print(f"  group {i} {s['class']} {g['layer_names']} window {s.get('sliding_window')} "
                  f"kv_heads {s['num_kv_heads']} head_size {s['head_size']} block_size {s['block_size']}")
    elif event == "update_state_after_alloc":
        blocks = [[("N" if b["null"] else "") + str(b["id"]) + ("h" if b["hashed"] else "") for b in g]
                  for g in d["blocks"]]
        print(f"{event} {d['request_id']} external {d['num_external_tokens']} computed "
              f"{d['num_computed_tokens']} blocks {blocks} unhashed {d['unhashed_block_ids']}")
    elif event == "register_kv_caches":
        for name, t in d["tensors"].items():
            print("  register", name, t)
        print("  layers_by_offset", d["layers_by_offset"])
    else:
        print(event, json.dumps(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--probe-out", required=True, help="the server's HMA_PROBE_OUT")
    ap.add_argument("--len", type=int, default=600, help="prompt length of A, B and C")
    a = ap.parse_args()
    drive(a.url, a.len)
    summarize(a.probe_out)


if __name__ == "__main__":
    main()

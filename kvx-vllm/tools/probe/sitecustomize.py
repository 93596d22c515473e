"""Makes vLLM's CPU attention ISA the same, and usable, in every process of a test-vllm.sh server.

Python imports this module at start-up when this folder is on ``PYTHONPATH``; scripts/test-vllm.sh
puts it there for every config, kvx's and NixlConnector's alike. Nothing is imported here: once
vLLM imports ``vllm.v1.attention.backends.cpu_attn``, its ``_get_attn_isa`` is wrapped, and each
call logs on stderr the ISA used and vLLM's choice ("kvx test: CPU attention ISA ..."), as
``KVX_VLLM_ATTN_ISA`` says:

- ``amx`` (test-vllm.sh's default): vLLM's choice; where it is ``amx``, the process asks Linux for
  the AMX tile data permission (``torch.cpu._init_amx()``, ``arch_prctl(ARCH_REQ_XCOMP_PERM)``)
  before its first forward;
- another ISA (``vec``, ...): that ISA wherever vLLM chose ``amx``; other choices (``vec16`` for the
  head sizes that need it, ...) are kept;
- ``vllm``, empty or unset: nothing is changed.

Why: vLLM 0.32 picks its AMX attention kernel from CPUID alone (``torch.cpu._is_amx_tile_supported``)
and never asks for the permission; a process gets it only as a side effect of oneDNN's first AMX
GEMM, which vLLM's bf16 linear layers run only for batches of more than 4 tokens. A decode server
whose first forward computes 1 token (NixlConnector loads all prompt tokens but the last) runs the
AMX attention kernel without it and dies of SIGILL. docs/VLLM.md, "AMX attention".
"""

import importlib.abc
import importlib.util
import os
import sys

_ISA = os.environ.get("KVX_VLLM_ATTN_ISA", "")
_MODULE = "vllm.v1.attention.backends.cpu_attn"


def _log(message):
    print(f"kvx test: CPU attention ISA {message}", file=sys.stderr, flush=True)


def _wrap(chosen_by_vllm):
    def get_attn_isa(*args, **kwargs):
        isa = chosen_by_vllm(*args, **kwargs)
        if isa != "amx":
            _log(f"{isa} (KVX_VLLM_ATTN_ISA={_ISA}; vLLM chose {isa})")
            return isa
        if _ISA != "amx":
            _log(f"{_ISA} (KVX_VLLM_ATTN_ISA={_ISA}; vLLM chose amx)")
            return _ISA
        import torch

        granted = torch.cpu._init_amx()
        _log(f"amx (KVX_VLLM_ATTN_ISA=amx; vLLM chose amx; AMX permission asked: {granted})")
        return isa

    return get_attn_isa


class _WrapAttentionIsa(importlib.abc.MetaPathFinder):
    """Finds vLLM's CPU attention module as usual, then wraps its ``_get_attn_isa``."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one module, found once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            module._get_attn_isa = _wrap(module._get_attn_isa)

        spec.loader.exec_module = exec_and_wrap
        return spec


if _ISA and _ISA != "vllm":
    sys.meta_path.insert(0, _WrapAttentionIsa())

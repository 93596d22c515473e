"""kvx's vLLM connector, native part: the extension module built from kvx-vllm/native (both
backends, kvx-ucx and kvx-nixl), installed beside the Python package kvx_vllm by the same wheel.
This file only re-exports it, as maturin does for a pure Rust module."""
from .kvx_vllm_native import *  # noqa: F401,F403

__doc__ = kvx_vllm_native.__doc__  # noqa: F405
if hasattr(kvx_vllm_native, "__all__"):  # noqa: F405
    __all__ = kvx_vllm_native.__all__  # noqa: F405

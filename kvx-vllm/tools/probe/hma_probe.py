"""``HmaProbeConnector``: a vLLM 0.32 KV connector that moves nothing and records what vLLM hands
a ``SupportsHMA`` connector, for models with several KV-cache groups (sliding window + full).

Each call is one JSON line in ``$HMA_PROBE_OUT/<role>-<pid>.jsonl``: the ``kv_cache_config``
(groups, their layers and specs, the ``KVCacheTensor`` placement), the tensors of
``register_kv_caches`` (shape, strides, data pointers and which layers share memory), the tensor
each layer passes to ``save_kv_layer`` (first call per layer), and, per request, the arguments
of ``get_num_new_matched_tokens``, ``update_state_after_alloc`` (every group's block ids, with
null and hashed blocks marked) and ``request_finished_all_groups``.

It plays both disaggregated roles inside one engine (``kv_role: kv_both``), so that a single
instance shows both sides:

- a request with ``kv_transfer_params: {"do_remote_decode": true}`` (prefill side) has its
  blocks held at finish (``request_finished_all_groups`` returns True and params naming the
  held block ids per group), released one step later (``finished_sending``);
- a request with ``{"do_remote_prefill": true}`` (decode side) is told its whole prompt but the
  last token is external and loaded asynchronously; the "load" (which writes nothing, so the
  output is garbage) completes one step after the allocation (``finished_recving``).

Load it with ``--kv-transfer-config '{"kv_connector":"HmaProbeConnector",
"kv_connector_module_path":"hma_probe","kv_role":"kv_both"}'`` and this directory on
``PYTHONPATH``; ``hma_drive.py`` sends the requests and summarizes the records.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


def _plain(obj: Any) -> Any:
    """A JSON-able copy of a vLLM config object: dataclasses as dicts (with their class name),
    enums as their values, anything else that is not plain JSON (dtypes) as strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"class": type(obj).__name__, **fields}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple, set)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


class _Log:
    """Appends one JSON object per event to this process's file."""

    def __init__(self, role: KVConnectorRole):
        out = os.environ.get("HMA_PROBE_OUT", "hma-probe")
        os.makedirs(out, exist_ok=True)
        self._file = open(os.path.join(out, f"{role.name.lower()}-{os.getpid()}.jsonl"), "a")

    def __call__(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"event": event, **_plain(fields)}) + "\n")
        self._file.flush()


def _blocks(blocks) -> list[list[dict]]:
    """Every group's blocks of a ``KVCacheBlocks``: id, null, hashed (vLLM has hashed it: a full
    block of known tokens, a prefix-cache hit or cached when allocated)."""
    return [
        [{"id": b.block_id, "null": b.is_null, "hashed": b.block_hash is not None} for b in group]
        for group in blocks.blocks
    ]


class HmaProbeMetadata(KVConnectorMetadata):
    """The requests whose load (``recving``) or hold (``sending``) the workers report finished."""

    def __init__(self, recving: set[str], sending: set[str]):
        self.recving = recving
        self.sending = sending


class HmaProbeConnector(KVConnectorBase_V1, SupportsHMA):
    """Records vLLM's calls; moves no data (see the module's documentation)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._log = _Log(role)
        self._loads: set[str] = set()  # decode side: allocated, to report received next step
        self._holds: set[str] = set()  # prefill side: held at finish, to release next step
        self._recving: set[str] = set()  # worker: loads to report finished
        self._sending: set[str] = set()  # worker: holds to report released
        self._saved_layers: set[str] = set()
        config = kv_cache_config
        self._log(
            "init",
            role=role.name,
            tp_rank=self._tp_rank() if role == KVConnectorRole.WORKER else None,
            hma_enabled=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            engine_id=vllm_config.kv_transfer_config.engine_id,
            instance_id=vllm_config.instance_id,  # one value for all ranks of an engine start?
            block_size=vllm_config.cache_config.block_size,
            kv_cache_config=config,
            transfer_group_ids=getattr(config, "transfer_group_ids", None),
            prefix_cacheable_group_ids=getattr(config, "prefix_cacheable_group_ids", None),
        )

    @staticmethod
    def _tp_rank() -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        return "LBHNC"  # as NixlConnector and kvx's connector on CPU

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        params = request.kv_transfer_params or {}
        external = 0
        if params.get("do_remote_prefill"):
            # As NixlConnector: the whole prompt but the last token, less any local hit.
            external = max(0, request.num_prompt_tokens - 1 - num_computed_tokens)
        self._log(
            "get_num_new_matched_tokens",
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=num_computed_tokens,
            kv_transfer_params=params,
            returns=[external, external > 0],
        )
        return external, external > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = request.kv_transfer_params or {}
        self._log(
            "update_state_after_alloc",
            request_id=request.request_id,
            num_external_tokens=num_external_tokens,
            num_computed_tokens=request.num_computed_tokens,
            blocks=_blocks(blocks),
            unhashed_block_ids=blocks.get_unhashed_block_ids_all_groups(),
            block_ids=blocks.get_block_ids(),
        )
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            self._loads.add(request.request_id)
            params["do_remote_prefill"] = False  # one load per request, as NixlConnector

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = HmaProbeMetadata(self._loads, self._holds)
        self._loads, self._holds = set(), set()
        return meta

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        params = request.kv_transfer_params or {}
        hold = bool(params.get("do_remote_decode")) and any(block_ids)
        out = None
        if hold:
            self._holds.add(request.request_id)
            out = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
                   "remote_request_id": request.request_id, "remote_num_tokens": request.num_computed_tokens}
        self._log(
            "request_finished_all_groups",
            request_id=request.request_id,
            status=request.status.name,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=request.num_output_tokens,
            block_ids=list(block_ids),
            returns=[hold, out],
        )
        return hold, out

    def request_finished(self, request, block_ids: list[int]):
        # Not called for a SupportsHMA connector; recorded in case it is.
        self._log("request_finished", request_id=request.request_id, block_ids=block_ids)
        return False, None

    def update_connector_output(self, connector_output):
        if connector_output.finished_sending or connector_output.finished_recving:
            self._log(
                "update_connector_output",
                finished_sending=sorted(connector_output.finished_sending or ()),
                finished_recving=sorted(connector_output.finished_recving or ()),
            )

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        base = min(t.data_ptr() for t in kv_caches.values())
        tensors = {}
        for name, t in kv_caches.items():
            storage = t.untyped_storage()
            tensors[name] = {
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": str(t.dtype),
                "contiguous": t.is_contiguous(),
                "offset_bytes": t.data_ptr() - base,
                "nbytes": t.numel() * t.element_size(),
                "storage_ptr_offset": storage.data_ptr() - base,
                "storage_nbytes": storage.nbytes(),
            }
        by_ptr: dict[int, list[str]] = {}
        for name, t in kv_caches.items():
            by_ptr.setdefault(t.data_ptr() - base, []).append(name)
        self._log("register_kv_caches", tensors=tensors, layers_by_offset=by_ptr)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HmaProbeMetadata)
        self._recving |= meta.recving
        self._sending |= meta.sending

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if layer_name not in self._saved_layers:
            self._saved_layers.add(layer_name)
            self._log(
                "save_kv_layer",
                layer_name=layer_name,
                shape=list(kv_layer.shape),
                stride=list(kv_layer.stride()),
                data_ptr=kv_layer.data_ptr(),
                attn_metadata=type(attn_metadata).__name__,
            )

    def wait_for_save(self):
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        recving, sending = self._recving, self._sending
        self._recving, self._sending = set(), set()
        if recving or sending:
            self._log("get_finished", finished_sending=sorted(sending), finished_recving=sorted(recving))
        return sending or None, recving or None

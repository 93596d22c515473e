"""``ProbedNixlConnector``: vLLM's NixlConnector, unchanged, recording the events of
``kvx_vllm.trace`` (under ``KVX_VLLM_TRACE_DIR``) so that ``pd_latency.py`` splits its requests'
latency like kvx's. Nothing of vLLM is patched: this is a subclass (loaded with
``"kv_connector": "ProbedNixlConnector", "kv_connector_module_path": "nixl_probe"`` and this
folder on ``PYTHONPATH``) whose methods record an event and call NixlConnector's, and whose
worker's ``_read_blocks`` is wrapped on the instance to stamp the READ's post.

NixlConnector finds a READ done in ``get_transfer_results`` (its worker's ``_pop_done_transfers``)
and returns it to vLLM in the same call, so ``d_read_done`` and ``d_finished`` are one moment for it: its
"READ" phase runs from the post to the step that found it done, as kvx's does.
"""

from __future__ import annotations

import functools

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from kvx_vllm.trace import Trace


class ProbedNixlConnector(NixlConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._trace = Trace(f"nixl-{role.name.lower()}")
        self._admitted: set[str] = set()
        self._scheduled: list[str] = []  # loads scheduled since the last metadata
        worker = self.connector_worker
        if role == KVConnectorRole.WORKER and worker is not None and self._trace:
            read_blocks = worker._read_blocks

            @functools.wraps(read_blocks)
            def traced_read_blocks(*args, **kwargs):
                out = read_blocks(*args, **kwargs)
                req_id = kwargs.get("request_id")
                if req_id is not None:
                    self._trace.event("d_posted", req_id)
                return out

            worker._read_blocks = traced_read_blocks

    # Scheduler side (EngineCore).

    def on_new_request(self, request) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            self._trace.event("d_arrived", request.request_id, remote_request_id=params.get("remote_request_id"),
                              prompt_tokens=request.num_prompt_tokens)
        elif params.get("do_remote_decode"):
            self._trace.event("p_arrived", request.request_id, prompt_tokens=request.num_prompt_tokens)
        return super().on_new_request(request)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if (request.kv_transfer_params or {}).get("do_remote_prefill"):
            self._trace.event("d_scheduled", request.request_id, external_tokens=num_external_tokens)
            if self._trace and num_external_tokens > 0:
                self._scheduled.append(request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        for req_id in self._scheduled:
            self._trace.event("d_meta", req_id)
        self._scheduled.clear()
        return meta

    def request_finished(self, request, block_ids):
        return self._prefill_done(request, super().request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        # What vLLM calls for NixlConnector (SupportsHMA).
        return self._prefill_done(request, super().request_finished_all_groups(request, block_ids))

    def _prefill_done(self, request, result):
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            self._trace.event("p_done", request.request_id, prompt_tokens=request.num_prompt_tokens, held=result[0])
        return result

    def update_connector_output(self, connector_output):
        failed = set(connector_output.failed_recving or ())
        for req_id in set(connector_output.finished_recving or ()) - failed:
            self._trace.event("d_reported", req_id)
        for req_id in failed:
            self._trace.event("d_failed", req_id)
        return super().update_connector_output(connector_output)

    # Worker side.

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for req_id in getattr(self._connector_metadata, "reqs_to_recv", {}) or {}:
            if req_id not in self._admitted:
                self._admitted.add(req_id)
                self._trace.event("d_step", req_id)
                self._trace.event("d_admitted", req_id)
        return super().start_load_kv(forward_context, **kwargs)

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        for req_id in results.finished_recving or ():
            self._admitted.discard(req_id)
            self._trace.event("d_read_done", req_id)
            self._trace.event("d_finished", req_id)
        return results

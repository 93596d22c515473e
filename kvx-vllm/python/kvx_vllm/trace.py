"""Per-request latency trace of a disaggregated request, for attributing its time to phases.

Off unless the environment variable ``KVX_VLLM_TRACE_DIR`` names a directory. Then every process
that records events (EngineCore's scheduler, each worker) appends JSON lines to
``{dir}/{name}-{pid}.jsonl``: ``{"t": wall-clock seconds (time.time()), "event": ..., "req":
request id, ...}``. All processes of one machine share that clock, so events of the prefill and
the decode server can be compared. kvx's connector records these events, and so does
``kvx-vllm/tools/probe/nixl_probe.py`` for vLLM's NixlConnector (the same names, so that one
analysis, ``kvx-vllm/tools/pd_latency.py``, reads both):

prefill engine (scheduler)
    ``p_arrived`` (the request reached the scheduler), ``p_done`` (it finished: prefill done, its
    blocks held for a decode engine)
decode engine (scheduler)
    ``d_arrived`` (with ``remote_request_id``, the prefill engine's request), ``d_scheduled``
    (blocks allocated for the load), ``d_meta`` (the step's connector metadata built),
    ``d_reported`` (the scheduler learnt the load finished) or ``d_failed``
decode engine (worker)
    ``d_step`` (the worker's step called the connector's ``start_load_kv`` with the load),
    ``d_admitted`` (the connector's worker took the load), ``d_posted`` (READ
    posted), ``d_read_done`` (a step found the READ done), ``d_confirmed`` (kvx: the prefill
    engine confirmed its hold lived through the READ), ``d_finished`` (the worker returned the
    load to vLLM as finished)
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

ENV = "KVX_VLLM_TRACE_DIR"


class Trace:
    """One process's event file, or nothing (every call a no-op) when tracing is off."""

    def __init__(self, name: str):
        directory = os.environ.get(ENV)
        self._file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            # Line-buffered: each event reaches the file whole, even if the process is killed.
            self._file = open(os.path.join(directory, f"{name}-{os.getpid()}.jsonl"), "a", buffering=1)

    def __bool__(self) -> bool:
        return self._file is not None

    def event(self, event: str, req: str, t: Optional[float] = None, **fields: Any) -> None:
        """Records ``event`` of request ``req`` at ``t`` (default: now)."""
        if self._file is not None:
            record = {"t": time.time() if t is None else t, "event": event, "req": req}
            record.update(fields)
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

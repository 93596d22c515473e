"""``KvxConnector``: a vLLM 0.32 ``KVConnectorBase_V1`` whose logic is kvx-core's.

The scheduler side (EngineCore process) wraps ``kvx_core::ConnectorScheduler``; the worker side
(each worker process) wraps ``kvx_core::WorkerDriver`` over a kvx transfer agent. The per-step
metadata crosses from EngineCore to the workers as kvx's wire bytes inside
``KvxConnectorMetadata`` (which vLLM pickles). The native module ``kvx_vllm_native`` carries both
backends; it is imported when the connector is constructed, and
``kv_connector_extra_config["backend"]`` chooses the agent. Debian's UCX (kvx-ucx) and the UCX
inside NIXL's wheel can share a process: kvx-ucx loads its UCX apart.

``kv_connector_extra_config`` keys (all optional):

- ``backend``: ``"ucx"`` (default), ``"nixl"``, or ``"tcp"`` (kvx-tcp: plain TCP in pure Rust,
  nothing to install; each worker's agent listens on ``side_channel_host`` at a free port and
  authenticates peers with ``auth_key``; for hosts without RDMA).
- ``side_channel_host`` / ``side_channel_port``: where each worker serves its handshake payload
  (rank ``r`` binds ``port + r``), also advertised to decode engines. Fallbacks: the environment
  variables ``KVX_SIDE_CHANNEL_HOST`` / ``KVX_SIDE_CHANNEL_PORT``, then ``127.0.0.1`` / ``5700``.
  Decode engines on other hosts need an address of this host: a prefill engine warns at start when
  the host is unspecified (``0.0.0.0``, ``::``), or loopback while ``VLLM_HOST_IP`` names another
  address of this node.
- ``discovery``: how engines find each other's handshake payloads: ``"tcp"`` (default; the side
  channel above, whose host and port the ``kv_transfer_params`` carry) or
  ``"etcd://HOST:PORT[,HOST:PORT]"``: every worker publishes its payload in that etcd cluster
  under ``/kvx/handshake/{engine_id}/{rank}`` on a lease (a dead engine's entry expires), binds no
  side channel, and decode engines find prefill engines by engine id, so the params carry no
  host or port. Every engine of the deployment uses the same. Fallback: the environment variable
  ``KVX_DISCOVERY``.
- ``mode``: how a request's KV moves when its ``kv_transfer_params`` name no ``transfer_mode``:
  ``"pull"`` (default: the decode engine READs the blocks the prefill engine offers) or
  ``"push"`` (the decode engine registers blocks it allocated, the prefill engine WRITEs into
  them as its prefill ends; vLLM's ``NixlPushConnector`` protocol, with kvx's checks). A
  request's own ``"transfer_mode"`` wins. In push mode a router may dispatch both legs at once:
  the decode leg needs only the prefill engine's ``remote_engine_id``, ``remote_host``,
  ``remote_port`` and ``tp_size`` (what that engine's answers carry), and the two legs must be
  sent with the same ``X-Request-Id`` header: vLLM suffixes each engine's request id with random
  characters, and kvx pairs the legs by the id without them (as ``NixlPushConnector`` does),
  unless the router names a shared ``remote_request_id`` in both legs' params. Ids must be unique
  among the requests in flight: a second prefill leg under a live id is freed unpushed.
- ``progress_thread``: progress the transfer agent in the background. Default: on with ``ucx``
  for a producer, and for a consumer in push mode (vLLM's KV memory is not UCX-allocated, so the
  target of a READ or WRITE must progress, and an idle engine does not step), off otherwise
  (NIXL's thread busy-spins a core).
- ``ucx_transports``: ``UCX_TLS`` for kvx-ucx's agent only.
- ``tcp_connections``: connections kvx-tcp opens to each peer (default: kvx-tcp's, 4).
- ``num_threads``: threads of NIXL's UCX thread-pool engine for ``nixl`` (default 4, as vLLM's
  NixlConnector; 0 for NIXL's single-worker engine).
- ``handshake_timeout``: seconds (default 30: a first connection inside a busy engine can take
  seconds).
- ``kv_lease_duration``: seconds (default 30, as vLLM's NixlConnector), the same on every engine
  of the deployment. A prefill engine frees the blocks it holds for a decode engine when no
  reader released them and no heartbeat renewed them for this long; a decode engine renews the
  leases of its requests still waiting for their KV every sixth of it (``on_new_request``
  registers them), and reports a load done only once the prefill engine answered that its hold
  lived through the READ.
- ``auth_key``: the deployment's shared key (at least 16 bytes; fallback: the environment
  variable ``KVX_AUTH_KEY``, which keeps it out of vLLM's logged config). With it, side-channel
  handshakes are authenticated both ways, the prefill engine signs the ``kv_transfer_params`` it
  returns, and a decode engine refuses params whose MAC does not verify before any READ. Every
  engine of the deployment needs the same key.
- ``metrics_port``: each worker serves Prometheus metrics (kvx's READs, bytes, descriptors,
  transfer and handshake durations, holds, leases, notifications, peers, side-channel refusals;
  see ``docs/METRICS.md``) on ``http://side_channel_host:(metrics_port + rank)/metrics``. Unset:
  no endpoint.

Whatever the keys, the workers also report each step's counts through vLLM's own connector stats
(``KvxConnectorStats``: vLLM's periodic "KV Transfer metrics" log line) and its Prometheus endpoint
(``KvxPromMetrics``: counters ``vllm:kvx_*``).

With the environment variable ``KVX_VLLM_TRACE_DIR`` set, the connector records each
disaggregated request's stages with wall-clock times (prefill done, the load's admission, READ
posted, READ done, confirmation, reported to the scheduler; ``kvx_vllm.trace``), for
``kvx-vllm/tools/pd_latency.py`` to attribute a request's latency.

kvx's own threads (its tokio runtime, NIXL's threads, kvx-ucx's progress thread) are started off
the CPU pinning that vLLM's CPU worker applies to its step thread (Rust ``kvx_vllm::unpinned``),
and the worker thread moves to the cores vLLM reserves for KV transfer (``_move_to_kv_cores``). Set
``KVX_LOG`` (e.g. ``kvx_core=debug``) to see kvx's log events on stderr.
"""

from __future__ import annotations

import array
import hashlib
import importlib
import json
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
from vllm.v1.metrics.utils import create_metric_per_engine

from kvx_vllm.trace import Trace

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvx_vllm")  # under vLLM's logging configuration

_BACKENDS = ("ucx", "nixl", "tcp")
_MODES = ("pull", "push")
_STATS_LOG_INTERVAL_S = 5.0
_DEFAULT_LEASE_S = 30.0


def _sampled_keys(native) -> set[str]:
    """The keys of the worker's ``stats()`` that cover only the time since its last call: each
    latency's count, summed seconds and longest. The rest (``native.WORKER_COUNTERS``) are totals.
    The native module has both lists from kvx-core's ``WorkerStats``, where they are declared."""
    return {f"{key}_{what}" for key, _ in native.WORKER_TIMINGS for what in ("count", "seconds", "max_seconds")}


def _prom_counters(native) -> dict[str, str]:
    """The counters ``vllm:kvx_<key>_total`` and their help: every counter of the worker's
    ``stats()``, and each latency's count and summed seconds."""
    counters = dict(native.WORKER_COUNTERS)
    for key, doc in native.WORKER_TIMINGS:
        counters[f"{key}_count"] = f"{doc}: how many"
        counters[f"{key}_seconds"] = f"{doc}: seconds, summed"
    return counters


# NixlConnector's per-transfer lists (NixlKVConnectorStats), kept under the same keys in kvx's
# stats so that NixlConnector's own Prometheus metrics (NixlPromMetrics: vllm:nixl_xfer_time_seconds,
# vllm:nixl_bytes_transferred, ...) show kvx's transfers and a NixlConnector dashboard reads them.
_NIXL_LISTS = (
    "transfer_duration",
    "post_duration",
    "bytes_transferred",
    "num_descriptors",
    "num_failed_transfers",
    "num_failed_notifications",
    "num_failed_handshakes",
    "num_kv_expired_reqs",
    "num_notifications_after_expiry",
)
# The kvx counter behind each of NixlConnector's failure lists (its increase goes in as one item).
_NIXL_COUNTS = {
    "reads_failed": "num_failed_transfers",
    "unsent_messages": "num_failed_notifications",
    "handshake_failures": "num_failed_handshakes",
    "expired_holds": "num_kv_expired_reqs",
    "lease_failures": "num_notifications_after_expiry",
}


def _nixl_lists(transfers: list[tuple[float, int, int]], delta: dict[str, Any]) -> dict[str, list]:
    """NixlConnector's lists for one poll: a transfer per READ kvx confirmed (``post_duration``
    stays empty: kvx's worker does not time its post calls), the failure counters' increases."""
    lists: dict[str, list] = {
        "transfer_duration": [seconds for seconds, _, _ in transfers],
        "post_duration": [],
        "bytes_transferred": [nbytes for _, nbytes, _ in transfers],
        "num_descriptors": [descriptors for _, _, descriptors in transfers],
    }
    for counter, key in _NIXL_COUNTS.items():
        grew = delta.get(counter, 0)
        lists[key] = [grew] if grew > 0 else []
    return lists


class KvxConnectorStats(KVConnectorStats):
    """What kvx's workers counted in an interval, summed over the workers: ``data`` maps each counter
    of ``Worker.stats()`` to its increase, ``read_*``, ``transfer_*``, ``handshake_*``,
    ``post_wait_*`` and ``confirm_*`` to the count, summed seconds and longest of the READs (post
    to done), transfers (post to the prefill engine's confirmation), handshakes, waits from a
    load's admission to its READ's post, and waits from a READ done to its confirmation, of the
    interval; and NixlConnector's per-transfer lists (``_NIXL_LISTS``), which are concatenated."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data[k] = self.data.get(k, []) + v
            elif k.endswith("_max_seconds"):
                self.data[k] = max(self.data.get(k, 0), v)
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        done = d.get("transfer_count", 0)
        return {
            "READs posted": d.get("reads_posted", 0),
            "READs done": d.get("read_count", 0),
            "READs failed": d.get("reads_failed", 0),
            "MB read": round(d.get("bytes_read", 0) / 1e6, 3),
            "Avg transfer time (ms)": round(1e3 * d.get("transfer_seconds", 0.0) / done, 3) if done else 0,
            "Max transfer time (ms)": round(1e3 * d.get("transfer_max_seconds", 0.0), 3),
            "Max READ time (ms)": round(1e3 * d.get("read_max_seconds", 0.0), 3),
            "Max wait to post (ms)": round(1e3 * d.get("post_wait_max_seconds", 0.0), 3),
            "Max wait for confirmation (ms)": round(1e3 * d.get("confirm_max_seconds", 0.0), 3),
            "Handshakes": d.get("handshake_count", 0),
            "Handshake failures": d.get("handshake_failures", 0),
            "Holds expired": d.get("expired_holds", 0),
            "Lease failures": d.get("lease_failures", 0),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvxPromMetrics(KVConnectorPromMetrics):
    """kvx's counts as vLLM Prometheus counters ``vllm:kvx_<key>_total``, per engine: every key of
    the worker's ``stats()`` but the longest durations (``_prom_counters``). Durations are
    counters of summed seconds (``rate(sum) / rate(count)`` is the mean); kvx's own ``/metrics``
    endpoint (``metrics_port``) has them as histograms. The same transfers also go to
    NixlConnector's metrics (``NixlPromMetrics``, its names, buckets and meanings), so that a
    NixlConnector dashboard shows kvx's transfers unchanged."""

    def __init__(self, vllm_config: "VllmConfig", metric_types, labelnames: list[str], per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kvx_{key}", documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, doc in _prom_counters(importlib.import_module("kvx_vllm_native")).items()
        }
        self._nixl = NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value > 0:
                per_engine[engine_idx].inc(value)
        self._nixl.observe({k: transfer_stats_data.get(k, []) for k in _NIXL_LISTS}, engine_idx)


class KvxConnectorMetadata(KVConnectorMetadata):
    """kvx's per-step metadata, encoded by kvx-core (``kvx_core::wire``)."""

    def __init__(self, data: bytes):
        self.data = data


class KvxHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its engine's scheduler at start-up (vLLM carries it from the worker
    processes to EngineCore): the instance the worker publishes in its handshake payload."""

    def __init__(self, instance: int):
        self.instance = instance


def _native(backend: str):
    """Imports the native module, ready for ``backend`` (NIXL's library found for ``nixl``)."""
    if backend not in _BACKENDS:
        raise ValueError(f"kvx: unknown backend {backend!r}; expected one of {list(_BACKENDS)}")
    if backend == "nixl":
        _preload_nixl()
    return importlib.import_module("kvx_vllm_native")


def _preload_nixl() -> None:
    """Makes the nixl-cu12 wheel's libnixl_capi.so findable by kvx-nixl (which dlopens it by
    name) and points NIXL at the wheel's plugins, unless the environment already does."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("nixl_cu12")
    if spec is None or spec.origin is None:
        return
    libs = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), ".nixl_cu12.mesonpy.libs")
    capi = os.path.join(libs, "libnixl_capi.so")
    if os.path.exists(capi):
        ctypes.CDLL(capi, mode=ctypes.RTLD_GLOBAL)
        os.environ.setdefault("NIXL_PLUGIN_DIR", os.path.join(libs, "plugins"))
    os.environ.setdefault("UCX_MODULES", "^ib*")


def _move_to_kv_cores() -> None:
    """On CPU, moves this worker's thread to the cores vLLM reserves for KV transfer (the last
    core of each NUMA node), as vLLM's NixlConnector does: vLLM's CPU worker keeps one core per
    node out of its OpenMP binding for the connector, so that ``start_load_kv`` and the
    transport do not compete with the model's threads."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not hasattr(os, "sched_setaffinity"):
        return
    cores = [max(node) for node in current_platform.discover_numa_topology() if node]
    if cores:
        os.sched_setaffinity(0, cores)


def _ask_amx_permission() -> None:
    """On a CPU with AMX, asks Linux for the AMX tile data permission for this worker process
    (``torch.cpu._init_amx()``, ``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before its first forward.
    vLLM 0.32 runs its AMX attention kernel whenever CPUID has AMX and never asks; a process gets
    the permission only from oneDNN's first AMX GEMM, which vLLM's linear layers run for batches
    of more than 4 tokens. kvx loads whole blocks, so a decode engine whose first request leaves 1
    to 4 tokens to compute (a 129-token prompt in 128-token blocks) would otherwise die of SIGILL
    in that kernel (docs/VLLM.md, "AMX attention"). Called before the transfer agent exists:
    asked once NIXL's UCX threads had started, the first READ over kvx-nixl timed out in 2 of 7
    starts; asked before, in none of 14."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return
    granted = torch.cpu._init_amx()
    log = logger.info if granted else logger.warning
    log("kvx: AMX tile permission for vLLM's CPU attention asked: %s", "granted" if granted else "refused")


def _kv_groups(kv_cache_config: Optional["KVCacheConfig"], block_size: int) -> list[tuple[str, Optional[int]]]:
    """Each KV-cache group's kind and sliding window in tokens (``None``: full attention), in
    vLLM's group order (the order of ``remote_block_ids``). kvx moves full-attention groups (MLA
    included) whole and sliding-window groups' window; any other kind (Mamba state, chunked local
    attention, attention sinks, a group of mixed specs, a group vLLM does not transfer, a group
    with its own block size) is refused here, so the engine fails at start with this error
    rather than serving wrong KV. With the hybrid allocator off, vLLM makes one full-attention
    group of every layer (a sliding-window layer's window is then only in its attention)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if kv_cache_config is None:
        return [("full", None)]
    groups: list[tuple[str, Optional[int]]] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        refused = None
        if not getattr(group, "enable_kv_transfer", True):
            refused = "vLLM does not transfer it"
        elif getattr(spec, "block_size", block_size) != block_size:
            refused = f"its block size {spec.block_size} is not the engine's {block_size}"
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(("full", None))
        elif type(spec) is SlidingWindowSpec:
            groups.append(("sliding", int(spec.sliding_window)))
        else:
            refused = "kvx moves full-attention and sliding-window groups only"
        if refused:
            layers = ", ".join(group.layer_names[:3]) + (", ..." if len(group.layer_names) > 3 else "")
            raise ValueError(f"kvx: KV-cache group {i} ({kind}: {layers}) cannot be moved: {refused}")
    return groups


def _groups_tag(groups: list[tuple[str, Optional[int]]]) -> str:
    """The KV-cache groups for the compatibility tag, e.g. ``sliding256,full``: engines whose
    groups differ (a hybrid model with the hybrid allocator on and off: two groups of half the
    slots each, or one group of all layers) lay their blocks out differently and must not pair."""
    return ",".join(kind if window is None else f"{kind}{window}" for kind, window in groups)


def _prompt_digest(token_ids) -> str:
    """SHA-256 of a prompt's token ids (32-bit little-endian), in hex: what both legs of a push
    compare (``kvx_prompt_digest``)."""
    return hashlib.sha256(array.array("I", token_ids).tobytes()).hexdigest()


def _layer_index(name: str) -> tuple[int, str]:
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def _finish_reason(request: "Request") -> str:
    from vllm.v1.request import RequestStatus

    return {
        RequestStatus.FINISHED_LENGTH_CAPPED: "length",
        RequestStatus.FINISHED_STOPPED: "stop",
        RequestStatus.FINISHED_ABORTED: "abort",
    }.get(request.status, "error")


class KvxConnector(KVConnectorBase_V1, SupportsHMA):
    """kvx's disaggregated prefill/decode connector (pull: the decode engine READs; push: the
    prefill engine WRITEs into blocks the decode engine registered).

    ``SupportsHMA``: vLLM keeps its hybrid allocator on, so a model with sliding-window and
    full-attention layers has one KV-cache group per attention type, all taking blocks from one
    pool (``request_finished_all_groups`` and ``update_state_after_alloc`` get each group's
    blocks, a sliding-window group's out-of-window positions as vLLM's null block 0). The prefill
    engine offers each group's full computed blocks (``remote_block_ids`` per group, with
    ``kvx_group_first`` naming where a sliding-window group's start); the decode engine loads a
    full-attention group whole and a sliding-window group only from the block the window of its
    first computed token reaches. Groups of other kinds (Mamba, chunked local attention) are
    refused at start (``_kv_groups``).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        self._backend = str(extra.get("backend", "ucx")).lower()
        self._engine_id = str(cfg.engine_id)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._groups = _kv_groups(kv_cache_config, self._block_size)
        self._hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        self._host = str(extra.get("side_channel_host") or os.environ.get("KVX_SIDE_CHANNEL_HOST", "127.0.0.1"))
        self._port = int(extra.get("side_channel_port") or os.environ.get("KVX_SIDE_CHANNEL_PORT", "5700"))
        self._auth_key = extra.get("auth_key") or os.environ.get("KVX_AUTH_KEY") or None
        self._discovery = str(extra.get("discovery") or os.environ.get("KVX_DISCOVERY", "tcp"))
        self._lease_s = float(extra.get("kv_lease_duration", _DEFAULT_LEASE_S))
        self._mode = str(extra.get("mode", "pull")).lower()
        if self._mode not in _MODES:
            raise ValueError(f"kvx: unknown mode {self._mode!r}; expected one of {list(_MODES)}")
        self._sched = None
        self._native = None
        self._worker = None
        self._tensors: list[Any] = []
        self._load_errors: set[int] = set()
        self._last_stats_log = 0.0
        # The worker's counters at the last poll, the sampled values summed since the start (for
        # the log), and what vLLM has not taken yet (get_kv_connector_stats).
        self._counters: dict[str, int] = {}
        self._totals: dict[str, float] = {}
        self._interval = KvxConnectorStats()
        self._sampled: set[str] = set()  # _sampled_keys, once the worker is created
        # Per-request events for latency attribution (KVX_VLLM_TRACE_DIR; off by default).
        self._trace = Trace(f"kvx-{role.name.lower()}")
        self._scheduled: list[str] = []  # traced loads scheduled since the last metadata
        if role == KVConnectorRole.SCHEDULER:
            native = self._native = _native(self._backend)
            self._sched = native.Scheduler(
                self._engine_id,
                self._block_size,
                self._host,
                self._port,
                auth_key=self._auth_key,
                lease_duration_s=self._lease_s,
                discovery=self._discovery,
                tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                group_windows=[window for _, window in self._groups],
            )
            if cfg.is_kv_producer and self._discovery == "tcp":
                # Decode engines connect to the host in the params this engine hands out.
                warning = native.side_channel_host_warning(self._host, os.environ.get("VLLM_HOST_IP") or None)
                if warning:
                    logger.warning("kvx: %s", warning)
        else:
            self._create_worker(extra, cfg, vllm_config)
        handshakes = self._discovery if self._discovery != "tcp" else f"side channel {self._host}:{self._port}"
        logger.info(
            "kvx connector (%s, %s backend, %s mode) for engine %s, %s, lease %gs, %s, KV-cache groups %s (hybrid allocator %s)",
            role.name, self._backend, self._mode, self._engine_id, handshakes, self._lease_s,
            "authenticated (shared key)" if self._auth_key else "unauthenticated (no key)",
            _groups_tag(self._groups), "on" if self._hma else "off",
        )

    def _create_worker(self, extra: dict, cfg, vllm_config: "VllmConfig") -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        _ask_amx_permission()
        _move_to_kv_cores()
        native = _native(self._backend)
        self._sampled = _sampled_keys(native)
        model = vllm_config.model_config
        world_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # The ranks of an engine publish one instance (its params name it): taken from vLLM's
        # instance id, which every rank of one engine start shares and a restart draws anew.
        instance = None
        if world_size > 1:
            digest = hashlib.sha256(str(vllm_config.instance_id).encode()).digest()
            instance = int.from_bytes(digest[:8], "little")
        options = native.WorkerOptions(
            self._engine_id,
            self._block_size,
            self._host,
            self._port,
            rank=int(get_tensor_model_parallel_rank()),
            world_size=world_size,
            # MLA's latent is one head on every rank.
            kv_heads=1 if getattr(model, "use_mla", False) else int(model.get_total_num_kv_heads()),
            instance=instance,
            compat_tag=f"{model.model}|{model.dtype}|{vllm_config.cache_config.cache_dtype}|{_groups_tag(self._groups)}",
            handshake_timeout_s=float(extra.get("handshake_timeout", 30.0)),
            lease_duration_s=self._lease_s,
            auth_key=self._auth_key,
            metrics_port=None if extra.get("metrics_port") is None else int(extra["metrics_port"]),
            discovery=self._discovery,
        )
        default_progress = self._backend == "ucx" and (cfg.is_kv_producer or self._mode == "push")
        progress = bool(extra.get("progress_thread", default_progress))
        if self._backend == "ucx":
            self._worker = native.create_worker(
                options, "ucx", progress_thread=progress, transports=extra.get("ucx_transports")
            )
        elif self._backend == "tcp":
            # kvx-tcp serves READs on its own threads: no progress thread to choose.
            self._worker = native.create_worker(options, "tcp", connections=int(extra.get("tcp_connections", 0)))
        else:
            self._worker = native.create_worker(
                options,
                "nixl",
                progress_thread=progress,
                progress_delay_us=int(extra.get("progress_delay_us", 0)),
                num_threads=int(extra.get("num_threads", 4)),
            )
        if self._worker.metrics_address is not None:
            logger.info("kvx worker metrics on http://%s/metrics", self._worker.metrics_address)

    # ---------------------------------------------------------------- scheduler side (EngineCore)

    def _params(self, request: "Request", arriving: bool = False) -> Optional[dict[str, Any]]:
        """The request's ``kv_transfer_params``, completed in place for a push: the engine's
        ``mode`` where they name no ``transfer_mode``, the id both legs share
        (``remote_request_id``: the request's id without vLLM's random suffix, unless the router
        named one) and, as the request is ``arriving`` (``on_new_request``, vLLM's first hook for
        it), the digest of its prompt (``kvx_prompt_digest``, replacing any a client sent): the
        prefill engine writes only into a decode request of the same prompt."""
        params = request.kv_transfer_params
        if not params or not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
            return params
        if self._mode == "push":
            params.setdefault("transfer_mode", "push")
        if params.get("transfer_mode") == "push":
            if not params.get("remote_request_id"):
                params["remote_request_id"] = get_base_request_id(request.request_id)
            if arriving:
                params.pop("kvx_prompt_digest", None)
                if request.prompt_token_ids is not None:
                    params["kvx_prompt_digest"] = _prompt_digest(request.prompt_token_ids)
        return params

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        params = self._params(request)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count, load_async = self._sched.get_num_new_matched_tokens(
            request.request_id, request.num_prompt_tokens, json.dumps(params), num_computed_tokens
        )
        return count, load_async

    def on_new_request(self, request: "Request") -> None:
        """Decode side: a request that loads its KV from a prefill engine has that engine's lease
        on its blocks renewed (heartbeats) until its load is reported or it finishes."""
        params = self._params(request, arriving=True)
        if params and params.get("do_remote_prefill"):
            self._trace.event(
                "d_arrived", request.request_id, remote_request_id=params.get("remote_request_id"),
                prompt_tokens=request.num_prompt_tokens,
            )
            self._sched.on_new_request(request.request_id, json.dumps(params))
        elif params and params.get("do_remote_decode"):
            self._trace.event("p_arrived", request.request_id, prompt_tokens=request.num_prompt_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = self._params(request)
        if not params or not params.get("do_remote_prefill"):
            return
        computed = self._local_computed_tokens(blocks)
        # Each group's blocks past the local hit (the new ones, which the load fills), past a
        # sliding-window group's leading null blocks (out of the window).
        groups = (
            self._native.vllm_block_groups(list(blocks.get_block_ids()), computed // self._block_size)
            if num_external_tokens > 0
            else []
        )
        self._trace.event("d_scheduled", request.request_id, external_tokens=num_external_tokens)
        if self._trace and num_external_tokens > 0:
            self._scheduled.append(request.request_id)
        if self._sched.update_state_after_alloc(
            request.request_id,
            request.num_prompt_tokens,
            json.dumps(params),
            groups,
            computed,
            num_external_tokens,
        ):
            params["do_remote_prefill"] = False

    def _local_computed_tokens(self, blocks: "KVCacheBlocks") -> int:
        """Tokens of the request's local prefix-cache hit: up to its last hashed block of any
        group (as vLLM's NixlConnector counts them, but per position: a sliding-window group
        keeps only the hit's last blocks, the rest are null; a full-attention group keeps them
        all). ``request.num_computed_tokens`` is still 0 here: vLLM sets it only after this hook,
        for an asynchronous load, whose new blocks it hashes only once loaded."""
        hit = 0
        for group in blocks.blocks:
            for position, block in enumerate(group):
                if block.block_hash is not None and not block.is_null:
                    hit = max(hit, position + 1)
        return hit * self._block_size

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvxConnectorMetadata(self._sched.build_connector_meta())
        for req_id in self._scheduled:
            self._trace.event("d_meta", req_id)
        self._scheduled.clear()
        return meta

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """vLLM's call for a ``SupportsHMA`` connector: the request's blocks of each group
        covering its computed tokens, out-of-window blocks of a sliding-window group already
        freed (null block 0). A prefill engine offers each group's blocks from its first non-null
        one on."""
        params = self._params(request)
        delay_free, out = self._sched.request_finished(
            request.request_id,
            json.dumps(params) if params else None,
            _finish_reason(request),
            request.num_computed_tokens,
            self._native.vllm_block_groups([list(ids) for ids in block_ids], 0),
        )
        if params and params.get("do_remote_decode"):
            self._trace.event("p_done", request.request_id, prompt_tokens=request.num_prompt_tokens, held=delay_free)
        return delay_free, (json.loads(out) if out is not None else None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """One group's blocks (vLLM calls ``request_finished_all_groups`` for a ``SupportsHMA``
        connector; this is for callers of the single-group hook)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        """The workers' ``KvxHandshakeMetadata`` by tensor-parallel rank: the scheduler names rank
        0's instance in the params it hands out, so that a decode worker still connected to an
        earlier instance of this engine handshakes again before it reads. Nothing is served from
        EngineCore: each worker serves its own handshake payload on its side channel (rank r at
        ``side_channel_port + r``)."""
        meta = (metadata or {}).get(0)
        if isinstance(meta, KvxHandshakeMetadata) and self._sched is not None:
            self._sched.set_instance(int(meta.instance))
            logger.info("kvx: engine %s offers name its instance %016x", self._engine_id, meta.instance)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        failed = set(connector_output.failed_recving or ())
        recved = set(connector_output.finished_recving or ()) - failed
        if self._trace:
            for req_id in recved:
                self._trace.event("d_reported", req_id)
            for req_id in failed:
                self._trace.event("d_failed", req_id)
        self._sched.update_finished(sorted(connector_output.finished_sending or ()), sorted(recved), sorted(failed))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        from vllm.platforms import current_platform

        # CPU: per layer (blocks, kv_heads, block_size, 2 * head_size), kvx's packed layout.
        return "LBHNC" if current_platform.is_cpu() else None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        """Registers each distinct KV allocation once, in layer order: kvx's "layers" are these
        regions. Layers can share one: a layer reusing another's cache (cross-layer KV sharing),
        and, with the hybrid allocator on, the j-th layers of the KV-cache groups, which vLLM
        overlays on one allocation (a block id belongs to one group at a time, so block ``b`` of
        whichever group owns it is at ``region_j + b * page`` for every j). A READ of a block of
        any group then takes its page from every region; for a region that holds no layer of
        that group (vLLM pads groups to one size) it moves bytes nobody reads."""
        seen: set[int] = set()
        layers = []
        for name in sorted(kv_caches, key=_layer_index):
            t = kv_caches[name]
            if t.data_ptr() in seen:  # a layer overlaid on (or sharing) another layer's cache
                continue
            seen.add(t.data_ptr())
            if not t.is_contiguous():
                raise ValueError(f"kvx: KV cache of {name} is not contiguous")
            self._tensors.append(t)  # kept alive until shutdown: the agent has them registered
            layers.append((t.data_ptr(), t.numel() * t.element_size(), list(t.shape), t.element_size()))
        kind = self._worker.register_kv_caches(layers)
        logger.info(
            "kvx: registered %d regions for %d layers as %s (shape %s, %s) with %s",
            len(layers), len(kv_caches), kind, layers[0][2] if layers else None,
            next(iter(kv_caches.values())).dtype if kv_caches else None, self._worker.backend,
        )

    def get_handshake_metadata(self) -> Optional[KvxHandshakeMetadata]:
        """This worker's instance, for its engine's scheduler (``set_xfer_handshake_metadata``).
        The handshake itself does not go through vLLM's out-of-band metadata (which
        NixlConnector serves from EngineCore): each worker publishes its payload on its own TCP
        side channel when it registers its KV caches, so a peer's handshake needs no EngineCore
        round trip and works for any number of ranks."""
        if self._worker is None:
            return None
        return KvxHandshakeMetadata(int(self._worker.instance))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata)
        called = time.time()
        loads, pushes = self._worker.start_load_kv(meta.data)
        for req_id in loads:
            self._trace.event("d_step", req_id, t=called)
        for req_id in pushes:
            self._trace.event("p_step", req_id, t=called)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.get_finished()
        failed_ids = set()
        for req_id, blocks, reason in failed:
            logger.warning("kvx: KV load of request %s failed: %s", req_id, reason)
            failed_ids.add(req_id)
            self._load_errors.update(blocks)
        self._maybe_log_stats(bool(recving or failed or sending))
        if self._trace:
            self._trace_loads(recving)
        return KVConnectorTransferResults(
            finished_sending=set(sending),
            finished_recving=set(recving) | failed_ids,  # vLLM: a failed receive is finished too
            failed_recving=failed_ids,
        )

    def _trace_loads(self, recving: list[str]) -> None:
        """Records the stages of the loads kvx completed (kvx-core's times) and that this call
        returns them to vLLM."""
        for req_id, admitted, posted, read_done, confirmed in self._worker.take_load_times():
            for event, t in (("d_admitted", admitted), ("d_posted", posted), ("d_read_done", read_done),
                             ("d_confirmed", confirmed)):
                self._trace.event(event, req_id, t=t)
        for req_id in recving:
            self._trace.event("d_finished", req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of failed loads, with one KV-cache group. With several, none: a block id
        names a block of one group, so vLLM refuses block-level failures then (it raises), and a
        failed load reaches it through ``failed_recving`` alone."""
        errors, self._load_errors = self._load_errors, set()
        return errors if len(self._groups) == 1 else set()

    def _maybe_log_stats(self, changed: bool) -> None:
        now = time.monotonic()
        if not changed and now - self._last_stats_log < _STATS_LOG_INTERVAL_S:
            return
        if not changed:
            self._last_stats_log = now
            return
        self._last_stats_log = now
        self._poll_stats()
        s = dict(self._counters)
        s.update({k: round(v, 6) if isinstance(v, float) else v for k, v in self._totals.items()})
        logger.info("kvx worker stats: %s", json.dumps(s, sort_keys=True))

    def _poll_stats(self) -> None:
        """Takes the worker's stats (the only caller of ``Worker.stats()``, whose samples cover the
        time since its last call): the increase of each counter and the samples go to the interval
        vLLM takes next, the samples to the logged totals too."""
        delta = {}
        for k, v in self._worker.stats().items():
            if k in self._sampled:
                delta[k] = v
                self._totals[k] = max(self._totals.get(k, 0.0), v) if k.endswith("_max_seconds") else self._totals.get(k, 0) + v
            else:
                delta[k] = v - self._counters.get(k, 0)
                self._counters[k] = v
        delta.update(_nixl_lists(self._worker.take_transfers(), delta))
        self._interval.aggregate(KvxConnectorStats(data=delta))

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """What this worker counted since the last call (vLLM calls it after every step); None on
        the scheduler side and when nothing changed."""
        if self._worker is None:
            return None
        self._poll_stats()
        interval, self._interval = self._interval, KvxConnectorStats()
        return None if interval.is_empty() else interval

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return KvxConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types, labelnames, per_engine_labelvalues):
        return KvxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        self._worker = None
        self._tensors.clear()
        self._trace.close()

"""KVBridgeConnector: kvbridge as a vLLM KV connector (the only module that imports vLLM).

This module translates, nothing more: vLLM's calls and types on one side, kvbridge's
vLLM-free :class:`~kvbridge.scheduling.handoff.HandoffBook` (scheduler role: per-request
decisions) and :class:`~kvbridge.scheduling.rank.RankSide` (worker role: one rank's transfer
loop) on the other. vLLM builds one instance in the scheduler process (role SCHEDULER) and one
per worker (role WORKER); they talk through vLLM's per-step connector metadata (scheduler →
worker) and ``get_transfer_results`` (worker → scheduler), plus a wake-up: an engine waiting on a
transfer sleeps, and the rank's transfer loop wakes it the moment a hand-off finishes
(:mod:`kvbridge.scheduling.wake`, :mod:`kvbridge.integrations.vllm_idle`). A finished receive
also reaches the scheduler that way (*direct arrival*, :mod:`kvbridge.scheduling.arrivals`): it is
told to vLLM before the next step, and the workers' own later report of it is dropped.

No call from vLLM raises because of what a client sent: ``kv_transfer_params`` are parsed once
(:mod:`kvbridge.params`), and a request that cannot be handed off is served locally with a
WARNING (or, with the HTTP guard of :mod:`kvbridge.integrations.vllm_http`, refused with 400
before it reaches the engine). Request protocol: docs/usage.md.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

import kvbridge
from kvbridge.config import Config, Preset
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.heads import HeadSplit
from kvbridge.hugepages import back_with_huge_pages
from kvbridge.integrations import names, vllm_idle
from kvbridge.integrations.vllm_groups import (
    NULL_BLOCK,
    group_layers,
    kv_groups,
    shorten_prompt,
    with_groups,
)
from kvbridge.integrations.vllm_spin import apply_engine_spin
from kvbridge.integrations.vllm_stats import KVBridgePromMetrics, KVBridgeStats, delta
from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.book import OffloadBook
from kvbridge.offload.keys import namespace_of, seed_key, weights_fingerprint
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.scheduling.arrivals import DirectArrivals
from kvbridge.scheduling.fences import CudaFence, Fence
from kvbridge.scheduling.handoff import HandoffBook, RankAddress, StepPlan
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.rank import RankSide
from kvbridge.scheduling.wake import EngineWake, WakeSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector", "register", "connector_class", "resolve_connector"]

log = logging.getLogger("kvbridge.connector")
CONNECTOR_NAME = names.GENERIC


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``KVBridgeConnector`` and one name per
    backend (:mod:`kvbridge.integrations.names`), once per process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in [CONNECTOR_NAME, *(c.name for c in names.connector_names())]:
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, __name__, name)
    apply_engine_spin()


def resolve_connector(name: str) -> type[Any]:
    """The class vLLM's ``KVConnectorFactory`` builds for ``name`` (what an engine started with
    ``kv_connector: name`` would get); ValueError when vLLM has no such name registered.
    ``kvbridge doctor`` calls it after :func:`register`."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls: type[Any] = KVConnectorFactory.get_connector_class_by_name(name)
    return cls


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step."""

    plan: StepPlan
    wake_address: str | None = None
    #: the engine's :attr:`~kvbridge.scheduling.wake.EngineWake.secret` (with wake_address,
    #: when direct arrival is on): lets a rank send arrivals the engine trusts
    wake_secret: bytes | None = None


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at start-up: where this rank's control channel listens."""

    control_address: str
    engine_id: str
    generation: str


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, once per step: offload lookup answers (lookup id → rank → blocks)."""

    answers: dict[str, dict[int, int]]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {k: dict(v) for k, v in self.answers.items()}
        if isinstance(other, KVBridgeWorkerMeta):
            for lid, ranks in other.answers.items():
                merged.setdefault(lid, {}).update(ranks)
        return KVBridgeWorkerMeta(merged)


def model_identity(vllm_config: VllmConfig) -> dict[str, str]:
    """What makes two engines' KV for the same tokens identical: the seed of offload keys."""
    import hashlib
    import json

    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    try:
        hf = json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str)
    except Exception:  # noqa: BLE001 - an exotic config: fall back to its repr
        hf = repr(mc.hf_config)
    tp, _ = _parallel(vllm_config)
    return {
        "model": str(mc.model), "revision": str(getattr(mc, "revision", None)),
        "weights": weights_fingerprint(str(mc.model)),
        "hf_config": hashlib.blake2b(hf.encode(), digest_size=16).hexdigest(),
        "dtype": str(mc.dtype), "cache_dtype": str(cc.cache_dtype),
        "block_size": str(cc.block_size), "tp_size": str(tp),
        "quantization": str(getattr(mc, "quantization", None)),
    }


def _parallel(vllm_config: VllmConfig) -> tuple[int, int]:
    pc = vllm_config.parallel_config
    return int(getattr(pc, "tensor_parallel_size", 1)), int(getattr(pc, "pipeline_parallel_size",
                                                                    1))


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. ``SupportsHMA``: hybrid models (sliding-window and
    full-attention KV-cache groups, :mod:`kvbridge.integrations.vllm_groups`) hand off every
    group's blocks; other group kinds are refused at start-up."""

    #: What a backend-specific subclass (``KVBridgeNixlConnector`` …) preselects.
    preset: ClassVar[Preset | None] = None

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = Config.load(ktc.kv_connector_extra_config, preset=self.preset)
        self.config.check_loadable()  # a missing backend fails here, with the install hint
        self._counted: dict[str, int] = {}
        logging.getLogger("kvbridge").setLevel(self.config.log_level)
        _ensure_log_handler()
        apply_engine_spin()
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size, pp_size = _parallel(vllm_config)
        if pp_size != 1:
            raise ConfigError(f"KVBridgeConnector does not support pipeline parallelism yet "
                              f"(pipeline_parallel_size={pp_size})")
        self.groups = kv_groups(kv_cache_config)
        if self.groups and self.config.offload_config().enabled:
            raise ConfigError("offload tiers do not support hybrid KV-cache groups yet "
                              f"({len(self.groups)} groups): remove 'offload' from the config, "
                              "or start vLLM with --disable-hybrid-kv-cache-manager")
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            log.info("%s %s (kvbridge %s, role %s, tp %d): %s", type(self).__name__,
                     self.engine_id, kvbridge.__version__, ktc.kv_role, self.tp_size,
                     self.config.summary())
            for warning in self.config.warnings:
                log.warning("%s", warning)
            if self.config.sources.get("engine_spin_ms") == "kv_connector_extra_config":
                log.warning("engine_spin_ms in kv_connector_extra_config is ignored: vLLM's "
                            "workers read it before the connector exists; set "
                            "KVBRIDGE_ENGINE_SPIN_MS in every engine's environment instead")
            self._sched = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self, vllm_config, kv_cache_config)

    # ---- stats (vLLM's KVConnectorStats; docs/metrics.md) ----

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: the rank's counter increments and per-transfer samples since the last call
        (None when nothing happened)."""
        if self._worker is None or self._worker.side is None:
            return None
        loop = self._worker.side.loop
        now = loop.counters()
        data: dict[str, Any] = loop.observe.drain()
        inc = delta(now, self._counted)
        self._counted = now
        if inc:
            data["counters"] = inc
        return KVBridgeStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    # ---- scheduler role ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        self._sched.seen(request)
        tier = self._sched.offload.matched(request.request_id, request.prompt_token_ids,
                                           num_computed_tokens)
        if tier is None:
            return None, False  # tier lookup in flight: vLLM asks again next step
        count, load_async = self._sched.book.matched_tokens(
            request.request_id, request.num_prompt_tokens, num_computed_tokens)
        if count or load_async:
            return count, load_async  # a P/D receive: the tier part is loaded with it
        return tier, False  # tier hit: copied in before this step's forward

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        sched = self._sched
        req_id = request.request_id
        tables = [list(t) for t in blocks.get_block_ids()] if num_external_tokens else []
        ids = tables[0] if tables else []
        tier = sched.offload.tier_tokens(req_id) if num_external_tokens else 0
        if sched.book.receives(req_id):
            tier = min(tier, num_external_tokens)
            sched.book.after_alloc(req_id, tables if self.groups else ids, num_external_tokens,
                                   request.num_prompt_tokens, tier_tokens=tier)
            sched.offload.committed(req_id, ids, tier)
        else:
            sched.offload.committed(req_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.seen(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.worker_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request, [list(block_ids)])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with its hybrid KV-cache manager on: one block table per group."""
        assert self._sched is not None
        return self._sched.finished(request, [list(t) for t in block_ids])

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and (self._sched.book.has_pending()
                                            or self._sched.offload.has_pending())

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self._sched is not None:
            ranks = [metadata[r] for r in sorted(metadata)]
            self._sched.book.set_ranks([RankAddress(m.control_address, m.generation)
                                        for m in ranks if isinstance(m, KVBridgeHandshake)])
            log.info("engine %s control channel(s): %s", self.engine_id,
                     [getattr(m, "control_address", "?") for m in ranks])

    # ---- worker role ----

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._worker is None else self._worker.handshake_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVBridgeMetadata):
            self._worker.on_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None  # loads are started asynchronously when the metadata is bound

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._worker is not None and self._worker.side is not None:
            self._worker.side.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None and self._worker.side is not None:
            self._worker.side.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None or self._worker.side is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._worker.side.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None or self._worker.side is None:
            return None
        answers = self._worker.side.take_offload_answers()
        if not answers:
            return None
        rank = self._worker.rank
        return KVBridgeWorkerMeta({lid: {rank: n} for lid, n in answers.items()})

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None or self._worker.side is None:
            return set()
        return self._worker.side.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()


_handler_installed = False


def _ensure_log_handler() -> None:
    """vLLM configures only its own loggers; give ``kvbridge`` a handler with the same look."""
    global _handler_installed
    if _handler_installed:
        return
    _handler_installed = True
    root = logging.getLogger("kvbridge")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "(kvbridge pid=%(process)d) %(levelname)s %(asctime)s %(name)s: %(message)s",
            "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False


def _ok_status(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                              RequestStatus.FINISHED_STOPPED)


class _SchedulerSide:
    """vLLM's scheduler hooks → :class:`HandoffBook`; runs on the engine-core thread."""

    def __init__(self, conn: KVBridgeConnector) -> None:
        self.book = HandoffBook(conn.config, conn.engine_id, block_size=conn.block_size,
                                tp_size=conn.tp_size, groups=conn.groups,
                                null_block=NULL_BLOCK if conn.groups else None)
        self.groups = conn.groups
        self.offload = OffloadBook(conn.config.offload_config(),
                                   seed_key(model_identity(conn._vllm_config)),
                                   block_size=conn.block_size, tp_size=conn.tp_size)
        self.config = conn.config
        self.kv_cache_manager: Any = None
        self._first_step_due: dict[str, str] = {}
        self._marks: list[tuple[str, str, float]] = []  # for the next plan (timing only)
        self._seen: set[str] = set()
        self._live: dict[str, Request] = {}  # requests with kv_transfer_params, until finished
        self.wake = EngineWake(conn.config.idle_wait_ms)
        self._wake_address: str | None = self.wake.address
        self._conn = conn
        self._direct = conn.config.wake_on_arrival and conn.config.direct_arrival
        self.arrivals = DirectArrivals(conn.tp_size, self.book.receiving)
        self._delivering = False
        self._checked_engine: Any = None
        if conn.config.wake_on_arrival and vllm_idle.install(
                self._idle, self._before_step if self._direct else None):
            self.wake.attach(vllm_idle.nudge)
        else:
            self._direct = False

    def seen(self, request: Request) -> None:
        if request.request_id in self._seen:
            return
        self._seen.add(request.request_id)
        raw = getattr(request, "kv_transfer_params", None)
        if raw is not None:
            self._live[request.request_id] = request
        self.book.on_new_request(request.request_id, raw, request.prompt_token_ids)
        shorten_prompt(request, self.book.prefill_cut(request.request_id))

    def _blocks(self, request: Request) -> list[int] | list[list[int]]:
        tables = [list(t) for t in self.kv_cache_manager.get_block_ids(request.request_id)]
        return tables if self.groups else tables[0]

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in self.book.producers():
            request = self._live.get(req_id)
            if req_id not in scheduled or request is None:
                continue
            if request.num_computed_tokens + scheduled[req_id] >= request.num_prompt_tokens:
                self.book.prefill_complete(req_id, self._blocks(request),
                                           request.num_prompt_tokens)
        if self.offload.enabled:
            self.book.add_offload(self.offload.take_plan(), self.offload.take_stats())
        self.book.stats.update(self.wake.take_counters())
        plan = self.book.take_plan()
        plan.marks, self._marks = self._marks, []
        if self._first_step_due:
            now = time.time()
            for req_id in [r for r in self._first_step_due if r in scheduled]:
                plan.marks.append((self._first_step_due.pop(req_id), "first_step", now))
        meta = KVBridgeMetadata(plan)
        if self._wake_address is not None:
            meta.wake_address, self._wake_address = self._wake_address, None
            if self._direct:
                meta.wake_secret = self.wake.secret
        if scheduler_output.total_num_scheduled_tokens or plan:
            self.wake.step_busy()
        elif not vllm_idle.active():  # hooked, the wait is vLLM's idle point: see _idle
            self.wake.poll_wait(self._busy())
        return meta

    def _busy(self) -> bool:
        return bool(self.book.transfers_in_progress() or self.offload.waiting())

    def _idle(self, inputs: queue.Queue[Any], seconds: float) -> None:
        """vLLM's idle sleep (:mod:`kvbridge.integrations.vllm_idle`): wait for a hand-off to
        finish or a client request, whichever comes first (bounded)."""
        self.wake.idle(inputs, seconds, self._busy())

    def _before_step(self, engine: Any) -> None:
        """Direct arrival (engine thread, before each step schedules): tell vLLM of every
        receive that all tp ranks finished, so this very step can schedule the request."""
        arrivals = self.wake.take_arrivals()
        if not arrivals:
            return
        if engine is not self._checked_engine:
            why = vllm_idle.deliverable(engine, self._conn)
            if why is not None:
                log.warning("direct arrival off (%s): finished receives reach vLLM with the "
                            "workers' next step output", why)
                self._direct = False
                self.wake.stop_arrivals()
                vllm_idle.install(self._idle, None)
                return
            self._checked_engine = engine
        ready, stale = self.arrivals.ready(arrivals)
        if stale:
            self.book.stats["recv_arrival_late"] += stale
        if not ready:
            return
        self._delivering = True
        try:
            told = vllm_idle.deliver_received(engine, ready)
        finally:
            self._delivering = False
        self.arrivals.told(told)
        self.book.stats["recv_direct"] += len(told)

    def finished(self, request: Request,
                 tables: list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        """``tables``: the request's block ids per KV-cache group (one list without groups)."""
        req_id = request.request_id
        self.arrivals.forget(req_id)
        self._seen.discard(req_id)
        self._live.pop(req_id, None)
        self._first_step_due.pop(req_id, None)
        ok = _ok_status(request)
        hold, params = self.book.finished(req_id, ok, tables if self.groups else tables[0],
                                          request.num_prompt_tokens)
        # offload is refused with groups, so its book sees the one table there is
        store = self.offload.finished(req_id, ok, request.prompt_token_ids, tables[0])
        return hold or store, params

    def worker_output(self, output: KVConnectorOutput) -> None:
        if output.finished_recving and not self._delivering:
            self._drop_delivered(output)
        if output.finished_recving or output.finished_sending:
            self.wake.work_due()
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBridgeWorkerMeta):
            self.offload.answered(meta.answers)
        for req_id in output.finished_recving or ():
            tid = self.book.transfer_done(req_id)
            if tid is not None and req_id in self._live:
                self._first_step_due[req_id] = tid
                self._marks.append((tid, "recv_seen", time.time()))
        for req_id in output.finished_sending or ():
            self.book.transfer_done(req_id)

    def _drop_delivered(self, output: KVConnectorOutput) -> None:
        """The workers' report of receives vLLM was already told of directly: removed from
        ``output`` (vLLM reads it after this hook) so it learns of each exactly once."""
        early = self.arrivals.reported(output.finished_recving or ())
        if early:
            output.finished_recving = set(output.finished_recving or ()) - early

    def shutdown(self) -> None:
        self.wake.close()


class _WorkerSide:
    """vLLM's worker hooks → :class:`RankSide`; runs on the model-runner thread."""

    def __init__(self, conn: KVBridgeConnector, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.conn = conn
        self.config = conn.config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.side: RankSide | None = None
        self._wake = WakeSender()
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - not initialised in some test harnesses
            self.rank = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = with_groups(
            KVLayout.from_tensors(kv_caches, self._kv_cache_config.num_blocks,
                                  self.conn.block_size),
            self.conn.groups, group_layers(self._kv_cache_config), kv_caches)
        mc = self._vllm_config.model_config
        hf = mc.hf_config
        compat = {  # block size and TP size are the layout's and head split's to check
            "model_type": str(getattr(hf, "model_type", "?")),
            "num_hidden_layers": str(getattr(hf, "num_hidden_layers", "?")),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "cache_dtype": str(self._vllm_config.cache_config.cache_dtype),
        }
        on_gpu = any(str(getattr(t, "device", "cpu")).startswith("cuda")
                     for t in kv_caches.values())
        on_cpu = all(str(getattr(t, "device", "cpu")) == "cpu" for t in kv_caches.values())
        if self.config.huge_pages and on_cpu:
            # before any transport registers (and perhaps pins) the memory; vLLM has only
            # just allocated it, zeroed, and nothing writes it yet
            log.info("kvbridge rank %d: %s", self.rank,
                     back_with_huge_pages(layout.regions()).describe())
        # a fresh CPU KV cache may move onto a memfd for shm peers to map (nothing pins or
        # writes it yet); the operator's own backend_options win
        mapped = {"map_memory": True} if (
            on_cpu and self.config.map_kv_cache and self.config.backend == "shm") else {}
        loop = TransferLoop(self.config, self.conn.engine_id, layout, rank=self.rank,
                            tp_size=self.conn.tp_size, compat=compat,
                            heads=self._head_split(kv_caches, layout),
                            transport_defaults=mapped)
        try:
            offload = self._offload(layout, on_gpu)
        except BaseException:
            loop.close()
            raise
        self.side = RankSide(loop, self._cuda_fence if on_gpu else None, offload)
        loop.on_progress(self._wake.poke)
        rank = self.rank
        loop.on_arrival(lambda req_id, tid: self._wake.arrived(rank, req_id, tid))
        if offload is not None:
            offload.on_progress(self._wake.poke)
            offload.count_into(loop.add_counters)

    def _head_split(self, kv_caches: dict[str, Any], layout: KVLayout) -> HeadSplit | None:
        """This rank's KV heads when kvbridge can map them (heterogeneous TP and block size):
        vLLM's CPU attention backend (``KVCacheLayout.LBHNC``, tensors ``(blocks, heads,
        block_size, 2*head_dim)``), whose kernel keeps per head K as ``[head_dim, N]`` then V
        as ``[N, head_dim]`` for its ``vec``/``vec16`` ISAs (``order="dt"``); other ISAs'
        slabs are kept opaque (TP maps, block sizes must be equal). None for other backends and
        for hybrid models (KV-cache groups): they exchange KV only with engines of the same TP
        size and block size."""
        vc, tp = self._vllm_config, self.conn.tp_size
        mc = vc.model_config
        try:
            from vllm.platforms import current_platform
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            resolved = vc.cache_config.get_resolved_kv_cache_layout().name
            total, local = mc.get_total_num_kv_heads(), mc.get_num_kv_heads(vc.parallel_config)
            head_dim, cpu = mc.get_head_size(), current_platform.is_cpu()
            expected = (layout.num_blocks, local, self.conn.block_size, 2 * head_dim)
            if not cpu or resolved != "LBHNC" or layout.groups or any(
                    tuple(t.shape) != expected for t in kv_caches.values()):
                log.info("KV layout %s on %s: no head split (heterogeneous TP and block size "
                         "are not mapped for it)", resolved, "CPU" if cpu else "this device")
                return None
            cache_dtype = str(vc.cache_config.cache_dtype)
            isa = _get_attn_isa(mc.dtype, self.conn.block_size, head_dim, cache_dtype)
            order = "dt" if isa in ("vec", "vec16") and cache_dtype == "auto" else ""
            split = HeadSplit.for_rank(total, tp, self.rank, head_dim, order=order,
                                       interior=f"vllm-cpu:{isa}:{cache_dtype}")
            if split.heads != local:
                return None
            split.check(layout, tp, self.rank)
        except (KVBridgeError, AttributeError, ImportError, ValueError, TypeError) as exc:
            log.info("no KV head split for this engine (%s): heterogeneous TP and block size "
                     "are not mapped for it", exc)
            return None
        log.info("KV heads [%d, %d) of %d, block format %s: heterogeneous TP%s mapped",
                 split.first_head, split.first_head + split.heads, total, split.interior,
                 " and block size" if order else "")
        return split

    def _offload(self, layout: KVLayout, on_gpu: bool) -> OffloadManager | None:
        cfg = self.config.offload_config()
        if not cfg.enabled:
            return None
        if on_gpu:
            raise ConfigError("offload tiers need the KV cache in host memory (CPU engines); "
                              "GPU offload is not built yet: remove 'offload' from the config")
        seed = seed_key(model_identity(self._vllm_config))
        namespace = namespace_of(seed, layout.fingerprint())
        io = BlockIO(layout)
        from kvbridge import trust  # the disk tier's MAC is keyed by the engine's secret

        tiers = build_tiers(cfg, io.chunk_bytes, namespace,
                            secret=trust.resolve(self.config).secret)
        return OffloadManager(cfg, tiers, io, layout_fingerprint=layout.fingerprint(),
                              rank=self.rank, tp_size=self.conn.tp_size)

    @staticmethod
    def _cuda_fence() -> Fence | None:
        return CudaFence()

    def handshake_metadata(self) -> KVBridgeHandshake | None:
        if self.side is None:
            return None
        loop = self.side.loop
        return KVBridgeHandshake(loop.control_address, self.conn.engine_id, loop.generation)

    def on_metadata(self, meta: KVBridgeMetadata) -> None:
        if self.side is None:
            return
        if meta.wake_address:  # every rank: with TP, each rank's completion is a wake-up
            self._wake.connect(meta.wake_address, meta.wake_secret)
        self.side.apply(meta.plan)

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
        self._wake.close()


_named: dict[str, type[KVBridgeConnector]] = {}


def connector_class(name: str) -> type[KVBridgeConnector]:
    """The connector class vLLM knows as ``name`` (``KVBridgeConnector`` or a backend-specific
    name); :class:`ConfigError` for a name that is neither."""
    if name == CONNECTOR_NAME:
        return KVBridgeConnector
    cls = _named.get(name)
    if cls is None:
        entry = names.lookup(name)
        if entry is None:
            raise ConfigError(f"no kvbridge connector is called {name!r} (known: "
                              f"{', '.join(c.name for c in names.connector_names())})")
        # The class's own name is the registered name: vLLM's MultiConnector keys child stats
        # by ``type(connector).__name__`` and rebuilds them through the registry by that name.
        cls = type(name, (KVBridgeConnector,), {
            "preset": entry.preset(), "__module__": __name__, "__qualname__": name,
            "__doc__": f"KVBridgeConnector with {entry.kind} {entry.backend!r} preselected."})
        _named[name] = cls
    return cls


def __getattr__(name: str) -> Any:
    """vLLM's factory loads ``KVBridge<Backend>Connector`` from this module by attribute."""
    if name.startswith("KVBridge") and name.endswith("Connector"):
        try:
            return connector_class(name)
        except ConfigError as exc:
            raise AttributeError(str(exc)) from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if os.environ.get("KVBRIDGE_REGISTER_ON_IMPORT"):
    register()

"""vLLM's scheduler hooks (scheduler role, engine-core thread) → kvbridge's books.

:class:`SchedulerSide` keeps one engine's :class:`~kvbridge.scheduling.handoff.HandoffBook`
(P/D hand-offs) and :class:`~kvbridge.offload.book.OffloadBook` (offload tiers), builds the
per-step :class:`~kvbridge.integrations.vllm_meta.KVBridgeMetadata` for the workers, takes
their reports, and runs the engine's wake-up (:mod:`kvbridge.scheduling.wake`) and direct
arrival (:mod:`kvbridge.scheduling.arrivals`, :mod:`kvbridge.integrations.vllm_idle`). Which
side a request's missing tokens come from is the planner's
(:func:`~kvbridge.scheduling.planner.load_source`, :func:`~kvbridge.scheduling.planner.
tier_share`). :class:`~kvbridge.integrations.vllm.KVBridgeConnector` calls it.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbridge.config import Config
from kvbridge.groups import KVGroup
from kvbridge.integrations import vllm_idle
from kvbridge.integrations.vllm_events import TierEventBook
from kvbridge.integrations.vllm_groups import NULL_BLOCK, shorten_prompt
from kvbridge.integrations.vllm_meta import (
    KVBridgeMetadata,
    KVBridgeWorkerMeta,
    identity_digest,
    kv_events_enabled,
    kv_events_publisher,
    model_identity,
    trace_parent,
    traces_enabled,
)
from kvbridge.offload.book import OffloadBook
from kvbridge.offload.keys import seed_key
from kvbridge.scheduling.arrivals import DirectArrivals
from kvbridge.scheduling.handoff import HandoffBook
from kvbridge.scheduling.planner import load_source, tier_share
from kvbridge.scheduling.wake import EngineWake

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide", "finished_ok"]

log = logging.getLogger("kvbridge.connector")


def finished_ok(request: Request) -> bool:
    """``request`` finished normally (stopped, or reached its length)."""
    from vllm.v1.request import RequestStatus  # heavy: loaded once a request finishes

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                              RequestStatus.FINISHED_STOPPED)


def _salt(request: Request) -> str | None:
    """The request's ``cache_salt`` (vLLM's tenant salt; None when it has none)."""
    salt = getattr(request, "cache_salt", None)
    return salt if isinstance(salt, str) and salt else None


class SchedulerSide:
    """vLLM's scheduler hooks → :class:`HandoffBook` and :class:`OffloadBook`; runs on the
    engine-core thread."""

    def __init__(self, config: Config, engine_id: str, *, block_size: int, tp_size: int,
                 groups: tuple[KVGroup, ...], vllm_config: VllmConfig, connector: Any) -> None:
        """``connector``: the vLLM connector object (what vLLM's engine knows it by, for the
        direct-arrival check)."""
        self.book = HandoffBook(config, engine_id, block_size=block_size, tp_size=tp_size,
                                groups=groups, null_block=NULL_BLOCK if groups else None)
        self.groups = groups
        self.book.kv_events = kv_events_publisher(vllm_config)  # reported to probes
        #: the tiers' KV events in vLLM's format (vLLM publishes them; None: events off)
        self.events = (TierEventBook(block_size)
                       if kv_events_enabled(vllm_config) and config.offload_config().enabled
                       else None)
        #: the model identity at start-up; each connector reset (a weight update) starts a new
        #: epoch of it (see reset_cache)
        self._identity = model_identity(vllm_config, config.model_identity)
        self.reloads = 0
        self.offload = OffloadBook(config.offload_config(),
                                   seed_key(self._identity, sealed=config.checksum),
                                   block_size=block_size, tp_size=tp_size)
        self.book.identity = identity_digest(self._identity)
        self._version: str | None = None  # the weight version the identity names
        self._scheduled_since_reset = False
        self.config = config
        self.kv_cache_manager: Any = None
        self._first_step_due: dict[str, str] = {}
        self._marks: list[tuple[str, str, float]] = []  # for the next plan (timing only)
        self._recording = config.flight_recorder
        #: vLLM traces: each hand-off's traceparent goes to the ranks (kvbridge.scheduling.spans)
        self._tracing = self._recording and traces_enabled(vllm_config)
        self._traces: list[tuple[str, str]] = []
        self._unrecorded: list[str] = []  # for the next plan: kvbridge_record false
        self._seen: set[str] = set()
        self._live: dict[str, Request] = {}  # requests with kv_transfer_params, until finished
        self.wake = EngineWake(config.idle_wait_ms)
        self._wake_address: str | None = self.wake.address
        self._conn = connector
        self._direct = config.wake_on_arrival and config.direct_arrival
        self.arrivals = DirectArrivals(tp_size, self.book.receiving)
        self._delivering = False
        self._checked_engine: Any = None
        if config.wake_on_arrival and vllm_idle.install(
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
        # abort_immediately: vLLM's clean-up of a rejected request (only vLLM sets it)
        self.book.on_new_request(request.request_id, raw, request.prompt_token_ids,
                                 cleanup=bool(getattr(request, "abort_immediately", False)),
                                 salt=_salt(request))
        shorten_prompt(request, self.book.prefill_cut(request.request_id))

    def matched(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: a tier hit or a P/D receive (the planner says)."""
        self.seen(request)
        req_id = request.request_id
        tier = (self.offload.matched(req_id, request.prompt_token_ids, num_computed,
                                     _salt(request))
                if self.book.uses_tiers(req_id) else 0)  # the router said: P sends it all
        count, load_async = self.book.matched_tokens(req_id, request.num_prompt_tokens,
                                                     num_computed)
        return load_source(tier, count, load_async)

    def allocated(self, request: Request, blocks: KVCacheBlocks, external: int) -> None:
        """``update_state_after_alloc``: plan the receive (when there is one) and commit the
        tiers' share of the ``external`` tokens vLLM allocated (the planner splits them)."""
        req_id = request.request_id
        tid = self.book.transfer_of(req_id) if req_id in self._live else None
        if tid is not None and not self.book.recorded(req_id):
            self._unrecorded.append(tid)  # the ranks mute it before this step's forward
        elif tid is not None and self._recording:  # the flight recorder: vLLM's queue, here
            arrival = getattr(request, "arrival_time", None)
            if isinstance(arrival, float):
                self._marks.append((tid, "arrived", arrival))
            self._marks.append((tid, "scheduled", time.time()))
            parent = trace_parent(request) if self._tracing else None
            if parent is not None:
                self._traces.append((tid, parent))
        tables = [list(t) for t in blocks.get_block_ids()] if external else []
        ids = tables[0] if tables else []
        receiving = self.book.receives(req_id)
        tier = tier_share(external, self.offload.tier_tokens(req_id) if external else 0,
                          receiving)
        if receiving:
            self.book.after_alloc(req_id, tables if self.groups else ids, external,
                                  request.num_prompt_tokens, tier_tokens=tier)
        self.offload.committed(req_id, ids, tier)

    def _blocks(self, request: Request) -> list[int] | list[list[int]]:
        tables = [list(t) for t in self.kv_cache_manager.get_block_ids(request.request_id)]
        return tables if self.groups else tables[0]

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        if scheduled:
            self._scheduled_since_reset = True
        version = vllm_idle.weight_version()
        if version is not None and version != self._version:
            self._new_weights()  # a weight update with a version, reset or not
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
        plan.traces, self._traces = self._traces, []
        plan.unrecorded, self._unrecorded = self._unrecorded, []
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
        ok = finished_ok(request)
        hold, params = self.book.finished(req_id, ok, tables if self.groups else tables[0],
                                          request.num_prompt_tokens)
        # offload is refused with groups, so its book sees the one table there is
        hashes: tuple[bytes, ...] = ()
        if self.events is not None and ok:
            hashes = self.events.remember(
                request, request.num_prompt_tokens // self.events.block_size)
        store = self.offload.finished(req_id, ok, request.prompt_token_ids, tables[0],
                                      _salt(request), hashes)
        return hold or store, params

    def worker_output(self, output: KVConnectorOutput) -> None:
        if output.finished_recving and not self._delivering:
            self._drop_delivered(output)
        if output.finished_recving or output.finished_sending:
            self.wake.work_due()
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVBridgeWorkerMeta):
            self.offload.answered(meta.answers)
            if meta.tier_events and self.events is not None:
                self.events.add(meta.tier_events)
        for req_id in output.finished_recving or ():
            tid = self.book.transfer_done(req_id)
            if (tid is not None and req_id in self._live and self._recording
                    and self.book.recorded(req_id)):
                self._first_step_due[req_id] = tid
                self._marks.append((tid, "recv_seen", time.time()))
        for req_id in output.finished_sending or ():
            self.book.transfer_done(req_id)

    def reset_cache(self) -> bool:
        """vLLM's connector reset (``reset_prefix_cache(reset_connector=True)``, which vLLM
        asks for after a weight update; ``POST /reset_prefix_cache?reset_external=true``): the
        weights may have changed, so the model identity moves on (:meth:`_new_weights`).
        Resets with no request scheduled between them are one (callers retry a reset vLLM
        refused, and each retry reaches the connector). Always succeeds."""
        if self._scheduled_since_reset or self.reloads == 0:
            self._scheduled_since_reset = False
            self.reloads += 1
            self._new_weights()
        return True

    def _new_weights(self) -> None:
        """Re-derive the identity: the weight version vLLM reports when it has one (engines
        updated to one version agree), else the count of resets since start-up. The tiers'
        entries stored under the old identity become misses (their keys are seeded by it), and
        a prefill engine of another identity is refused at the next hand-off (its answers name
        its identity) until both agree."""
        version = vllm_idle.weight_version()
        extra = {"weight_version": version} if version else {"reloads": str(self.reloads)}
        identity = {**self._identity, **extra}
        self._version = version
        self.offload.seed = seed_key(identity, sealed=self.config.checksum)
        self.book.identity = identity_digest(identity)
        self.book.stats["identity_changes"] += 1
        log.info("kvbridge: the weights may have changed (%s): model identity is now %s; tier "
                 "entries stored before are misses, and hand-offs with engines of another "
                 "identity are refused", f"weight version {version}" if version
                 else f"connector reset {self.reloads}", self.book.identity)

    def take_events(self) -> list[Any]:
        """The tiers' KV events made since the last call, as vLLM's ``KVCacheEvent``s."""
        if self.events is None:
            return []
        self.book.stats.update(self.events.stats)
        self.events.stats.clear()
        return self.events.take()

    def _drop_delivered(self, output: KVConnectorOutput) -> None:
        """The workers' report of receives vLLM was already told of directly: removed from
        ``output`` (vLLM reads it after this hook) so it learns of each exactly once."""
        early = self.arrivals.reported(output.finished_recving or ())
        if early:
            output.finished_recving = set(output.finished_recving or ()) - early

    def shutdown(self) -> None:
        self.wake.close()

"""KVBridgeConnector: kvbridge as a vLLM KV connector (with its ``vllm_*`` neighbours, the only
modules that import vLLM).

This module translates, nothing more: vLLM's calls and types on one side, kvbridge's
vLLM-free :class:`~kvbridge.scheduling.handoff.HandoffBook` (scheduler role: per-request
decisions, through :class:`~kvbridge.integrations.vllm_scheduler.SchedulerSide`) and
:class:`~kvbridge.scheduling.rank.RankSide` (worker role: one rank's transfer loop, through
:class:`~kvbridge.integrations.vllm_worker.WorkerSide`) on the other. vLLM builds one
instance in the scheduler process (role SCHEDULER) and one per worker (role WORKER); they talk
through vLLM's per-step connector metadata (scheduler → worker) and ``get_transfer_results``
(worker → scheduler), plus a wake-up: an engine waiting on a transfer sleeps, and the rank's
transfer loop wakes it the moment a hand-off finishes (:mod:`kvbridge.scheduling.wake`,
:mod:`kvbridge.integrations.vllm_idle`). A finished receive also reaches the scheduler that way
(*direct arrival*, :mod:`kvbridge.scheduling.arrivals`): it is told to vLLM before the next
step, and the workers' own later report of it is dropped.

No call from vLLM raises because of what a client sent: ``kv_transfer_params`` are parsed once
(:mod:`kvbridge.params`), and a request that cannot be handed off is served locally with a
WARNING (or, with the HTTP guard of :mod:`kvbridge.integrations.vllm_http`, refused with 400
before it reaches the engine). Request protocol: docs/usage.md.
"""

from __future__ import annotations

import logging
import os
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
from kvbridge.errors import ConfigError
from kvbridge.integrations import names
from kvbridge.integrations.vllm_groups import kv_groups
from kvbridge.integrations.vllm_meta import (
    KVBridgeHandshake,
    KVBridgeMetadata,
    KVBridgeWorkerMeta,
    parallel_sizes,
)
from kvbridge.integrations.vllm_scheduler import SchedulerSide
from kvbridge.integrations.vllm_spin import apply_engine_spin
from kvbridge.integrations.vllm_stats import KVBridgePromMetrics, KVBridgeStats, delta
from kvbridge.integrations.vllm_worker import WorkerSide
from kvbridge.scheduling.handoff import RankAddress

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
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
        self.tp_size, pp_size = parallel_sizes(vllm_config)
        if pp_size != 1:
            raise ConfigError(f"KVBridgeConnector does not support pipeline parallelism yet "
                              f"(pipeline_parallel_size={pp_size})")
        self.groups = kv_groups(kv_cache_config)
        if self.groups and self.config.offload_config().enabled:
            raise ConfigError("offload tiers do not support hybrid KV-cache groups yet "
                              f"({len(self.groups)} groups): remove 'offload' from the config, "
                              "or start vLLM with --disable-hybrid-kv-cache-manager")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        sizes: dict[str, Any] = dict(block_size=self.block_size, tp_size=self.tp_size,
                                     groups=self.groups, vllm_config=vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            log.info("%s %s (kvbridge %s, role %s, tp %d): %s", type(self).__name__,
                     self.engine_id, kvbridge.__version__, ktc.kv_role, self.tp_size,
                     self.config.summary())
            for warning in self.config.warnings:  # engine_spin_ms in extra_config among them
                log.warning("%s", warning)
            self._sched = SchedulerSide(self.config, self.engine_id, connector=self, **sizes)
        else:
            self._worker = WorkerSide(self.config, self.engine_id,
                                      kv_cache_config=kv_cache_config, **sizes)

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
        return self._sched.matched(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.seen(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.worker_output(connector_output)

    def reset_cache(self) -> bool | None:
        """vLLM's connector reset (after a weight update): a new model-identity epoch
        (:meth:`~kvbridge.integrations.vllm_scheduler.SchedulerSide.reset_cache`)."""
        return self._sched.reset_cache() if self._sched is not None else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The offload tiers' KV events, in vLLM's format (vLLM publishes them with its own;
        :mod:`kvbridge.integrations.vllm_events`)."""
        return self._sched.take_events() if self._sched is not None else ()

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
        return None  # loads are started when the metadata is bound (hand-offs: asynchronously)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None and self._worker.side is not None:
            self._worker.side.wait_layer(layer_name)

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
        events = self._worker.side.take_tier_events()
        if not (answers or events):
            return None
        rank = self._worker.rank
        return KVBridgeWorkerMeta({lid: {rank: n} for lid, n in answers.items()}, events)

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

"""KVBridgeConnector: kvbridge as a vLLM KV connector (the only module that imports vLLM).

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker (role
WORKER). The scheduler half decides, per request, what to move (from ``kv_transfer_params``);
the worker half owns a :class:`~kvbridge.scheduling.agent.TransferAgent` that moves it. They talk
through vLLM's per-step connector metadata (scheduler → worker) and ``get_transfer_results``
(worker → scheduler), plus a tiny wake socket so an idle engine waiting on a transfer sleeps
instead of spinning.

Request protocol (vLLM's key names, so stock proxies work):

* P leg: ``{"do_remote_decode": true, "transfer_id": T, "transfer_mode": "pull"|"push"}``.
  Pull: P pins the blocks under a lease and returns ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_host``, ``remote_port``, ``remote_block_ids``, ``remote_request_id``, ``tp_size``,
  ``transfer_id``, ``transfer_mode`` for D. Push: P writes into D's registered blocks as soon as
  its KV is ready.
* D leg: ``{"do_remote_prefill": true, "remote_host": …, "remote_port": …, "transfer_id": T,
  "transfer_mode": …}`` (+ ``remote_block_ids`` for pull).
* Probe: ``{"kvbridge_probe": true}`` returns the engine's control address without pinning.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

import kvbridge
from kvbridge.config import Config, TransferMode
from kvbridge.control import ControlClient
from kvbridge.integrations.vllm_spin import apply_engine_spin
from kvbridge.layout import KVLayout
from kvbridge.messages import Codec
from kvbridge.scheduling.agent import PullSpec, PushSpec, TransferAgent
from kvbridge.scheduling.lease import HeartbeatSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVBridgeConnector", "register"]

log = logging.getLogger("kvbridge.connector")
CONNECTOR_NAME = "KVBridgeConnector"


def register() -> None:
    """``vllm.general_plugins`` entry point: register the connector name (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, CONNECTOR_NAME)
    apply_engine_spin()


# -- metadata ------------------------------------------------------------------------------------


@dataclass
class RecvPlan:
    req_id: str
    transfer_id: str
    mode: str
    peer_address: str
    local_ids: list[int]
    remote_ids: list[int]
    skip_blocks: int


@dataclass
class SendPlan:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    layerwise: bool = False


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step."""

    recvs: list[RecvPlan] = field(default_factory=list)
    stages: list[SendPlan] = field(default_factory=list)
    push_ready: list[SendPlan] = field(default_factory=list)
    cancel_recvs: list[tuple[str, str]] = field(default_factory=list)
    cancel_sends: list[tuple[str, str]] = field(default_factory=list)
    #: transfer ids whose prompt KV is complete after this step's forward (P, timing only)
    prefill_done: list[str] = field(default_factory=list)
    #: (transfer_id, wall time) of a received request's first step on D (timing only)
    first_steps: list[tuple[str, float]] = field(default_factory=list)
    wake_address: str | None = None

    def __bool__(self) -> bool:
        return bool(self.recvs or self.stages or self.push_ready or self.cancel_recvs
                    or self.cancel_sends)


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):
    """Worker → scheduler at start-up: where this rank's control channel listens."""

    control_address: str
    engine_id: str
    generation: str


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _flat_block_ids(value: Any) -> list[int]:
    if not value:
        return []
    if isinstance(value[0], (list, tuple)):  # vLLM's per-group form [[...]]
        value = value[0]
    return [int(b) for b in value]


# -- the connector ---------------------------------------------------------------------------------


class KVBridgeConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = Config.load(ktc.kv_connector_extra_config)
        logging.getLogger("kvbridge").setLevel(self.config.log_level)
        _ensure_log_handler()
        apply_engine_spin()
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            log.info("KVBridgeConnector %s (kvbridge %s, role %s): %s", self.engine_id,
                     kvbridge.__version__, ktc.kv_role, self.config.summary())
            for warning in self.config.warnings:
                log.warning("%s", warning)
            self._sched = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self, vllm_config, kv_cache_config)

    # ---- scheduler role ----

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self._sched is not None:
            self._sched.set_worker_info(metadata)

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
        if self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.take_load_errors()

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


# -- scheduler side --------------------------------------------------------------------------------


class _SchedulerSide:
    """Per-request decisions; runs on the engine-core thread (single-threaded)."""

    def __init__(self, conn: KVBridgeConnector) -> None:
        self.conn = conn
        self.config = conn.config
        self.kv_cache_manager: Any = None
        self._meta = KVBridgeMetadata()
        # P requests still prefilling: req_id -> (request, transfer_id, mode)
        self._producers: dict[str, tuple[Request, str, TransferMode]] = {}
        # D requests whose KV arrived, until their first step: req_id -> transfer_id
        self._first_step_due: dict[str, str] = {}
        self._handed_to_worker: dict[str, str] = {}  # P req_id -> transfer_id (blocks pinned)
        self._recving: dict[str, str] = {}  # D req_id -> transfer_id (transfer in progress)
        self._worker_address: str | None = None
        self._generation = ""
        codec = Codec(self.config.secret, self.config.max_message_bytes)
        self._heartbeats = HeartbeatSender(ControlClient(codec, self.config.control_timeout_s),
                                           self.config.heartbeat_s)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._wake = ctx.socket(zmq.PULL)
        self._wake.setsockopt(zmq.LINGER, 0)
        port = self._wake.bind_to_random_port("tcp://127.0.0.1")
        self._wake_address: str | None = f"tcp://127.0.0.1:{port}"
        self._idle_delay = 0.001

    # -- helpers

    def _params(self, request: Request) -> dict[str, Any]:
        params = getattr(request, "kv_transfer_params", None)
        return params if isinstance(params, dict) else {}

    def _mode(self, params: dict[str, Any]) -> TransferMode:
        raw = params.get("transfer_mode") or self.config.mode.value
        try:
            mode = TransferMode(str(raw).lower())
        except ValueError:
            log.warning("unknown transfer_mode %r; using pull", raw)
            mode = TransferMode.PULL
        return TransferMode.PULL if mode is TransferMode.AUTO else mode

    def _layerwise(self, params: dict[str, Any]) -> bool:
        """Per-request ``kvbridge_layerwise`` wins over the ``layerwise`` setting."""
        return bool(params.get("kvbridge_layerwise", self.config.layerwise))

    def _transfer_id(self, request: Request, params: dict[str, Any]) -> str:
        tid = params.get("transfer_id")
        return str(tid) if tid else f"{self.conn.engine_id}-{request.request_id}"

    def set_worker_info(self, metadata: dict[int, Any]) -> None:
        info = metadata.get(0)
        if isinstance(info, KVBridgeHandshake):
            self._worker_address = info.control_address
            self._generation = info.generation
            log.info("engine %s control channel at %s", self.conn.engine_id, info.control_address)

    def _address_params(self) -> dict[str, Any]:
        if self._worker_address is None:
            return {}
        host, port = _host_port(self._worker_address)
        return {"remote_engine_id": self.conn.engine_id, "remote_host": host,
                "remote_port": port, "tp_size": 1, "pp_size": 1,
                "kvbridge_version": kvbridge.__version__,
                "kvbridge_generation": self._generation}

    # -- vLLM hooks

    def on_new_request(self, request: Request) -> None:
        params = self._params(request)
        if params.get("do_remote_prefill") and params.get("remote_host"):
            self._heartbeats.add(self._transfer_id(request, params),
                                 f"tcp://{params['remote_host']}:{params['remote_port']}")

    def _recv_params_problem(self, params: dict[str, Any]) -> str | None:
        """Why a decode leg's ``kv_transfer_params`` cannot be served, or None."""
        if not params.get("remote_host") or not params.get("remote_port"):
            return "kv_transfer_params lack remote_host/remote_port"
        if self._mode(params) is TransferMode.PULL and not params.get("remote_block_ids"):
            return "a pull needs remote_block_ids (send P's returned params unchanged)"
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = self._params(request)
        if not params.get("do_remote_prefill"):
            return 0, False
        problem = self._recv_params_problem(params)
        if problem is not None:
            # Never silent: say that this request will be prefilled here instead.
            log.warning("request %s: %s; its prompt will be computed on this engine",
                        request.request_id, problem)
            params["do_remote_prefill"] = False
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._params(request)
        if params.get("do_remote_decode") and not params.get("kvbridge_probe"):
            self._producers[request.request_id] = (
                request, self._transfer_id(request, params), self._mode(params))
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if rescheduled
        tid = self._transfer_id(request, params)
        self._heartbeats.remove(tid)
        mode = self._mode(params)
        address = f"tcp://{params.get('remote_host')}:{params.get('remote_port')}"
        n_prompt = len(request.prompt_token_ids or ())
        bs = self.conn.block_size
        n_blocks = math.ceil(n_prompt / bs)
        skip = (n_prompt - num_external_tokens) // bs if num_external_tokens else n_blocks
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        local = list(block_ids[skip:n_blocks])
        remote = _flat_block_ids(params.get("remote_block_ids"))[skip:n_blocks]
        self._meta.recvs.append(RecvPlan(request.request_id, tid, mode.value, address, local,
                                         remote, skip))
        if num_external_tokens:  # an async load: vLLM waits for finished_recving
            self._recving[request.request_id] = tid

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in self._producers if r in scheduled]:
            request, tid, mode = self._producers[req_id]
            if request.num_computed_tokens + scheduled[req_id] < request.num_prompt_tokens:
                continue  # a chunked prefill that is not finished yet
            del self._producers[req_id]
            self._meta.prefill_done.append(tid)
            if mode is TransferMode.PUSH:
                self._meta.push_ready.append(SendPlan(
                    req_id, tid, self._prompt_blocks(request),
                    self._layerwise(self._params(request))))
                self._handed_to_worker[req_id] = tid
        if self._first_step_due:
            now = time.time()
            for req_id in [r for r in self._first_step_due if r in scheduled]:
                self._meta.first_steps.append((self._first_step_due.pop(req_id), now))
        meta, self._meta = self._meta, KVBridgeMetadata()
        if self._wake_address is not None:
            meta.wake_address, self._wake_address = self._wake_address, None
        if scheduler_output.total_num_scheduled_tokens == 0 and not meta:
            self._idle_wait()
        else:
            self._idle_delay = 0.001
        return meta

    def _prompt_blocks(self, request: Request, block_ids: list[int] | None = None) -> list[int]:
        if block_ids is None:
            block_ids = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        return list(block_ids[: math.ceil(request.num_prompt_tokens / self.conn.block_size)])

    def _idle_wait(self) -> None:
        """Nothing to compute this step: sleep until the worker reports progress (bounded)."""
        if self.config.idle_wait_ms <= 0 or not (self._handed_to_worker or self._recving):
            return
        if self._wake.poll(int(self._idle_delay * 1000) or 1):
            while True:
                try:
                    self._wake.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            self._idle_delay = 0.001
        else:
            self._idle_delay = min(self._idle_delay * 2, self.config.idle_wait_ms / 1000)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = self._params(request)
        req_id = request.request_id
        if params.get("kvbridge_probe"):
            return False, self._address_params() or None
        self._first_step_due.pop(req_id, None)
        if req_id in self._recving:  # D: finished (aborted) while its transfer is in flight
            self._meta.cancel_recvs.append((req_id, self._recving[req_id]))
            self._heartbeats.remove(self._recving[req_id])
            return True, None
        if params.get("do_remote_prefill"):  # D: aborted before allocation
            self._heartbeats.remove(self._transfer_id(request, params))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        tid = self._transfer_id(request, params)
        mode = self._mode(params)
        self._producers.pop(req_id, None)
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                RequestStatus.FINISHED_STOPPED)
        if req_id in self._handed_to_worker:  # push already handed over: let the WRITE finish
            return True, {**self._address_params(), "transfer_id": tid, "transfer_mode": "push"}
        if not ok:
            if mode is TransferMode.PUSH:
                self._meta.cancel_sends.append((req_id, tid))
            return False, None
        prompt_blocks = self._prompt_blocks(request, list(block_ids))
        plan = SendPlan(req_id, tid, prompt_blocks)
        self._handed_to_worker[req_id] = tid
        if mode is TransferMode.PUSH:
            self._meta.push_ready.append(plan)
            return True, {**self._address_params(), "transfer_id": tid, "transfer_mode": "push"}
        self._meta.stages.append(plan)
        return True, {
            **self._address_params(),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": prompt_blocks,
            "remote_request_id": req_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "transfer_id": tid,
            "transfer_mode": "pull",
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_sending or ():
            self._handed_to_worker.pop(req_id, None)
        for req_id in connector_output.finished_recving or ():
            tid = self._recving.pop(req_id, None)
            if tid is not None:
                self._first_step_due[req_id] = tid

    def has_pending_work(self) -> bool:
        return bool(self._meta)

    def shutdown(self) -> None:
        self._heartbeats.close()
        self._wake.close()


# -- worker side -----------------------------------------------------------------------------------


class _WorkerSide:
    """Owns the TransferAgent; runs on the worker's model-runner thread."""

    def __init__(self, conn: KVBridgeConnector, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.conn = conn
        self.config = conn.config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.agent: TransferAgent | None = None
        self._ready: list[SendPlan] = []
        self._prefill_done: list[str] = []
        self._finished_reqs: set[str] = set()
        self._send_reqs: set[str] = set()  # requests whose blocks the agent holds for sending
        self._recv_reqs: set[str] = set()  # receives in progress: each is reported exactly once
        self._held_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._wake: zmq.Socket[bytes] | None = None
        self._wake_lock = threading.Lock()
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - not initialised in some test harnesses
            self.rank = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = KVLayout.from_tensors(kv_caches, self._kv_cache_config.num_blocks,
                                       self.conn.block_size)
        mc = self._vllm_config.model_config
        hf = mc.hf_config
        compat = {
            "model_type": str(getattr(hf, "model_type", "?")),
            "num_hidden_layers": str(getattr(hf, "num_hidden_layers", "?")),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "cache_dtype": str(self._vllm_config.cache_config.cache_dtype),
            "block_size": str(self.conn.block_size),
        }
        self.agent = TransferAgent(self.config, self.conn.engine_id, layout, rank=self.rank,
                                   compat=compat)
        self.agent.on_progress(self._poke)

    def handshake_metadata(self) -> KVBridgeHandshake | None:
        if self.agent is None:
            return None
        return KVBridgeHandshake(self.agent.control_address, self.conn.engine_id,
                                 self.agent.generation)

    def _poke(self) -> None:
        with self._wake_lock:
            if self._wake is not None:
                try:
                    self._wake.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def on_metadata(self, meta: KVBridgeMetadata) -> None:
        agent = self.agent
        if agent is None:
            return
        if meta.wake_address:
            with self._wake_lock:
                sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 16)
                sock.connect(meta.wake_address)
                self._wake = sock
        for plan in meta.recvs:
            if plan.local_ids:
                self._recv_reqs.add(plan.req_id)
            if plan.mode == TransferMode.PUSH.value:
                agent.expect_push(PushSpec(plan.req_id, plan.transfer_id, plan.peer_address,
                                           tuple(plan.local_ids), plan.skip_blocks))
            else:
                agent.start_pull(PullSpec(plan.req_id, plan.transfer_id, plan.peer_address,
                                          tuple(plan.local_ids), tuple(plan.remote_ids)))
        self._send_reqs.update(p.req_id for p in meta.stages)
        self._send_reqs.update(p.req_id for p in meta.push_ready)
        for send in meta.stages:
            agent.stage_pull(send.req_id, send.transfer_id, send.block_ids)
        for req_id, tid in meta.cancel_recvs:
            agent.cancel_recv(req_id, tid)
        for req_id, tid in meta.cancel_sends:
            agent.cancel_send(req_id, tid)
        # Push-ready plans are released after this step's forward (KV written): see after_forward.
        self._ready.extend(meta.push_ready)
        self._prefill_done.extend(meta.prefill_done)
        for tid, ts in meta.first_steps:
            agent.mark(tid, "first_step", ts)

    def layer_saved(self, layer_name: str) -> None:
        """Layer-wise push: this layer's KV of the requests finishing prefill is written."""
        if self.agent is None or not self._ready:
            return
        for plan in self._ready:
            if plan.layerwise:
                self.agent.push_layer(plan.req_id, plan.transfer_id, plan.block_ids,
                                      layer_name)

    def after_forward(self) -> None:
        if self.agent is None:
            return
        for tid in self._prefill_done:
            self.agent.mark(tid, "kv_ready")
        self._prefill_done.clear()
        for plan in self._ready:
            self.agent.push_ready(plan.req_id, plan.transfer_id, plan.block_ids)
        self._ready.clear()

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.agent is None:
            return KVConnectorTransferResults()
        # wait_for_save is skipped on steps without a forward; never strand a ready push.
        self.after_forward()
        res = self.agent.drain()
        self._finished_reqs |= finished_req_ids & self._send_reqs
        self._held_sending |= res.finished_sending
        # vLLM frees a sender's blocks on finished_sending: only report requests it has finished.
        sending = self._held_sending & self._finished_reqs
        self._held_sending -= sending
        self._finished_reqs -= sending
        self._send_reqs -= sending
        self._load_errors |= res.invalid_blocks
        recving = res.finished_recving & self._recv_reqs
        self._recv_reqs -= recving
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
        with self._wake_lock:
            if self._wake is not None:
                self._wake.close()
                self._wake = None


if os.environ.get("KVBRIDGE_REGISTER_ON_IMPORT"):
    register()

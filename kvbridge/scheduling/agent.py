"""TransferAgent: the per-rank state machines for pull and push, transport-agnostic.

One agent lives in each engine rank that holds KV memory (vLLM's worker). It owns the transport,
the control server, the peer table and the hand-off buffers, and runs one *mover* thread that
posts READs/WRITEs, completes them, sends DONE/FAIL and reaps leases. The vLLM connector (or a
test) drives it with plain calls and drains results with :meth:`TransferAgent.drain`.

State machines (transfer_id is the cross-engine key; req_id is the local request id):

* pull, P side: ``stage`` → staged (lease, renewed by heartbeats) → DONE from D (blocks released;
  D is told whether the lease still held, so a READ racing an expired lease is discarded) or FAIL
  from D or lease expiry (released, counted).
* pull, D side: ``start_pull`` → handshake (cached) → READ → DONE to P → finished_recving; any
  failure → failed_recving + invalid blocks, and FAIL to P so nothing waits out a timeout.
* push, P side: ``push_ready`` (KV written) and D's registration meet in the LookupBuffers
  whichever comes first → WRITE → DONE to D → blocks released; failure → FAIL to D.
* push, D side: ``expect_push`` → handshake → registration to P → wait for DONE/FAIL under
  ``push_timeout_s``; on timeout D asks P to cancel and only gives its blocks up once P confirms
  no WRITE is in flight (posted writes cannot be aborted).

Thread safety: the public methods enqueue work and return at once; they may be called from any
thread. Results are collected under a lock.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvbridge import registry
from kvbridge.config import Config
from kvbridge.control import ControlClient, ControlServer
from kvbridge.errors import KVBridgeError, PeerUnreachable
from kvbridge.layout import DescriptorArray, KVLayout, descriptor_pair
from kvbridge.lookup_buffer import LookupBuffer
from kvbridge.messages import (
    Ack,
    Codec,
    Heartbeat,
    Hello,
    HelloReply,
    Message,
    PushRegister,
    StatsQuery,
    StatsReply,
    TransferDone,
    TransferFail,
)
from kvbridge.scheduling.peers import Peer, PeerTable, make_info
from kvbridge.transport import HandleState, MemoryRegion, Op, TransferHandle, Transport

__all__ = ["TransferAgent", "Results", "PullSpec", "PushSpec"]

log = logging.getLogger("kvbridge.agent")


@dataclass(frozen=True)
class PullSpec:
    """D: read ``remote_ids`` of the engine at ``peer_address`` into ``local_ids``."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]


@dataclass(frozen=True)
class PushSpec:
    """D: ask the engine at ``peer_address`` to write its prompt blocks ``skip_blocks``… into
    ``local_ids``."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    skip_blocks: int = 0


@dataclass(frozen=True)
class _Send:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]


@dataclass
class Results:
    """What finished since the last :meth:`TransferAgent.drain`."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass
class _PushJob:
    """P side: one push whose registration matched; WRITEs posted per layer or all at once."""

    send: _Send
    reg: PushRegister
    peer: Peer
    src: tuple[int, ...]
    posted: set[int] = field(default_factory=set)  # plane indices already posted
    handles: list[TransferHandle] = field(default_factory=list)
    nbytes: int = 0
    final: bool = False  # the whole prompt's KV is written: post what is left, then DONE
    error: str | None = None


@dataclass
class _Inflight:
    """D side: one READ in flight."""

    handle: TransferHandle
    local: DescriptorArray
    spec: Any
    peer: Peer
    nbytes: int


def digest(descs: DescriptorArray) -> str:
    """blake2b over the bytes the descriptors cover, in order (for checksum mode)."""
    h = hashlib.blake2b(digest_size=16)
    for addr, length, _dev in descs.tolist():
        h.update(ctypes.string_at(addr, length))
    return h.hexdigest()


class TransferAgent:
    """See the module docstring."""

    def __init__(
        self,
        config: Config,
        engine_id: str,
        layout: KVLayout,
        *,
        rank: int = 0,
        compat: dict[str, str] | None = None,
        transport: Transport | None = None,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.layout = layout
        self.generation = uuid.uuid4().hex[:12]
        self._codec = Codec(config.secret, config.max_message_bytes)
        self.transport = transport or registry.create(
            config.backend, f"{engine_id}:{self.generation}:{rank}", config.backend_options
        )
        metadata = self.transport.register_memory(
            [MemoryRegion(a, n, layout.device) for a, n in layout.regions()]
        )
        port = config.side_channel_port + rank if config.side_channel_port else 0
        self._server = ControlServer(self._on_message, self._codec, config.side_channel_host, port)
        self._client = ControlClient(self._codec, config.control_timeout_s)
        self.info = make_info(
            engine_id=engine_id,
            generation=self.generation,
            rank=rank,
            backend=self.transport.name,
            transport_metadata=metadata,
            layout=layout,
            control_address=self._server.address,
            compat=dict(compat or {}),
        )
        self.peers = PeerTable(self.info, self.transport, self._client)

        lease = config.lease_s
        self._staged: LookupBuffer[str, _Send] = LookupBuffer(name="staged pulls")
        self._ready: LookupBuffer[str, _Send] = LookupBuffer(name="ready pushes")
        self._regs: LookupBuffer[str, PushRegister] = LookupBuffer(name="push registrations")
        self._awaiting: LookupBuffer[str, PushSpec] = LookupBuffer(name="awaited pushes")
        self._lease = lease
        # transfer ids that ended (done, failed, expired) → why; bounded by _forget_old().
        self._ended: dict[str, tuple[float, str]] = {}
        self._jobs: dict[str, _PushJob] = {}
        # pull DONEs that arrived before their stage event: transfer_id -> arrival (monotonic)
        self._early_done: dict[str, float] = {}  # P side: pushes with WRITEs posted or due
        self._inflight: list[_Inflight] = []  # D side: READs in flight
        self._lock = threading.Lock()
        self._results = Results()
        self.stats: Counter[str] = Counter()
        #: transfer_id -> {event: wall time} for the most recent transfers (hand-off timing)
        self.timings: collections.OrderedDict[str, dict[str, float]] = collections.OrderedDict()
        self._q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._notifier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvbridge-notify")
        self._wake_cb: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-mover", daemon=True)
        self._thread.start()
        log.info("agent %s gen %s rank %d up: backend %s, control %s, %d KV planes, %d blocks",
                 engine_id, self.generation, rank, self.transport.name, self._server.address,
                 len(layout.planes), layout.num_blocks)

    # -- public API (any thread) ----------------------------------------------------------------

    @property
    def control_address(self) -> str:
        return self._server.address

    def on_progress(self, callback: Any) -> None:
        """``callback()`` is called (on the mover thread) whenever new results are available."""
        self._wake_cb = callback

    def stage_pull(self, req_id: str, transfer_id: str, block_ids: list[int]) -> None:
        """P: hold ``block_ids`` for a pull under a lease until D says DONE."""
        self._q.put(("stage", _Send(req_id, transfer_id, tuple(block_ids))))

    def push_ready(self, req_id: str, transfer_id: str, block_ids: list[int]) -> None:
        """P: the KV of ``block_ids`` is written; WRITE it as soon as D has registered."""
        self._q.put(("ready", _Send(req_id, transfer_id, tuple(block_ids))))

    def push_layer(self, req_id: str, transfer_id: str, block_ids: list[int], layer: str) -> None:
        """P (layer-wise push): ``layer``'s KV of ``block_ids`` is final; if D has registered,
        WRITE that layer now. :meth:`push_ready` must still follow for the whole request."""
        self._q.put(("layer", (_Send(req_id, transfer_id, tuple(block_ids)), layer)))

    def start_pull(self, spec: PullSpec) -> None:
        """D: read the blocks; completion shows in :meth:`drain`."""
        self._q.put(("pull", spec))

    def expect_push(self, spec: PushSpec) -> None:
        """D: register with P and wait for its WRITE; completion shows in :meth:`drain`."""
        self._q.put(("expect", spec))

    def cancel_send(self, req_id: str, transfer_id: str) -> None:
        """P: the request ended before its KV was handed over; fail any waiting decode side."""
        self._q.put(("cancel_send", (req_id, transfer_id)))

    def cancel_recv(self, req_id: str, transfer_id: str) -> None:
        """D: the request was aborted; give up the transfer as soon as it is safe."""
        self._q.put(("cancel_recv", (req_id, transfer_id)))

    def mark(self, transfer_id: str, event: str, when: float | None = None) -> None:
        """Record a timing event (wall clock) for a transfer; keeps the last 1024 transfers."""
        with self._lock:
            entry = self.timings.setdefault(transfer_id, {})
            entry.setdefault(event, time.time() if when is None else when)
            self.timings.move_to_end(transfer_id)
            while len(self.timings) > 1024:
                self.timings.popitem(last=False)

    def drain(self) -> Results:
        """Return and clear what finished since the last call."""
        with self._lock:
            out, self._results = self._results, Results()
        return out

    def pending(self) -> int:
        """Transfers this agent still tracks (staged, ready, registered, awaited, in flight)."""
        return (len(self._staged) + len(self._ready) + len(self._regs) + len(self._awaiting)
                + len(self._inflight) + len(self._jobs))

    def close(self, timeout: float = 5.0) -> None:
        """Stop the mover thread, the control server and the transport. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._q.put(("stop", None))
        self._thread.join(timeout)
        self._notifier.shutdown(wait=True, cancel_futures=False)
        self._server.close()
        self._client.close()
        self.transport.close(timeout)

    # -- results --------------------------------------------------------------------------------

    def _finish_send(self, req_id: str, transfer_id: str, why: str) -> None:
        with self._lock:
            self._results.finished_sending.add(req_id)
        self._ended[transfer_id] = (time.monotonic(), why)
        self._wake()

    def _finish_recv(self, spec: PullSpec | PushSpec, ok: bool, why: str = "") -> None:
        self.mark(spec.transfer_id, "recv_done" if ok else "recv_failed")
        with self._lock:
            self._results.finished_recving.add(spec.req_id)
            if not ok:
                self._results.failed_recving.add(spec.req_id)
                self._results.invalid_blocks.update(spec.local_ids)
        self._ended[spec.transfer_id] = (time.monotonic(), why or "done")
        if ok:
            self.stats["recv_ok"] += 1
        else:
            self.stats["recv_failed"] += 1
            log.warning("transfer %s for %s failed: %s", spec.transfer_id, spec.req_id, why)
        self._wake()

    def _wake(self) -> None:
        cb = self._wake_cb
        if cb is not None:
            try:
                cb()
            except Exception:  # noqa: BLE001
                log.exception("progress callback failed")

    # -- control messages (control-server thread) -----------------------------------------------

    def _on_message(self, msg: Message) -> Message:
        if isinstance(msg, Hello):
            self.peers.accept(msg.info)
            return HelloReply(info=self.info)
        if isinstance(msg, StatsQuery):
            with self._lock:
                timings = {k: dict(v) for k, v in self.timings.items()}
            return StatsReply(engine_id=self.engine_id, generation=self.generation,
                              stats=dict(self.stats), pending=self.pending(), timings=timings)
        if isinstance(msg, Heartbeat):
            for tid in msg.transfer_ids:
                renewed = self._staged.extend(tid, self._lease) or self._ready.extend(
                    tid, self._lease)
                if not renewed:
                    self.stats["heartbeat_unknown"] += 1
            return Ack()
        if isinstance(msg, PushRegister):
            ended = self._ended.get(msg.transfer_id)
            if ended is not None:
                return Ack(ok=False, error=f"transfer {msg.transfer_id} already ended: {ended[1]}")
            self._q.put(("reg", msg))
            return Ack()
        if isinstance(msg, TransferDone):
            if msg.transfer_id in self._awaiting:  # D side: P finished its WRITE
                self._q.put(("push_done", msg))
                return Ack()
            return self._on_pull_done(msg)
        if isinstance(msg, TransferFail):
            if msg.transfer_id in self._awaiting:  # D side: P gave up
                self._q.put(("push_fail", msg))
                return Ack()
            return self._on_remote_cancel(msg)
        return Ack(ok=False, error=f"unexpected message {type(msg).__name__}")

    def _on_pull_done(self, msg: TransferDone) -> Ack:
        """P side: D finished reading. Tell D whether the blocks were still pinned."""
        send = self._staged.drop_select(msg.transfer_id)
        if send is None:
            ended = self._ended.get(msg.transfer_id)
            if ended is not None:
                self.stats["late_done"] += 1
                return Ack(ok=False, error=f"lease of {msg.transfer_id} ended before DONE "
                           f"({ended[1]}); blocks may have been reused")
            # D read before our stage event was processed: remember it; the stage releases at once.
            self._early_done[msg.transfer_id] = time.monotonic()
            send = self._staged.drop_select(msg.transfer_id)  # the stage may have landed meanwhile
            if send is None:
                return Ack()
            self._early_done.pop(msg.transfer_id, None)
        ok, err = True, None
        if msg.checksum is not None:
            mine = digest(self.layout.descriptors(msg.source_blocks))
            if mine != msg.checksum:
                ok, err = False, "checksum mismatch: bytes changed in transit"
                self.stats["checksum_mismatch"] += 1
        self.stats["pull_served"] += 1
        self._finish_send(send.req_id, msg.transfer_id, "done")
        return Ack(ok=ok, error=err)

    def _on_remote_cancel(self, msg: TransferFail) -> Ack:
        """P side: D gave up. Release, unless a WRITE into D is still in flight."""
        tid = msg.transfer_id
        if tid in self._jobs:
            return Ack(ok=False, error="write in flight")
        self._regs.drop_select(tid)
        for buf in (self._staged, self._ready):
            send = buf.drop_select(tid)
            if send is not None:
                self._finish_send(send.req_id, tid, f"cancelled by decode: {msg.reason}")
        self._ended.setdefault(tid, (time.monotonic(), f"cancelled by decode: {msg.reason}"))
        return Ack()

    # -- mover thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        delay = 1e-4
        while not self._stop.is_set():
            timeout = delay if (self._inflight or self._jobs) else 0.25
            try:
                kind, arg = self._q.get(timeout=timeout)
                self._dispatch(kind, arg)
                while True:
                    kind, arg = self._q.get_nowait()
                    self._dispatch(kind, arg)
            except queue.Empty:
                pass
            except Exception:  # noqa: BLE001 - the mover must survive any single failure
                log.exception("transfer agent step failed")
            progressed = self._poll_inflight()
            delay = 1e-4 if progressed else min(delay * 2, 2e-3)
            self._reap()

    def _dispatch(self, kind: str, arg: Any) -> None:
        if kind == "stop":
            return
        try:
            getattr(self, f"_ev_{kind}")(arg)
        except Exception as exc:  # noqa: BLE001 - never lose a request on an unexpected error
            log.exception("%s event failed; failing its transfer", kind)
            self._fail_event(kind, arg, f"{type(exc).__name__}: {exc}")

    def _fail_event(self, kind: str, arg: Any, why: str) -> None:
        """An event could not be handled: end its transfer so no block stays pinned."""
        self.stats["internal_errors"] += 1
        if isinstance(arg, tuple) and arg and isinstance(arg[0], _Send):
            arg = arg[0]
        if isinstance(arg, _Send):
            if arg.transfer_id not in self._jobs:
                self._finish_send(arg.req_id, arg.transfer_id, f"failed: {why}")
        elif isinstance(arg, PullSpec):
            self._finish_recv(arg, False, why)
        elif isinstance(arg, PushSpec):
            held = self._awaiting.peek(arg.transfer_id)
            if held is None or held is arg:  # not taken (and finished) by a DONE/FAIL handler
                if held is arg:
                    self._awaiting.drop_select(arg.transfer_id)
                self._finish_recv(arg, False, why)
        elif isinstance(arg, PushRegister):
            self._fail_push_to(arg, why)

    def _ev_stage(self, send: _Send) -> None:
        if self._early_done.pop(send.transfer_id, None) is not None:
            self._finish_send(send.req_id, send.transfer_id, "done (decode read first)")
            return
        self._staged.insert(send.transfer_id, send, self._lease)
        self.stats["staged"] += 1

    def _ev_ready(self, send: _Send) -> None:
        if send.transfer_id in self._ended:
            self._finish_send(send.req_id, send.transfer_id, self._ended[send.transfer_id][1])
            return
        job = self._jobs.get(send.transfer_id)
        if job is None:
            reg = self._regs.drop_select(send.transfer_id)
            if reg is None:
                self._ready.insert(send.transfer_id, send, self._lease)
                return
            job = self._new_job(send, reg)
        if job is not None:
            job.final = True
            self._post(job, range(len(self.layout.planes)))

    def _ev_layer(self, arg: tuple[_Send, str]) -> None:
        send, layer = arg
        job = self._jobs.get(send.transfer_id)
        if job is None:
            reg = self._regs.drop_select(send.transfer_id)
            if reg is None:
                return  # D has not registered yet: push_ready will post every layer
            job = self._new_job(send, reg)
        if job is not None:
            self._post(job, self.layout.plane_indices(layer))

    def _ev_reg(self, reg: PushRegister) -> None:
        send = self._ready.drop_select(reg.transfer_id)
        if send is None:
            self._regs.insert(reg.transfer_id, reg, self.config.push_timeout_s)
            return
        job = self._new_job(send, reg)
        if job is not None:
            job.final = True
            self._post(job, range(len(self.layout.planes)))

    def _new_job(self, send: _Send, reg: PushRegister) -> _PushJob | None:
        """Match P's blocks with D's registration; None (and FAIL sent) if they cannot match."""
        tid = send.transfer_id
        try:
            peer = self.peers.by_key(reg.engine_id, reg.generation)
            src = send.block_ids[reg.skip_blocks : reg.skip_blocks + len(reg.block_ids)]
            if len(src) != len(reg.block_ids):
                raise KVBridgeError(
                    f"decode wants {len(reg.block_ids)} blocks after {reg.skip_blocks}, prefill "
                    f"has {len(send.block_ids)}"
                )
        except KVBridgeError as exc:
            log.warning("push %s cannot start: %s", tid, exc)
            self._fail_push_to(reg, str(exc))
            self._finish_send(send.req_id, tid, f"failed: {exc}")
            return None
        job = _PushJob(send, reg, peer, tuple(src))
        self._jobs[tid] = job
        return job

    def _post(self, job: _PushJob, planes: Any) -> None:
        """Post WRITEs for the given planes of a job not yet posted (one transfer per call)."""
        todo = [i for i in planes if i not in job.posted]
        if not todo or job.error is not None or not job.src:
            return
        job.posted.update(todo)
        tid = job.send.transfer_id
        try:
            local, remote = descriptor_pair(self.layout.select(todo), job.src,
                                            job.peer.layout.select(todo), job.reg.block_ids)
            job.handles.append(self.transport.submit(Op.WRITE, job.peer.name, local, remote))
        except KVBridgeError as exc:
            job.error = str(exc)
            return
        job.nbytes += int(local[:, 1].sum())
        self.mark(tid, "write_posted")

    def _ev_pull(self, spec: PullSpec) -> None:
        try:
            peer = self.peers.get(spec.peer_address)
            if not spec.local_ids:
                self._done_to_prefill(spec, peer, None, 0)
                return
            local, remote = descriptor_pair(self.layout, spec.local_ids, peer.layout,
                                            spec.remote_ids)
            handle = self.transport.submit(Op.READ, peer.name, local, remote)
        except KVBridgeError as exc:
            self._fail_to_prefill(spec, str(exc))
            self._finish_recv(spec, False, str(exc))
            return
        self._inflight.append(
            _Inflight(handle, local, spec, peer, int(local[:, 1].sum()))
        )

    def _ev_expect(self, spec: PushSpec) -> None:
        try:
            self.peers.get(spec.peer_address)
            self._awaiting.insert(spec.transfer_id, spec, self.config.push_timeout_s)
        except KVBridgeError as exc:  # nothing of ours is in the buffer: just fail this one
            self._finish_recv(spec, False, str(exc))
            return
        try:
            reply = self._client.request(spec.peer_address, PushRegister(
                transfer_id=spec.transfer_id, engine_id=self.engine_id,
                generation=self.generation, block_ids=list(spec.local_ids),
                skip_blocks=spec.skip_blocks, layout_fingerprint=self.info.layout_fingerprint,
            ))
            if not (isinstance(reply, Ack) and reply.ok):
                why = getattr(reply, "error", reply)
                raise KVBridgeError(f"prefill refused the registration: {why}")
            self.stats["push_registered"] += 1
        except KVBridgeError as exc:
            # Ours unless a DONE/FAIL from P already took it (and finished it).
            if self._awaiting.drop_select(spec.transfer_id) is not None:
                self._finish_recv(spec, False, str(exc))

    def _ev_push_done(self, msg: TransferDone) -> None:
        spec = self._awaiting.drop_select(msg.transfer_id)
        if spec is None:
            return
        if msg.checksum is not None:
            if digest(self.layout.descriptors(spec.local_ids)) != msg.checksum:
                self.stats["checksum_mismatch"] += 1
                self._finish_recv(spec, False, "checksum mismatch: bytes changed in transit")
                return
        self.stats["push_received_bytes"] += msg.nbytes
        self._finish_recv(spec, True)

    def _ev_push_fail(self, msg: TransferFail) -> None:
        spec = self._awaiting.drop_select(msg.transfer_id)
        if spec is not None:
            self._finish_recv(spec, False, f"prefill failed the push: {msg.reason}")

    def _ev_cancel_send(self, arg: tuple[str, str]) -> None:
        _req_id, tid = arg
        self._ended.setdefault(tid, (time.monotonic(), "prefill request aborted"))
        reg = self._regs.drop_select(tid)
        if reg is not None:
            self._fail_push_to(reg, "prefill request aborted")

    def _ev_cancel_recv(self, arg: tuple[str, str]) -> None:
        req_id, tid = arg
        spec = self._awaiting.peek(tid)
        if spec is None:
            return  # a pull in flight completes by itself; nothing else to cancel
        self._cancel_push(spec, "request aborted on decode")

    def _cancel_push(self, spec: PushSpec, reason: str) -> None:
        """D: give up an awaited push once P confirms nothing is still being written."""
        try:
            reply = self._client.request(spec.peer_address,
                                         TransferFail(transfer_id=spec.transfer_id, reason=reason))
            safe = isinstance(reply, Ack) and reply.ok
        except PeerUnreachable:
            safe = True  # the prefill process is gone: no write can land any more
        if not safe:
            self._awaiting.extend(spec.transfer_id, 1.0)  # DONE/FAIL will arrive shortly
            return
        if self._awaiting.drop_select(spec.transfer_id) is not None:
            self._finish_recv(spec, False, reason)

    # -- completions ----------------------------------------------------------------------------

    def _poll_inflight(self) -> bool:
        progressed = self._poll_jobs()
        if not self._inflight:
            return progressed
        still: list[_Inflight] = []
        for item in self._inflight:
            state = self.transport.poll(item.handle)
            if state is HandleState.PENDING:
                if time.perf_counter() - item.handle.started > self.config.transfer_timeout_s:
                    log.warning("READ of %s still pending after %.0f s",
                                item.spec.transfer_id, self.config.transfer_timeout_s)
                still.append(item)
                continue
            progressed = True
            self._pull_completed(item, state)
        self._inflight = still
        return progressed

    def _poll_jobs(self) -> bool:
        progressed = False
        for tid, job in list(self._jobs.items()):
            states = [self.transport.poll(h) for h in job.handles]
            if any(st is HandleState.PENDING for st in states):
                continue
            for h, st in zip(job.handles, states, strict=True):
                if st is HandleState.FAILED and job.error is None:
                    job.error = h.error or "WRITE failed"
            if not job.final and job.error is None:
                continue  # more layers to come
            # Every posted WRITE has stopped: only now may the blocks be released.
            del self._jobs[tid]
            progressed = True
            self._push_completed(job)
        return progressed

    def _pull_completed(self, item: _Inflight, state: HandleState) -> None:
        spec: PullSpec = item.spec
        if state is HandleState.FAILED:
            self._fail_to_prefill(spec, item.handle.error or "READ failed")
            self._finish_recv(spec, False, item.handle.error or "READ failed")
            return
        checksum = digest(item.local) if self.config.checksum else None
        self._done_to_prefill(spec, item.peer, checksum, item.nbytes)

    def _done_to_prefill(self, spec: PullSpec, peer: Peer, checksum: str | None,
                         nbytes: int) -> None:
        msg = TransferDone(transfer_id=spec.transfer_id, nbytes=nbytes, checksum=checksum,
                           source_blocks=list(spec.remote_ids) if checksum else [])
        try:
            reply = self._client.request(spec.peer_address, msg)
        except PeerUnreachable as exc:
            self._finish_recv(spec, False, f"prefill did not confirm the read: {exc}")
            return
        if isinstance(reply, Ack) and reply.ok:
            self.stats["pull_bytes"] += nbytes
            self._finish_recv(spec, True)
        else:
            self._finish_recv(spec, False, getattr(reply, "error", None) or "prefill refused DONE")

    def _push_completed(self, job: _PushJob) -> None:
        send, tid = job.send, job.send.transfer_id
        if job.error is not None:
            log.warning("push %s failed: %s", tid, job.error)
            self._fail_push_to(job.reg, job.error)
            self._finish_send(send.req_id, tid, "failed")
            return
        self.mark(tid, "write_done")
        checksum = None
        if self.config.checksum and job.src:
            checksum = digest(self.layout.descriptors(job.src))
        self._notify(job.peer.info.control_address,
                     TransferDone(transfer_id=tid, nbytes=job.nbytes, checksum=checksum))
        self.stats["push_bytes"] += job.nbytes
        self.stats["push_sent"] += 1
        if len(job.handles) > 1:
            self.stats["push_layerwise"] += 1
        self._finish_send(send.req_id, tid, "done")

    def _notify(self, address: str, msg: Message) -> None:
        """Send a one-way notice (DONE/FAIL) off the mover thread: a dead or slow peer must not
        stall other transfers. Failures are logged; the receiver's own timeout covers them."""
        def send() -> None:
            try:
                reply = self._client.request(address, msg)
                if isinstance(reply, Ack) and not reply.ok:
                    log.info("%s for %s refused by %s: %s", type(msg).__name__,
                             getattr(msg, "transfer_id", "?"), address, reply.error)
            except KVBridgeError as exc:
                self.stats["notify_failed"] += 1
                log.warning("cannot send %s to %s: %s", type(msg).__name__, address, exc)

        try:
            self._notifier.submit(send)
        except RuntimeError:  # shutting down
            pass

    def _fail_push_to(self, reg: PushRegister, reason: str) -> None:
        try:
            peer = self.peers.by_key(reg.engine_id, reg.generation)
        except KVBridgeError:
            return
        self._notify(peer.info.control_address,
                     TransferFail(transfer_id=reg.transfer_id, reason=reason))

    def _fail_to_prefill(self, spec: PullSpec, reason: str) -> None:
        self._notify(spec.peer_address, TransferFail(transfer_id=spec.transfer_id, reason=reason))

    # -- leases ---------------------------------------------------------------------------------

    def _reap(self) -> None:
        for tid, send in self._staged.expire() + self._ready.expire():
            self.stats["lease_expired"] += 1
            log.warning("lease of %s (%s) expired before decode took it; %d blocks released",
                        tid, send.req_id, len(send.block_ids))
            self._finish_send(send.req_id, tid, "lease expired")
        for tid, reg in self._regs.expire():
            self.stats["registration_expired"] += 1
            self._ended[tid] = (time.monotonic(), "prefill never arrived")
            self._fail_push_to(reg, "prefill never became ready")
        for tid, spec in self._awaiting.expire():
            self._awaiting.insert(tid, spec, 1.0)
            self.stats["push_timeout"] += 1
            self._cancel_push(spec, f"no push within {self.config.push_timeout_s} s")
        stale = time.monotonic() - self._lease
        for tid in [t for t, ts in self._early_done.items() if ts < stale]:
            self._early_done.pop(tid, None)  # a DONE for a transfer never staged here
            self.stats["unmatched_done"] += 1
        self._forget_old()

    def _forget_old(self, keep_s: float = 600.0) -> None:
        if len(self._ended) < 4096:
            return
        cutoff = time.monotonic() - keep_s
        for tid in [t for t, (ts, _) in self._ended.items() if ts < cutoff]:
            self._ended.pop(tid, None)


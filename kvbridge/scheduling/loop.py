"""TransferLoop: the one owner of an engine rank's transfer state.

One thread runs a reactor over the control server's socket, the asynchronous client's
sockets, a wake-up pipe and the transport's in-flight handles. Everything that changes
transfer state happens on that thread: control messages, the connector's events (submitted from
vLLM's threads through a queue), replies to our own calls, completions and timers. So a cancel
and a post cannot race, and a round trip to one peer never waits behind another's: every call
is asynchronous with its own deadline.

Public methods may be called from any thread; they enqueue an event and return at once.
Results (what vLLM must learn) are collected under a lock and taken with :meth:`drain`;
``on_progress`` wakes the caller when there is something to take.

If the loop thread ever dies (a bug), every transfer still in progress is reported failed and
every later request fails at once: nothing hangs silently. Blocks that a posted transfer might
still write are then never given back (a CRITICAL line says so; a leak is better than a
corruption).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from kvbridge import identity, registry, trust
from kvbridge.config import Config
from kvbridge.control import ControlServer, RpcClient
from kvbridge.errors import KVBridgeError
from kvbridge.heads import HeadSplit
from kvbridge.layout import KVLayout
from kvbridge.messages import Cancel, Codec
from kvbridge.scheduling import follow
from kvbridge.scheduling.dispatch import answer, outcome
from kvbridge.scheduling.fences import Fence, FenceWaiter
from kvbridge.scheduling.layer_stream import LayerStream
from kvbridge.scheduling.leases import HeartbeatBook, PeerEvents, Prober, Timers
from kvbridge.scheduling.mapping import Shape
from kvbridge.scheduling.observations import Observations
from kvbridge.scheduling.peers import ANY_GENERATION, Peer, PeerTable, make_info
from kvbridge.scheduling.pull import PullSink, PullSource
from kvbridge.scheduling.push import PushSource
from kvbridge.scheduling.push_wait import PushSink
from kvbridge.scheduling.recorder import Recorder
from kvbridge.scheduling.results import Outcomes, ResultBox, Results
from kvbridge.scheduling.spans import HandoffSpans
from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan
from kvbridge.transport import MemoryRegion, TransferHandle, Transport

__all__ = ["TransferLoop", "Results", "SendPlan", "PullSpec", "PushSpec"]

log = logging.getLogger("kvbridge.loop")


class TransferLoop(PeerEvents):
    """See the module docstring. ``transport_defaults``: transport options the caller derives
    from the engine (the connector: ``map_memory`` for a CPU KV cache over shm), under the
    operator's ``backend_options``, which win.

    The loop is the :class:`~kvbridge.scheduling.context.LoopContext` of its state machines
    (and the :class:`~kvbridge.scheduling.dispatch.Host` of its control answers)."""

    def __init__(self, config: Config, engine_id: str, layout: KVLayout, *, rank: int = 0,
                 tp_size: int = 1, compat: dict[str, str] | None = None,
                 transport: Transport | None = None, heads: HeadSplit | None = None,
                 transport_defaults: dict[str, Any] | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.layout = layout
        if heads is not None:
            heads.check(layout, tp_size, rank)
        self.heads = heads
        #: this rank's geometry for the heterogeneous mapping (kvbridge.scheduling.mapping)
        self.shape = Shape(tp_size, rank, layout.block_size, heads)
        self.generation = uuid.uuid4().hex[:12]
        #: the secret authenticating this rank, and where it came from (kvbridge.trust)
        self.trust = trust.resolve(config)
        self.codec = Codec(self.trust.secret, config.max_message_bytes,
                           window_s=config.replay_window_s)
        options = {**(transport_defaults or {}), **config.backend_options}
        if self.trust.secret is not None:
            options.setdefault("secret", self.trust.secret)
        self.transport = transport or registry.create(
            config.backend, identity.agent_name(engine_id, self.generation, rank), options)
        #: the words P's copies keep for this rank's push receives (kvbridge.scheduling.follow)
        self.board = (follow.Board() if self.transport.capabilities.copies_landing
                      and follow.available() else None)
        metadata = self.transport.register_memory(
            [MemoryRegion(a, n, layout.device) for a, n in layout.regions()]
            + ([MemoryRegion(*self.board.region)] if self.board is not None else []))
        port = config.side_channel_port + rank if config.side_channel_port else 0
        self.server = ControlServer(self.codec, config.side_channel_host, port,
                                    allow_insecure=config.allow_insecure_control,
                                    advertise_host=config.advertise_host)
        if not self.codec.authenticated:
            log.warning("kvbridge control channel %s is unauthenticated (%s): anyone who can "
                        "reach it can steer transfers; unset KVBRIDGE_ALLOW_INSECURE_CONTROL or "
                        "set KVBRIDGE_SECRET on every engine (docs/security.md)",
                        self.server.address, self.trust.source)
        else:
            log.info("kvbridge control channel %s is %s", self.server.address,
                     self.trust.describe())
        self.info = make_info(
            engine_id=engine_id, generation=self.generation, rank=rank, tp_size=tp_size,
            backend=self.transport.name, agent=self.transport.agent_name,
            transport_metadata=metadata, layout=layout,
            control_address=self.server.address, compat=dict(compat or {}),
            checksum=config.checksum, heads=heads)
        self.stats: Counter[str] = Counter()
        self.observe = Observations(self.transport.name)
        #: the flight recorder: per-transfer timestamps (kvbridge.scheduling.recorder)
        self.recorder = Recorder(1024, on_phase=self.observe.phase,
                                 enabled=config.flight_recorder)
        #: the hand-off spans, once :meth:`trace_spans` turned them on (vLLM traces)
        self.spans: HandoffSpans | None = None
        #: a DrainNotice's action, set by the rank's owner (kvbridge.scheduling.rank)
        self.on_drain: Callable[[], None] | None = None
        self.ended = Outcomes()
        self.results = ResultBox(layout, self.stats, self.ended, self.mark, self.wake_caller)
        self.timers = Timers()
        self._poller = zmq.Poller()
        self._poller.register(self.server.socket, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.rpc = RpcClient(self.codec, self._on_socket)
        self.prober = Prober(self.submit)
        self.peers = PeerTable(self.info, self.transport, self.rpc, self.submit,
                               timeout=config.control_timeout_s, capacity=config.max_peers,
                               prober=self.prober,
                               loopback_only=not (config.secret
                                                  or config.allow_insecure_control))
        self.peers.on_proven = self.observe.admit
        self.peers.on_forged = lambda: self.stats.update(peer_forged=1)
        self.transport.on_peer_lost(lambda name: self.submit(self._peer_lost, name))
        self.heartbeats = HeartbeatBook(self.rpc, self, self.prober,
                                        interval=config.heartbeat_s, lease=config.lease_s)
        self.pull_source = PullSource(self)
        self.pull_sink = PullSink(self)
        self.push_source = PushSource(self)
        self.push_sink = PushSink(self)
        self._events: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque())
        self._streams: list[LayerStream] = []  # layer-wise pushes being written (loop thread)
        self._wake_cb: Callable[[], None] | None = None
        self._arrival_cb: Callable[[str, str], None] | None = None
        self._in_flight: set[TransferHandle] = set()
        self._fenced = False  # a confirmed push waits for a device fence that must be polled
        self.fences = FenceWaiter(self._fence_passed, f"kvbridge-fence-{rank}")
        self._poll_delay = 5e-5
        self._stopping = False
        self.dead: str | None = None
        self.timers.set("heartbeat", config.heartbeat_s, self._heartbeat_tick)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-loop-{rank}",
                                        daemon=True)
        self._thread.start()
        log.info("transfer loop %s gen %s rank %d/%d up: backend %s, control %s, %d KV planes, "
                 "%d blocks", engine_id, self.generation, rank, tp_size, self.transport.name,
                 self.server.address, len(layout.planes), layout.num_blocks)

    # -- public API (any thread) --------------------------------------------------------------

    @property
    def control_address(self) -> str:
        return self.server.address

    def on_progress(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (on the loop thread) whenever :meth:`drain` has something."""
        self._wake_cb = callback

    def on_arrival(self, callback: Callable[[str, str], None]) -> None:
        """``callback(req_id, transfer_id)`` runs (on the loop thread) instead of the progress
        callback when a receive succeeded: every byte of its KV is in place, and the request
        shows in :meth:`drain`'s ``finished_recving``."""
        self._arrival_cb = callback

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread (FIFO)."""
        self._events.append((fn, args))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full, so the loop is awake anyway (or closed)

    def flush(self, timeout: float) -> bool:
        """Block the caller until the loop thread has run every event submitted before this
        call, or ``timeout`` seconds passed (False then; the events still run later).

        The worker calls it right after handing over push-ready KV: while it waits it holds
        neither the GIL nor the CPU, so the loop posts the WRITE at once instead of competing
        with the rest of the engine step. Never call it from the loop thread (returns False).
        """
        if self.dead or self._stopping or threading.current_thread() is self._thread:
            return False
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def stage_pull(self, plan: SendPlan) -> None:
        """P: hold ``plan``'s blocks under a lease until the decode side read them."""
        if self.dead:
            self.results.sent(plan.req_id)
            return
        self.submit(self.pull_source.stage, plan)

    def push_ready(self, plan: SendPlan, fence: Fence | None = None) -> None:
        """P: ``plan``'s KV is written (after ``fence``): WRITE it once D confirmed."""
        if self.dead:
            self.results.sent(plan.req_id)
            return
        self.submit(self.push_source.ready, plan, fence, None)

    def push_prepare(self, plan: SendPlan) -> None:
        """P: the forward now running writes ``plan``'s KV; :meth:`push_ready` follows after
        it. The loop builds the WRITE meanwhile, so that readiness only posts it."""
        if not self.dead:
            self.submit(self.push_source.prepare, plan)

    def push_layers(self, stream: LayerStream) -> None:
        """P, layer-wise push: the loop drains ``stream`` (which the forward fills) from now
        on, and WRITEs each layer of its plans as it comes; the end of the stream is their
        readiness (as :meth:`push_ready` is for a whole-request push)."""
        if not self.dead:
            self.submit(self._streams.append, stream)

    def wake(self) -> None:
        """Make the loop look at its inputs now (a pipe it drains got something). Any thread."""
        self._wake()

    def start_pull(self, spec: PullSpec) -> None:
        """D: claim and READ the blocks; the outcome shows in :meth:`drain`."""
        if self.dead:
            self.results.fail(spec.req_id, spec.local_ids, self.dead, safe=True)
            return
        self.submit(self.pull_sink.start, spec)

    def expect_push(self, spec: PushSpec) -> None:
        """D: register with P and wait for its WRITE; the outcome shows in :meth:`drain`."""
        if self.dead:
            self.results.fail(spec.req_id, spec.local_ids, self.dead, safe=True)
            return
        self.submit(self.push_sink.expect, spec)

    def fail_recv(self, req_id: str, transfer_id: str, local_ids: Sequence[int],
                  why: str) -> None:
        """D: a receive that cannot even start (nothing was posted): report it failed."""
        self.submit(functools.partial(self.results.fail, req_id, local_ids, why, safe=True,
                                      transfer_id=transfer_id))

    def announce(self, transfer_id: str) -> None:
        """P: the prefill request of push ``transfer_id`` arrived (its KV will come)."""
        self.submit(self.push_source.announce, transfer_id)

    def cancel_send(self, transfer_id: str, reason: str = "prefill request aborted") -> None:
        """P: the request ended before its KV was handed over."""
        self.submit(self.push_source.cancel_send, transfer_id, reason)

    def cancel_recv(self, transfer_id: str, reason: str = "request aborted on decode") -> None:
        """D: the request ended; give the transfer up as soon as it is safe (its request id
        then shows in ``finished_recving``)."""
        self.submit(self._cancel_recv, transfer_id, reason)

    def watch(self, transfer_id: str, address: str, generation: str = ANY_GENERATION) -> None:
        """D: keep P's lease on ``transfer_id`` alive while the request waits to be scheduled."""
        self.submit(self.heartbeats.watch, transfer_id, address, generation)

    def unwatch(self, transfer_id: str, address: str) -> None:
        self.submit(self.heartbeats.unwatch, transfer_id, address)

    def release_remote(self, address: str, transfer_id: str, reason: str) -> None:
        """D needs nothing of ``transfer_id`` (its prompt was cached here): tell P to release."""
        self.submit(self.cancel_remote, address, transfer_id, reason)

    def add_counters(self, counters: dict[str, int]) -> None:
        """Add counters kept elsewhere (the scheduler side's) to this rank's stats."""
        self.submit(self.stats.update, dict(counters))

    def backend_of(self, peer_name: str) -> str:
        """The transport carrying ``peer_name`` (a compose member's name, else the backend)."""
        member_for = getattr(self.transport, "member_for", None)
        if callable(member_for):
            try:
                return str(member_for(peer_name))
            except KVBridgeError:
                pass
        return self.transport.name

    def count(self, name: str, mode: str, peer: Peer | None = None, *,
              stats: bool = True) -> None:
        """A failure event: ``stats[name] += 1`` (unless ``stats`` is False, when another place
        counts it) and the same event labelled by mode, backend and peer for vLLM's metrics."""
        if stats:
            self.stats[name] += 1
        self.observe.event(name, mode, None if peer is None else peer.info.engine_id,
                           None if peer is None else self.backend_of(peer.name))

    def counters(self) -> dict[str, int]:
        """A copy of the counters, from any thread without a round trip (one C-level dict copy
        under the GIL: each value is one the loop thread really held)."""
        return dict(self.stats)

    def mark(self, transfer_id: str, event: str, when: float | None = None,
             mono_ns: int | None = None) -> None:
        """Record a timing event of a transfer (now, at wall time ``when``, or at
        ``time.monotonic_ns()`` value ``mono_ns``) in the flight recorder; it keeps the last
        1024 transfers."""
        self.recorder.mark(transfer_id, event, when, mono_ns)
        if self.spans is not None:
            self.spans.mark(transfer_id, event)

    def trace_spans(self, spans: HandoffSpans) -> None:
        """Make a hand-off span of each transfer the scheduler names a ``traceparent`` for
        (kvbridge.scheduling.spans); call before the first step."""
        self.spans = spans
        self.ended.on_record = spans.ended

    def drain(self) -> Results:
        """Return and clear what finished since the last call."""
        return self.results.drain()

    def snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
        """Counters and pending count, read on the loop thread."""
        if self.dead or not self._thread.is_alive():
            return {"stats": dict(self.stats), "pending": self.pending()}
        fut: Future[dict[str, Any]] = Future()
        self.submit(lambda: fut.set_result({"stats": dict(self.stats),
                                            "pending": self.pending()}))
        return fut.result(timeout)

    def outcome(self, transfer_id: str, timeout: float = 10.0) -> str | None:
        """How ``transfer_id`` ended (or what it is doing), read on the loop thread."""
        if self.dead or not self._thread.is_alive():
            return outcome(self, transfer_id)
        fut: Future[str | None] = Future()
        self.submit(lambda: fut.set_result(outcome(self, transfer_id)))
        return fut.result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop, then the control server and the transport. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self.submit(lambda: None)
        self._thread.join(timeout)
        self.fences.close(timeout)
        self.prober.close()
        self.peers.close()
        self.rpc.close()
        self.server.close()
        self.transport.close(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- services for the state machines (loop thread) ----------------------------------------

    def wake_caller(self, arrival: tuple[str, str] | None = None) -> None:
        """Run the progress callback; for ``arrival`` (``(req_id, transfer_id)`` of a receive
        that succeeded) the arrival callback instead, where there is one."""
        try:
            if arrival is not None and self._arrival_cb is not None:
                self._arrival_cb(*arrival)
            elif self._wake_cb is not None:
                self._wake_cb()
        except Exception:  # noqa: BLE001
            log.exception("progress callback failed")

    def watch_handle(self, handle: TransferHandle) -> None:
        """Track a posted handle: the loop polls it (and wakes early if the transport says)."""
        self._in_flight.add(handle)
        self._poll_delay = 5e-5
        handle.add_done_callback(self._wake)

    def fence_pending(self, fence: Fence) -> None:
        """A push waits for ``fence``: a thread waits it (and the loop acts the moment it
        passes) when it can be waited, else the loop polls it until it passes."""
        if not self.fences.add(fence):
            self._fenced = True
            self._poll_delay = 5e-5

    def _fence_passed(self, fence: Fence, ok: bool) -> None:
        """FenceWaiter thread: ``fence`` passed (or could not be waited: poll it)."""
        self.submit(self._after_fence, ok)

    def _after_fence(self, ok: bool) -> None:
        if not ok:
            self._fenced = True
            self._poll_delay = 5e-5
        self.push_source.poll()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\1")
        except (BlockingIOError, OSError):
            pass

    def cancel_remote(self, address: str, transfer_id: str, reason: str) -> None:
        """Tell the prefill engine at ``address`` that this side gave up (best effort)."""
        self.stats["cancel_sent"] += 1
        self.rpc.call(address, Cancel(transfer_id=transfer_id, reason=reason[:4000]),
                      self.config.control_timeout_s, lambda reply: False)

    def holds_pull(self, transfer_id: str) -> bool:
        return transfer_id in self.pull_source.staged

    def _cancel_recv(self, tid: str, reason: str) -> None:
        if not (self.pull_sink.cancel(tid, reason) or self.push_sink.cancel(tid, reason)):
            self.stats["cancel_unknown"] += 1

    def pending(self) -> int:
        return (len(self.pull_source) + len(self.pull_sink) + len(self.push_source)
                + len(self.push_sink))

    def _heartbeat_tick(self) -> None:
        self.timers.set("heartbeat", self.config.heartbeat_s, self._heartbeat_tick)
        self.heartbeats.tick()

    # PeerEvents
    def peer_gone(self, address: str, why: str) -> None:
        self.stats["peer_gone"] += 1
        self.pull_sink.peer_gone(address, why)
        self.push_sink.peer_gone(address, why)
        self.peers.forget(address)

    def _peer_lost(self, name: str) -> None:
        """The transport found peer ``name``'s process gone (and unmapped its memory)."""
        address = self.peers.address_of(name)
        if address is not None:
            self.peer_gone(address, f"its process exited ({name})")

    def transfers_unknown(self, address: str, transfer_ids: list[str], asked: int) -> None:
        self.pull_sink.transfers_unknown(address, transfer_ids)
        self.push_sink.transfers_unknown(address, transfer_ids, asked)

    # -- the reactor ---------------------------------------------------------------------------

    def _on_socket(self, sock: zmq.Socket[bytes], added: bool) -> None:
        if added:
            self._poller.register(sock, zmq.POLLIN)
        else:
            self._poller.unregister(sock)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - one bad event must never stop the loop
            self.stats["internal_errors"] += 1
            log.exception("transfer loop: %s failed", getattr(fn, "__qualname__", fn))
            return None

    def _timeout_ms(self) -> float:
        if self._events:
            return 0
        now = time.monotonic()
        deadlines = [d for d in (self.timers.next_deadline(), self.rpc.next_deadline())
                     if d is not None]
        wait = max(0.0, min(deadlines) - now) if deadlines else 1.0
        if self._in_flight or self._fenced:
            wait = min(wait, self._poll_delay)
        return wait * 1000.0

    def _run(self) -> None:
        try:
            while not self._stopping:
                timeout_ms = self._timeout_ms()
                if 0 < timeout_ms < 1.0:  # sub-millisecond: zmq polls in whole milliseconds
                    ready = dict(self._poller.poll(0))
                    if not ready:
                        time.sleep(timeout_ms / 1000.0)
                else:
                    ready = dict(self._poller.poll(int(timeout_ms) + (timeout_ms % 1 > 0)))
                self._step(ready)
        except BaseException as exc:  # noqa: BLE001 - record why, then fail everything
            self.dead = f"transfer loop died: {type(exc).__name__}: {exc}"
            log.critical("%s; failing every transfer in progress (blocks a transfer may still "
                         "write are kept for good)", self.dead, exc_info=True)
            self._fail_everything()
        else:
            self._guard(self.pull_source.close)
            self._guard(self.push_source.close)

    def _step(self, ready: dict[Any, int]) -> None:
        for sock in ready:
            if sock is self.server.socket:
                for ctx, msg in self.server.receive():
                    reply = self._guard(answer, self, ctx, msg)
                    if reply is not None:
                        self.server.reply(ctx, reply)
            elif sock == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            else:
                self._guard(self.rpc.on_readable, sock)
        # layer-wise pushes are drained before the events (a flush() after a stream's end then
        # returns once the end was taken) and after them (a stream attached by one of them)
        self._pump_all()
        for _ in range(len(self._events)):
            fn, args = self._events.popleft()
            self._guard(fn, *args)
        self._pump_all()
        if self._in_flight:
            # Only handles that were terminal *before* the state machines polled them leave the
            # set: one finishing during the poll (the transport's thread) is seen next step,
            # not dropped unseen (its transfer would then wait for its timeout).
            seen = {h for h in self._in_flight if h.state.terminal}
            self._guard(self.pull_sink.poll)
            self._guard(self.push_source.poll)
            self._in_flight -= seen
            if seen:
                self._poll_delay = 5e-5
            else:
                self._poll_delay = min(self._poll_delay * 2, 2e-3)
        if self._fenced:
            self._guard(self.push_source.poll)  # device fences to recheck
            self._fenced = bool(self._guard(self.push_source.fenced))
            self._poll_delay = min(self._poll_delay * 2, 2e-3)
        self._guard(self.rpc.expire)
        for fn in self.timers.due():
            self._guard(fn)

    def _pump_all(self) -> None:
        for stream in list(self._streams):
            self._guard(self._pump, stream)

    def _pump(self, stream: LayerStream) -> None:
        """Hand the layers the forward wrote since the last step to the push source."""
        layers, ended = stream.take()
        for layer, fence in layers:
            for plan in stream.plans:
                self.push_source.ready(plan, fence, layer)
        if ended:
            self._streams.remove(stream)
            for plan in stream.plans:
                self.push_source.ready(plan, stream.final_fence, None)

    def _fail_everything(self) -> None:
        why = self.dead or "transfer loop stopped"
        for parts in list(self.pull_sink.jobs.values()):
            spec = parts[0].spec
            self.results.fail(spec.req_id, spec.local_ids, why,
                              safe=all(job.handle is None for job in parts),
                              transfer_id=spec.transfer_id)
        self.push_sink.close()
        for waits in list(self.push_sink.jobs.values()):
            expected = waits[0].spec
            self.results.fail(expected.req_id, expected.local_ids, why, safe=False,
                              transfer_id=expected.transfer_id)
        for st in self.pull_source.held():
            self.results.sent(st.plan.req_id)
        for out in list(self.push_source.outs.values()):
            if out.plan is not None and out.final and not any(t.handles for t in out.targets):
                self.results.sent(out.plan.req_id)


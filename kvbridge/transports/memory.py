"""The in-process transport: one-sided READ/WRITE between transports of the same process.

``memory`` is the fake driver registered exactly like the real ones (oslo.messaging style): agent,
planner and connector tests get real descriptors, real handles and real bytes without spawning a
process. Bytes move with :func:`ctypes.memmove` (which releases the GIL) on a background thread.

Contract (on top of :mod:`kvbridge.transport`):

* Proof: ``add_peer(metadata, proof)`` loads a transport only if it attested ``proof``
  (:meth:`MemoryTransport.attest`), once; else :class:`PeerForged`.
* Reach: transports of this process only. Every live instance sits in a process-global registry
  of weak references under a random token it created; ``register_memory`` returns msgpack
  metadata (:class:`MemoryMetadata`: agent name, pid, token, regions). ``add_peer`` decodes it
  strictly and with bounds (:class:`MessageError`) and refuses metadata of another process or of a
  token that is not live (closed, garbage-collected, or made up) with :class:`PeerUnreachable`.
* Security: metadata can be forged, so its ``regions`` are never trusted. What a peer may touch is
  what the live peer object has *actually* registered, read at submit time (regions it registers
  later are reachable without resending metadata). Remote descriptors are checked against those
  and local ones against ours before any byte moves (:class:`DescriptorError`).
* Blocking: ``submit`` validates and queues, it never copies; ``poll`` only reads the handle. One
  worker thread per transport runs transfers in submission order and finishes their handles.
  ``send_notification`` appends to the peer's inbox at once (a short lock, nothing else).
* Partial failure: a transfer is cut at a descriptor (or 16 MiB) boundary when either side
  closes; its handle is then FAILED and some of its bytes may have landed. A transfer to a peer
  that was closed or collected FAILS; nothing raises on the worker thread. A transport dropped
  without ``close`` fails its own queued transfers when it is garbage-collected. A transfer's
  notification is delivered after all its bytes landed, and only if it succeeded.
* Notifications: each inbox is bounded (``max_notifications`` messages, default 4096, and
  ``max_notification_bytes`` in total, default 4 MiB). Beyond that the *new* message is dropped and
  counted in the receiver's :attr:`MemoryTransport.dropped_notifications` (a warning at most once
  a second); a transfer whose attached notification was dropped still ends DONE.
* Transfers by block id (:class:`~kvbridge.blocks.BlockTransport`): preparing checks both
  layouts against the regions registered then; ``submit_blocks`` validates the ids and queues,
  and the worker computes the coalesced copies from the plane tables.
* Thread safety: every method may be called from any thread.
* ``close`` unregisters the token, waits up to ``timeout`` for queued transfers, fails the rest,
  joins the worker, then stops peers from touching our memory (an inbound copy stops at its next
  boundary): no byte lands in our memory after ``close`` returns. Idempotent.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from kvbridge.blocks import BlockPair, BlockRequest, BlockTransport, check_in_regions
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    MessageError,
    MessageTooLarge,
    PeerForged,
    PeerUnreachable,
    TransferFailed,
    TransportClosed,
    UnknownPeer,
)
from kvbridge.transport import (
    Capabilities,
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Op,
    TransferHandle,
    check_within,
)
from kvbridge.transports.proofs import Attestations, check_proof

__all__ = [
    "MemoryTransport",
    "MemoryMetadata",
    "MAX_METADATA_BYTES",
    "MAX_REGIONS",
    "MAX_AGENT_NAME",
    "DEFAULT_MAX_NOTIFICATIONS",
    "DEFAULT_MAX_NOTIFICATION_BYTES",
]

log = logging.getLogger("kvbridge.transport.memory")

MAX_METADATA_BYTES = 1 << 20
MAX_REGIONS = 16384
MAX_AGENT_NAME = 256
DEFAULT_MAX_NOTIFICATIONS = 4096
DEFAULT_MAX_NOTIFICATION_BYTES = 4 << 20
_CHUNK = 16 << 20  # bytes per memmove call: the granularity at which a close cuts a copy

_Positive = Annotated[int, msgspec.Meta(gt=0, le=2**63 - 1)]  # fits the int64 descriptors


class MemoryMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.memory.v1"):
    """What a peer in this process needs to find this transport (``regions`` is informative)."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_AGENT_NAME)]
    pid: _Positive
    token: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
    regions: Annotated[list[tuple[_Positive, _Positive]], msgspec.Meta(max_length=MAX_REGIONS)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MemoryMetadata)

_live: weakref.WeakValueDictionary[str, MemoryTransport] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def _reset_after_fork() -> None:
    # A forked child has copies of the parent's transports but none of their worker threads.
    global _live, _live_lock
    _live, _live_lock = weakref.WeakValueDictionary(), threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class _Endpoint:
    """The part of a transport its peers touch: registered regions, inbox, gate on its memory."""

    def __init__(self, agent: str, max_messages: int, max_bytes: int) -> None:
        self.agent = agent
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self.open = True
        self.dropped = 0
        self._regions: list[tuple[int, int]] = []
        self._users = 0  # copies from peers' workers now touching our memory
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._inbox_bytes = 0
        self._last_warning = float("-inf")
        self._cond = threading.Condition()

    def add_regions(self, new: list[tuple[int, int]]) -> list[tuple[int, int]]:
        with self._cond:
            if len(self._regions) + len(new) > MAX_REGIONS:
                raise DescriptorError(f"more than {MAX_REGIONS} regions registered")
            self._regions.extend(new)
            return list(self._regions)

    def regions(self) -> list[tuple[int, int]]:
        with self._cond:
            return list(self._regions)

    @contextmanager
    def access(self) -> Iterator[None]:
        """Hold the memory open for one copy; raises :class:`TransferFailed` once shut."""
        with self._cond:
            if not self.open:
                raise TransferFailed(f"peer {self.agent!r} was closed")
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                if self._users == 0:
                    self._cond.notify_all()

    def shut(self, timeout: float) -> bool:
        """Refuse new access and notifications; wait for copies in progress. True if none left."""
        with self._cond:
            self.open = False
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._users == 0, timeout)

    def deliver(self, sender: str, message: bytes) -> bool:
        """Queue ``message`` unless the inbox is full (then drop and count it); True if queued."""
        with self._cond:
            if not self.open:
                raise PeerUnreachable(f"peer {self.agent!r} was closed")
            if (len(self._inbox) < self.max_messages
                    and self._inbox_bytes + len(message) <= self.max_bytes):
                self._inbox.append((sender, message))
                self._inbox_bytes += len(message)
                self._cond.notify_all()
                return True
            self.dropped += 1
            dropped, now = self.dropped, time.monotonic()
            warn = now - self._last_warning >= 1.0
            if warn:
                self._last_warning = now
            held, held_bytes = len(self._inbox), self._inbox_bytes
        if warn:
            log.warning("memory %r: notification inbox full (%d messages, %d bytes); dropped one "
                        "from %r (%d dropped so far)", self.agent, held, held_bytes, sender,
                        dropped)
        return False

    def drain(self) -> list[tuple[str, bytes]]:
        with self._cond:
            out = list(self._inbox)
            self._inbox.clear()
            self._inbox_bytes = 0
            return out

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._inbox) or not self.open,
                                       timeout) and bool(self._inbox)


@dataclass
class _Peer:
    meta: MemoryMetadata
    endpoint: _Endpoint


Copies = list[tuple[int, int, int]]  # (destination, source, length), coalesced


@dataclass
class _Job:
    handle: TransferHandle
    target: _Endpoint
    copies: Copies | Callable[[], Copies]  # or how to compute them (on the worker)
    notification: bytes | None
    sender: str


def _plan(op: Op, local: DescriptorArray, remote: DescriptorArray) -> Copies:
    """``(dst, src, n)`` copies, runs contiguous on both sides merged (vectorised)."""
    if local.shape[0] == 0:
        return []
    dst, src = (local, remote) if op is Op.READ else (remote, local)
    d, s, n = dst[:, 0], src[:, 0], local[:, 1]
    starts = np.ones(n.size, dtype=bool)
    starts[1:] = (d[:-1] + n[:-1] != d[1:]) | (s[:-1] + n[:-1] != s[1:])
    idx = np.flatnonzero(starts)
    lengths = np.add.reduceat(n, idx)
    return list(zip(d[idx].tolist(), s[idx].tolist(), lengths.tolist(), strict=True))


def _copy(copies: Copies, abort: threading.Event, target: _Endpoint) -> None:
    moved = 0
    for dst, src, n in copies:
        for off in range(0, n, _CHUNK):
            if abort.is_set():
                raise TransferFailed(f"transport closed after {moved} bytes; transfer abandoned")
            if not target.open:
                raise TransferFailed(f"peer {target.agent!r} closed after {moved} bytes")
            k = min(_CHUNK, n - off)
            ctypes.memmove(dst + off, src + off, k)
            moved += k


def _run(job: _Job, abort: threading.Event, agent: str) -> None:
    h = job.handle
    if abort.is_set():
        h.fail("transport closed before the transfer started")
        return
    try:
        copies = job.copies if isinstance(job.copies, list) else job.copies()
        with job.target.access():
            _copy(copies, abort, job.target)
            if job.notification is not None:
                job.target.deliver(job.sender, job.notification)
    except Exception as exc:  # noqa: BLE001 - every failure ends the handle, never the thread
        log.debug("memory %r %s #%d failed: %s", agent, h.op.value, h.id, exc)
        h.fail(f"{h.op.value} with {h.peer!r} failed: {exc}")
        return
    h.succeed()


def _work(jobs: queue.SimpleQueue[_Job | None], abort: threading.Event, agent: str) -> None:
    # A plain function (not a method) so the thread does not keep its transport alive.
    while (job := jobs.get()) is not None:
        _run(job, abort, agent)


def _collected(
    endpoint: _Endpoint, jobs: queue.SimpleQueue[_Job | None], abort: threading.Event
) -> None:
    """Finalizer of a transport dropped without ``close``: its queued transfers and transfers of
    peers into it fail (its memory may be freed next), and the worker ends."""
    abort.set()
    endpoint.shut(0.0)
    jobs.put(None)


def _positive(options: Mapping[str, Any], key: str, default: int) -> int:
    try:
        value = int(options.get(key, default))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"memory transport option {key!r} must be an integer: {exc}") from exc
    if value < 1:
        raise ConfigError(f"memory transport option {key!r} must be >= 1, got {value}")
    return value


def _decode(metadata: bytes) -> MemoryMetadata:
    if not isinstance(metadata, bytes | bytearray | memoryview):
        raise MessageError(f"memory peer metadata must be bytes, not {type(metadata).__name__}")
    size = memoryview(metadata).nbytes
    if size > MAX_METADATA_BYTES:
        raise MessageTooLarge(f"memory peer metadata of {size} bytes exceeds {MAX_METADATA_BYTES}")
    try:
        return _decoder.decode(metadata)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed memory peer metadata: {exc}") from exc


class MemoryTransport(BlockTransport):
    """In-process transport over ``memmove``; see the module docstring."""

    name = "memory"
    #: no vLLM connector name: it cannot reach another engine (kvbridge.integrations.names)
    connector_word = ""
    capabilities = Capabilities(
        read=True, write=True, notifications=True, device_memory=False, cross_host=False
    )

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        if not 1 <= len(agent_name) <= MAX_AGENT_NAME:
            raise ConfigError(f"agent name must have 1 to {MAX_AGENT_NAME} characters")
        self._endpoint = _Endpoint(
            agent_name,
            _positive(self.options, "max_notifications", DEFAULT_MAX_NOTIFICATIONS),
            _positive(self.options, "max_notification_bytes", DEFAULT_MAX_NOTIFICATION_BYTES),
        )
        self.token = secrets.token_hex(16)
        self._attested = Attestations()
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._abort = threading.Event()
        self._worker = threading.Thread(
            target=_work, args=(self._jobs, self._abort, agent_name),
            name=f"kvbridge-memory-{agent_name}", daemon=True,
        )
        self._worker.start()
        self._finalizer = weakref.finalize(
            self, _collected, self._endpoint, self._jobs, self._abort
        )
        with _live_lock:
            _live[self.token] = self
        log.info("memory transport %r ready", agent_name)

    @property
    def dropped_notifications(self) -> int:
        """Notifications this transport's inbox refused because it was full."""
        return self._endpoint.dropped

    # -- memory and peers -----------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Record host-DRAM ``regions``; return metadata listing every region registered so far."""
        self._check_open()
        new: list[tuple[int, int]] = []
        for r in regions:
            if r.kind.upper() != "DRAM":
                raise DescriptorError(
                    f"the memory transport moves host DRAM only, not {r.kind} (device {r.device})"
                )
            if r.address <= 0 or r.length <= 0:
                raise DescriptorError(f"bad region [0x{r.address:x}, +{r.length})")
            new.append((int(r.address), int(r.length)))
        every = self._endpoint.add_regions(new)
        log.info("memory %r registered %d region(s), %d bytes", self.agent_name, len(new),
                 sum(n for _, n in new))
        return _encoder.encode(MemoryMetadata(
            agent=self.agent_name, pid=os.getpid(), token=self.token, regions=every
        ))

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Let in the transport of this process that shows ``proof`` (once)."""
        self._attested.add(proof)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load a live transport of this process that attested ``proof``; see the module
        docstring for what is refused."""
        self._check_open()
        proof = check_proof(proof)
        meta = _decode(metadata)
        if meta.pid != os.getpid():
            raise PeerUnreachable(
                f"peer {meta.agent!r} lives in process {meta.pid}, not this one ({os.getpid()}): "
                "the memory transport only reaches transports of the same process — use shm"
            )
        with _live_lock:
            target = _live.get(meta.token)
        if target is None or target.closed:
            raise PeerUnreachable(
                f"peer {meta.agent!r}: no live memory transport of this process has the token in "
                "its metadata (closed, garbage-collected, or the metadata is forged)"
            )
        if target.agent_name != meta.agent:
            raise MessageError(f"memory peer metadata field 'agent' is {meta.agent!r}, but its "
                               f"token belongs to {target.agent_name!r}")
        why = target._attested.take(proof)
        if why is not None:
            raise PeerForged(f"memory peer {meta.agent!r} did not attest this handshake: {why}")
        endpoint = target._endpoint
        del target  # hold the endpoint only: a peer must not keep the other transport alive
        self._warn_if_overclaimed(meta, endpoint)
        with self._lock:
            self._peers[meta.agent] = _Peer(meta, endpoint)
        self._forget_blocks(meta.agent)
        log.info("memory %r added peer %r", self.agent_name, meta.agent)
        return meta.agent

    def _warn_if_overclaimed(self, meta: MemoryMetadata, endpoint: _Endpoint) -> None:
        if not meta.regions:
            return
        claimed = np.array([(a, n, 0) for a, n in meta.regions], dtype=np.int64)
        try:
            check_within(claimed, endpoint.regions(), "claimed")
        except DescriptorError as exc:
            log.warning("memory %r: peer %r's metadata claims memory it never registered (%s); "
                        "only what it registered is reachable", self.agent_name, meta.agent, exc)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        self._forget_blocks(peer)
        if old is not None:
            log.info("memory %r removed peer %r", self.agent_name, peer)

    def _peer(self, name: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeer(f"memory {self.agent_name!r} has no peer {name!r}")
        return peer

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"memory transport {self.agent_name!r} is closed")

    # -- data path ------------------------------------------------------------------------------

    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        p = self._peer(peer)
        check_within(local, self._endpoint.regions(), "local")
        check_within(remote, p.endpoint.regions(), f"remote ({peer})")  # live, not p.meta
        handle = TransferHandle(op, peer, int(local[:, 1].sum()), int(local.shape[0]))
        if not p.endpoint.open:
            handle.fail(f"{op.value} with {peer!r} failed: the peer "
                                               "was closed")
            return handle
        job = _Job(handle, p.endpoint, _plan(op, local, remote), notification, self.agent_name)
        log.debug("memory %r posting %s #%d: %d bytes in %d descriptors to %r", self.agent_name,
                  op.value, handle.id, handle.nbytes, handle.count, peer)
        with self._lock:
            self._check_open()
            self._jobs.put(job)
        return handle

    def _prepare_blocks(self, pair: BlockPair) -> _Peer:
        p = self._peer(pair.peer)
        check_in_regions(pair.local, self._endpoint.regions(), "local")
        check_in_regions(pair.remote, p.endpoint.regions(), f"remote ({pair.peer})")
        return p

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        """Queue the request; its copies are computed on the worker (see :func:`_plan`)."""
        p: _Peer = pair.native
        if self._peer(pair.peer) is not p:
            raise UnknownPeer(f"memory {self.agent_name!r}: peer {pair.peer!r} was re-added")
        handle = TransferHandle(op, pair.peer, req.nbytes, req.count)
        if not p.endpoint.open:
            handle.fail(f"{op.value} with {pair.peer!r} failed: the peer "
                                               "was closed")
            return handle
        job = _Job(handle, p.endpoint, lambda: _plan(op, *req.descriptors(pair)), notification,
                   self.agent_name)
        with self._lock:
            self._check_open()
            self._jobs.put(job)
        return handle

    def poll(self, handle: TransferHandle) -> HandleState:
        """The handle's state (non-blocking; the worker thread makes progress)."""
        return handle.state

    # -- notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        """Append to the peer's inbox (dropped there if full); PeerUnreachable once it closed."""
        self._check_open()
        if not isinstance(message, bytes):
            raise DescriptorError("a notification must be bytes")
        self._peer(peer).endpoint.deliver(self.agent_name, message)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return self._endpoint.drain()

    def wait_notification(self, timeout: float | None = None) -> bool:
        """Block (without polling) until a notification is queued; True if one is."""
        return self._endpoint.wait(timeout)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued transfers for up to ``timeout`` s, fail the rest, shut our memory."""
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                self._jobs.put(None)
                self._peers.clear()
            self._forget_blocks(None)
            with _live_lock:
                if _live.get(self.token) is self:
                    del _live[self.token]
            self._finalizer.detach()
            self._worker.join(timeout)
            if self._worker.is_alive():
                log.warning("memory %r: transfers still queued after %.1f s; failing them",
                            self.agent_name, timeout)
                self._abort.set()
                self._worker.join(5.0)
            self._abort.set()
            self._fail_leftovers()
            if not self._endpoint.shut(5.0):
                log.warning("memory %r: a peer's copy into our memory did not stop in 5 s",
                            self.agent_name)
            log.info("memory transport %r closed", self.agent_name)

    def _fail_leftovers(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.handle.fail("transport closed before the transfer ran")

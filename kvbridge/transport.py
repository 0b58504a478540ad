"""The Transport ABC: the small interface every backend implements.

A transport moves bytes between memory this process registered and memory a peer registered,
one-sided (READ pulls from the peer, WRITE pushes to it), and carries short notifications.
Everything else — batching, retries, leases, which blocks to move — lives in the core.

Contract shared by every implementation (the conformance suite in :mod:`kvbridge.testing`
checks it):

* ``register_memory`` may be called once or several times; it returns the *local metadata* the
  peer needs (opaque bytes, exchanged by the core over its control channel).
* Peers are proven, not believed (:mod:`kvbridge.identity`): ``attest(proof)`` on the side that
  answered a handshake lets in the dialler that shows ``proof``; ``add_peer(metadata, proof)``
  on the dialler loads the peer only if *its* data plane shows ``proof`` (else
  :class:`PeerForged`, and nothing is loaded), and returns the peer's name; unknown names raise
  :class:`UnknownPeer`. A peer found gone on the transport's own (its process exited) is
  forgotten and reported through :meth:`Transport.on_peer_lost`.
* ``submit`` never blocks on the data path: it validates, posts, and returns a
  :class:`TransferHandle`. Descriptor arrays are ``int64`` of shape ``(N, 3)`` (address, length,
  device), both of the same length with equal lengths row by row, else :class:`DescriptorError`.
  Remote ranges outside the peer's registered memory are refused before any byte moves.
* ``poll`` is non-blocking and returns the handle's :class:`HandleState`. A FAILED handle means no
  byte of the transfer may be trusted (some may have landed). A notification given to ``submit``
  reaches the peer only after the transfer's bytes are visible there, and only if it succeeded.
* ``wait`` blocks (with back-off, never a busy spin) until the handle is terminal or the timeout
  passes; a timeout raises :class:`TransferTimeout` and leaves the handle running.
* Thread safety: all methods may be called from any thread; implementations serialise access to
  their native library as needed.
* ``close`` stops accepting work, waits up to ``timeout`` for posted transfers to stop (posted
  RDMA cannot be aborted, so memory must not be released while they may land), fails the rest,
  and releases native resources. It is idempotent.

Optional capability: a transport that also subclasses :class:`kvbridge.blocks.BlockTransport`
takes transfers described by block ids over prepared layout pairs (what the core uses); any
other transport gets descriptor arrays through ``submit`` (see :mod:`kvbridge.blocks`).
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvbridge.errors import DescriptorError, TransferFailed, TransferTimeout, TransportClosed
from kvbridge.identity import PROOF_BYTES

__all__ = [
    "Capabilities",
    "HandleState",
    "MemoryRegion",
    "Op",
    "PROOF_BYTES",
    "Transport",
    "TransferHandle",
    "as_descriptors",
    "check_within",
]

DescriptorArray = npt.NDArray[np.int64]
_MAX_ADDRESS = (1 << 62)  # no real mapping is above this; keeps address + length in int64


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; the core reads this instead of checking backend names."""

    read: bool = True
    write: bool = True
    notifications: bool = True
    device_memory: bool = False
    cross_host: bool = False
    #: False when two peers on one host, both confined to the same single core, can stall in
    #: connection set-up (NIXL/UCX: docs/backends/nixl.md); the peer table then warns
    #: (:func:`kvbridge.placement.shared_core_warning`)
    shared_core_safe: bool = True
    #: True when the ``map_memory`` option moves a fresh host KV cache onto shared memory at
    #: registration (same addresses, same bytes) for same-host peers to map; the vLLM adapter
    #: then asks for it on a CPU engine (``Config.map_kv_cache``)
    map_memory: bool = False


class HandleState(enum.Enum):
    """Lifecycle of one posted transfer."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self is not HandleState.PENDING


class Op(enum.Enum):
    """Direction of a one-sided transfer, seen from the initiator."""

    READ = "READ"
    WRITE = "WRITE"


@dataclass(frozen=True)
class MemoryRegion:
    """A contiguous range of this process's memory to register."""

    address: int
    length: int
    device: int = 0
    kind: str = "DRAM"


_handle_ids = itertools.count(1)


@dataclass(eq=False)
class TransferHandle:
    """A posted transfer. ``state`` and ``error`` are updated by the transport only."""

    op: Op
    peer: str
    nbytes: int
    count: int
    id: int = field(default_factory=lambda: next(_handle_ids))
    state: HandleState = HandleState.PENDING
    error: str | None = None
    native: Any = None
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    done_event: threading.Event = field(default_factory=threading.Event, repr=False)
    _callbacks: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (on the transport's thread) once the handle is terminal; at once if it
        already is. ``fn`` must be quick and may be called twice in a race: make it idempotent
        (the transfer loop uses it only to wake up). Transports that finish handles only inside
        :meth:`Transport.poll` call it from there."""
        self._callbacks.append(fn)
        if self.done_event.is_set():
            fn()

    def _finish(self, state: HandleState, error: str | None = None) -> None:
        """Record a terminal state (transport implementations call this exactly once)."""
        self.error = error
        self.finished = time.perf_counter()
        self.state = state
        self.done_event.set()
        for fn in list(self._callbacks):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a waker must never break a transport thread
                pass


def as_descriptors(value: Any, what: str) -> DescriptorArray:
    """Coerce ``value`` to an ``(N, 3)`` int64 descriptor array, else :class:`DescriptorError`."""
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise DescriptorError(f"{what} descriptors are not integers: {exc}") from exc
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise DescriptorError(f"{what} descriptors must have shape (N, 3), got {arr.shape}")
    if arr.shape[1] == 2:
        arr = np.concatenate([arr, np.zeros((arr.shape[0], 1), dtype=np.int64)], axis=1)
    if (arr[:, 1] <= 0).any():
        raise DescriptorError(f"{what} descriptors contain a non-positive length")
    if (arr[:, 0] <= 0).any():
        raise DescriptorError(f"{what} descriptors contain a null or negative address")
    if (arr[:, 0] > _MAX_ADDRESS - arr[:, 1]).any():  # address + length must not wrap int64
        raise DescriptorError(f"{what} descriptors run past the end of the address space")
    return np.ascontiguousarray(arr)


def check_within(
    descs: DescriptorArray, regions: Sequence[tuple[int, int]], what: str
) -> None:
    """Raise :class:`DescriptorError` unless every descriptor lies inside one of ``regions``.

    ``regions`` are ``(address, length)`` pairs; vectorised over descriptors.
    """
    if descs.shape[0] == 0:
        return
    if not regions:
        raise DescriptorError(f"{what}: no memory is registered")
    if any(a <= 0 or n <= 0 or a > _MAX_ADDRESS - n for a, n in regions):
        raise DescriptorError(f"{what}: a registered region is outside the address space")
    reg = np.asarray(sorted(regions), dtype=np.int64)
    starts, ends = reg[:, 0], reg[:, 0] + reg[:, 1]
    idx = np.searchsorted(starts, descs[:, 0], side="right") - 1
    ok = idx >= 0
    safe = np.where(ok, idx, 0)
    ok &= descs[:, 0] + descs[:, 1] <= ends[safe]
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        addr, length = int(descs[bad, 0]), int(descs[bad, 1])
        raise DescriptorError(
            f"{what} descriptor #{bad} [0x{addr:x}, +{length}) is outside registered memory"
        )


class Transport(ABC):
    """Base class of every backend. See the module docstring for the contract."""

    #: Registry name (the entry-point name), e.g. ``"shm"``.
    name: ClassVar[str] = "?"
    #: What the transport can do.
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        """Create the transport for one engine rank named ``agent_name``.

        ``options`` are backend-specific (from ``kv_connector_extra_config`` / ``KVBRIDGE_*``);
        unknown keys are ignored by the base class. Raise :class:`BackendUnavailable` when a
        native dependency is missing, with one line naming what to install.
        """
        self.agent_name = agent_name
        self.options: dict[str, Any] = dict(options or {})
        self._closed = False
        self._lost_callback: Callable[[str], None] | None = None

    # -- memory and peers -----------------------------------------------------------------------

    @abstractmethod
    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register ``regions`` for transfers and return this side's metadata for peers."""

    @abstractmethod
    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Responder side of a handshake: a dialler that shows ``proof`` (:data:`PROOF_BYTES`
        bytes, :mod:`kvbridge.identity`) may load this transport as its peer.

        The core calls it when its control plane answers a :class:`~kvbridge.messages.Hello`,
        before the reply leaves. A token stays valid for about a minute; at most a few hundred
        are held (the oldest are dropped). ``peer_metadata`` is the dialler's own metadata from
        that authenticated handshake: a transport that hands out memory may bind the token to
        the process it names (shm does; malformed metadata is ignored there, the token then
        admits no one). Non-blocking; raises :class:`DescriptorError` for a token of another
        length.
        """

    def invite(self, peer_metadata: bytes | None = None) -> bytes:
        """Attest a fresh random proof and return it: for callers that hand this transport's
        metadata to a peer over a private channel of their own (tests, benches, a program's own
        two processes) instead of kvbridge's handshake. Send the proof with the metadata; the
        peer passes both to :meth:`add_peer`."""
        token = os.urandom(PROOF_BYTES)
        self.attest(token, peer_metadata)
        return token

    @abstractmethod
    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load a peer from its metadata once its data plane showed ``proof``; return its name.
        Re-adding replaces the old entry.

        ``proof`` is the token the peer's own transport was told to :meth:`attest`. A peer that
        cannot show it — metadata relayed from or replayed by another endpoint, another process
        than the metadata names, a generation that ended — raises :class:`PeerForged` and is not
        loaded (a peer of that name loaded before may have been removed). Raises
        :class:`MessageError` for malformed metadata and :class:`PeerUnreachable` when the
        peer cannot be reached to prove anything.
        """

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (no-op if unknown). Transfers already posted still complete or fail."""

    def on_peer_lost(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback(name)`` when the transport finds a peer gone on its own (shm: the
        peer's process exited) and has forgotten it — memory of the peer it mapped is unmapped
        by then. Runs on a transport thread: it must be quick and must not call back into the
        transport. Transports that cannot tell never call it."""
        self._lost_callback = callback

    def _peer_lost(self, name: str) -> None:
        """Report ``name`` lost (implementations call this after forgetting the peer)."""
        callback = self._lost_callback
        if callback is not None:
            try:
                callback(name)
            except Exception:  # noqa: BLE001 - a callback bug must not break a transport thread
                pass

    # -- data path ------------------------------------------------------------------------------

    def submit(
        self,
        op: Op,
        peer: str,
        local: Any,
        remote: Any,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Post a one-sided transfer ``local[i] <-> remote[i]`` and return its handle.

        Validates the descriptor lists (equal length, equal sizes) and then calls
        :meth:`_submit`. Non-blocking. Raises :class:`DescriptorError`, :class:`UnknownPeer`
        or :class:`TransportClosed` before anything is posted.
        """
        if self._closed:
            raise TransportClosed(f"{self.name} transport {self.agent_name!r} is closed")
        loc = as_descriptors(local, "local")
        rem = as_descriptors(remote, "remote")
        if loc.shape[0] != rem.shape[0]:
            raise DescriptorError(
                f"descriptor lists of unequal length: {loc.shape[0]} local, {rem.shape[0]} remote"
            )
        if not np.array_equal(loc[:, 1], rem[:, 1]):
            bad = int(np.flatnonzero(loc[:, 1] != rem[:, 1])[0])
            raise DescriptorError(
                f"descriptor #{bad} lengths differ: {loc[bad, 1]} local, {rem[bad, 1]} remote"
            )
        if notification is not None and not isinstance(notification, bytes):
            raise DescriptorError("a notification must be bytes")
        return self._submit(op, peer, loc, rem, notification)

    @abstractmethod
    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        """Post validated descriptors (see :meth:`submit`)."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> HandleState:
        """Non-blocking progress check; returns the handle's state."""

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> HandleState:
        """Block until ``handle`` is terminal; raise :class:`TransferTimeout` after ``timeout``.

        The default polls with exponential back-off (50 µs → 5 ms): no busy spin.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 50e-6
        while True:
            state = self.poll(handle)
            if state.terminal:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout(
                    f"{handle.op.value} of {handle.nbytes} bytes to {handle.peer!r} did not "
                    f"finish within {timeout} s"
                )
            self._event_of(handle).wait(delay)
            delay = min(delay * 2, 5e-3)

    def _event_of(self, handle: TransferHandle) -> threading.Event:
        """The event :meth:`wait` sleeps on between polls (a wrapper's inner handle's)."""
        return handle.done_event

    def transfer(
        self,
        op: Op,
        peer: str,
        local: Any,
        remote: Any,
        notification: bytes | None = None,
        timeout: float | None = 60.0,
    ) -> TransferHandle:
        """Submit and wait; raise :class:`TransferFailed` if the transfer failed."""
        handle = self.submit(op, peer, local, remote, notification)
        if self.wait(handle, timeout) is HandleState.FAILED:
            raise TransferFailed(handle.error or f"{op.value} to {peer!r} failed")
        return handle

    # -- notifications --------------------------------------------------------------------------

    @abstractmethod
    def send_notification(self, peer: str, message: bytes) -> None:
        """Send a short message to ``peer``; ordered per peer. Raises :class:`UnknownPeer`."""

    @abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain and return ``(peer name, message)`` pairs received so far (non-blocking)."""

    # -- lifecycle ------------------------------------------------------------------------------

    @abstractmethod
    def close(self, timeout: float = 5.0) -> None:
        """Stop, wait for posted transfers up to ``timeout``, release resources. Idempotent."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The Transport contract: what every backend implements, and what it may add.

A transport moves bytes between memory this process registered and memory a peer registered,
one-sided (READ pulls from the peer, WRITE pushes to it). Everything else — batching, retries,
leases, which blocks to move — lives in the core. The conformance suites in
:mod:`kvbridge.testing.conformance` check every rule below.

**Required** (the six abstract methods of :class:`Transport`):

* ``register_memory(regions) -> bytes`` — may be called once or several times; returns the
  *local metadata* the peer needs (opaque bytes, exchanged by the core over its control channel).
* ``attest(proof, peer_metadata)`` and ``add_peer(metadata, proof) -> name`` — peers are proven,
  not believed (:mod:`kvbridge.identity`): ``attest`` on the side that answered a handshake lets
  in the dialler that shows ``proof``; ``add_peer`` on the dialler loads the peer only if *its*
  data plane shows ``proof`` (else :class:`PeerForged`, and nothing is loaded). ``attest`` stays
  required: it is the responder's half of that proof and no default could be sound — one that
  admitted everybody would let any process on the network load itself as a peer.
* ``remove_peer(name)`` — forget a peer (a no-op for an unknown name; the other methods raise
  :class:`UnknownPeer` for one). A peer found gone on the transport's own (its process exited) is
  forgotten and reported through :meth:`Transport.on_peer_lost`.
* ``_submit(op, peer, local, remote, notification) -> TransferHandle`` — behind the public
  :meth:`Transport.submit`, which validates first. ``submit`` never blocks on the data path: it
  validates, posts, and returns a :class:`TransferHandle`. Descriptor arrays are ``int64`` of
  shape ``(N, 3)`` (address, length, device), both of the same length with equal lengths row by
  row, else :class:`DescriptorError`. Remote ranges outside the peer's registered memory are
  refused before any byte moves. The transport settles every handle it returned exactly once,
  with :meth:`TransferHandle.succeed` or :meth:`TransferHandle.fail`; a FAILED handle means no
  byte of the transfer may be trusted (some may have landed).
* ``close(timeout)`` — stops accepting work, waits up to ``timeout`` for posted transfers to stop
  (posted RDMA cannot be aborted, so memory must not be released while they may land), fails the
  rest, and releases native resources. Idempotent.

**With defaults**: ``poll`` (non-blocking; returns the handle's state — the default suits a
transport whose own threads settle handles, one whose native library must be asked overrides
it), ``wait`` (blocks with back-off, never a busy spin, until the handle is terminal or the
timeout passes; a timeout raises :class:`TransferTimeout` and leaves the handle running),
``transfer`` (submit + wait), ``invite`` and ``on_peer_lost``.

**Optional protocols** — the core's scheduler needs neither, so a backend need not offer them:

* :class:`Notifying` — ``send_notification`` / ``get_notifications``: short messages, ordered
  per peer. A transport that offers them also delivers a notification given to ``submit``, only
  after the transfer's bytes are visible at the peer and only if it succeeded; one that does
  not refuses such a notification (:class:`DescriptorError`). Code that relies on them
  (``compose``, the benches, tests) asks through :func:`notifying`, which names what is missing.
* Block posting — :class:`kvbridge.blocks.BlockTransport` (a subclass of :class:`Transport`)
  takes transfers described by block ids over prepared layout pairs, the core's fast path; the
  core reaches it through the functions of :mod:`kvbridge.blocks`, which give any other
  transport descriptor arrays through ``submit``.

**Blocking.** ``submit``, ``poll``, ``attest`` and ``get_notifications`` never block;
``register_memory``, ``add_peer`` (it proves the peer over the network) and ``close`` may;
``wait`` blocks by design.

**Thread safety.** Every method may be called from any thread; implementations serialise access
to their native library as needed. A handle's done callbacks run on whichever thread settles it.

The benches' contract with a backend package (entry-point group ``kvbridge.bench_hooks``) is
declared here too: :class:`BenchHook`, with :class:`RawResponderHook` and :class:`BlockCostHook`
as optional extras; :func:`kvbridge.registry.bench_hook` checks it.
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
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    TransferFailed,
    TransferTimeout,
    TransportClosed,
)
from kvbridge.identity import PROOF_BYTES

__all__ = [
    "BenchHook",
    "BlockCostHook",
    "Capabilities",
    "HandleState",
    "MemoryRegion",
    "Notifying",
    "Op",
    "PROOF_BYTES",
    "RawResponderHook",
    "Transport",
    "TransferHandle",
    "as_descriptors",
    "check_notification",
    "check_within",
    "notifying",
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
    #: (:func:`kvbridge.host.placement.shared_core_warning`)
    shared_core_safe: bool = True
    #: True when the ``map_memory`` option moves a fresh host KV cache onto shared memory at
    #: registration (same addresses, same bytes) for same-host peers to map; the vLLM adapter
    #: then asks for it on a CPU engine (``Config.map_kv_cache``)
    map_memory: bool = False
    #: True when a prepared request may be copied with its caller's ``landing`` copy, which
    #: then keeps the peer's progress word (``PreparedRequest.progress``); a decode rank on such
    #: a transport registers a board of those words (kvbridge.scheduling.follow)
    copies_landing: bool = False


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
    """A posted transfer. Only the transport that posted it settles it, through
    :meth:`succeed` or :meth:`fail`; everyone else reads ``state`` and ``error``."""

    op: Op
    peer: str
    nbytes: int
    count: int
    id: int = field(default_factory=lambda: next(_handle_ids))
    state: HandleState = HandleState.PENDING
    error: str | None = None
    native: Any = None
    #: what the request's caller-supplied copy returned (:attr:`kvbridge.blocks.PreparedRequest.
    #: landing`: the digests of what landed), set before the handle is DONE; None where the
    #: transport made its own copy
    landed: bytes | None = None
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

    def succeed(self) -> None:
        """Mark the transfer DONE: every byte landed (and a notification given to ``submit`` was
        delivered). The transport that owns the handle calls :meth:`succeed` or :meth:`fail`
        exactly once; it wakes :meth:`Transport.wait` and runs the done callbacks on the
        calling thread."""
        self._settle(HandleState.DONE, None)

    def fail(self, error: str) -> None:
        """Mark the transfer FAILED with ``error`` (one line for logs and :class:`TransferFailed`):
        no byte of it may be trusted. Same rules as :meth:`succeed`."""
        self._settle(HandleState.FAILED, error)

    def _settle(self, state: HandleState, error: str | None) -> None:
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


@runtime_checkable
class Notifying(Protocol):
    """Optional protocol: short messages between peers, ordered per peer (module docstring).

    A :class:`Transport` offers it by defining both methods; nothing needs to be declared.
    """

    def send_notification(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer``. Raises :class:`UnknownPeer`, :class:`DescriptorError`
        for a message that is not bytes, :class:`TransportClosed`; may block only while a
        bounded outbound queue is full."""

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Drain and return ``(peer name, message)`` pairs received so far (non-blocking)."""


def notifying(transport: object) -> Notifying:
    """``transport`` as a :class:`Notifying`, for code that relies on notifications; raises
    :class:`ConfigError` naming the transport and the missing method otherwise."""
    if isinstance(transport, Notifying):
        return transport
    missing = [m for m in ("send_notification", "get_notifications")
               if not callable(getattr(transport, m, None))]
    name = getattr(transport, "name", type(transport).__name__)
    raise ConfigError(f"transport {name!r} carries no notifications (no {', '.join(missing)}); "
                      "this needs a backend that does (kvbridge.transport.Notifying)")


def check_notification(transport: object, notification: bytes | None) -> None:
    """Refuse a notification attached to a transfer unless it is bytes and ``transport`` is
    :class:`Notifying` (:class:`DescriptorError`, before anything is posted)."""
    if notification is None:
        return
    if not isinstance(notification, bytes):
        raise DescriptorError("a notification must be bytes")
    if not isinstance(transport, Notifying):
        name = getattr(transport, "name", type(transport).__name__)
        raise DescriptorError(f"transport {name!r} carries no notifications: post the transfer "
                              "without one")


@runtime_checkable
class BenchHook(Protocol):
    """What a backend package offers the benches: the module its ``kvbridge.bench_hooks`` entry
    point names (:func:`kvbridge.registry.bench_hook` checks it).

    ``raw_session(total_bytes, seed)`` returns the backend's library alone, without kvbridge, as
    an object with ``reset(op, block_bytes)``, ``run(op, block_bytes) -> seconds``,
    ``verify(op, block_bytes)`` and ``close()``, and optionally ``prepare(op, block_bytes)``
    (build ahead) and ``shared`` (it moves the bench's own buffers); a session that takes keyword
    arguments also gets the backend's options and, with a :class:`RawResponderHook`, ``peer`` and
    ``local`` (``kvbridge bench transfer``, docs/benchmarks.md). Blocking.
    """

    def raw_session(self, total_bytes: int, seed: int = 0) -> Any:
        """A raw-library session over ``total_bytes`` of blocks seeded with ``seed``."""


@runtime_checkable
class RawResponderHook(Protocol):
    """Optional bench extra: the raw library alone over memory the caller owns, the far side of
    a shared raw session (an object with ``metadata``, ``drain()`` and ``close()``)."""

    def raw_responder(self, address: int, nbytes: int, **options: Any) -> Any:
        """A responder over ``nbytes`` at ``address``."""


@runtime_checkable
class BlockCostHook(Protocol):
    """Optional bench extra: kvbridge's per-transfer work on the block path next to the
    library's own request creation (``kvbridge bench descriptors``)."""

    def block_cost(self, planes: int, num_blocks: int, cases: Any, reps: int,
                   **options: Any) -> dict[str, list[tuple[float, float, float]]]:
        """Per case, ``reps`` samples of (seconds, seconds, seconds)."""


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
        check_notification(self, notification)
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

    def poll(self, handle: TransferHandle) -> HandleState:
        """Non-blocking progress check; returns the handle's state.

        The default suits a transport whose own threads settle handles (:meth:`TransferHandle.
        succeed` / :meth:`~TransferHandle.fail`): it returns ``handle.state``. A transport whose
        native library must be asked (NIXL) overrides it and settles the handle from here.
        """
        return handle.state

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

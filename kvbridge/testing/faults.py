"""A fault-injecting wrapper around any transport, for testing the core's failure handling.

``FaultyTransport(inner, ...)`` behaves exactly like ``inner`` (same handles, same bytes, same
notifications) except for the faults it was told to inject. Transfers and notifications are
counted from 1 in the order they were accepted (a submit that raised does not count; every
notification handed to ``send_notification`` or attached to a transfer counts, in call order):

``delay``
    Every transfer's handle — and the notification attached to it — completes no earlier than
    ``delay`` seconds after submit. The bytes themselves may land earlier (the transfer is posted
    at once, so descriptor errors still raise from ``submit``). Standalone notifications are not
    delayed.
``post_delay``
    Every ``submit`` sleeps ``post_delay`` seconds before it posts (a transport slow to build
    and post its descriptors). Unlike ``delay`` it blocks the caller: the time lands before
    the transfer is on the wire.
``fail`` (n or a collection of n)
    Transfer n is posted *without* its notification and its handle ends FAILED with an error
    naming the injected fault, whatever the inner transport reported. Its bytes may well have
    landed: a FAILED handle means "trust no byte", and the core must not.
``corrupt`` (n or a collection of n), ``corrupt_offset``
    One byte of transfer n is wrong at its destination: the byte at ``corrupt_offset`` (modulo
    the transfer's size) counted through the local descriptors in order. For a WRITE the peer's
    memory cannot be touched from here, so the *source* byte is flipped (XOR 0xFF) just before
    the transfer is posted and restored once it finished, before ``submit`` returns (a corrupted
    WRITE's submit blocks until the inner transfer stopped): the peer receives the flipped byte
    and the sender, which may read its source right after posting (to digest it), never sees
    it. For a READ the landed local byte
    is flipped after the transfer finished and before the handle reports DONE. The handle ends
    DONE and the notification is sent as usual — silent corruption, for checksum tests.
``drop_notification`` (n or a collection of n)
    Notification n is swallowed: a standalone one is never sent (and its peer name is not
    checked); an attached one is stripped and its transfer otherwise runs normally.
``stall`` (n or a collection of n)
    Transfer n makes no progress: it is posted (its bytes may land) but its handle stays
    PENDING, and an attached notification is held back, until :meth:`FaultyTransport.unstall`
    (then it completes as usual) or :meth:`~FaultyTransport.close` (then it ends FAILED). What a
    READ or WRITE looks like when the peer's side of the transport livelocks.
``stall_add_peer`` (n or a collection of n)
    Call n of ``add_peer`` (counted from 1, every call) blocks until :meth:`unstall` (then it
    adds the peer as usual) or :meth:`close` (then it raises :class:`TransportClosed`): a
    connection set-up that never finishes, as NIXL's ``add_remote_agent`` can on a shared core.

:class:`FaultyBackend` is the same wrapper as a backend plugin, for tests that inject faults into
engines they start (a vLLM engine builds its transport from its configuration).

Every injected fault is appended to :attr:`FaultyTransport.injected` as ``(kind, n)``, so a test
can assert it really happened. Transfers with no fault and no delay return the inner transport's
own handle: the wrapper is then transparent. Faulted or delayed transfers get a wrapper handle
that one background thread completes in submission order. Thread-safe like the inner transport.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge import registry
from kvbridge.errors import ConfigError, TransferTimeout, TransportClosed
from kvbridge.transport import (
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Op,
    TransferHandle,
    Transport,
    notifying,
)

__all__ = ["FaultyTransport", "FaultyBackend", "FAULTS"]

log = logging.getLogger("kvbridge.testing.faults")


def _nths(value: int | Iterable[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)


def _byte_address(descs: DescriptorArray, offset: int) -> int:
    lengths = descs[:, 1]
    offset %= int(lengths.sum())
    cum = np.cumsum(lengths)
    row = int(np.searchsorted(cum, offset, side="right"))
    before = int(cum[row - 1]) if row else 0
    return int(descs[row, 0]) + offset - before


def _flip(address: int) -> None:
    byte = ctypes.c_uint8.from_address(address)
    byte.value ^= 0xFF


@dataclass
class _Pending:
    inner: TransferHandle
    number: int
    deadline: float
    fail: bool
    restore: int | None  # WRITE: source byte to flip back
    flip_landed: int | None  # READ: landed byte to flip
    notification: bytes | None  # held back until the delay passed
    stalled: bool = False  # completes only after unstall() (or fails at close)
    cut: bool = False  # still stalled when the transport closed: ends FAILED


class FaultyTransport(Transport):
    """Wrap ``inner`` and inject the faults described in the module docstring."""

    name = "faulty"

    def __init__(
        self,
        inner: Transport,
        *,
        delay: float = 0.0,
        post_delay: float = 0.0,
        fail: int | Iterable[int] | None = None,
        corrupt: int | Iterable[int] | None = None,
        corrupt_offset: int = 0,
        drop_notification: int | Iterable[int] | None = None,
        stall: int | Iterable[int] | None = None,
        stall_add_peer: int | Iterable[int] | None = None,
    ) -> None:
        super().__init__(inner.agent_name, inner.options)
        self.inner = inner
        setattr(self, "capabilities", inner.capabilities)  # noqa: B010 - per instance, not class
        self.delay = float(delay)
        self.post_delay = float(post_delay)
        self.fail = _nths(fail)
        self.corrupt = _nths(corrupt)
        self.corrupt_offset = int(corrupt_offset)
        self.drop_notification = _nths(drop_notification)
        self.stall = _nths(stall)
        self.stall_add_peer = _nths(stall_add_peer)
        self._stalled: list[TransferHandle] = []
        self._unstalled = threading.Event()
        self._adds = itertools.count(1)
        self.injected: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._transfers = itertools.count(1)
        self._notes = itertools.count(1)
        self._queue: queue.SimpleQueue[TransferHandle | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._complete, name="kvbridge-faults", daemon=True)
        self._thread.start()

    # -- delegation -----------------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        return self.inner.register_memory(regions)

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        self.inner.attest(proof, peer_metadata)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        with self._lock:
            n = next(self._adds)
            stalled = n in self.stall_add_peer
            if stalled:
                self._record("stall_add_peer", n)
        if stalled:
            self._unstalled.wait()
            if self._closed:
                raise TransportClosed(f"faulty transport {self.agent_name!r} closed while "
                                      f"add_peer #{n} was stalled")
        return self.inner.add_peer(metadata, proof)

    def on_peer_lost(self, callback: Callable[[str], None] | None) -> None:
        self.inner.on_peer_lost(callback)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return notifying(self.inner).get_notifications()

    def _record(self, kind: str, n: int) -> None:
        self.injected.append((kind, n))
        log.info("injected %s into #%d", kind, n)

    # -- faults ---------------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        with self._lock:
            n = next(self._notes)
            if n in self.drop_notification:
                self._record("drop_notification", n)
                return
            notifying(self.inner).send_notification(peer, message)

    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        if self.post_delay > 0:
            time.sleep(self.post_delay)
        with self._lock:
            if self._closed:
                raise TransportClosed(f"faulty transport {self.agent_name!r} is closed")
            n = next(self._transfers)
            note_n = next(self._notes) if notification is not None else None
            fail, corrupt = n in self.fail, n in self.corrupt
            stall = n in self.stall and not fail
            send = notification
            if note_n is not None and note_n in self.drop_notification:
                send = None
            held = send if ((self.delay > 0 or stall) and not fail) else None
            inner_note = None if (fail or held is not None) else send
            restore = flip_landed = None
            if corrupt:
                addr = _byte_address(local, self.corrupt_offset)
                if op is Op.WRITE:
                    _flip(addr)
                    restore = addr
                else:
                    flip_landed = addr
            try:
                handle = self.inner.submit(op, peer, local, remote, inner_note)
            except BaseException:
                if restore is not None:
                    _flip(restore)
                self._transfers = itertools.count(n)  # a refused submit does not count
                if note_n is not None:
                    self._notes = itertools.count(note_n)
                raise
            if restore is not None:  # see ``corrupt``: the source is whole again on return
                self._wait_inner(handle)
                _flip(restore)
                restore = None
            if note_n is not None and send is None:
                self._record("drop_notification", note_n)
            if fail:
                self._record("fail", n)
            if corrupt:
                self._record("corrupt", n)
            if stall:
                self._record("stall", n)
            if not (fail or corrupt or stall or self.delay > 0):
                return handle  # transparent
            outer = TransferHandle(op, peer, handle.nbytes, handle.count)
            outer.native = _Pending(
                handle, n, outer.started + self.delay, fail, restore, flip_landed, held, stall
            )
            if stall and not self._unstalled.is_set():
                self._stalled.append(outer)
            else:
                self._queue.put(outer)
            return outer

    def unstall(self) -> None:
        """End every stall injected so far and to come: stalled transfers complete as usual
        (in submission order) and stalled ``add_peer`` calls go on."""
        with self._lock:
            self._unstalled.set()
            stalled, self._stalled = self._stalled, []
            for outer in stalled:
                self._queue.put(outer)

    def _complete(self) -> None:
        while True:
            outer = self._queue.get()
            if outer is None:
                return
            p: _Pending = outer.native
            state = self._wait_inner(p.inner)
            if p.restore is not None:
                _flip(p.restore)
            if state is HandleState.DONE and p.flip_landed is not None:
                _flip(p.flip_landed)
            left = p.deadline - time.perf_counter()
            if left > 0:
                self._stop.wait(left)
            if p.fail:
                outer.fail(f"injected failure of transfer #{p.number}")
                continue
            if p.cut:
                outer.fail(f"transfer #{p.number} was stalled until the transport closed")
                continue
            if state is not HandleState.DONE:
                outer.fail(p.inner.error or "transfer failed")
                continue
            if p.notification is not None:
                try:
                    notifying(self.inner).send_notification(outer.peer, p.notification)
                except Exception as exc:  # noqa: BLE001 - the handle reports it
                    outer.fail(f"notification not sent: {exc}")
                    continue
            outer.succeed()

    def _wait_inner(self, h: TransferHandle) -> HandleState:
        while True:
            try:
                return self.inner.wait(h, 0.2)
            except TransferTimeout:
                if self._abandon.is_set():
                    return HandleState.FAILED

    def poll(self, handle: TransferHandle) -> HandleState:
        if isinstance(handle.native, _Pending):
            return handle.state
        return self.inner.poll(handle)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Skip remaining delays, let pending transfers finish (up to ``timeout``), close inner."""
        with self._close_lock:
            if self._closed:
                return
            with self._lock:
                self._closed = True
                stalled, self._stalled = self._stalled, []
                for outer in stalled:
                    outer.native.cut = True
                    self._queue.put(outer)
                self._queue.put(None)
                self._unstalled.set()  # stalled add_peer calls raise TransportClosed
            self._stop.set()
            end = time.monotonic() + timeout
            self._thread.join(timeout)
            self.inner.close(max(0.0, end - time.monotonic()))
            self._abandon.set()
            self._thread.join(5.0)


#: the keyword arguments of :class:`FaultyTransport` that name faults
FAULTS = frozenset({"delay", "post_delay", "fail", "corrupt", "corrupt_offset",
                    "drop_notification", "stall", "stall_add_peer"})


class FaultyBackend(FaultyTransport):
    """:class:`FaultyTransport` as a backend plugin (``Transport(agent_name, options)``), for
    tests that inject faults into engines they start. ``backend_options``: ``inner`` (the
    wrapped backend's name, default ``shm``), ``faults`` (a mapping of :data:`FAULTS` to
    values, as the keyword arguments of :class:`FaultyTransport`), and the inner backend's own
    options. It presents itself under the inner backend's ``name`` and capabilities, so an
    engine using it hands off with engines of that backend.

    Test-only: no distribution registers it. A test that wants it declares the entry point
    itself, on the path of the engines it starts (``tests/engines/test_vllm_faults.py``)."""

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        opts = dict(options or {})
        inner_name = opts.pop("inner", "shm")
        faults = opts.pop("faults", {})
        if not isinstance(inner_name, str):
            raise ConfigError(f"backend_options.inner: a backend name, got {inner_name!r}")
        if not isinstance(faults, Mapping) or not set(faults) <= FAULTS:
            raise ConfigError(f"backend_options.faults: a mapping of {sorted(FAULTS)}, got "
                              f"{faults!r}")
        inner = registry.create(inner_name, agent_name, opts)
        super().__init__(inner, **dict(faults))
        setattr(self, "name", inner.name)  # noqa: B010 - per instance: it is the inner backend

"""The shm transport's data path: one worker thread that runs transfers in submission order.

A transfer is queued as a :class:`_Job` (iovecs built at submit or ahead, in
:class:`_Part` s) or a :class:`_BlockJob` (iovecs built here, from the plane tables). Each part
first copies the ranges the peer's mapped memory holds with the native range copy (without the
GIL), then the rest by cross-memory attach. With ``threads`` > 1 a transfer of at least
``split_bytes`` is cut into that many parts, copied at once on helper threads; it finishes (and
its notification is sent, only on success) once every part stopped. A transfer to a peer that
was removed, or whose process exited, fails without a system call.

Thread-safety and blocking: :meth:`Worker.put` and the part builders may be called from any
thread and never block; the jobs, the counters and the helper pool belong to the worker thread.
:meth:`Worker.stop` blocks for up to its timeout (plus 5 s for a copy to notice the abort).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvbridge.blocks import BlockPair, BlockRequest, LandingCopy
from kvbridge.errors import TransferFailed
from kvbridge.transport import Op, TransferHandle
from kvbridge.transports.shm.cma import IovArray, _explain, _Libc, copy_iovecs, split_iovecs
from kvbridge.transports.shm.memfd import PeerMapping
from kvbridge.transports.shm.proof import _Peer

log = logging.getLogger("kvbridge.transport.shm")


@dataclass
class _Part:
    """One copy thread's share of a transfer: ``moves`` (rows of dst, src, length) to copy
    through the peer's mapped memory, then the ``local <-> remote`` iovecs by CMA."""

    moves: IovArray
    local: IovArray
    remote: IovArray
    mapped_bytes: int = 0


Parts = list[_Part]


@dataclass
class _Job:
    """A transfer whose iovecs are built: at submit (by descriptors) or ahead (prepared)."""

    handle: TransferHandle
    peer: _Peer
    parts: Parts
    notification: bytes | None
    landing: LandingCopy | None = None  # the caller's copy (PreparedRequest.landing)
    progress: int = 0  # where PreparedRequest.progress is mapped here, or 0


@dataclass
class _BlockJob:
    """A transfer by block ids: its iovecs are built on the worker, from the plane tables."""

    handle: TransferHandle
    peer: _Peer
    pair: BlockPair
    req: BlockRequest
    notification: bytes | None


@dataclass
class _Prepared:
    """A request built ahead (:meth:`ShmTransport.prepare_request`): its parts, ready to copy."""

    peer: _Peer
    parts: Parts


#: what the worker runs: a transfer, a call to make in order with them, or None (the last)
Task = _Job | _BlockJob | Callable[[], None] | None


class Worker:
    """Runs the transport ``agent_name``'s transfers on one daemon thread (started here)."""

    def __init__(self, agent_name: str, libc: _Libc, iov_max: int, threads: int,
                 split_bytes: int) -> None:
        self.agent_name = agent_name
        self._libc = libc
        self._iov_max, self._threads, self._split_bytes = iov_max, threads, split_bytes
        self._stop = ctypes.c_int32(0)  # set with _abort: the native copy checks it
        self._abort = threading.Event()
        #: the copy threads beside the worker (started with the first split transfer)
        self.helpers: ThreadPoolExecutor | None = None
        #: bytes copied through peers' mapped memory / by cross-memory attach (successful
        #: transfers)
        self.mapped_bytes = 0
        self.cma_bytes = 0
        self._jobs: queue.SimpleQueue[Task] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"kvbridge-shm-{agent_name}",
                                        daemon=True)
        self._thread.start()

    def put(self, task: Task) -> None:
        """Queue ``task`` behind every one queued before (None: stop after it)."""
        self._jobs.put(task)

    def parts(self, peer: _Peer, op: Op, local: IovArray, remote: IovArray,
              nbytes: int) -> Parts:
        """The pieces the copy threads take: the whole transfer below ``split_bytes`` (or with
        one thread), else ``threads`` pieces of about equal bytes; in each, the ranges the
        peer's mapped memory holds are moves, the others stay iovecs."""
        if self._threads <= 1 or nbytes < self._split_bytes or local.shape[0] == 0:
            pairs = [(local, remote)]
        else:
            pairs = split_iovecs(local, remote, self._threads)
        return [_part(peer.mapping, op, loc, rem) for loc, rem in pairs]

    def block_parts(self, peer: _Peer, op: Op, pair: BlockPair, req: BlockRequest) -> Parts:
        """``req``'s iovecs, from the plane tables, cut into the copy threads' parts."""
        loc, rem = req.descriptors(pair, columns=2)
        return self.parts(peer, op, loc.view(np.uint64), rem.view(np.uint64), req.nbytes)

    def stop(self, timeout: float) -> bool:
        """After ``put(None)``: wait up to ``timeout`` for the queued transfers, then abandon
        the one running (a transfer cut between two batches is FAILED) and fail the rest.
        True where the worker is still stuck in a copy (its mappings must then stay)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("shm %r: transfers still queued after %.1f s; failing them",
                        self.agent_name, timeout)
            self._abort.set()
            self._stop.value = 1
            self._thread.join(5.0)
        self._abort.set()
        self._stop.value = 1
        self._fail_leftovers()
        if self.helpers is not None:
            self.helpers.shutdown(wait=True)
        return self._thread.is_alive()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if not isinstance(job, (_Job, _BlockJob)):
                job()
                continue
            self._run(job)

    def _run(self, job: _Job | _BlockJob) -> None:
        h, peer = job.handle, job.peer
        if self._abort.is_set():
            h.fail("transport closed before the transfer started")
            return
        if peer.retired:
            h.fail(f"peer {h.peer!r} was removed before the transfer ran")
            return
        if not peer.alive():  # its pid may already belong to another process
            h.fail(f"{h.op.value} with {h.peer!r} failed: "
                      f"{_explain(errno.ESRCH, peer.pid)}")
            return
        fn = self._libc.readv if h.op is Op.READ else self._libc.writev
        try:
            parts = (job.parts if isinstance(job, _Job)
                     else self.block_parts(peer, h.op, job.pair, job.req))
            h.landed = (self._copy(fn, peer, parts, job.landing, job.progress)
                        if isinstance(job, _Job) else self._copy(fn, peer, parts))
            mapped = sum(p.mapped_bytes for p in parts)
            if mapped and not peer.alive():  # CMA would have failed with ESRCH
                raise TransferFailed(_explain(errno.ESRCH, peer.pid))
            self.mapped_bytes += mapped
            self.cma_bytes += h.nbytes - mapped
            if job.notification is not None:
                peer.sender.send(job.notification)
        except Exception as exc:  # noqa: BLE001 - every failure ends the handle, never the thread
            log.debug("shm %r %s #%d failed: %s", self.agent_name, h.op.value, h.id, exc)
            h.fail(f"{h.op.value} with {h.peer!r} failed: {exc}")
            return
        h.succeed()

    def _copy(self, fn: Callable[..., int], peer: _Peer, parts: Parts,
              landing: LandingCopy | None = None, progress: int = 0) -> bytes | None:
        """Copy the parts: every range mapped, with the caller's copy ``landing`` where there is
        one (given ``progress``; its result returned; None otherwise), else in one native call
        on the worker and its helper thread (the GIL let go and taken back once: a pool
        thread's copy would take it back too, and the worker then waited for that as well, up
        to a switch interval each while the engine runs Python); else the first part on the
        worker and the others on the pool threads, returning once every part stopped, also
        when one failed (its bytes may be landing), then raising the first failure."""
        mapped = all_mapped(peer, parts)
        if mapped and landing is not None:
            landed = landing(_moves(parts), ctypes.addressof(self._stop), progress)
            if landed is None:
                raise TransferFailed("transport closed during the transfer; abandoned")
            return landed
        if len(parts) == 1:
            self._copy_part(fn, peer, parts[0])
            return None
        if mapped:
            self._copy_part(fn, peer, _Part(_moves(parts), _NO_MOVES, _NO_MOVES),
                            threads=len(parts))
            return None
        if self.helpers is None:
            self.helpers = ThreadPoolExecutor(self._threads - 1,
                                              thread_name_prefix=f"kvbridge-shm-{self.agent_name}")
        first, *rest = parts
        futures = [self.helpers.submit(self._copy_part, fn, peer, p) for p in rest]
        errors: list[BaseException] = []
        try:
            self._copy_part(fn, peer, first)
        except Exception as exc:  # noqa: BLE001 - reported once every part stopped
            errors.append(exc)
        for f in futures:
            failure = f.exception()
            if failure is not None:
                errors.append(failure)
        if errors:
            raise errors[0]
        return None

    def _copy_part(self, fn: Callable[..., int], peer: _Peer, part: _Part,
                   threads: int = 1) -> None:
        """Copy the part's mapped ranges in one native call (without the GIL; with ``threads``
        2, a helper thread inside it), then the rest by CMA; :meth:`stop` (the transport's
        ``close``) stops either within 64 ranges."""
        if part.moves.shape[0]:
            assert peer.copy is not None  # there are moves only with a mapping
            if peer.copy(part.moves, self._stop, threads) < part.moves.shape[0]:
                raise TransferFailed("transport closed during the transfer; abandoned")
        if part.local.shape[0]:
            copy_iovecs(fn, peer.pid, part.local, part.remote, self._iov_max, self._abort)

    def _fail_leftovers(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, (_Job, _BlockJob)):
                job.handle.fail("transport closed before the transfer ran")
            elif job is not None:
                job()


def all_mapped(peer: _Peer, parts: Parts) -> bool:
    """Every range of ``parts`` is copied through ``peer``'s mapping (none by CMA)."""
    return peer.copy is not None and not any(p.local.shape[0] for p in parts)


def _moves(parts: Parts) -> IovArray:
    """The parts' mapped moves as one array, in order."""
    return parts[0].moves if len(parts) == 1 else np.concatenate([p.moves for p in parts])


def _part(mapping: PeerMapping | None, op: Op, local: IovArray, remote: IovArray) -> _Part:
    """Split one thread's iovecs into moves through ``mapping`` and the rest (vectorised)."""
    if mapping is None or local.shape[0] == 0:
        return _Part(_NO_MOVES, local, remote)
    length = remote[:, 1].astype(np.int64)
    inside, here = mapping.translate(remote[:, 0].astype(np.int64), length)
    if not inside.any():
        return _Part(_NO_MOVES, local, remote)
    mine = local[inside, 0].astype(np.int64)
    dst, src = (mine, here[inside]) if op is Op.READ else (here[inside], mine)
    sizes = length[inside]
    moves = np.ascontiguousarray(np.stack([dst, src, sizes], axis=1)).view(np.uint64)
    outside = ~inside
    return _Part(moves, np.ascontiguousarray(local[outside]),
                 np.ascontiguousarray(remote[outside]), int(sizes.sum()))


_NO_MOVES: IovArray = np.zeros((0, 3), dtype=np.uint64)

"""Posting and completing NIXL transfers for :class:`~kvbridge_nixl.transport.NixlTransport`.

:class:`Progress` is a mixin of the transport (after :class:`~kvbridge_nixl._requests.
RequestBuilder`). NIXL completes a transfer (and sends its notification) only when the
initiator checks its state, so a progress thread polls in-flight handles — interval 1/32 of the
oldest one's age, 20 µs – 1 ms, asleep when nothing is in flight — settles each one
(:meth:`~kvbridge.transport.TransferHandle.succeed` / :meth:`~kvbridge.transport.TransferHandle.
fail`) and releases its request; :meth:`Progress.wait` sleeps on the handle's event. Removed
peers are unloaded from NIXL once none of their transfers is in flight (:meth:`Progress.
_reap_peers`). Every agent call holds the transport's lock (NIXL is not guaranteed
thread-safe); ``poll`` and ``wait`` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvbridge.errors import KVBridgeError, TransferFailed, TransferTimeout
from kvbridge.transport import DescriptorArray, HandleState, Op, TransferHandle
from kvbridge_nixl._peer import PeerState, describe, translate
from kvbridge_nixl._requests import RequestBuilder

__all__ = ["Progress"]

log = logging.getLogger("kvbridge.transport.nixl")


class Progress(RequestBuilder):
    """Mixin of :class:`~kvbridge_nixl.transport.NixlTransport` (see the module docstring)."""

    _closed: bool
    _cv: threading.Condition
    _progress: threading.Thread | None
    _peers: dict[str, PeerState]
    _retired_peers: list[PeerState]

    def _post(
        self, op: Op, peer: PeerState, local: DescriptorArray, remote: DescriptorArray, notif: bytes
    ) -> tuple[Any, str]:
        agent, mem = self._agent, self._mem_type or "DRAM"
        nbytes = int(local[:, 1].sum())
        what = describe(op, nbytes, peer.name)
        try:
            native = None
            if self.settings.xfer_mode != "direct":
                native = self._make_prepped(op, peer, local, remote, notif)
            if native is None:
                if self.settings.xfer_mode == "prepped":
                    log.debug("nixl: descriptors do not fit a prepared grid; posting directly")
                native = agent.initialize_xfer(
                    op.value, agent.get_xfer_descs(local, mem),
                    agent.get_xfer_descs(remote, peer.mem_type), peer.name, notif,
                )
                self.stats["direct"] += 1
            else:
                self.stats["prepped"] += 1
        except Exception as exc:
            raise translate(exc, what, peer.name) from exc
        return native, self._start(native, op, nbytes, peer.name)

    def _start(self, native: Any, op: Op, nbytes: int, peer: str) -> str:
        """``transfer`` a made request: its state, ``"DONE"`` where NIXL completed it inside
        the call (small or local transfers), else ``"PROC"``; release it and raise if NIXL
        refuses."""
        try:
            status: str = self._agent.transfer(native)
        except Exception as exc:
            self._release(native)
            raise translate(exc, describe(op, nbytes, peer), peer) from exc
        if status == "ERR":
            self._release(native)
            raise TransferFailed(f"{describe(op, nbytes, peer)}: NIXL refused to post the transfer "
                                 "(ERR)")
        return status

    def _track(self, handle: TransferHandle, state: PeerState, native: Any, status: str) -> None:
        """Book a posted transfer (``status`` from :meth:`_start`): finish it at once where NIXL
        completed it inside ``transfer``, else poll it once (holding the lock)."""
        handle.native = native
        state.inflight += 1
        self._inflight[handle.id] = (handle, state)
        if status == "DONE":
            self._settle(handle)
            handle.succeed()
            return
        self._poll_locked(handle)
        if not handle.state.terminal:
            self._ensure_progress()
            self._cv.notify_all()

    def _ensure_progress(self) -> None:
        if self._progress is None:
            self._progress = threading.Thread(
                target=self._progress_loop, name=f"kvbridge-nixl-{self.agent_name}", daemon=True
            )
            self._progress.start()

    def _progress_loop(self) -> None:
        """Poll in-flight handles until the transport closes; sleeps while nothing is in flight.

        NIXL (UCX) completes a transfer, and sends its notification, only when the initiator
        checks its state; this thread does that so notifications flow even if nobody polls.
        The poll interval is 1/32 of the oldest transfer's age, between 20 µs and 1 ms, so a
        waiter learns of completion at most ~3 % late, and nothing is polled while idle.
        """
        with self._cv:
            while self._agent is not None and not (self._closed and not self._inflight):
                if not self._inflight:
                    self._cv.wait()
                    continue
                for handle, _ in list(self._inflight.values()):
                    self._poll_locked(handle)
                if self._inflight:
                    oldest = min(h.started for h, _ in self._inflight.values())
                    age = time.perf_counter() - oldest
                    self._cv.wait(min(max(age / 32, 20e-6), 1e-3))

    def _reap_peers(self) -> None:
        """Forget removed peers in NIXL once none of their transfers is in flight."""
        keep = []
        for p in self._retired_peers:
            if p.inflight or not p.removed:
                keep.append(p)
                continue
            self._retire(p.grids)
            if p.name not in self._peers:
                try:
                    self._agent.remove_remote_agent(p.name)
                except Exception as exc:  # noqa: BLE001 - best effort, logged
                    log.warning("nixl: remove_remote_agent(%r) failed: %r", p.name, exc)
        self._retired_peers = keep

    def poll(self, handle: TransferHandle) -> HandleState:
        if handle.state.terminal:
            return handle.state
        with self._lock:
            return self._poll_locked(handle)

    def _poll_locked(self, handle: TransferHandle) -> HandleState:
        if handle.state.terminal or handle.id not in self._inflight:
            return handle.state
        error: KVBridgeError | None = None
        try:
            status = self._agent.check_xfer_state(handle.native)
        except Exception as exc:
            status, error = "ERR", translate(exc, "check_xfer_state", handle.peer)
        if status == "PROC":
            return handle.state
        self._settle(handle)
        if status == "DONE":
            handle.succeed()
        else:
            handle.fail(str(error) if error else (
                f"{handle.op.value} of {handle.nbytes} bytes with {handle.peer!r} failed "
                "(NIXL state ERR: peer gone or network error)"))
        return handle.state

    def _settle(self, handle: TransferHandle) -> None:
        """Release a handle that stopped and update the bookkeeping."""
        _, peer = self._inflight.pop(handle.id)
        peer.inflight -= 1
        self._release(handle.native)
        handle.native = None
        if peer.removed:
            self._reap_peers()
        self._release_retired()

    def _release(self, native: Any) -> None:
        try:
            self._agent.release_xfer_handle(native)
        except Exception as exc:  # noqa: BLE001 - a stuck handle is kept alive by NIXL's list
            log.warning("nixl: releasing a transfer handle failed: %r", exc)

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> HandleState:
        """Block until ``handle`` is terminal or raise :class:`TransferTimeout`.

        Sleeps on the handle's event, which the progress thread sets on completion (no polling
        here beyond a 50 ms safety net).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.poll(handle)
            if state.terminal:
                return state
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TransferTimeout(
                    f"{handle.op.value} of {handle.nbytes} bytes with {handle.peer!r} did not "
                    f"finish within {timeout} s"
                )
            with self._lock:
                if not handle.state.terminal and handle.id in self._inflight:
                    self._ensure_progress()
            delay = 0.05 if deadline is None else min(0.05, max(deadline - now, 0.0))
            handle.done_event.wait(delay)

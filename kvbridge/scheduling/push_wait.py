"""Push, D side: register with P, confirm its WRITE, wait for the result (see push.py).

Per transfer: handshake (cached) → ``PushRegister`` on D's own connection to P → P's
``PushConfirm`` arrives on P's connection to D (D answers ok only for a registration it made
and did not cancel; from then on P may write) → the registration's final ``PushResult``
(byte count and checksum checked) → received. Giving up (timeout, abort) before confirming is
safe at once; after, D sends Cancel and keeps its blocks until P answers that no WRITE is in
flight, P's ``PushResult`` arrives, or P is proven gone (plus ``gone_grace_s``).

Runs on the transfer loop's thread.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError
from kvbridge.messages import (
    Ack,
    Cancel,
    CancelReply,
    ErrorKind,
    Message,
    PushConfirm,
    PushRegister,
    PushResult,
)
from kvbridge.scheduling.peers import Peer
from kvbridge.scheduling.push import PushSpec

if TYPE_CHECKING:
    from kvbridge.scheduling.loop import TransferLoop

__all__ = ["PushSink"]

log = logging.getLogger("kvbridge.push")


class _Wait(enum.Enum):
    DIALING = "dialing"
    REGISTERING = "registering"
    CONFIRMED = "confirmed"
    CANCELLING = "cancelling"


@dataclass
class _In:
    spec: PushSpec
    state: _Wait = _Wait.DIALING
    peer: Peer | None = None
    call: int | None = None
    failure: str | None = None  # reported; blocks held until P's answer or P gone
    started: float = field(default_factory=time.perf_counter)


class PushSink:
    """D side of pushes (see the module docstring)."""

    def __init__(self, core: TransferLoop) -> None:
        self.core = core
        self.waits: dict[str, _In] = {}

    def __len__(self) -> int:
        return len(self.waits)

    def expect(self, spec: PushSpec) -> None:
        core, tid = self.core, spec.transfer_id
        if tid in self.waits:
            core.results.fail(spec.req_id, spec.local_ids, f"transfer {tid} is already awaited",
                              safe=True)
            return
        w = self.waits[tid] = _In(spec)
        core.heartbeats.watch(tid, spec.peer_address, spec.peer_generation)
        core.mark(tid, "recv_start")
        core.timers.set(("push", tid), core.config.push_timeout_s, lambda: self._timed_out(w))
        core.peers.ensure(spec.peer_address, spec.peer_generation,
                          lambda result: self._handshaken(w, result))

    def _live(self, w: _In) -> bool:
        return self.waits.get(w.spec.transfer_id) is w and w.failure is None

    def _handshaken(self, w: _In, result: Peer | KVBridgeError) -> None:
        if not self._live(w):
            return
        if isinstance(result, KVBridgeError):
            self._fail(w, f"cannot reach prefill {w.spec.peer_address}: {result}", safe=True)
            return
        w.peer, w.state = result, _Wait.REGISTERING
        core, s = self.core, w.spec
        reg = PushRegister(
            transfer_id=s.transfer_id, generation=result.info.generation,
            engine_id=core.engine_id, sender_generation=core.generation,
            control_address=core.control_address, block_ids=list(s.local_ids),
            skip_blocks=s.skip_blocks, num_tokens=s.num_tokens, prompt_digest=s.prompt_digest,
            layout_fingerprint=core.info.layout_fingerprint)
        w.call = core.rpc.call(s.peer_address, reg, core.config.control_timeout_s,
                               lambda reply: self._answer(w, reply))
        core.stats["push_registered"] += 1

    def _answer(self, w: _In, reply: Message | KVBridgeError) -> bool:
        """The registration's answers: first an Ack, finally a PushResult."""
        if self.waits.get(w.spec.transfer_id) is not w:
            return False
        if isinstance(reply, Ack):
            if reply.ok:
                return True  # registered; the PushResult follows on this call
            self._fail(w, f"prefill refused the registration: {reply.error}", safe=True,
                       cancel=False)
            return False
        if isinstance(reply, PushResult):
            self._result(w, reply)
            return False
        if isinstance(reply, KVBridgeError):
            # No answer at all: P never saw it, or is gone; it cannot have written unconfirmed.
            safe = w.state is not _Wait.CONFIRMED
            self._fail(w, f"no answer to the registration: {reply}", safe=safe)
            return False
        self._fail(w, f"unexpected answer {type(reply).__name__} to a registration",
                   safe=w.state is not _Wait.CONFIRMED)
        return False

    def _result(self, w: _In, msg: PushResult) -> None:
        core, s = self.core, w.spec
        if w.failure is not None:  # we gave up earlier; now every WRITE has stopped
            self._forget(w)
            core.results.release(s.req_id)
            return
        if not msg.ok:
            self._fail(w, f"prefill failed the push: {msg.error}", safe=True, cancel=False)
            return
        expected = core.layout.nbytes(s.local_ids)
        problem = None
        if w.state is not _Wait.CONFIRMED and s.local_ids:
            problem = "prefill reported a write this engine never confirmed"
        elif msg.nbytes != expected:
            problem = f"prefill wrote {msg.nbytes} bytes, {expected} were expected"
        elif msg.checksum is None and core.config.checksum:
            problem = "this engine verifies checksums; the push carried none"
        elif msg.checksum is not None and msg.checksum != core.digest(s.local_ids):
            core.count("checksum_mismatch", "push", w.peer)
            problem = "checksum mismatch: bytes changed in transit"
        if problem is not None:
            self._fail(w, problem, safe=True, cancel=False)
            return
        self._forget(w)
        core.stats["push_received_bytes"] += msg.nbytes
        if w.peer is not None:
            core.observe.handoff("push", w.peer.info.engine_id, time.perf_counter() - w.started,
                                 core.backend_of(w.peer.name))
        core.results.received(s.req_id, s.transfer_id)

    def on_confirm(self, ctx: RequestContext, msg: PushConfirm) -> Message:
        core = self.core
        w = self.waits.get(msg.transfer_id)
        if w is None or not self._live(w) or w.state not in (_Wait.REGISTERING,
                                                             _Wait.CONFIRMED):
            core.stats["confirm_refused"] += 1
            return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                       error=f"no registration of {msg.transfer_id} is waiting here")
        if msg.generation != core.generation or tuple(msg.block_ids) != w.spec.local_ids:
            core.stats["confirm_refused"] += 1
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error="the confirmation does not match this engine's registration")
        w.state = _Wait.CONFIRMED
        return Ack()

    def _timed_out(self, w: _In) -> None:
        if self._live(w):
            self.core.count("push_timeout", "push", w.peer)
            self._give_up(w, f"no push within {self.core.config.push_timeout_s} s")

    def cancel(self, tid: str, reason: str) -> bool:
        w = self.waits.get(tid)
        if w is None:
            return False
        if w.failure is None:
            self._give_up(w, reason)
        return True

    def _give_up(self, w: _In, reason: str) -> None:
        """D stops waiting; its blocks are safe now unless P may already write them."""
        if w.state is not _Wait.CONFIRMED:
            self._fail(w, reason, safe=True)
            return
        w.state = _Wait.CANCELLING
        self._fail(w, reason, safe=False, cancel=False)
        self.core.rpc.call(w.spec.peer_address,
                           Cancel(transfer_id=w.spec.transfer_id, reason=reason[:4000]),
                           self.core.config.control_timeout_s,
                           lambda reply: self._cancel_answer(w, reply))

    def _cancel_answer(self, w: _In, reply: Message | KVBridgeError) -> bool:
        if self.waits.get(w.spec.transfer_id) is not w:
            return False
        if isinstance(reply, CancelReply) and reply.safe:
            self._release(w)
        # not safe: P's PushResult follows on the registration; no answer: P's heartbeats
        # decide (gone -> released after the grace period).
        return False

    def peer_gone(self, address: str, why: str) -> None:
        for w in list(self.waits.values()):
            if w.spec.peer_address != address:
                continue
            if w.failure is None:
                self._fail(w, f"prefill {address} is gone: {why}",
                           safe=w.state is not _Wait.CONFIRMED, cancel=False)
            if self.waits.get(w.spec.transfer_id) is w:
                self._release_later(w)

    def transfers_unknown(self, address: str, tids: list[str]) -> None:
        for tid in tids:
            w = self.waits.get(tid)
            if w is not None and w.failure is None and w.state is _Wait.CONFIRMED:
                self._fail(w, "prefill no longer holds this push", safe=False, cancel=False)
                self._release_later(w)

    def _release_later(self, w: _In) -> None:
        """P may have posted WRITEs before it died: give the blocks back after the grace."""
        self.core.timers.set(("gone", w.spec.transfer_id), self.core.config.gone_grace_s,
                             lambda: self._release(w))

    def _fail(self, w: _In, why: str, *, safe: bool, cancel: bool = True) -> None:
        core, s = self.core, w.spec
        if cancel and w.state is not _Wait.DIALING:
            core.cancel_remote(s.peer_address, s.transfer_id, why)
        w.failure = why
        core.count("recv_failed", "push", w.peer, stats=False)  # results.fail counts it
        core.results.fail(s.req_id, s.local_ids, why, safe=safe, transfer_id=s.transfer_id)
        if safe:
            self._forget(w)

    def _release(self, w: _In) -> None:
        if self.waits.get(w.spec.transfer_id) is w:
            self._forget(w)
            self.core.results.release(w.spec.req_id)

    def _forget(self, w: _In) -> None:
        s = w.spec
        if self.waits.get(s.transfer_id) is w:
            del self.waits[s.transfer_id]
        if w.call is not None:
            self.core.rpc.cancel(w.call)
        for key in ("push", "gone"):
            self.core.timers.cancel((key, s.transfer_id))
        self.core.heartbeats.unwatch(s.transfer_id, s.peer_address)

"""Push, D side: register with P, confirm its WRITE, wait for the result (see push.py).

Per transfer and prefill rank that writes this rank's heads (one part; several with
heterogeneous TP, joined by a :class:`~kvbridge.scheduling.fanin.FanIn` so the failure of any
fails the receive): handshake (cached) → ``PushRegister`` on D's own connection to P → P's
``PushConfirm`` arrives on P's connection to D (D answers ok only for a registration it made
and did not cancel; from then on P may write) → the registration's final ``PushResult``
(byte count and checksum checked against this rank's side of the part) → received. Giving up
(timeout, abort) before confirming is safe at once; after, D sends Cancel and keeps its blocks
until P answers that no WRITE is in flight, P's ``PushResult`` arrives, or P is proven gone
(plus ``gone_grace_s``). The handshake and the registration's first answer must each come
within ``stall_s``; after that D waits for P's prefill, which ``push_timeout_s`` bounds.

Runs on the transfer loop's thread.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError
from kvbridge.layout import DescriptorArray
from kvbridge.messages import (
    Ack,
    Cancel,
    CancelReply,
    ErrorKind,
    Message,
    PushConfirm,
    PushLanded,
    PushRegister,
    PushResult,
)
from kvbridge.scheduling import digests, follow, mapping
from kvbridge.scheduling.peers import Peer
from kvbridge.scheduling.receive import Half, Part, Receiver, check_source
from kvbridge.scheduling.specs import PushSpec

__all__ = ["PushSink"]

log = logging.getLogger("kvbridge.push")


class _Wait(enum.Enum):
    DIALING = "dialing"
    REGISTERING = "registering"
    CONFIRMED = "confirmed"
    CANCELLING = "cancelling"


@dataclass
class _In(Part[PushSpec]):
    """One part of a push receive: what one prefill rank writes into this rank's blocks
    (``failure``: blocks held until P's answer or P gone)."""

    state: _Wait = _Wait.DIALING
    half: Half = field(default_factory=list)  # this rank's side of the part
    #: the half's descriptors, built while P computes (what the digests cover), or None
    stream: DescriptorArray | None = None
    call: int | None = None
    #: HeartbeatBook.sent when P's confirmation came: earlier heartbeats' answers predate it
    confirmed_after: int = 0
    #: the board word P's copy may keep (given back when the part is forgotten) and the
    #: follower hashing behind it (kvbridge.scheduling.follow)
    word: int | None = None
    follower: follow.Follower | None = None
    #: the digests of what landed, made when P said every WRITE stopped (``PushLanded``)
    early: bytes | None = None


class PushSink(Receiver[_In]):
    """D side of pushes (see the module docstring). ``jobs``: transfer id → its parts."""

    kind = "push"

    def expect(self, spec: PushSpec) -> None:
        self._open(spec, lambda src, box: _In(spec, src, box), "already awaited",
                   self._timed_out)

    def _handshaken(self, w: _In, result: Peer | KVBridgeError) -> None:
        if not self._live(w):
            return
        if isinstance(result, KVBridgeError):
            self._fail(w, f"cannot reach prefill {w.address}: {result}", safe=True)
            return
        w.peer = result
        try:
            w.half = self._half(w, result)
        except KVBridgeError as exc:
            self._fail(w, f"cannot map the KV of prefill {w.address}: {exc}", safe=True)
            return
        w.state = _Wait.REGISTERING
        core, s = self.core, w.spec
        checked = core.config.checksum or result.info.checksum
        if checked and core.board is not None and w.half:  # P's copy may keep a word of ours
            w.word = core.board.take()
        reg = PushRegister(
            transfer_id=s.transfer_id, generation=result.info.generation,
            engine_id=core.engine_id, sender_generation=core.generation,
            control_address=core.control_address, block_ids=list(s.local_ids),
            skip_blocks=s.skip_blocks, num_tokens=s.num_tokens, prompt_digest=s.prompt_digest,
            layout_fingerprint=core.info.layout_fingerprint, progress=w.word,
            check_early=checked and w.word is None)
        self._expect(w, core.config.stall_s,
                     f"prefill {w.address} did not answer the registration")
        w.call = core.rpc.call(w.address, reg, core.config.control_timeout_s,
                               lambda reply: self._answer(w, reply))
        core.stats["push_registered"] += 1
        if checked:  # off the hand-off's path
            w.stream = mapping.side_descriptors(w.half)
            if w.word is not None and len(w.stream):
                w.follower = follow.Follower(w.stream, w.word)

    def _half(self, w: _In, peer: Peer) -> Half:
        """This rank's side of the part, after checking the peer is the rank expected."""
        core, s = self.core, w.spec
        theirs = check_source(core, w.source, peer)
        span = mapping.Span(s.skip_blocks * core.layout.block_size, s.num_tokens)
        return mapping.side(core.layout, core.shape, theirs, mapping.reads(core.shape, theirs),
                            s.local_ids, s.skip_blocks, span)

    def _answer(self, w: _In, reply: Message | KVBridgeError) -> bool:
        """The registration's answers: first an Ack, maybe a PushLanded, finally a
        PushResult."""
        if w not in self.jobs.get(w.tid, ()):
            return False
        if isinstance(reply, Ack):
            if reply.ok:  # registered; the PushResult follows on this call, after P's
                self._progressed(w)  # prefill: push_timeout_s bounds that, not stall_s
                return True
            # P refuses a registration alone (push.py); one that does not match P's prompt or
            # layout is ours and cannot be served: say so, P need not hold its KV for a lease
            self._fail(w, f"prefill refused the registration: {reply.error}", safe=True,
                       cancel=reply.kind is ErrorKind.MISMATCH)
            return False
        if isinstance(reply, PushResult):
            self._result(w, reply)
            return False
        if isinstance(reply, PushLanded):  # the PushResult follows on this call
            self._landed(w, reply)
            return True
        if isinstance(reply, KVBridgeError):
            # No answer at all: P never saw it, or is gone; it cannot have written unconfirmed.
            safe = w.state is not _Wait.CONFIRMED
            self._fail(w, f"no answer to the registration: {reply}", safe=safe)
            return False
        self._fail(w, f"unexpected answer {type(reply).__name__} to a registration",
                   safe=w.state is not _Wait.CONFIRMED)
        return False

    def _landed(self, w: _In, msg: PushLanded) -> None:
        """P's WRITEs stopped and P digests its side: digest what landed meanwhile (for the
        result to compare), where it is what this registration expects."""
        if (w.failure is None and w.state is _Wait.CONFIRMED and w.stream is not None
                and w.early is None and msg.nbytes == mapping.side_bytes(w.half)):
            w.early = digests.compute(w.stream)

    def _result(self, w: _In, msg: PushResult) -> None:
        core, s = self.core, w.spec
        if w.failure is not None:  # we gave up earlier; now every WRITE has stopped
            self._forget(w)
            w.box.release(s.req_id)
            return
        if not msg.ok:
            self._fail(w, f"prefill failed the push: {msg.error}", safe=True, cancel=False)
            return
        expected = mapping.side_bytes(w.half)
        problem = None
        if w.state is not _Wait.CONFIRMED and s.local_ids:
            problem = "prefill reported a write this engine never confirmed"
        elif msg.nbytes != expected:
            problem = f"prefill wrote {msg.nbytes} bytes, {expected} were expected"
        elif expected and (core.config.checksum or msg.digests is not None):
            landed = w.follower.finish() if w.follower is not None else None
            if landed is not None:
                core.stats["push_digested_behind"] += 1
            elif w.early is not None:
                landed = w.early
                core.stats["push_checked_early"] += 1
            problem = digests.mismatch(msg.digests, mapping.side_descriptors(w.half)
                                       if w.stream is None else w.stream, landed)
            if problem is not None:
                core.count("checksum_mismatch", "push", w.peer)
                problem = f"the pushed KV is not what prefill computed: {problem}"
        if problem is not None:
            self._fail(w, problem, safe=True, cancel=False)
            return
        self._forget(w)
        core.stats["push_received_bytes"] += msg.nbytes
        if w.peer is not None:
            core.observe.handoff("push", w.peer.info.engine_id, time.perf_counter() - w.started,
                                 core.backend_of(w.peer.name))
        w.box.received(s.req_id, s.transfer_id)

    def on_confirm(self, ctx: RequestContext, msg: PushConfirm) -> Message:
        core = self.core
        waiting = [w for w in self.jobs.get(msg.transfer_id, ())
                   if self._live(w) and w.state in (_Wait.REGISTERING, _Wait.CONFIRMED)
                   and (msg.rank is None or (w.peer is not None and w.peer.info.rank == msg.rank))]
        if len(waiting) != 1:
            core.stats["confirm_refused"] += 1
            return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                       error=f"no registration of {msg.transfer_id} is waiting here"
                             + (f" for prefill rank {msg.rank}" if msg.rank is not None else ""))
        w = waiting[0]
        if msg.generation != core.generation or tuple(msg.block_ids) != w.spec.local_ids:
            core.stats["confirm_refused"] += 1
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error="the confirmation does not match this engine's registration")
        w.state = _Wait.CONFIRMED
        w.confirmed_after = core.heartbeats.sent
        return Ack()

    def close(self) -> None:
        """The loop stops: every follower thread ends (the parts' words stay taken)."""
        for w in self.parts():
            if w.follower is not None:
                w.follower.stop()

    def _stalled_part(self, part: _In, why: str) -> None:
        self._give_up(part, why)

    def _timed_out(self, tid: str) -> None:
        live = [w for w in self.jobs.get(tid, ()) if self._live(w)]
        if live:
            self.core.count("push_timeout", "push", live[0].peer)
            self.cancel(tid, f"no push within {self.core.config.push_timeout_s} s")

    def cancel(self, tid: str, reason: str) -> bool:
        """The request ended on D (or a part failed): give up every part still waiting."""
        parts = self.jobs.get(tid)
        if parts is None:
            return False
        for w in list(parts):
            if self._live(w):
                self._give_up(w, reason)
        return True

    def _give_up(self, w: _In, reason: str) -> None:
        """D stops waiting; its blocks are safe now unless P may already write them."""
        if w.state is not _Wait.CONFIRMED:
            self._fail(w, reason, safe=True)
            return
        w.state = _Wait.CANCELLING
        self._fail(w, reason, safe=False, cancel=False)
        self.core.rpc.call(w.address,
                           Cancel(transfer_id=w.tid, reason=reason[:4000]),
                           self.core.config.control_timeout_s,
                           lambda reply: self._cancel_answer(w, reply))

    def _cancel_answer(self, w: _In, reply: Message | KVBridgeError) -> bool:
        if w not in self.jobs.get(w.tid, ()):
            return False
        if isinstance(reply, CancelReply) and reply.safe:
            self._release(w)
        # not safe: P's PushResult follows on the registration; no answer: P's heartbeats
        # decide (gone -> released after the grace period).
        return False

    def peer_gone(self, address: str, why: str) -> None:
        for w in self.parts():
            if w.address != address:
                continue
            if w.failure is None:
                self._fail(w, f"prefill {address} is gone: {why}",
                           safe=w.state is not _Wait.CONFIRMED, cancel=False)
            if w in self.jobs.get(w.tid, ()):
                self._release_later(w)

    def transfers_unknown(self, address: str, tids: list[str], asked: int) -> None:
        """P's heartbeat answer (heartbeat number ``asked``) says it does not hold ``tids``.

        Only a confirmed part P forgot counts: before the confirmation P may not know the
        registration yet, and an answer to a heartbeat sent before the confirmation came is
        stale (P answered it, then took the registration, then confirmed on its own connection
        to this engine, whose message this loop may read first)."""
        for tid in tids:
            for w in list(self.jobs.get(tid, ())):
                if (w.address == address and w.failure is None
                        and w.state is _Wait.CONFIRMED and asked > w.confirmed_after):
                    self._fail(w, "prefill no longer holds this push", safe=False, cancel=False)
                    self._release_later(w)

    def _release_later(self, w: _In) -> None:
        """P may have posted WRITEs before it died: give the blocks back after the grace."""
        self.core.timers.set(("gone", w.tid, w.address), self.core.config.gone_grace_s,
                             lambda: self._release(w))

    def _fail(self, w: _In, why: str, *, safe: bool, cancel: bool = True) -> None:
        core, s = self.core, w.spec
        if cancel and w.state is not _Wait.DIALING:
            core.cancel_remote(w.address, s.transfer_id, why)
        self._progressed(w)
        w.failure = why
        core.count("recv_failed", "push", w.peer, stats=False)  # results.fail counts it
        if safe:
            self._forget(w)
        w.box.fail(s.req_id, s.local_ids, why, safe=safe, transfer_id=s.transfer_id)

    def _release(self, w: _In) -> None:
        if w in self.jobs.get(w.tid, ()):
            self._forget(w)
            w.box.release(w.spec.req_id)

    def _forget(self, w: _In) -> None:
        if w.follower is not None:
            w.follower.stop()
        if w.word is not None and self.core.board is not None:  # no WRITE of P's can follow
            self.core.board.give(w.word)
            w.word = None
        self._drop(w)
        if w.call is not None:
            self.core.rpc.cancel(w.call)
        self.core.timers.cancel(("gone", w.tid, w.address))

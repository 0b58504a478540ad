"""Pull: D reads the KV P holds under a lease. Both halves run on the transfer loop's thread.

P side (:class:`PullSource`), per transfer: *staged* (blocks pinned under a lease, renewed by
D's heartbeats) → *claimed* by one control connection whose claim matched every staged fact
(block ids, token count, prompt digest) → released on that connection's DONE (answered ok only
if the lease still held), its Cancel, or lease expiry. A DONE, Cancel or renewal from any other
connection is refused and counted: only the claimant can end a claimed transfer.

D side (:class:`PullSink`), per transfer: handshake (cached) → claim → READ (bounded by
``transfer_timeout_s``) → DONE → received. Every failure before the READ is posted is *safe*
(nothing can land in D's blocks) and is reported at once, with a Cancel to P so nothing waits
out a lease. After the READ is posted, a failure is reported at once but D's blocks are only
given back once the READ handle has stopped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.blocks import prepare_blocks, submit_blocks
from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError
from kvbridge.messages import Ack, Cancel, CancelReply, ErrorKind, Message, PullClaim, PullDone
from kvbridge.scheduling.peers import ANY_GENERATION, Peer
from kvbridge.scheduling.planner import sources_for
from kvbridge.transport import HandleState, Op, TransferHandle

if TYPE_CHECKING:
    from kvbridge.scheduling.loop import TransferLoop

__all__ = ["SendPlan", "PullSpec", "PullSource", "PullSink"]

log = logging.getLogger("kvbridge.pull")

_MAX_EARLY_CLAIMS = 1024


@dataclass(frozen=True)
class SendPlan:
    """P: one request's prompt blocks, ready to hand to a decode engine."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str
    layerwise: bool = False


@dataclass(frozen=True)
class PullSpec:
    """D: read the prompt's blocks from ``skip_blocks`` on (``remote_ids`` at the engine at
    ``peer_address``, generation ``peer_generation``) into ``local_ids``."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    skip_blocks: int = 0
    num_tokens: int = 0
    prompt_digest: str = ""
    peer_generation: str = ANY_GENERATION


@dataclass
class _Staged:
    plan: SendPlan
    claimant: bytes | None = None
    claimed: tuple[int, ...] = ()


class PullSource:
    """P side of pulls (see the module docstring)."""

    def __init__(self, core: TransferLoop) -> None:
        self.core = core
        self.staged: dict[str, _Staged] = {}
        self._early: dict[str, list[tuple[RequestContext, PullClaim]]] = {}

    def __len__(self) -> int:
        return len(self.staged)

    def stage(self, plan: SendPlan) -> None:
        core, tid = self.core, plan.transfer_id
        if tid in self.staged or core.ended.get(tid) is not None:
            core.stats["duplicate_transfer"] += 1
            log.warning("transfer %s of %s is already staged or ended (%s); not staged again",
                        tid, plan.req_id, core.ended.get(tid) or "staged")
            core.results.sent(plan.req_id)
            return
        self.staged[tid] = _Staged(plan)
        core.timers.set(("lease", tid), core.config.lease_s, lambda: self._expire(tid))
        core.stats["staged"] += 1
        for ctx, claim in self._early.pop(tid, []):
            core.timers.cancel(("early", tid, ctx))
            reply = self.on_claim(ctx, claim)
            if reply is not None:
                core.server.reply(ctx, reply)

    def on_claim(self, ctx: RequestContext, msg: PullClaim) -> Message | None:
        core, tid = self.core, msg.transfer_id
        if msg.generation not in (ANY_GENERATION, core.generation):
            return Ack(ok=False, kind=ErrorKind.STALE_GENERATION,
                       error=f"this engine is generation {core.generation}; the claim names "
                             f"{msg.generation} (it restarted)")
        st = self.staged.get(tid)
        if st is None:
            why = core.ended.get(tid)
            if why is not None:
                return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                           error=f"transfer {tid} already ended: {why}")
            held = sum(len(v) for v in self._early.values())
            if held >= _MAX_EARLY_CLAIMS:
                return Ack(ok=False, kind=ErrorKind.BUSY, error="too many early claims")
            # The claim overtook our own stage event (the answer reached D first): hold it.
            self._early.setdefault(tid, []).append((ctx, msg))
            core.timers.set(("early", tid, ctx), min(core.config.control_timeout_s, 5.0),
                            lambda: self._early_expired(tid, ctx))
            return None
        if st.claimant is not None and st.claimant != ctx.conn:
            core.stats["forged_claim"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"transfer {tid} is claimed by another connection")
        plan = st.plan
        problem = None
        if msg.num_tokens != plan.num_tokens:
            problem = f"prefill computed {plan.num_tokens} tokens, the claim says {msg.num_tokens}"
        elif msg.prompt_digest != plan.prompt_digest:
            problem = "the claim's prompt differs from the prompt prefilled here"
        elif not self._leased(plan, msg):
            problem = (f"the claim names blocks P did not lease to {tid} (skip "
                       f"{msg.skip_blocks}, {len(msg.block_ids)} ids)")
        if problem is not None:
            core.stats["claim_refused"] += 1
            log.warning("refusing claim of %s: %s", tid, problem)
            return Ack(ok=False, kind=ErrorKind.MISMATCH, error=problem)
        st.claimant, st.claimed = ctx.conn, tuple(msg.block_ids)
        lease = core.config.lease_s + core.config.transfer_timeout_s
        core.timers.set(("lease", tid), lease, lambda: self._expire(tid))
        core.stats["pull_claimed"] += 1
        return Ack()

    def _leased(self, plan: SendPlan, msg: PullClaim) -> bool:
        """The claim names exactly the blocks of ``plan`` that pair with what D lacks."""
        try:
            expected = sources_for(plan.block_ids, msg.block_ids, msg.skip_blocks,
                                   len(self.core.layout.groups))
        except KVBridgeError:
            return False
        return tuple(msg.block_ids) == expected

    def _early_expired(self, tid: str, ctx: RequestContext) -> None:
        waiting = self._early.get(tid, [])
        self._early[tid] = [(c, m) for c, m in waiting if c != ctx]
        if not self._early[tid]:
            del self._early[tid]
        self.core.server.reply(ctx, Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                                        error=f"transfer {tid} was never staged here"))

    def on_done(self, ctx: RequestContext, msg: PullDone) -> Message:
        core, tid = self.core, msg.transfer_id
        st = self.staged.get(tid)
        if st is None:
            core.stats["late_done"] += 1
            why = core.ended.get(tid) or "never staged here"
            return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                       error=f"lease of {tid} ended before DONE ({why}); blocks may be reused")
        if st.claimant is None or st.claimant != ctx.conn:
            core.stats["forged_done"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"DONE for {tid} from a connection that did not claim it")
        expected = core.layout.nbytes(st.claimed)
        reply = Ack()
        if msg.nbytes != expected:
            reply = Ack(ok=False, kind=ErrorKind.MISMATCH,
                        error=f"DONE reports {msg.nbytes} bytes, {expected} were leased")
        elif core.config.checksum and msg.checksum is None:
            reply = Ack(ok=False, kind=ErrorKind.CHECKSUM,
                        error="this prefill engine verifies checksums; the DONE carries none")
        elif msg.checksum is not None and msg.checksum != core.digest(st.claimed):
            core.count("checksum_mismatch", "pull")
            reply = Ack(ok=False, kind=ErrorKind.CHECKSUM,
                        error="checksum mismatch: bytes changed in transit")
        if reply.ok:
            core.stats["pull_served"] += 1
        self._release(tid, "done" if reply.ok else f"failed: {reply.error}")
        return reply

    def on_cancel(self, ctx: RequestContext, msg: Cancel) -> Message | None:
        """D gave up; None if this side does not hold the transfer."""
        st = self.staged.get(msg.transfer_id)
        if st is None:
            return None
        if st.claimant is not None and st.claimant != ctx.conn:
            self.core.stats["forged_cancel"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"transfer {msg.transfer_id} is claimed by another connection")
        self.core.stats["pull_cancelled"] += 1
        self._release(msg.transfer_id, f"cancelled by decode: {msg.reason}")
        return CancelReply(safe=True)

    def renew(self, ctx: RequestContext, tid: str) -> bool:
        st = self.staged.get(tid)
        if st is None or (st.claimant is not None and st.claimant != ctx.conn):
            return False
        lease = self.core.config.lease_s
        if st.claimant is not None:
            lease += self.core.config.transfer_timeout_s
        self.core.timers.set(("lease", tid), lease, lambda: self._expire(tid))
        return True

    def _expire(self, tid: str) -> None:
        st = self.staged.get(tid)
        if st is None:
            return
        self.core.count("lease_expired", "pull")
        log.warning("lease of %s (%s) expired before decode %s; %d blocks released", tid,
                    st.plan.req_id, "finished reading" if st.claimant else "claimed it",
                    len(st.plan.block_ids))
        self._release(tid, "lease expired")

    def _release(self, tid: str, why: str) -> None:
        st = self.staged.pop(tid)
        self.core.timers.cancel(("lease", tid))
        self.core.ended.record(tid, why)
        self.core.results.sent(st.plan.req_id)

    def close(self) -> None:
        for tid in list(self.staged):
            self._release(tid, "engine shutting down")


@dataclass
class _Pull:
    spec: PullSpec
    peer: Peer | None = None
    handle: TransferHandle | None = None
    reading: bool = False  # the READ is posted and has not stopped
    failure: str | None = None  # reported already; blocks held until the handle stops
    started: float = field(default_factory=time.perf_counter)


class PullSink:
    """D side of pulls (see the module docstring)."""

    def __init__(self, core: TransferLoop) -> None:
        self.core = core
        self.jobs: dict[str, _Pull] = {}

    def __len__(self) -> int:
        return len(self.jobs)

    def start(self, spec: PullSpec) -> None:
        core, tid = self.core, spec.transfer_id
        if tid in self.jobs:
            core.results.fail(spec.req_id, spec.local_ids, f"transfer {tid} is already running",
                              safe=True)
            return
        job = self.jobs[tid] = _Pull(spec)
        core.heartbeats.watch(tid, spec.peer_address, spec.peer_generation)
        core.mark(tid, "recv_start")
        # Handshake and claim are bounded by their calls; this bounds the whole hand-off.
        core.timers.set(("pull", tid), core.config.push_timeout_s, lambda: self._stalled(job))
        core.peers.ensure(spec.peer_address, spec.peer_generation,
                          lambda result: self._handshaken(job, result))

    def _live(self, job: _Pull) -> bool:
        return self.jobs.get(job.spec.transfer_id) is job and job.failure is None

    def _handshaken(self, job: _Pull, result: Peer | KVBridgeError) -> None:
        if not self._live(job):
            return
        if isinstance(result, KVBridgeError):
            self._fail(job, f"cannot reach prefill {job.spec.peer_address}: {result}")
            return
        job.peer = result
        s = job.spec
        claim = PullClaim(transfer_id=s.transfer_id, generation=result.info.generation,
                          skip_blocks=s.skip_blocks, block_ids=list(s.remote_ids),
                          num_tokens=s.num_tokens, prompt_digest=s.prompt_digest)
        self.core.rpc.call(s.peer_address, claim, self.core.config.control_timeout_s,
                           lambda reply: self._claimed(job, reply))

    def _claimed(self, job: _Pull, reply: Message | KVBridgeError) -> bool:
        if not self._live(job):
            return False
        if not (isinstance(reply, Ack) and reply.ok):
            why = reply.error if isinstance(reply, Ack) else str(reply)
            self.core.stats["claim_refused"] += 1
            self._fail(job, f"prefill refused the claim: {why}", cancel=False)
            return False
        assert job.peer is not None
        core, s = self.core, job.spec
        try:
            pair = prepare_blocks(core.transport, job.peer.name, core.layout, job.peer.layout)
            job.handle = submit_blocks(core.transport, Op.READ, pair, s.local_ids, s.remote_ids)
        except KVBridgeError as exc:
            self._fail(job, f"cannot post the READ: {exc}")
            return False
        job.reading = True
        core.timers.cancel(("pull", s.transfer_id))
        core.watch_handle(job.handle)
        core.timers.set(("read", s.transfer_id), core.config.transfer_timeout_s,
                        lambda: self._timed_out(job))
        return False

    def poll(self) -> None:
        """Complete the READs that stopped (called by the loop while any is in flight)."""
        for job in list(self.jobs.values()):
            handle = job.handle
            if handle is None or not job.reading:
                continue
            state = self.core.transport.poll(handle)
            if state is HandleState.PENDING:
                continue
            job.reading = False
            self.core.timers.cancel(("read", job.spec.transfer_id))
            self._observe(job, handle, state)
            if job.failure is not None:  # already failed (timeout, abort): blocks now safe
                self._forget(job)
                self.core.results.release(job.spec.req_id)
            elif state is HandleState.FAILED:
                self._fail(job, f"READ failed: {handle.error or 'transport error'}")
            else:
                self._read_done(job)

    def in_flight(self) -> bool:
        return any(j.reading for j in self.jobs.values())

    def _observe(self, job: _Pull, handle: TransferHandle, state: HandleState) -> None:
        if job.peer is None:
            return
        wire = (handle.finished or time.perf_counter()) - handle.started
        self.core.observe.transfer("pull", job.peer.info.engine_id, state is HandleState.DONE,
                                   wire, handle.nbytes, handle.count,
                                   self.core.backend_of(job.peer.name))

    def _read_done(self, job: _Pull) -> None:
        core, s = self.core, job.spec
        nbytes = core.layout.nbytes(s.local_ids)
        assert job.peer is not None
        checksum = None
        if core.config.checksum or job.peer.info.checksum:
            checksum = core.digest(s.local_ids)
        done = PullDone(transfer_id=s.transfer_id, nbytes=nbytes, checksum=checksum)
        core.rpc.call(s.peer_address, done, core.config.control_timeout_s,
                      lambda reply: self._confirmed(job, reply, nbytes))

    def _confirmed(self, job: _Pull, reply: Message | KVBridgeError, nbytes: int) -> bool:
        if not self._live(job):
            return False
        if isinstance(reply, Ack) and reply.ok:
            self._forget(job)
            self.core.stats["pull_bytes"] += nbytes
            if job.peer is not None:
                self.core.observe.handoff("pull", job.peer.info.engine_id,
                                          time.perf_counter() - job.started,
                                          self.core.backend_of(job.peer.name))
            self.core.results.received(job.spec.req_id, job.spec.transfer_id)
            return False
        why = reply.error if isinstance(reply, Ack) else f"no confirmation: {reply}"
        if isinstance(reply, Ack) and reply.kind is ErrorKind.CHECKSUM:
            self.core.count("checksum_mismatch", "pull", job.peer)
        self._fail(job, f"prefill did not confirm the read: {why}", cancel=False)
        return False

    def _stalled(self, job: _Pull) -> None:
        if self._live(job) and job.handle is None:
            self._fail(job, f"no READ posted within {self.core.config.push_timeout_s} s")

    def _timed_out(self, job: _Pull) -> None:
        if self._live(job):
            self.core.count("transfer_timeout", "pull", job.peer)
            self._fail(job, f"READ did not finish within {self.core.config.transfer_timeout_s} s")

    def cancel(self, tid: str, reason: str) -> bool:
        """The request ended on D; False if no pull of that id runs here."""
        job = self.jobs.get(tid)
        if job is None:
            return False
        if job.failure is None:
            self._fail(job, reason)
        return True

    def peer_gone(self, address: str, why: str) -> None:
        for job in list(self.jobs.values()):
            if job.spec.peer_address == address and job.failure is None:
                self._fail(job, f"prefill {address} is gone: {why}", cancel=False)

    def transfers_unknown(self, address: str, tids: list[str]) -> None:
        for tid in tids:
            job = self.jobs.get(tid)
            if job is not None and job.failure is None and job.handle is not None:
                self._fail(job, "prefill no longer holds this transfer (lease expired?)",
                           cancel=False)

    def _fail(self, job: _Pull, why: str, *, cancel: bool = True) -> None:
        core, s = self.core, job.spec
        if cancel:
            core.cancel_remote(s.peer_address, s.transfer_id, why)
        reading = job.reading
        job.failure = why
        core.count("recv_failed", "pull", job.peer, stats=False)  # results.fail counts it
        core.results.fail(s.req_id, s.local_ids, why, safe=not reading,
                          transfer_id=s.transfer_id)
        if not reading:
            self._forget(job)

    def _forget(self, job: _Pull) -> None:
        s = job.spec
        if self.jobs.get(s.transfer_id) is job:
            del self.jobs[s.transfer_id]
        self.core.timers.cancel(("read", s.transfer_id))
        self.core.timers.cancel(("pull", s.transfer_id))
        self.core.heartbeats.unwatch(s.transfer_id, s.peer_address)

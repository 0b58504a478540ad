"""Pull: D reads the KV P holds under a lease. Both halves run on the transfer loop's thread.

P side (:class:`PullSource`), per transfer: *staged* (blocks pinned under a lease, renewed by
D's heartbeats; the staged transfers are a :class:`~kvbridge.lookup.LookupBuffer` keyed by
transfer id, at most :data:`MAX_STAGED`: beyond, a transfer is not staged and its blocks are
freed at once) → *claimed* by the decode ranks that read from this rank, each on its own
control connection, whose claim matched every staged fact (block ids, token count, prompt
digest, and a decode rank this rank serves: :func:`~kvbridge.scheduling.mapping.consumers`) →
released when every one of them sent DONE (each answered ok only if the lease still held), on a
claimant's Cancel, or on lease expiry. A DONE, Cancel or renewal from any other connection is
refused and counted once every consumer has claimed: only claimants can end a claimed transfer.
With equal TP on both sides the one consumer is the decode rank of the same rank.

D side (:class:`PullSink`), per transfer and prefill rank read from (one part; several with
heterogeneous TP, joined by a :class:`~kvbridge.scheduling.fanin.FanIn`): handshake (cached) →
claim → READ (bounded by ``transfer_timeout_s``) → DONE → received. A part that makes no
progress is given up within ``stall_s`` (the handshake, the claim's answer) or, for a posted
READ of N bytes, ``stall_s`` + N / :data:`STALL_READ_RATE` (when that is below
``transfer_timeout_s``), not after ``push_timeout_s``. A claim P did not answer is followed by a
Cancel (P may accept it after D gave up); a refused one is not. The READ is built while the
claim is in flight (:func:`~kvbridge.blocks.prepare_parts`, where the transport builds requests
ahead and the part is one sub-transfer; with digests on, with a copy that hashes each piece as it
lands, :func:`~kvbridge.scheduling.digests.landing`), so an accepted claim only posts it; a part
that ends before posting discards it. Every failure before the READ is posted is *safe* (nothing
can land in D's blocks) and is reported at once, with a Cancel to P so nothing waits out a lease.
After the READ is posted, a failure is reported at once but D's blocks are only given back once
the READ handle has stopped. The failure of any part gives up every other part of the transfer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbridge.blocks import PreparedRequest, prepare_parts, submit_parts
from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError, LayoutError, LayoutMismatch
from kvbridge.hashing import xxh3_128
from kvbridge.layout import DescriptorArray
from kvbridge.lookup import BufferFull, LookupBuffer
from kvbridge.messages import (
    Ack,
    Cancel,
    CancelReply,
    ClaimPart,
    ErrorKind,
    Message,
    PullClaim,
    PullDone,
    PullServed,
)
from kvbridge.scheduling import digests, mapping
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.peers import ANY_GENERATION, Peer
from kvbridge.scheduling.planner import sources_for
from kvbridge.scheduling.receive import Half, Part, Receiver, check_source
from kvbridge.scheduling.specs import PullSpec, SendPlan
from kvbridge.transport import HandleState, Op, TransferHandle

__all__ = ["PullSource", "PullSink", "MAX_STAGED", "STALL_READ_RATE", "staged_buffer"]

log = logging.getLogger("kvbridge.pull")

_MAX_EARLY_CLAIMS = 1024
#: transfers one prefill rank holds staged at once (each pins blocks until D reads them)
MAX_STAGED = 65536
#: bytes per second a posted READ must at least move to not count as stalled: a READ of N bytes
#: is given up after ``stall_s`` + N / STALL_READ_RATE (``transfer_timeout_s`` at most)
STALL_READ_RATE = 64 << 20


@dataclass
class _Claim:
    conn: bytes
    half: Half  # this rank's side of the claimant's part
    digests: bytes | None = None  # of this rank's side, hashed while the claimant reads it
    done: bool = False


@dataclass
class _Staged:
    plan: SendPlan
    claims: dict[int, _Claim] = field(default_factory=dict)  # decode rank -> its claim
    expected: frozenset[int] | None = None  # decode ranks that read from this rank
    decode_tp: int | None = None
    #: (what the stream's descriptors hash to, its digests): this rank's whole prompt, as a
    #: decode rank of its own shape reads it, digested when staged (None: not digested)
    ahead: tuple[bytes, bytes] | None = None

    def digested(self, stream: DescriptorArray) -> bytes | None:
        """The digests of ``stream`` if they were computed when staged (the same bytes)."""
        ahead = self.ahead
        return ahead[1] if ahead and xxh3_128(stream.tobytes()) == ahead[0] else None

    def claimant(self, conn: bytes) -> int | None:
        return next((r for r, c in self.claims.items() if c.conn == conn), None)

    def open(self) -> bool:
        """Some consumer has not claimed yet (a stranger may be it)."""
        return self.expected is None or not self.expected <= self.claims.keys()


def staged_buffer(capacity: int = MAX_STAGED,
                  clock: Callable[[], float] = time.monotonic) -> LookupBuffer[str, _Staged]:
    """P's staged pulls (transfer id → what is staged), leased; full: not staged."""
    return LookupBuffer("pull-staged", capacity, clock=clock)


class PullSource:
    """P side of pulls (see the module docstring)."""

    def __init__(self, core: LoopContext) -> None:
        self.core = core
        self.staged: LookupBuffer[str, _Staged] = staged_buffer(clock=core.timers.clock)
        self._armed: float | None = None  # when the leases' sweep timer fires
        self._early: dict[str, list[tuple[RequestContext, PullClaim]]] = {}

    def __len__(self) -> int:
        return len(self.staged)

    # -- leases: the buffer holds the deadlines, one timer sweeps them -------------------------

    def _arm(self) -> None:
        """Make the sweep timer fire by the earliest lease's end (extensions only move
        deadlines later, so an armed timer is never late; it re-arms when it fires)."""
        due = self.staged.next_deadline()
        if due is not None and (self._armed is None or due < self._armed):
            self._armed = due
            self.core.timers.set(("pull-leases",), max(0.0, due - self.core.timers.clock()),
                                 self._sweep)

    def _sweep(self) -> None:
        self._armed = None
        self._collect()
        self._arm()

    def _collect(self) -> None:
        """Release every transfer whose lease ended (before any message is handled, so an
        ended lease is never mistaken for one not staged yet)."""
        for tid, st in self.staged.expire():
            self._expired(tid, st)

    def stage(self, plan: SendPlan) -> None:
        core, tid = self.core, plan.transfer_id
        self._collect()
        if tid in self.staged or core.ended.get(tid) is not None:
            core.stats["duplicate_transfer"] += 1
            log.warning("transfer %s of %s is already staged or ended (%s); not staged again",
                        tid, plan.req_id, core.ended.get(tid) or "staged")
            core.results.sent(plan.req_id)
            return
        st = _Staged(plan)
        try:
            self.staged.insert(tid, st, lease=core.config.lease_s)
        except BufferFull as exc:
            core.stats["staged_full"] += 1
            log.warning("transfer %s of %s not staged (%s): its blocks are freed and its decode "
                        "engine is told it is unknown", tid, plan.req_id, exc)
            core.ended.record(tid, f"not staged: {exc}")
            core.results.sent(plan.req_id)
            return
        self._arm()
        core.stats["staged"] += 1
        if core.config.checksum and not core.layout.groups and plan.block_ids:
            # While this rank's answer travels to D through the proxy: a claim of the whole
            # prompt by a decode rank of this rank's shape (the usual claim) finds its digests
            # made; any other claim (D holds a prefix, another TP) is digested when it comes.
            stream = mapping.side_descriptors([(core.layout, np.asarray(plan.block_ids,
                                                                        dtype=np.int64))])
            st.ahead = (xxh3_128(stream.tobytes()), digests.compute(stream))
        for ctx, claim in self._early.pop(tid, []):
            core.timers.cancel(("early", tid, ctx))
            reply = self.on_claim(ctx, claim)
            if reply is not None:
                core.server.reply(ctx, reply)

    def on_claim(self, ctx: RequestContext, msg: PullClaim) -> Message | None:
        core, tid = self.core, msg.transfer_id
        self._collect()
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
            if sum(len(v) for v in self._early.values()) >= _MAX_EARLY_CLAIMS:
                return Ack(ok=False, kind=ErrorKind.BUSY, error="too many early claims")
            # The claim overtook our own stage event (the answer reached D first): hold it.
            self._early.setdefault(tid, []).append((ctx, msg))
            core.timers.set(("early", tid, ctx), min(core.config.control_timeout_s, 5.0),
                            lambda: self._early_expired(tid, ctx))
            return None
        part = msg.part or ClaimPart(tp_size=core.tp_size, rank=core.rank,
                                     block_size=core.layout.block_size,
                                     first_token=msg.skip_blocks * core.layout.block_size)
        was, own = st.claimant(ctx.conn), st.claims.get(part.rank)
        if (was is not None and was != part.rank) or (own is not None and own.conn != ctx.conn):
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
        else:
            try:
                half = self._half(st, part, msg)
            except (LayoutError, LayoutMismatch) as exc:
                problem = f"cannot serve decode rank {part.rank}: {exc}"
        if problem is not None:
            core.stats["claim_refused"] += 1
            log.warning("refusing claim of %s: %s", tid, problem)
            return Ack(ok=False, kind=ErrorKind.MISMATCH, error=problem)
        claim = st.claims[part.rank] = _Claim(ctx.conn, half)
        self.staged.extend(tid, core.config.lease_s + core.config.transfer_timeout_s)
        core.stats["pull_claimed"] += 1
        if not core.config.checksum:
            return Ack()
        stream = mapping.side_descriptors(half)
        claim.digests = st.digested(stream)
        if claim.digests is not None:
            core.stats["pull_digested_ahead"] += 1
            return Ack()
        # Answer first: D posts its READ on the answer, and this rank digests its side while
        # the bytes move, so the DONE's answer carries digests ready made (off D's path).
        core.server.reply(ctx, Ack())
        claim.digests = digests.compute(stream)
        return None

    def _half(self, st: _Staged, part: ClaimPart, msg: PullClaim) -> Half:
        """This rank's side of the claiming decode rank's part; fixes who consumes ``st``."""
        core, bs = self.core, self.core.layout.block_size
        if st.decode_tp not in (None, part.tp_size):
            raise LayoutMismatch(f"the claim says tensor-parallel {part.tp_size}, an earlier "
                                 f"claim {st.decode_tp}")
        if part.rank >= part.tp_size:
            raise LayoutMismatch(f"rank {part.rank} outside tensor-parallel {part.tp_size}")
        if part.first_token // bs != msg.skip_blocks or part.first_token % part.block_size:
            raise LayoutError(f"first token {part.first_token} does not start at prefill block "
                              f"{msg.skip_blocks} on a decode block boundary")
        split = core.heads
        if split is not None:
            mapping.check_block_sizes(bs, part.block_size)
            split = split.like(part.tp_size, part.rank)
        reader = mapping.Shape(part.tp_size, part.rank, part.block_size, split)
        share, expected = mapping.serves(core.shape, reader)
        half = mapping.side(core.layout, core.shape, reader, share, msg.block_ids,
                            msg.skip_blocks, mapping.Span(part.first_token, msg.num_tokens))
        st.decode_tp, st.expected = part.tp_size, expected
        return half

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
        self._collect()
        st = self.staged.get(tid)
        if st is None:
            core.stats["late_done"] += 1
            why = core.ended.get(tid) or "never staged here"
            return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                       error=f"lease of {tid} ended before DONE ({why}); blocks may be reused")
        rank = st.claimant(ctx.conn)
        if rank is None:
            core.stats["forged_done"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"DONE for {tid} from a connection that did not claim it")
        claim = st.claims[rank]
        expected = mapping.side_bytes(claim.half)
        if msg.nbytes != expected:
            reply = Ack(ok=False, kind=ErrorKind.MISMATCH,
                        error=f"DONE reports {msg.nbytes} bytes, {expected} were leased")
            self._release(tid, f"failed: {reply.error}")
            return reply
        sums = claim.digests  # made when staged or claimed (this rank checks), else if D asks
        if sums is None and msg.want_digests:  # from this rank's KV, before the lease ends
            sums = digests.compute(mapping.side_descriptors(claim.half))
        served = PullServed(transfer_id=tid, digests=sums)
        claim.done = True
        if st.expected is not None and all(r in st.claims and st.claims[r].done
                                           for r in st.expected):
            core.stats["pull_served"] += 1
            self._release(tid, "done")
        return served

    def on_cancel(self, ctx: RequestContext, msg: Cancel) -> Message | None:
        """D gave up; None if this side does not hold the transfer."""
        self._collect()
        st = self.staged.get(msg.transfer_id)
        if st is None:
            return None
        if st.claimant(ctx.conn) is None and not st.open():
            self.core.stats["forged_cancel"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"transfer {msg.transfer_id} is claimed by another connection")
        self.core.stats["pull_cancelled"] += 1
        self._release(msg.transfer_id, f"cancelled by decode: {msg.reason}")
        return CancelReply(safe=True)

    def renew(self, ctx: RequestContext, tid: str) -> bool:
        self._collect()
        st = self.staged.get(tid)
        if st is None or (st.claimant(ctx.conn) is None and not st.open()):
            return False
        cfg = self.core.config
        return self.staged.extend(tid, cfg.lease_s + (cfg.transfer_timeout_s if st.claims else 0))

    def _expired(self, tid: str, st: _Staged) -> None:
        """``tid``'s lease ended (already out of the buffer): free its blocks."""
        self.core.count("lease_expired", "pull")
        waiting = sorted(set(st.expected or ()) - {r for r, c in st.claims.items() if c.done})
        log.warning("lease of %s (%s) expired before decode %s; %d blocks released", tid,
                    st.plan.req_id, f"rank(s) {waiting} finished reading" if st.claims
                    else "claimed it", len(st.plan.block_ids))
        self._ended(tid, st, "lease expired")

    def _release(self, tid: str, why: str) -> None:
        st = self.staged.discard(tid)
        if st is not None:
            self._ended(tid, st, why)

    def _ended(self, tid: str, st: _Staged, why: str) -> None:
        self.core.ended.record(tid, why)
        self.core.results.sent(st.plan.req_id)

    def held(self) -> list[_Staged]:
        """Everything staged, ended leases not yet collected included (for a loop that died)."""
        return [st for _, st in self.staged.held()]

    def close(self) -> None:
        for tid, _ in self.staged.held():
            self._release(tid, "engine shutting down")


@dataclass
class _Pull(Part[PullSpec]):
    """A part of a pull: what this rank reads from one prefill rank (``failure``: see Part)."""

    subs: list[mapping.SubTransfer] = field(default_factory=list)
    handle: TransferHandle | None = None
    prepared: PreparedRequest | None = None  # the READ built while the claim is in flight
    reading: bool = False  # the READ is posted and has not stopped
    landed: bytes | None = None  # digests of what the READ landed, when they are checked


class PullSink(Receiver[_Pull]):
    """D side of pulls (see the module docstring). ``jobs``: transfer id → its parts."""

    kind = "pull"

    def start(self, spec: PullSpec) -> None:
        # Handshake and claim are bounded by their calls; the hand-off timer bounds the whole.
        self._open(spec, lambda src, box: _Pull(spec, src, box), "already running",
                   self._stalled)

    def _handshaken(self, job: _Pull, result: Peer | KVBridgeError) -> None:
        if not self._live(job):
            return
        if isinstance(result, KVBridgeError):
            self._fail(job, f"cannot reach prefill {job.address}: {result}")
            return
        job.peer = result
        s, core = job.spec, self.core
        remote_skip = s.skip_blocks if s.remote_skip is None else s.remote_skip
        first = s.skip_blocks * core.layout.block_size
        try:
            job.subs = self._plan(job, result, remote_skip, first)
        except KVBridgeError as exc:
            self._fail(job, f"cannot map the KV of prefill {job.address}: {exc}")
            return
        claim = PullClaim(transfer_id=s.transfer_id, generation=result.info.generation,
                          skip_blocks=remote_skip, block_ids=list(s.remote_ids),
                          num_tokens=s.num_tokens, prompt_digest=s.prompt_digest,
                          part=ClaimPart(tp_size=core.tp_size, rank=core.rank,
                                         block_size=core.layout.block_size, first_token=first))
        self._expect(job, core.config.stall_s, f"prefill {job.address} did not answer the claim")
        core.rpc.call(job.address, claim, core.config.control_timeout_s,
                      lambda reply: self._claimed(job, reply))
        if self._live(job):  # else the claim failed at once (its callback ran inside call)
            self._prepare(job, result)  # while the claim is in flight

    def _prepare(self, job: _Pull, peer: Peer) -> None:
        """Build the part's READ ahead (:func:`~kvbridge.blocks.prepare_parts`), so that an
        accepted claim only posts it; where the transport cannot (or the part is several
        sub-transfers), or building fails, :meth:`_claimed` submits as before and reports."""
        try:
            job.prepared = prepare_parts(self.core.transport, Op.READ, peer.name,
                                         mapping.parts(job.subs))
        except KVBridgeError as exc:
            log.debug("pull %s: READ not prepared ahead: %s", job.tid, exc)
        if job.prepared is not None and job.prepared.takes_landing() and (
                self.core.config.checksum or peer.info.checksum):
            job.prepared.landing = digests.landing(mapping.side_descriptors(
                [(x.local, x.local_ids) for x in job.subs]))  # digested as the READ lands

    @staticmethod
    def _discard(job: _Pull) -> None:
        if job.prepared is not None:
            job.prepared.discard()
            job.prepared = None

    def _plan(self, job: _Pull, peer: Peer, remote_skip: int,
              first: int) -> list[mapping.SubTransfer]:
        """The sub-transfers of this part, after checking the peer is the rank expected."""
        core, s = self.core, job.spec
        theirs = check_source(core, job.source, peer)
        share = mapping.reads(core.shape, theirs)
        return mapping.pair(core.layout, core.shape, s.local_ids, s.skip_blocks, peer.layout,
                            theirs, s.remote_ids, remote_skip, share,
                            mapping.Span(first, s.num_tokens))

    def _claimed(self, job: _Pull, reply: Message | KVBridgeError) -> bool:
        if not self._live(job):
            return False
        if not (isinstance(reply, Ack) and reply.ok):
            self.core.stats["claim_refused"] += 1
            if isinstance(reply, Ack):
                self._fail(job, f"prefill refused the claim: {reply.error}", cancel=False)
            else:  # no answer: P may still take the claim when it reads it, so say we gave up
                self._fail(job, f"prefill did not answer the claim: {reply}"
                           if isinstance(reply, KVBridgeError) else
                           f"prefill answered the claim with {type(reply).__name__}")
            return False
        assert job.peer is not None
        core, s = self.core, job.spec
        prep, job.prepared = job.prepared, None
        try:
            job.handle = (prep.post() if prep is not None else
                          submit_parts(core.transport, Op.READ, job.peer.name,
                                       mapping.parts(job.subs)))
        except KVBridgeError as exc:
            self._fail(job, f"cannot post the READ: {exc}")
            return False
        job.reading = True
        core.mark(s.transfer_id, "read_posted")
        if all(j.handle is not None for j in self.jobs.get(s.transfer_id, ())):
            core.timers.cancel(("pull", s.transfer_id))
        core.watch_handle(job.handle)
        core.timers.set(("read", s.transfer_id, job.address), core.config.transfer_timeout_s,
                        lambda: self._timed_out(job))
        bound = core.config.stall_s + job.handle.nbytes / STALL_READ_RATE
        if bound < core.config.transfer_timeout_s:
            self._expect(job, bound, f"the READ of {job.handle.nbytes} bytes from prefill "
                                     f"{job.address} did not finish")
        else:
            self._progressed(job)
        return False

    def poll(self) -> None:
        """Complete the READs that stopped (called by the loop while any is in flight)."""
        for job in self.parts():
            handle = job.handle
            if handle is None or not job.reading:
                continue
            state = self.core.transport.poll(handle)
            if state is HandleState.PENDING:
                continue
            job.reading = False
            self.core.timers.cancel(("read", job.tid, job.address))
            self._progressed(job)
            self._observe(job, handle, state)
            if job.failure is not None:  # already failed (timeout, abort): blocks now safe
                self._forget(job)
                job.box.release(job.spec.req_id)
            elif state is HandleState.FAILED:
                self._fail(job, f"READ failed: {handle.error or 'transport error'}")
            else:
                self._read_done(job)

    def in_flight(self) -> bool:
        return any(j.reading for j in self.parts())

    def _observe(self, job: _Pull, handle: TransferHandle, state: HandleState) -> None:
        if job.peer is None:
            return
        wire = (handle.finished or time.perf_counter()) - handle.started
        self.core.observe.transfer("pull", job.peer.info.engine_id, state is HandleState.DONE,
                                   wire, handle.nbytes, handle.count,
                                   self.core.backend_of(job.peer.name))

    def _read_done(self, job: _Pull) -> None:
        core, s = self.core, job.spec
        half = [(x.local, x.local_ids) for x in job.subs]
        nbytes = mapping.side_bytes(half)
        assert job.peer is not None
        want = nbytes > 0 and (core.config.checksum or job.peer.info.checksum)
        done = PullDone(transfer_id=s.transfer_id, nbytes=nbytes, want_digests=want)
        core.rpc.call(job.address, done, core.config.control_timeout_s,
                      lambda reply: self._confirmed(job, reply, nbytes))
        landed = job.handle.landed if want and job.handle is not None else None
        core.stats["pull_digested_landing"] += landed is not None  # as the READ landed (shm)
        if want:  # else now, while the DONE flies and P digests its side
            job.landed = landed or digests.compute(mapping.side_descriptors(half))

    def _confirmed(self, job: _Pull, reply: Message | KVBridgeError, nbytes: int) -> bool:
        if not self._live(job):
            return False
        if isinstance(reply, PullServed) and job.landed is not None and (
                reply.digests != job.landed):
            self.core.count("checksum_mismatch", "pull", job.peer)
            self._fail(job, "the pulled KV is not what prefill computed: " + (
                digests.mismatch(reply.digests, mapping.side_descriptors(
                    [(x.local, x.local_ids) for x in job.subs])) or "digests differ"),
                cancel=False)
            return False
        if isinstance(reply, PullServed):
            self._forget(job)
            self.core.stats["pull_bytes"] += nbytes
            if job.peer is not None:
                self.core.observe.handoff("pull", job.peer.info.engine_id,
                                          time.perf_counter() - job.started,
                                          self.core.backend_of(job.peer.name))
            job.box.received(job.spec.req_id, job.tid)
            return False
        why = reply.error if isinstance(reply, Ack) else f"no confirmation: {reply}"
        self._fail(job, f"prefill did not confirm the read: {why}", cancel=False)
        return False

    def _stalled(self, tid: str) -> None:
        for job in list(self.jobs.get(tid, ())):
            if self._live(job) and job.handle is None:
                self._fail(job, f"no READ posted within {self.core.config.push_timeout_s} s")

    def _stalled_part(self, part: _Pull, why: str) -> None:
        self._fail(part, why)

    def _timed_out(self, job: _Pull) -> None:
        if self._live(job):
            self.core.count("transfer_timeout", "pull", job.peer)
            self._fail(job, f"READ did not finish within {self.core.config.transfer_timeout_s} s")

    def cancel(self, tid: str, reason: str) -> bool:
        """The request ended on D (or a part failed): give up every running part; False if none."""
        parts = self.jobs.get(tid)
        if parts is None:
            return False
        for job in list(parts):
            if self._live(job):
                self._fail(job, reason)
        return True

    def peer_gone(self, address: str, why: str) -> None:
        for job in self.parts():
            if job.address == address and self._live(job):
                self._fail(job, f"prefill {address} is gone: {why}", cancel=False)

    def transfers_unknown(self, address: str, tids: list[str]) -> None:
        for tid in tids:
            for job in list(self.jobs.get(tid, ())):
                if job.address == address and self._live(job) and job.handle is not None:
                    self._fail(job, "prefill no longer holds this transfer (lease expired?)",
                               cancel=False)

    def _fail(self, job: _Pull, why: str, *, cancel: bool = True) -> None:
        core, s = self.core, job.spec
        if cancel:
            core.cancel_remote(job.address, s.transfer_id, why)
        self._discard(job)
        self._progressed(job)
        core.heartbeats.unwatch(s.transfer_id, job.address)  # D wants nothing more of P
        reading = job.reading
        job.failure = why
        core.count("recv_failed", "pull", job.peer, stats=False)  # results.fail counts it
        if not reading:
            self._forget(job)
        job.box.fail(s.req_id, s.local_ids, why, safe=not reading, transfer_id=s.transfer_id)

    def _forget(self, job: _Pull) -> None:
        self._discard(job)
        self._drop(job)
        self.core.timers.cancel(("read", job.tid, job.address))

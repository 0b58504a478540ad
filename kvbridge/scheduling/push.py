"""Push: P writes the KV into blocks D registered. This module is P's half (and the shared
types); D's half is :mod:`kvbridge.scheduling.push_wait`. Both run on the transfer loop's thread.

The protocol (every step is serialised by the loop that owns the transfer, so "cancel" and
"post" cannot race):

1. D → P ``PushRegister`` on D's own connection to the address it dialled. P answers at once
   (``Ack``: registered, or refused with a reason) and keeps the request open: the *final*
   answer, ``PushResult``, comes on the same request when every WRITE has stopped. D trusts
   that answer because it arrives on the connection D opened to the engine it handshook.
2. P dials the control address D registered (handshaking it if needed, identity checked) and
   asks ``PushConfirm``: D answers ok only for a registration it made and has not cancelled.
   Only then may P write, and from then on D keeps its blocks until the ``PushResult``
   arrives or P is proven gone (new generation, connection refused, or silent for a lease).
3. When P's KV is ready (after the forward, or per layer; on a GPU, once its fence says the
   kernels finished) and D confirmed, P posts the WRITEs. A whole-request push is *prepared*
   earlier, while the forward that writes the KV runs (:meth:`PushSource.prepare`, as soon as
   both the plan and D's confirmation are known): ids validated, the transport's request built
   (:func:`~kvbridge.blocks.prepare_parts`), so that readiness only posts it.
   A prepared WRITE that is not posted is discarded with its registration. P digests its KV as
   the prepared WRITE's copy reads it (shm: :func:`~kvbridge.scheduling.digests.landing`, D
   hashing behind it: :mod:`~kvbridge.scheduling.follow`), else while the last WRITE moves it;
   where the transport copied inside the post (every WRITE DONE when it returned, as NIXL over
   UCX's cross-memory attach) and D asked (``check_early``), P first answers ``PushLanded`` on
   the same request, so that D digests what landed while P digests what it sent.

A Cancel from D before anything is posted is answered ``safe``; after, ``not safe`` and the
``PushResult`` follows when the WRITEs stopped. One that P cannot serve (prefill aborted, never
ready, mismatch) is failed at once.

Fair limits: registrations held per decode control address, per connection and in all are
bounded (:mod:`kvbridge.scheduling.push_limits`); a refusal is an ``Ack`` of kind ``BUSY``.

Heterogeneous TP: every decode rank that reads heads from this rank
(:func:`~kvbridge.scheduling.mapping.consumers`, known from the first registering rank's
handshake) registers on its own connection, and is confirmed and written separately; P keeps
its blocks until each of them ended, and the failure of any (a Cancel, a failed WRITE, a rank
that never registers within the lease) fails the push for all. Equal TP: one registration, from
the decode rank of the same rank.

A registration P cannot serve on its own account — its prompt or blocks differ from P's, its
control address does not answer as the engine it names, that engine does not confirm it, or
its decode rank is already served — is refused alone (``register_refused``): the push goes on
with the rightful registrations (or ends with the lease). Which decode ranks a push serves is
fixed by the first *confirmed* registration, so a stranger that read a live ``transfer_id``
cannot end the push nor take its place (as a pull refuses a forged claim alone).
"""

from __future__ import annotations

import functools
import logging
import time

from kvbridge.blocks import PreparedRequest, prepare_parts, submit_parts
from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError, LayoutError, LayoutMismatch
from kvbridge.lookup import BufferFull, LookupBuffer
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
from kvbridge.params import MAX_TP
from kvbridge.scheduling import digests, mapping, push_map
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.peers import ANY_GENERATION, Peer
from kvbridge.scheduling.push_limits import RegistrationLimits
from kvbridge.scheduling.push_state import Out, Stage, Target, push_table
from kvbridge.scheduling.specs import SendPlan
from kvbridge.transport import HandleState, Op

__all__ = ["PushSource"]

log = logging.getLogger("kvbridge.push")


class PushSource:
    """P side of pushes (see the module docstring)."""

    def __init__(self, core: LoopContext) -> None:
        self.core = core
        self.outs: LookupBuffer[str, Out] = push_table(clock=core.timers.clock)
        self.limits = RegistrationLimits(core.config.max_pending_per_peer, core.config.max_pending)
        self._announced: dict[str, None] = {}  # bounded, oldest first

    def __len__(self) -> int:
        return len(self.outs)

    def held(self) -> dict[str, int]:
        """Registrations held now: ``{"total": n, "peers": control addresses holding some,
        "connections": connections holding some}`` (what the fair limits count)."""
        return self.limits.held()

    def fenced(self) -> bool:
        """Some push waits for a device fence nobody waits on (the loop keeps polling while
        so; fences the loop's :class:`~kvbridge.scheduling.fences.FenceWaiter` holds are not
        polled)."""
        owns = self.core.fences.owns
        return any(any(f is not None and not owns(f) for _, f in o.fences)
                   for o in self.outs.values())

    # -- events from the connector ------------------------------------------------------------

    def prepare(self, plan: SendPlan) -> None:
        """P: the forward now running writes ``plan``'s KV (whole-request push): build its
        WRITE for every decode rank that confirmed, so that :meth:`ready` only posts it. Best
        effort: what cannot be built now is built at :meth:`ready`, which follows."""
        if plan.layerwise or self.core.ended.get(plan.transfer_id) is not None:
            return
        out = self._with_plan(plan)
        if out is None:
            return
        for t in list(out.targets):
            self._prepare(out, t)

    def _with_plan(self, plan: SendPlan) -> Out | None:
        """The push of ``plan`` knowing its plan (a registration that does not match it is
        refused alone); None, and the transfer ended, if the push table is full."""
        out = self.outs.get(plan.transfer_id)
        if out is None:
            try:
                self.outs.insert(plan.transfer_id, out := Out(plan.transfer_id))
            except BufferFull as exc:  # the transfer ends here: ready() frees its blocks
                self.core.stats["push_table_full"] += 1
                log.warning("push %s of %s not served: %s", plan.transfer_id, plan.req_id, exc)
                self.core.ended.record(plan.transfer_id, f"not pushed: {exc}")
                return None
        if out.plan is None:
            out.plan = plan
            for t in list(out.targets):
                problem = push_map.mismatch(self.core, out, t)
                if problem is not None:
                    self._refuse(out, t, problem)
        return out

    def ready(self, plan: SendPlan, fence: Fence | None, layer: str | None = None) -> None:
        """P's KV of ``plan`` is written (``layer``: only that layer's, layer-wise push)."""
        core, tid = self.core, plan.transfer_id
        if layer is None:
            core.mark(tid, "ready_seen")
        out = None if core.ended.get(tid) is not None else self._with_plan(plan)
        if out is None:  # ended, or the push table is full
            if layer is None:
                core.results.sent(plan.req_id)
            return
        if layer is None:
            out.final = True
        planes = (list(range(len(core.layout.planes))) if layer is None
                  else core.layout.plane_indices(layer))
        out.fences.append((planes, fence))
        if fence is not None:
            core.fence_pending(fence)
        if layer is None and not out.complete():
            core.timers.set(("ready", tid), core.config.lease_s, lambda: self._unclaimed(tid))
        self._advance(out)

    def announce(self, tid: str) -> None:
        """The prefill request of ``tid`` arrived: its registration may wait the full time."""
        self._announced[tid] = None
        while len(self._announced) > self.core.config.max_pending * 4:
            self._announced.pop(next(iter(self._announced)))
        out = self.outs.get(tid)
        if out is not None and out.targets and not out.final:
            self.core.timers.set(("register", tid), self.core.config.push_timeout_s,
                                 lambda: self._never_ready(tid))

    def cancel_send(self, tid: str, reason: str) -> None:
        """P's request ended before its KV was handed over."""
        self.core.ended.record(tid, reason)
        out = self.outs.get(tid)
        if out is not None and not any(t.handles for t in out.targets):
            self._fail(out, reason)

    # -- control messages ------------------------------------------------------------------

    def on_register(self, ctx: RequestContext, msg: PushRegister) -> Message | None:
        core, tid, cfg = self.core, msg.transfer_id, self.core.config
        if msg.generation not in (ANY_GENERATION, core.generation):
            return Ack(ok=False, kind=ErrorKind.STALE_GENERATION,
                       error=f"this engine is generation {core.generation}; the registration "
                             f"names {msg.generation} (it restarted)")
        why = core.ended.get(tid)
        if why is not None:
            return Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER,
                       error=f"transfer {tid} already ended: {why}")
        out = self.outs.get(tid)
        if out is not None and (any(t.ctx.conn == ctx.conn for t in out.targets)
                                or out.complete() or len(out.targets) >= MAX_TP):
            core.stats["forged_register"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN, error=f"{tid} is already registered")
        if core.holds_pull(tid):
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error=f"this prefill engine holds {tid} for a pull, not a push")
        if core.heads is None and msg.layout_fingerprint != core.info.layout_fingerprint:
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error="decode's KV layout differs from this engine's")
        busy = self.limits.refusal(ctx.conn, msg.control_address)
        if busy is not None:
            core.stats["register_refused_busy"] += 1
            return Ack(ok=False, kind=ErrorKind.BUSY, error=busy)
        if out is None:
            try:
                self.outs.insert(tid, out := Out(tid))
            except BufferFull as exc:
                core.stats["register_refused_busy"] += 1
                return Ack(ok=False, kind=ErrorKind.BUSY, error=str(exc))
        t = Target(msg, ctx)
        out.targets.append(t)
        self.limits.take(ctx.conn, msg.control_address)  # given back by _end, once
        wait = cfg.push_timeout_s if tid in self._announced else min(cfg.push_timeout_s,
                                                                     cfg.prefill_wait_s)
        core.timers.set(("register", tid), wait, lambda: self._never_ready(tid))
        core.stats["push_registrations"] += 1
        problem = push_map.mismatch(self.core, out, t)
        if problem is not None:
            self._refuse(out, t, problem, answer=False)
            return Ack(ok=False, kind=ErrorKind.MISMATCH, error=problem)
        core.server.reply(ctx, Ack())
        core.peers.ensure(msg.control_address, msg.sender_generation,
                          functools.partial(self._dialled, out, t))
        return None

    def on_cancel(self, ctx: RequestContext, msg: Cancel) -> Message | None:
        out = self.outs.get(msg.transfer_id)
        if out is None:
            return None
        mine = next((t for t in out.targets if t.ctx.conn == ctx.conn), None)
        if mine is None and out.targets and out.complete():
            self.core.stats["forged_cancel"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"{msg.transfer_id} was registered by another connection")
        self.core.stats["push_cancelled"] += 1
        reason = f"cancelled by decode: {msg.reason}"
        self.core.ended.record(msg.transfer_id, reason)
        safe = mine is None or not mine.handles
        self._fail(out, reason, silent=mine if safe else None)
        return CancelReply(safe=safe)

    def renew(self, tid: str) -> bool:
        out = self.outs.get(tid)
        if out is None:
            return False
        if ("ready", tid) in self.core.timers:
            self.core.timers.set(("ready", tid), self.core.config.lease_s,
                                 lambda: self._unclaimed(tid))
        return True

    # -- the state machine -------------------------------------------------------------------

    def _live(self, out: Out, t: Target) -> bool:
        return self.outs.get(out.tid) is out and t in out.targets

    def _dialled(self, out: Out, t: Target, result: Peer | KVBridgeError) -> None:
        if not self._live(out, t) or t.stage is not Stage.CONFIRMING:
            return
        if isinstance(result, KVBridgeError):
            self._refuse(out, t, f"cannot reach the registering decode engine: {result}")
            return
        if result.info.engine_id != t.reg.engine_id:
            self.core.stats["forged_register"] += 1
            self._refuse(out, t, f"{t.reg.control_address} is engine {result.info.engine_id}, "
                                 f"not {t.reg.engine_id}")
            return
        t.peer = result
        try:
            self._map(out, t, result)
        except (LayoutError, LayoutMismatch) as exc:
            self._refuse(out, t, f"cannot write decode rank {result.info.rank}: {exc}")
            return
        problem = push_map.mismatch(self.core, out, t)
        if problem is not None:
            self._refuse(out, t, problem)
            return
        confirm = PushConfirm(transfer_id=out.tid, generation=t.reg.sender_generation,
                              block_ids=list(t.reg.block_ids), rank=self.core.rank)
        self.core.rpc.call(result.address, confirm, self.core.config.control_timeout_s,
                           lambda reply: self._confirmed(out, t, reply))

    def _map(self, out: Out, t: Target, peer: Peer) -> None:
        """Which decode rank registered, and which of this rank's heads it gets (the push's
        decode ranks are fixed when it is confirmed: :meth:`_taken`)."""
        info = peer.info
        if t.reg.layout_fingerprint != info.layout_fingerprint:
            raise LayoutMismatch("the registration's layout is not the registering engine's")
        shape = mapping.Shape(info.tp_size, info.rank, peer.layout.block_size, info.heads)
        t.shape = shape
        problem = self._taken(out, t)
        if problem is not None:
            raise LayoutMismatch(problem)
        t.share, t.expected = mapping.serves(self.core.shape, shape)

    @staticmethod
    def _taken(out: Out, t: Target) -> str | None:
        """Why ``t``'s decode rank cannot join the ranks confirmed so far, or None."""
        assert t.shape is not None
        if t.shape.rank in out.registered():
            return f"decode rank {t.shape.rank} already registered {out.tid}"
        if out.decode_tp not in (None, t.shape.tp_size):
            return (f"decode runs tensor-parallel {t.shape.tp_size}, an earlier rank "
                    f"registered with {out.decode_tp}")
        return None

    def _confirmed(self, out: Out, t: Target, reply: Message | KVBridgeError) -> bool:
        if not self._live(out, t) or t.stage is not Stage.CONFIRMING:
            return False
        if not (isinstance(reply, Ack) and reply.ok):
            why = reply.error if isinstance(reply, Ack) else str(reply)
            self.core.stats["confirm_refused"] += 1
            self._refuse(out, t, f"decode did not confirm the registration: {why}")
            return False
        taken = self._taken(out, t)  # another registration of that rank was confirmed first
        if taken is not None:
            self._refuse(out, t, taken)
            return False
        assert t.shape is not None
        t.stage = Stage.CONFIRMED
        out.decode_tp, out.expected = t.shape.tp_size, t.expected
        if out.complete():
            self.core.timers.cancel(("ready", out.tid))
        if not out.final:  # the KV is still being written: build the WRITE meanwhile
            self._prepare(out, t)
        self._advance(out)
        return False

    def _advance(self, out: Out) -> None:
        """Post every WRITE whose KV is ready and fence passed, to each decode rank that
        confirmed."""
        if out.plan is None:
            return
        still: list[tuple[list[int], Fence | None]] = []
        for planes, fence in out.fences:
            if fence is not None and not fence.ready():
                still.append((planes, fence))
            else:
                out.ready.append(planes)
        out.fences = still
        for t in list(out.targets):
            if t.stage is Stage.CONFIRMED and out.error is None and t.error is None:
                self._post(out, t)
            self.poll_one(out, t)

    def _prepare(self, out: Out, t: Target, posting: bool = False) -> None:
        """Build ``t``'s whole-request WRITE ahead (:meth:`prepare`) where the transport can and
        the mapping is one sub-transfer; ``posting``: at the post, only where its copy digests."""
        if (out.plan is None or out.plan.layerwise or out.error is not None
                or t.stage is not Stage.CONFIRMED or t.error is not None or t.posted
                or t.prepared is not None or not t.reg.block_ids or t.peer is None):
            return
        checked = self.core.config.checksum or t.peer.info.checksum
        if posting and not (checked and self.core.transport.capabilities.copies_landing):
            return
        if checked:
            t.stream = push_map.side(self.core, out, t)
        try:
            t.prepared = prepare_parts(self.core.transport, Op.WRITE, t.peer.name, mapping.parts(
                push_map.subs(self.core, out, t, list(range(len(self.core.layout.planes))))))
        except KVBridgeError as exc:  # _post builds it again and reports the problem
            log.debug("push %s: WRITE not prepared ahead: %s", out.tid, exc)
        if t.prepared is not None and t.stream is not None and t.prepared.takes_landing():
            t.prepared.landing = digests.landing(t.stream, source=True)  # hashed as it is read
            t.prepared.progress = t.reg.progress or 0  # and D hashes behind it (follow.py)

    def _discard(self, t: Target) -> None:
        if t.prepared is not None:
            t.prepared.discard()
            t.prepared = None

    def _post(self, out: Out, t: Target) -> None:
        core = self.core
        assert out.plan is not None and t.peer is not None and t.shape is not None
        prep: PreparedRequest | None = None
        self._prepare(out, t, posting=True)  # not built ahead: now, so its copy digests
        for group in out.ready:
            todo = [i for i in group if i not in t.posted]
            if not todo or not t.reg.block_ids:
                continue
            t.posted.update(todo)
            prep, t.prepared = t.prepared, None
            if prep is not None and len(todo) != len(core.layout.planes):
                prep.discard()  # built for every plane, and only some are ready
                prep = None
            posted_at = time.monotonic_ns()  # before the post: a transport may copy inside it
            try:
                if prep is not None:
                    handle = prep.post()
                else:
                    handle = submit_parts(core.transport, Op.WRITE, t.peer.name,
                                          mapping.parts(push_map.subs(self.core, out, t, todo)))
            except KVBridgeError as exc:
                t.error = f"cannot post the WRITE: {exc}"
                return
            core.watch_handle(handle)
            t.handles.append(handle)
            t.nbytes += handle.nbytes
            core.mark(out.tid, "write_posted", mono_ns=posted_at)
            if len(t.handles) == 1:
                core.timers.set(("write", out.tid, id(t)), core.config.transfer_timeout_s,
                                lambda: self._write_timeout(out, t))
        if (t.digests is None and len(t.posted) == len(core.layout.planes) and not (
                prep and prep.landing) and (core.config.checksum or t.peer.info.checksum)):
            if t.reg.check_early and all(h.state is HandleState.DONE for h in t.handles):
                # copied inside the post (NIXL over UCX's cross-memory attach): D digests what
                # landed while this rank digests what it sent (the result still decides)
                core.server.reply(t.ctx, PushLanded(transfer_id=out.tid, nbytes=t.nbytes))
            t.digests = digests.compute(push_map.side(core, out, t) if t.stream is None
                                        else t.stream)

    def poll(self) -> None:
        for out in list(self.outs.values()):
            if out.fences:
                self._advance(out)
            else:
                for t in list(out.targets):
                    if t.handles:
                        self.poll_one(out, t)

    def poll_one(self, out: Out, t: Target) -> None:
        if not self._live(out, t):
            return
        for handle in t.handles:
            if self.core.transport.poll(handle) is HandleState.PENDING:
                return
        for handle in t.handles:
            if handle.state is HandleState.FAILED and t.error is None:
                t.error = f"WRITE failed: {handle.error or 'transport error'}"
        error = t.error or out.error
        if error is None and not (out.final and not out.fences):
            return  # more layers to come
        if error is None and t.stage is not Stage.CONFIRMED:
            return
        self._end(out, t, error)
        if error is not None:
            self._fail(out, error)

    def _write_timeout(self, out: Out, t: Target) -> None:
        if self._live(out, t) and t.handles:
            t.error = t.error or (f"WRITE did not finish within "
                                  f"{self.core.config.transfer_timeout_s} s")
            self.core.count("transfer_timeout", "push", t.peer)
            log.warning("push %s: %s (waiting for it to stop before answering)", out.tid, t.error)

    def _unclaimed(self, tid: str) -> None:
        out = self.outs.get(tid)
        if out is None or out.complete():
            return
        missing = sorted(set(out.expected or ()) - out.registered())
        self.core.count("lease_expired", "push", out.targets[0].peer if out.targets else None)
        if not out.targets:
            log.warning("push %s: no decode registered within the lease; blocks released", tid)
        self._fail(out, "lease expired (decode never registered)" if not out.targets and
                   not out.served else f"lease expired (decode rank(s) {missing} never "
                   "registered)")

    def _never_ready(self, tid: str) -> None:
        out = self.outs.get(tid)
        if out is not None and not out.final and not any(t.handles for t in out.targets):
            self.core.stats["registration_expired"] += 1
            self._fail(out, "prefill never became ready" if tid in self._announced
                       else "this prefill engine never received the request's prefill leg")

    def _refuse(self, out: Out, t: Target, why: str, *, answer: bool = True) -> None:
        """One registration failed on its own account (see the module docstring): end it
        alone, before anything was written for it (``answer``: send it a failed
        ``PushResult``; False: the caller answers)."""
        if not self._live(out, t):
            return
        out.targets.remove(t)
        self._discard(t)
        self.limits.give_back(t.ctx.conn, t.reg.control_address)  # t left out.targets
        self.core.stats["register_refused"] += 1
        log.warning("push %s: registration by %s refused: %s", out.tid, t.reg.control_address, why)
        if answer:
            self.core.server.reply(t.ctx, PushResult(transfer_id=out.tid, ok=False, nbytes=0,
                                                     error=why))
        self._close(out)  # the rightful pushes may all have ended meanwhile

    def _fail(self, out: Out, error: str, *, silent: Target | None = None) -> None:
        """The push of ``out`` failed for every decode rank: each registration is answered
        once its WRITEs stopped (``silent``: one that needs no answer)."""
        if self.outs.get(out.tid) is not out:
            return
        out.error = out.error or error
        for t in list(out.targets):
            if not t.handles or all(h.state.terminal for h in t.handles):
                self._end(out, t, out.error, answer=t is not silent)
        self._close(out)

    def _end(self, out: Out, t: Target, error: str | None, *, answer: bool = True) -> None:
        """End one decode rank's push: every handle of it has stopped (or none was posted)."""
        core = self.core
        if t not in out.targets:
            return
        out.targets.remove(t)
        self._discard(t)
        core.timers.cancel(("write", out.tid, id(t)))
        self.limits.give_back(t.ctx.conn, t.reg.control_address)  # t left out.targets
        if t.shape is not None:
            out.served.add(t.shape.rank)
        if t.handles and t.peer is not None:
            wire = (max(h.finished or h.started for h in t.handles)
                    - min(h.started for h in t.handles))
            core.observe.transfer("push", t.peer.info.engine_id, error is None, wire,
                                  t.nbytes, sum(h.count for h in t.handles),
                                  core.backend_of(t.peer.name))
        if error is None:
            core.mark(out.tid, "write_done")
            core.stats["push_sent"] += 1
            core.stats["push_bytes"] += t.nbytes
            if len(t.handles) > 1:
                core.stats["push_layerwise"] += 1
        else:
            core.count("push_failed", "push", t.peer)
            log.warning("push %s failed: %s", out.tid, error)
        if error is None and t.digests is None and t.stream is not None:  # (see _prepare)
            t.digests = t.handles[-1].landed or digests.compute(t.stream)
        if answer:
            core.server.reply(t.ctx, PushResult(
                transfer_id=out.tid, ok=error is None, nbytes=t.nbytes, error=error,
                digests=t.digests if error is None else None))
        if error is None:
            self._close(out)

    def _close(self, out: Out) -> None:
        """End the transfer once no decode rank's push is left to serve."""
        core = self.core
        if self.outs.get(out.tid) is not out or out.targets:
            return
        if out.error is None and not (out.final and out.complete()):
            return
        self.outs.discard(out.tid)
        self._announced.pop(out.tid, None)
        for key in ("ready", "register"):
            core.timers.cancel((key, out.tid))
        core.ended.record(out.tid, "done" if out.error is None else f"failed: {out.error}")
        if out.plan is not None and out.final:
            core.results.sent(out.plan.req_id)

    def close(self) -> None:
        for out in list(self.outs.values()):
            if not any(t.handles for t in out.targets):
                self._fail(out, "engine shutting down")

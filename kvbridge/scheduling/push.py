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
   kernels finished) and D confirmed, P posts the WRITEs; when all have stopped it sends the
   ``PushResult`` with the byte count (and a checksum when either side asks for one), which D
   checks against what it expected.

A Cancel from D before anything is posted is answered ``safe``; after, ``not safe`` and the
``PushResult`` follows when the WRITEs stopped. Registrations are bounded per connection and in
total; one that P cannot serve (prefill aborted, never ready, mismatch) is failed at once.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbridge.control import RequestContext
from kvbridge.errors import KVBridgeError
from kvbridge.layout import descriptor_pair
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
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.peers import ANY_GENERATION, Peer
from kvbridge.scheduling.pull import SendPlan
from kvbridge.transport import HandleState, Op, TransferHandle

if TYPE_CHECKING:
    from kvbridge.scheduling.loop import TransferLoop

__all__ = ["Fence", "PushSpec", "PushSource"]

log = logging.getLogger("kvbridge.push")


@dataclass(frozen=True)
class PushSpec:
    """D: ask the engine at ``peer_address`` to write the prompt's blocks from ``skip_blocks``
    on into ``local_ids``."""

    req_id: str
    transfer_id: str
    peer_address: str
    local_ids: tuple[int, ...]
    skip_blocks: int = 0
    num_tokens: int = 0
    prompt_digest: str = ""
    peer_generation: str = ANY_GENERATION


class _Stage(enum.Enum):
    WAITING = "waiting"  # for the registration, the KV, or D's confirmation
    CONFIRMING = "confirming"
    CONFIRMED = "confirmed"
    ENDED = "ended"


@dataclass
class _Out:
    tid: str
    plan: SendPlan | None = None
    final: bool = False  # the whole prompt's KV is written
    fences: list[tuple[list[int], Fence | None]] = field(default_factory=list)
    reg: PushRegister | None = None
    ctx: RequestContext | None = None
    peer: Peer | None = None
    stage: _Stage = _Stage.WAITING
    posted: set[int] = field(default_factory=set)
    handles: list[TransferHandle] = field(default_factory=list)
    nbytes: int = 0
    error: str | None = None


class PushSource:
    """P side of pushes (see the module docstring)."""

    def __init__(self, core: TransferLoop) -> None:
        self.core = core
        self.outs: dict[str, _Out] = {}
        self._regs_by_conn: dict[bytes, int] = {}
        self._announced: dict[str, None] = {}  # bounded, oldest first

    def __len__(self) -> int:
        return len(self.outs)

    def fenced(self) -> bool:
        """Some push waits for a device fence nobody waits on (the loop keeps polling while
        so; fences the loop's :class:`~kvbridge.scheduling.fences.FenceWaiter` holds are not
        polled)."""
        owns = self.core.fences.owns
        return any(any(f is not None and not owns(f) for _, f in o.fences)
                   for o in self.outs.values())

    # -- events from the connector ------------------------------------------------------------

    def ready(self, plan: SendPlan, fence: Fence | None, layer: str | None = None) -> None:
        """P's KV of ``plan`` is written (``layer``: only that layer's, layer-wise push)."""
        core, tid = self.core, plan.transfer_id
        if layer is None:
            core.mark(tid, "ready_seen")
        why = core.ended.get(tid)
        if why is not None:
            if layer is None:
                core.results.sent(plan.req_id)
            return
        out = self.outs.get(tid)
        if out is None:
            out = self.outs[tid] = _Out(tid)
        if layer is None:
            out.final = True
        if out.plan is None:
            out.plan = plan
            problem = self._mismatch(out)
            if problem is not None:
                self._finish(out, problem)
                return
        planes = (list(range(len(core.layout.planes))) if layer is None
                  else core.layout.plane_indices(layer))
        out.fences.append((planes, fence))
        if fence is not None:
            core.fence_pending(fence)
        if layer is None:
            if out.reg is None:
                core.timers.set(("ready", tid), core.config.lease_s, lambda: self._unclaimed(tid))
        self._advance(out)

    def announce(self, tid: str) -> None:
        """The prefill request of ``tid`` arrived: its registration may wait the full time."""
        self._announced[tid] = None
        while len(self._announced) > self.core.config.max_pending * 4:
            self._announced.pop(next(iter(self._announced)))
        out = self.outs.get(tid)
        if out is not None and out.reg is not None and not out.final:
            self.core.timers.set(("register", tid), self.core.config.push_timeout_s,
                                 lambda: self._never_ready(tid))

    def cancel_send(self, tid: str, reason: str) -> None:
        """P's request ended before its KV was handed over."""
        self.core.ended.record(tid, reason)
        out = self.outs.get(tid)
        if out is not None and not out.handles:
            self._finish(out, reason)

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
        if out is not None and out.reg is not None:
            core.stats["forged_register"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN, error=f"{tid} is already registered")
        if tid in core.pull_source.staged:
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error=f"this prefill engine holds {tid} for a pull, not a push")
        if msg.layout_fingerprint != core.info.layout_fingerprint:
            return Ack(ok=False, kind=ErrorKind.MISMATCH,
                       error="decode's KV layout differs from this engine's")
        if self._regs_by_conn.get(ctx.conn, 0) >= cfg.max_pending_per_peer or \
                sum(self._regs_by_conn.values()) >= cfg.max_pending:
            core.stats["register_refused_busy"] += 1
            return Ack(ok=False, kind=ErrorKind.BUSY, error="too many pending registrations")
        if out is None:
            out = self.outs[tid] = _Out(tid)
        out.reg, out.ctx = msg, ctx
        self._regs_by_conn[ctx.conn] = self._regs_by_conn.get(ctx.conn, 0) + 1
        core.timers.cancel(("ready", tid))
        wait = cfg.push_timeout_s if tid in self._announced else min(cfg.push_timeout_s,
                                                                     cfg.prefill_wait_s)
        core.timers.set(("register", tid), wait, lambda: self._never_ready(tid))
        core.stats["push_registrations"] += 1
        problem = self._mismatch(out)
        if problem is not None:
            self._finish(out, problem, answer=False)
            return Ack(ok=False, kind=ErrorKind.MISMATCH, error=problem)
        core.server.reply(ctx, Ack())
        out.stage = _Stage.CONFIRMING
        core.peers.ensure(msg.control_address, msg.sender_generation,
                          lambda result: self._dialled(out, result))
        return None

    def on_cancel(self, ctx: RequestContext, msg: Cancel) -> Message | None:
        out = self.outs.get(msg.transfer_id)
        if out is None:
            return None
        if out.ctx is not None and out.ctx.conn != ctx.conn:
            self.core.stats["forged_cancel"] += 1
            return Ack(ok=False, kind=ErrorKind.FORBIDDEN,
                       error=f"{msg.transfer_id} was registered by another connection")
        self.core.stats["push_cancelled"] += 1
        reason = f"cancelled by decode: {msg.reason}"
        self.core.ended.record(msg.transfer_id, reason)
        if out.handles:
            out.error = out.error or reason
            return CancelReply(safe=False)
        self._finish(out, reason, answer=False)
        return CancelReply(safe=True)

    def renew(self, tid: str) -> bool:
        out = self.outs.get(tid)
        if out is None:
            return False
        if ("ready", tid) in self.core.timers:
            self.core.timers.set(("ready", tid), self.core.config.lease_s,
                                 lambda: self._unclaimed(tid))
        return True

    # -- the state machine -------------------------------------------------------------------

    def _mismatch(self, out: _Out) -> str | None:
        plan, reg = out.plan, out.reg
        if plan is None or reg is None:
            return None
        if reg.num_tokens != plan.num_tokens:
            return f"prefill computed {plan.num_tokens} tokens, decode expects {reg.num_tokens}"
        if reg.prompt_digest != plan.prompt_digest:
            return "decode's prompt differs from the prompt prefilled here"
        if reg.skip_blocks + len(reg.block_ids) != len(plan.block_ids):
            return (f"decode wants {len(reg.block_ids)} blocks after {reg.skip_blocks}, the "
                    f"prompt has {len(plan.block_ids)}")
        return None

    def _dialled(self, out: _Out, result: Peer | KVBridgeError) -> None:
        if self.outs.get(out.tid) is not out or out.stage is not _Stage.CONFIRMING:
            return
        assert out.reg is not None
        if isinstance(result, KVBridgeError):
            self._finish(out, f"cannot reach the registering decode engine: {result}")
            return
        if result.info.engine_id != out.reg.engine_id:
            self.core.stats["forged_register"] += 1
            self._finish(out, f"{out.reg.control_address} is engine {result.info.engine_id}, "
                              f"not {out.reg.engine_id}")
            return
        out.peer = result
        confirm = PushConfirm(transfer_id=out.tid, generation=out.reg.sender_generation,
                              block_ids=list(out.reg.block_ids))
        self.core.rpc.call(result.address, confirm, self.core.config.control_timeout_s,
                           lambda reply: self._confirmed(out, reply))

    def _confirmed(self, out: _Out, reply: Message | KVBridgeError) -> bool:
        if self.outs.get(out.tid) is not out or out.stage is not _Stage.CONFIRMING:
            return False
        if not (isinstance(reply, Ack) and reply.ok):
            why = reply.error if isinstance(reply, Ack) else str(reply)
            self.core.stats["confirm_refused"] += 1
            self._finish(out, f"decode did not confirm the registration: {why}")
            return False
        out.stage = _Stage.CONFIRMED
        self._advance(out)
        return False

    def _advance(self, out: _Out) -> None:
        """Post every WRITE whose KV is ready and fence passed, once D confirmed."""
        if out.stage is not _Stage.CONFIRMED or out.error is not None or out.plan is None:
            return
        assert out.reg is not None and out.peer is not None
        core = self.core
        still: list[tuple[list[int], Fence | None]] = []
        for planes, fence in out.fences:
            if fence is not None and not fence.ready():
                still.append((planes, fence))
                continue
            todo = [i for i in planes if i not in out.posted]
            if not todo or not out.reg.block_ids:
                continue
            out.posted.update(todo)
            src = out.plan.block_ids[out.reg.skip_blocks:]
            try:
                local, remote = descriptor_pair(core.layout.select(todo), src,
                                                out.peer.layout.select(todo), out.reg.block_ids)
                handle = core.transport.submit(Op.WRITE, out.peer.name, local, remote)
            except KVBridgeError as exc:
                out.error = f"cannot post the WRITE: {exc}"
                break
            core.watch_handle(handle)
            out.handles.append(handle)
            out.nbytes += int(local[:, 1].sum())
            core.mark(out.tid, "write_posted")
            if len(out.handles) == 1:
                core.timers.set(("write", out.tid), core.config.transfer_timeout_s,
                                lambda: self._write_timeout(out))
        out.fences = still
        self.poll_one(out)

    def poll(self) -> None:
        for out in list(self.outs.values()):
            if out.fences and out.stage is _Stage.CONFIRMED:
                self._advance(out)
            elif out.handles:
                self.poll_one(out)

    def poll_one(self, out: _Out) -> None:
        if self.outs.get(out.tid) is not out:
            return
        for handle in out.handles:
            if self.core.transport.poll(handle) is HandleState.PENDING:
                return
        for handle in out.handles:
            if handle.state is HandleState.FAILED and out.error is None:
                out.error = f"WRITE failed: {handle.error or 'transport error'}"
        if out.error is None and not (out.final and not out.fences):
            return  # more layers to come
        if out.error is None and out.stage is not _Stage.CONFIRMED:
            return
        self._finish(out, out.error)

    def _write_timeout(self, out: _Out) -> None:
        if self.outs.get(out.tid) is out and out.handles:
            out.error = out.error or (f"WRITE did not finish within "
                                      f"{self.core.config.transfer_timeout_s} s")
            self.core.count("transfer_timeout", "push", out.peer)
            log.warning("push %s: %s (waiting for it to stop before answering)", out.tid,
                        out.error)

    def _unclaimed(self, tid: str) -> None:
        out = self.outs.get(tid)
        if out is not None and out.reg is None:
            self.core.count("lease_expired", "push", out.peer)
            log.warning("push %s: no decode registered within the lease; blocks released", tid)
            self._finish(out, "lease expired (decode never registered)")

    def _never_ready(self, tid: str) -> None:
        out = self.outs.get(tid)
        if out is not None and not out.final and not out.handles:
            self.core.stats["registration_expired"] += 1
            self._finish(out, "prefill never became ready" if tid in self._announced
                         else "this prefill engine never received the request's prefill leg")

    def _finish(self, out: _Out, error: str | None, *, answer: bool = True) -> None:
        """End ``out``: every handle has stopped (or none was posted)."""
        core = self.core
        if self.outs.get(out.tid) is not out:
            return
        del self.outs[out.tid]
        self._announced.pop(out.tid, None)
        for key in ("ready", "register", "write"):
            core.timers.cancel((key, out.tid))
        if out.ctx is not None:
            n = self._regs_by_conn.get(out.ctx.conn, 1) - 1
            if n > 0:
                self._regs_by_conn[out.ctx.conn] = n
            else:
                self._regs_by_conn.pop(out.ctx.conn, None)
        if out.handles and out.peer is not None:
            wire = (max(h.finished or h.started for h in out.handles)
                    - min(h.started for h in out.handles))
            core.observe.transfer("push", out.peer.info.engine_id, error is None, wire,
                                  out.nbytes, sum(h.count for h in out.handles),
                                  core.backend_of(out.peer.name))
        if error is None:
            core.mark(out.tid, "write_done")
            core.stats["push_sent"] += 1
            core.stats["push_bytes"] += out.nbytes
            if len(out.handles) > 1:
                core.stats["push_layerwise"] += 1
        else:
            core.count("push_failed", "push", out.peer)
            log.warning("push %s failed: %s", out.tid, error)
        core.ended.record(out.tid, "done" if error is None else f"failed: {error}")
        if answer and out.ctx is not None:
            result = PushResult(transfer_id=out.tid, ok=error is None, nbytes=out.nbytes,
                                error=error)
            if error is None and out.plan is not None and out.reg is not None and (
                    core.config.checksum or (out.peer is not None and out.peer.info.checksum)):
                src = out.plan.block_ids[out.reg.skip_blocks:]
                result = PushResult(transfer_id=out.tid, ok=True, nbytes=out.nbytes,
                                    checksum=core.digest(src))
            core.server.reply(out.ctx, result)
        if out.plan is not None and out.final:
            core.results.sent(out.plan.req_id)

    def close(self) -> None:
        for out in list(self.outs.values()):
            if not out.handles:
                self._finish(out, "engine shutting down")

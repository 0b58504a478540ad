"""The transfer loop's answers to control requests: which state machine a message is for.

Every handler runs on the loop thread; a handler returns the reply, or None when it answers
later (a claim held until its stage, a registration whose final answer comes with the WRITE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvbridge import identity
from kvbridge.control import ControlServer, RequestContext
from kvbridge.messages import (
    Ack,
    Cancel,
    CancelReply,
    DrainNotice,
    ErrorKind,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Message,
    PullClaim,
    PullDone,
    PushConfirm,
    PushRegister,
    StatsQuery,
    StatsReply,
    TransferQuery,
    TransferReply,
)
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.leases import HeartbeatBook
from kvbridge.scheduling.peers import ANY_GENERATION, PeerTable
from kvbridge.scheduling.pull import PullSink, PullSource
from kvbridge.scheduling.push import PushSource
from kvbridge.scheduling.push_wait import PushSink
from kvbridge.scheduling.recorder import Recorder

__all__ = ["Host", "answer", "outcome", "held"]


class Host(LoopContext, Protocol):
    """What answering needs beyond the state machines' context: the state machines
    themselves, and the loop's books for :class:`~kvbridge.messages.StatsQuery` (the
    :class:`~kvbridge.scheduling.loop.TransferLoop` is one)."""

    pull_source: PullSource
    pull_sink: PullSink
    push_source: PushSource
    push_sink: PushSink
    recorder: Recorder
    #: what a DrainNotice starts (the rank's offload write-out); None: no offload tiers
    on_drain: Callable[[], None] | None

    @property
    def server(self) -> ControlServer: ...

    @property
    def peers(self) -> PeerTable: ...

    @property
    def heartbeats(self) -> HeartbeatBook: ...

    def pending(self) -> int:
        """Transfers in progress."""


def answer(core: Host, ctx: RequestContext, msg: Message) -> Message | None:
    """The reply to one control request (None: answered later, or not at all)."""
    if isinstance(msg, PullClaim):
        return core.pull_source.on_claim(ctx, msg)
    if isinstance(msg, PullDone):
        return core.pull_source.on_done(ctx, msg)
    if isinstance(msg, PushRegister):
        return core.push_source.on_register(ctx, msg)
    if isinstance(msg, PushConfirm):
        return core.push_sink.on_confirm(ctx, msg)
    if isinstance(msg, Heartbeat):
        return _heartbeat(core, ctx, msg)
    if isinstance(msg, Cancel):
        reply = core.pull_source.on_cancel(ctx, msg) or core.push_source.on_cancel(ctx, msg)
        if reply is None:  # not here (yet): a later stage or ready releases at once
            core.ended.record(msg.transfer_id, f"cancelled by decode: {msg.reason}")
            reply = CancelReply(safe=True)
        return reply
    if isinstance(msg, Hello):
        core.stats["hello_answered"] += 1
        # the dialler's transport loads ours only if ours shows this proof (kvbridge.identity)
        core.transport.attest(identity.proof(msg.challenge, core.control_address, core.engine_id,
                                             core.generation, core.rank, core.info.agent),
                              msg.info.transport_metadata)
        return HelloReply(info=core.info)
    if isinstance(msg, StatsQuery):
        timings = core.recorder.snapshot()
        stats = dict(core.stats)
        for key, value in (("control_dropped_auth", core.server.dropped_auth),
                           ("control_dropped_malformed", core.server.dropped_malformed),
                           ("peers", len(core.peers)), ("handshakes", core.peers.handshakes),
                           ("heartbeat_targets", len(core.heartbeats)),
                           ("heartbeats_sent", core.heartbeats.sent),
                           ("heartbeats_unanswered", core.heartbeats.failed)):
            if value:
                stats[key] = value
        return StatsReply(engine_id=core.engine_id, generation=core.generation,
                          stats=stats, pending=core.pending(), timings=timings,
                          held=held(core))
    if isinstance(msg, DrainNotice):
        if core.on_drain is None:
            return Ack(ok=False, error="this rank has no offload tiers: nothing to write out")
        core.stats["drain_notices"] += 1
        core.on_drain()
        return Ack(ok=True)
    if isinstance(msg, TransferQuery):
        outcomes = {t: o for t in msg.transfer_ids if (o := outcome(core, t)) is not None}
        if msg.timings:
            return TransferReply(outcomes=outcomes,
                                 timings=core.recorder.many(list(msg.transfer_ids)))
        return TransferReply(outcomes=outcomes)
    return Ack(ok=False, kind=ErrorKind.MALFORMED,
               error=f"unexpected message {type(msg).__name__}")

def _heartbeat(core: Host, ctx: RequestContext, msg: Heartbeat) -> Message:
    if msg.generation not in (ANY_GENERATION, core.generation):
        return HeartbeatReply(generation=core.generation, unknown=list(msg.transfer_ids))
    unknown = [t for t in msg.transfer_ids
               if not (core.pull_source.renew(ctx, t) or core.push_source.renew(t))]
    return HeartbeatReply(generation=core.generation, unknown=unknown)

def outcome(core: Host, tid: str) -> str | None:
    """How ``tid`` ended, or what it is doing now; None if this rank does not know it."""
    ended = core.ended.get(tid)
    if ended is not None:
        return ended
    for name, table in (("staged", core.pull_source.staged), ("pulling", core.pull_sink.jobs),
                        ("pushing", core.push_source.outs),
                        ("awaiting push", core.push_sink.jobs)):
        if tid in table:
            return f"in progress: {name}"
    return None

def held(core: Host) -> dict[str, list[str]]:
    """A few transfer ids of each kind this rank holds (for ``kvbridge stats``)."""
    out: dict[str, list[str]] = {}
    for name, table in (("staged", core.pull_source.staged), ("pulling", core.pull_sink.jobs),
                        ("pushing", core.push_source.outs),
                        ("awaiting_push", core.push_sink.jobs)):
        if table:
            out[name] = list(table)[:16]
    return out

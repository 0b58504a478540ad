"""State machines driven without a transfer loop: :class:`PullSource` and the registrations
of :class:`PushSource` on a fake context.

The state machines reach their loop only through :class:`~kvbridge.scheduling.context.
LoopContext`, so these tests run the P side of a pull, and of a push up to its WRITE, with
:class:`FakeLoop` (no sockets, no thread, no transport) and a hand-driven clock: every step is
a plain call, every timer fires when the test says, every dial and call is answered by the
test.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvbridge.config import Config
from kvbridge.control import ReplyCallback, RequestContext
from kvbridge.errors import PeerUnreachable
from kvbridge.layout import KVLayout
from kvbridge.messages import (
    Ack,
    Cancel,
    CancelReply,
    ErrorKind,
    Message,
    PullClaim,
    PullDone,
    PullServed,
    PushRegister,
    PushResult,
)
from kvbridge.scheduling import digests, mapping
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.leases import Timers
from kvbridge.scheduling.observations import Observations
from kvbridge.scheduling.peers import Peer, PeerCallback, make_info
from kvbridge.scheduling.pull import PullSource
from kvbridge.scheduling.push import PushSource
from kvbridge.scheduling.results import Outcomes, ResultBox
from kvbridge.scheduling.specs import SendPlan
from kvbridge.testing.agents import make_caches
from kvbridge.transport import TransferHandle


class Clock:
    """Monotonic time that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeLoop:
    """Stands in for the :class:`~kvbridge.scheduling.loop.TransferLoop` (a
    :class:`LoopContext`): real counters, outcomes, result box and timers (on a hand-driven
    :class:`Clock`); the control channel records what the state machine sends instead of
    sending it (``replies``, ``calls``, ``dialled``, ``watched``, ``cancelled``). The
    transport and the engine info are absent: :class:`PullSource` does not use them."""

    layout: KVLayout
    config: Config = field(default_factory=lambda: Config(lease_s=10.0, heartbeat_s=1.0))
    engine_id: str = "prefill"
    generation: str = "gen-p"
    rank: int = 0
    tp_size: int = 1
    heads: Any = None
    info: Any = None
    transport: Any = None
    clock: Clock = field(default_factory=Clock)
    stats: Counter[str] = field(default_factory=Counter)
    observe: Observations = field(default_factory=lambda: Observations("fake"))
    ended: Outcomes = field(default_factory=Outcomes)
    replies: list[tuple[RequestContext, Message]] = field(default_factory=list)
    calls: list[tuple[str, Message]] = field(default_factory=list)
    dialled: list[str] = field(default_factory=list)
    dials: list[PeerCallback] = field(default_factory=list)  # answered by the test
    answers: list[ReplyCallback] = field(default_factory=list)  # one per call
    watched: set[tuple[str, str]] = field(default_factory=set)
    cancelled: list[tuple[str, str]] = field(default_factory=list)
    marks: list[tuple[str, str]] = field(default_factory=list)
    wakes: int = 0
    sent: int = 0  # heartbeat rounds (Watcher.sent)

    def __post_init__(self) -> None:
        self.shape = mapping.Shape(self.tp_size, self.rank, self.layout.block_size, self.heads)
        self.timers = Timers(self.clock)
        self.results = ResultBox(self.layout, self.stats, self.ended, self.mark, self._wake)

    # the control channel: every collaborator is this object, recording
    control_address = "tcp://127.0.0.1:1"

    @property
    def server(self) -> FakeLoop:
        return self

    @property
    def rpc(self) -> FakeLoop:
        return self

    @property
    def peers(self) -> FakeLoop:
        return self

    @property
    def heartbeats(self) -> FakeLoop:
        return self

    @property
    def fences(self) -> FakeLoop:
        return self

    def reply(self, ctx: RequestContext, msg: Message) -> None:
        self.replies.append((ctx, msg))

    def call(self, address: str, msg: Message, timeout: float | None,
             callback: ReplyCallback) -> int:
        self.calls.append((address, msg))
        self.answers.append(callback)
        return len(self.calls)

    def cancel(self, call_id: int) -> None:
        pass

    def ensure(self, address: str, generation: str, callback: PeerCallback) -> None:
        self.dialled.append(address)
        self.dials.append(callback)

    def watch(self, transfer_id: str, address: str, generation: str = "*") -> None:
        self.watched.add((transfer_id, address))

    def unwatch(self, transfer_id: str, address: str) -> None:
        self.watched.discard((transfer_id, address))

    def owns(self, fence: Fence) -> bool:
        return False

    # the loop's own services
    def mark(self, transfer_id: str, event: str, when: float | None = None,
             mono_ns: int | None = None) -> None:
        self.marks.append((transfer_id, event))

    def count(self, name: str, mode: str, peer: Peer | None = None, *,
              stats: bool = True) -> None:
        if stats:
            self.stats[name] += 1

    def backend_of(self, peer_name: str) -> str:
        return "fake"

    def watch_handle(self, handle: TransferHandle) -> None:
        raise AssertionError("PullSource posts nothing")

    def fence_pending(self, fence: Fence) -> None:
        raise AssertionError("PullSource waits for no fence")

    def cancel_remote(self, address: str, transfer_id: str, reason: str) -> None:
        self.cancelled.append((address, transfer_id))

    def holds_pull(self, transfer_id: str) -> bool:
        return False

    def _wake(self, arrival: tuple[str, str] | None) -> None:
        self.wakes += 1

    def run_timers(self, seconds: float) -> None:
        """Let ``seconds`` pass and fire the timers that came due."""
        self.clock.now += seconds
        for fn in self.timers.due():
            fn()


def _context(loop: FakeLoop) -> LoopContext:
    return loop  # checks (for mypy, where tests are checked) that the fake is a context


BLOCKS = (3, 5, 6)
PLAN = SendPlan("req", "t1", BLOCKS, num_tokens=10, prompt_digest="d")
CTX = RequestContext(b"conn-d", b"rid-1")


_CACHES: list[Any] = []  # the layouts' memory, alive for the digests P computes from it


def _source() -> tuple[FakeLoop, PullSource]:
    caches, layout = make_caches((2, 8, 4, 8))
    _CACHES.append(caches)
    loop = FakeLoop(layout)
    return loop, PullSource(_context(loop))


def _claim(**kw: Any) -> PullClaim:
    fields: dict[str, Any] = dict(transfer_id="t1", generation="gen-p", block_ids=list(BLOCKS),
                                  num_tokens=10, prompt_digest="d")
    return PullClaim(**{**fields, **kw})


def _claimed(loop: FakeLoop, src: PullSource, ctx: RequestContext = CTX) -> None:
    """Claim all of t1 on ``ctx``: answered ok at once (its digests were made when staged)."""
    assert src.on_claim(ctx, _claim()) == Ack()


def test_staged_claimed_done_releases_the_blocks_once() -> None:
    loop, src = _source()
    src.stage(PLAN)
    assert "t1" in src.staged and ("pull-leases",) in loop.timers and len(src) == 1
    _claimed(loop, src)
    staged = src.staged.get("t1")
    assert staged is not None
    nbytes = mapping.side_bytes(staged.claims[0].half)
    served = src.on_done(CTX, PullDone(transfer_id="t1", nbytes=nbytes))
    assert isinstance(served, PullServed) and served.transfer_id == "t1"
    assert served.digests == digests.compute(mapping.side_descriptors(staged.claims[0].half))
    assert len(src) == 0 and "t1" not in src.staged
    assert loop.results.drain().finished_sending == {"req"}
    assert loop.ended.get("t1") == "done" and loop.stats["pull_served"] == 1


def test_lease_expires_on_the_fake_clock() -> None:
    loop, src = _source()
    src.stage(PLAN)
    loop.run_timers(9.0)
    assert len(src) == 1
    loop.run_timers(2.0)
    assert len(src) == 0 and loop.stats["lease_expired"] == 1
    assert loop.ended.get("t1") == "lease expired"
    assert loop.results.drain().finished_sending == {"req"}


def test_a_claim_before_the_stage_is_answered_when_it_comes() -> None:
    loop, src = _source()
    assert src.on_claim(CTX, _claim()) is None  # held: the stage event is behind
    src.stage(PLAN)
    assert loop.replies == [(CTX, Ack())]


def test_an_early_claim_that_never_sees_its_stage_is_refused_in_time() -> None:
    loop, src = _source()
    assert src.on_claim(CTX, _claim()) is None
    loop.run_timers(loop.config.control_timeout_s + 0.1)
    [(ctx, reply)] = loop.replies
    assert ctx == CTX and isinstance(reply, Ack) and reply.kind is ErrorKind.UNKNOWN_TRANSFER


def _flip_first_byte(half: Any) -> Any:
    """Flip the first byte ``half`` covers (again to undo); the byte's ctypes view."""
    first = mapping.side_descriptors(half)[0]
    view = (ctypes.c_uint8 * int(first[1])).from_address(int(first[0]))
    view[0] ^= 0xFF
    return view


@pytest.mark.parametrize("skip", [0, 1])
def test_p_digests_before_d_reads_not_at_its_done(skip: int) -> None:
    """P's digests are of its KV as it was when staged (a claim of the whole prompt, answered
    at once) or when claimed (D holds a prefix: answered first, then digested while D reads),
    never at D's DONE: bytes P changed meanwhile show in D's check as a mismatch."""
    loop, src = _source()
    src.stage(PLAN)
    claim = _claim(skip_blocks=skip, block_ids=list(BLOCKS[skip:]))
    if skip:
        assert src.on_claim(CTX, claim) is None and loop.replies == [(CTX, Ack())]
    else:
        assert src.on_claim(CTX, claim) == Ack() and not loop.replies
    assert loop.stats["pull_digested_ahead"] == (0 if skip else 1)
    staged = src.staged.get("t1")
    assert staged is not None
    half = staged.claims[0].half
    before = digests.compute(mapping.side_descriptors(half))
    view = _flip_first_byte(half)  # P's KV changes after the claim
    served = src.on_done(CTX, PullDone(transfer_id="t1", nbytes=mapping.side_bytes(half)))
    view[0] ^= 0xFF
    assert isinstance(served, PullServed) and served.digests == before
    assert len(served.digests) == digests.DIGEST_BYTES  # one chunk: (3 - skip) small blocks


def test_a_claim_of_the_whole_prompt_gets_digests_of_what_it_claims() -> None:
    """The digests made when staged are used only for a stream of exactly those bytes."""
    loop, src = _source()
    src.stage(PLAN)
    staged = src.staged.get("t1")
    assert staged is not None and staged.ahead is not None
    whole = mapping.side_descriptors([(loop.layout, np.asarray(BLOCKS, dtype=np.int64))])
    assert staged.digested(whole) == digests.compute(whole)
    assert staged.digested(whole[1:]) is None and staged.digested(whole[::-1].copy()) is None


def test_with_checksums_off_p_digests_only_when_d_asks_at_done() -> None:
    loop, src = _source()
    loop.config = Config(lease_s=10.0, heartbeat_s=1.0, checksum=False)
    for tid, want in (("t1", True), ("t2", False)):
        src.stage(SendPlan("req", tid, BLOCKS, num_tokens=10, prompt_digest="d"))
        assert src.on_claim(CTX, _claim(transfer_id=tid)) == Ack()  # answered at once
        staged = src.staged.get(tid)
        assert staged is not None and staged.claims[0].digests is None
        half = staged.claims[0].half
        served = src.on_done(CTX, PullDone(transfer_id=tid, nbytes=mapping.side_bytes(half),
                                           want_digests=want))
        assert isinstance(served, PullServed)
        assert served.digests == (digests.compute(mapping.side_descriptors(half)) if want
                                  else None)


def test_only_the_claimant_may_end_a_claimed_transfer() -> None:
    loop, src = _source()
    src.stage(PLAN)
    _claimed(loop, src)
    stranger = RequestContext(b"conn-x", b"rid-9")
    refused = src.on_cancel(stranger, Cancel(transfer_id="t1", reason="no"))
    assert isinstance(refused, Ack) and refused.kind is ErrorKind.FORBIDDEN
    assert loop.stats["forged_cancel"] == 1 and len(src) == 1
    assert src.on_cancel(CTX, Cancel(transfer_id="t1", reason="bye")) == CancelReply(safe=True)
    assert loop.ended.get("t1") == "cancelled by decode: bye"


def test_a_claim_for_another_prompt_is_refused_and_counted() -> None:
    loop, src = _source()
    src.stage(PLAN)
    reply = src.on_claim(CTX, _claim(prompt_digest="other"))
    assert isinstance(reply, Ack) and reply.kind is ErrorKind.MISMATCH
    assert loop.stats["claim_refused"] == 1 and len(src) == 1


# -- push registrations (issue 33 item 5) ------------------------------------------------------

D_ADDR = "tcp://127.0.0.1:2"
CTX_X = RequestContext(b"conn-x", b"rid-7")  # a stranger that read the live transfer id


def _info(layout: KVLayout, engine_id: str, address: str) -> Any:
    return make_info(engine_id=engine_id, generation=f"gen-{engine_id}", rank=0, tp_size=1,
                     backend="fake", agent=engine_id, transport_metadata=b"", layout=layout,
                     control_address=address, compat={}, checksum=False)


def _push_source() -> tuple[FakeLoop, PushSource, Peer]:
    _, layout = make_caches((2, 8, 4, 8))
    loop = FakeLoop(layout, info=_info(layout, "prefill", "tcp://127.0.0.1:1"))
    decode = Peer(_info(layout, "decode", D_ADDR), layout, "decode", D_ADDR)
    return loop, PushSource(_context(loop)), decode


def _register(loop: FakeLoop, **kw: Any) -> PushRegister:
    fields: dict[str, Any] = dict(
        transfer_id="t1", generation="*", engine_id="decode", sender_generation="gen-decode",
        control_address=D_ADDR, block_ids=[7, 8, 9], num_tokens=10, prompt_digest="d",
        layout_fingerprint=loop.layout.fingerprint())
    return PushRegister(**{**fields, **kw})


def _failed_result(loop: FakeLoop, ctx: RequestContext) -> str:
    [result] = [m for c, m in loop.replies if c == ctx and isinstance(m, PushResult)]
    assert not result.ok and result.error
    return result.error


def test_a_forged_registration_decode_never_made_is_refused_alone() -> None:
    """Registered first, in D's name with other blocks: D refuses to confirm it. Only it
    ends; D's own registration is then confirmed and the push goes on."""
    loop, src, decode = _push_source()
    assert src.on_register(CTX_X, _register(loop, block_ids=[1, 2, 3])) is None
    assert src.on_register(CTX, _register(loop)) is None
    forged_dial, real_dial = loop.dials
    forged_dial(decode)  # P dials D for the forgery and asks it to confirm: refused
    loop.answers[-1](Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER, error="not mine"))
    assert "did not confirm" in _failed_result(loop, CTX_X)
    real_dial(decode)
    loop.answers[-1](Ack())
    out = src.outs["t1"]
    assert [t.ctx for t in out.targets] == [CTX] and out.complete() and out.error is None
    assert loop.ended.get("t1") is None
    assert loop.stats["confirm_refused"] == 1 and loop.stats["register_refused"] == 1


def test_a_forged_registration_that_cannot_be_reached_or_is_another_engine_ends_alone() -> None:
    loop, src, decode = _push_source()
    src.on_register(CTX, _register(loop))
    src.on_register(CTX_X, _register(loop, control_address="tcp://127.0.0.1:9"))
    other = RequestContext(b"conn-y", b"rid-8")
    src.on_register(other, _register(loop, engine_id="someone"))
    real_dial, unreachable, impostor = loop.dials
    unreachable(PeerUnreachable("connection refused"))
    impostor(decode)  # the address answers as engine "decode", not "someone"
    assert "cannot reach" in _failed_result(loop, CTX_X)
    assert "not someone" in _failed_result(loop, other)
    assert loop.stats["forged_register"] == 1
    real_dial(decode)
    loop.answers[-1](Ack())
    assert src.outs["t1"].complete() and loop.ended.get("t1") is None


def test_a_registration_for_another_prompt_is_refused_alone() -> None:
    """Once P knows its plan, a registration for another prompt is refused at once; before,
    when the plan comes. Neither ends the rightful registration."""
    loop, src, _ = _push_source()
    src.on_register(CTX, _register(loop))
    early = RequestContext(b"conn-y", b"rid-8")
    src.on_register(early, _register(loop, num_tokens=9))
    src.prepare(PLAN)
    assert "prefill computed 10 tokens" in _failed_result(loop, early)
    refused = src.on_register(CTX_X, _register(loop, prompt_digest="other"))
    assert isinstance(refused, Ack) and refused.kind is ErrorKind.MISMATCH
    assert [t.ctx for t in src.outs["t1"].targets] == [CTX]
    assert loop.ended.get("t1") is None and loop.stats["register_refused"] == 2


def test_of_two_registrations_d_confirmed_for_one_rank_the_second_is_refused_alone() -> None:
    """A copy of D's registration (D confirms both: it cannot tell them apart): the first
    confirmed keeps the decode rank; the other is refused, the push is not failed."""
    loop, src, decode = _push_source()
    src.on_register(CTX, _register(loop))
    src.on_register(CTX_X, _register(loop))
    for dial in loop.dials:
        dial(decode)
    first, second = loop.answers
    first(Ack())
    second(Ack())
    assert "already registered" in _failed_result(loop, CTX_X)
    out = src.outs["t1"]
    assert [t.ctx for t in out.targets] == [CTX] and out.complete() and out.error is None


def test_a_push_that_ended_while_a_forgery_was_pending_closes_when_it_is_refused() -> None:
    """The rightful push finished (here: D had the whole prompt, nothing to write) while a
    forged registration was still being dialled: once that is refused, the push closes and
    P's blocks are given back."""
    loop, src, decode = _push_source()
    src.on_register(CTX, _register(loop, block_ids=[], skip_blocks=3))
    src.on_register(CTX_X, _register(loop, control_address="tcp://127.0.0.1:9"))
    real_dial, unreachable = loop.dials
    real_dial(decode)
    loop.answers[-1](Ack())
    src.ready(PLAN, None)
    assert [m for c, m in loop.replies if c == CTX and isinstance(m, PushResult)] == [
        PushResult(transfer_id="t1", ok=True, nbytes=0)]
    unreachable(PeerUnreachable("connection refused"))
    assert "t1" not in src.outs and loop.ended.get("t1") == "done"
    assert loop.results.drain().finished_sending == {"req"}


def test_a_receive_past_the_table_s_capacity_fails_at_once_and_safely() -> None:
    """D's receives are a LookupBuffer: when it is full a new receive is failed at once (safe:
    nothing was posted into its blocks), the receives already there go on."""
    from kvbridge.scheduling.pull import PullSink
    from kvbridge.scheduling.receive import receive_table
    from kvbridge.scheduling.specs import PullSpec

    _, layout = make_caches((2, 8, 4, 8))
    loop = FakeLoop(layout)
    sink = PullSink(_context(loop))
    sink.jobs = receive_table(1, clock=loop.clock)
    sink.start(PullSpec("r1", "t1", "tcp://127.0.0.1:9", (1, 2), (3, 4), num_tokens=32))
    sink.start(PullSpec("r2", "t2", "tcp://127.0.0.1:9", (5, 6), (7, 8), num_tokens=32))
    assert "t1" in sink.jobs and "t2" not in sink.jobs
    res = loop.results.drain()
    assert res.failed_recving == {"r2"} and "r1" not in res.failed_recving
    assert "receives 1 transfers already" in (loop.ended.get("t2") or "")

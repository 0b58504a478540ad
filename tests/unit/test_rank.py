"""kvbridge.scheduling.rank: one worker rank applies the scheduler's StepPlans to a real
TransferLoop (``memory`` transport, in this process) and reports what vLLM must learn."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.config import Config, TransferMode
from kvbridge.params import PeerRef
from kvbridge.scheduling.handoff import HandoffBook, RankAddress, RecvOrder, StepPlan
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.scheduling.rank import RankSide
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.faults import FaultyTransport
from kvbridge.testing.handoffs import BLOCK, FAST, pull, send, tokens
from kvbridge.transports.memory import MemoryTransport

PD = tuple[LocalAgent, LocalAgent]
Sides = tuple[LocalAgent, LocalAgent, RankSide, RankSide]
SLOW_LEASE = {**FAST, "lease_s": 30}  # a P rank that must keep holding for the whole test
Outcome = tuple[set[str], set[str], set[str]]


def _ref(agent: LocalAgent) -> PeerRef:
    return PeerRef(agent.address, agent.generation)


def _order(req: str, tid: str, peers: tuple[PeerRef, ...], local: list[int],
           remote: list[int] | None = None, *, skip: int = 0,
           error: str | None = None) -> RecvOrder:
    prompt = tokens(len(local) + skip)
    mode = TransferMode.PULL if remote is not None else TransferMode.PUSH
    return RecvOrder(req, tid, mode, peers, tuple(local), tuple(remote or ()), skip, len(prompt),
                     prompt_digest(prompt), error)


class _Results:
    """Accumulates RankSide.results() across steps, the way vLLM sees them."""

    def __init__(self, side: RankSide) -> None:
        self.side = side
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()
        self.load_errors: set[int] = set()

    def step(self, finished: set[str] | None = None) -> Outcome:
        out = self.side.results(finished or set())
        self.sending |= out[0]
        self.recving |= out[1]
        self.failed |= out[2]
        self.load_errors |= self.side.take_load_errors()
        return out

    def until(self, cond: Callable[[], bool], timeout: float = 15.0,
              finished: set[str] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            self.step(finished)
            if cond():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def idle(self, seconds: float, finished: set[str] | None = None) -> None:
        self.until(lambda: False, seconds, finished)


@pytest.fixture
def sides(local_pd: PD) -> Iterator[Sides]:
    p, d = local_pd
    yield p, d, RankSide(p.loop), RankSide(d.loop)


# -- tensor parallelism: each rank takes its own peer ---------------------------------------------


def test_rank_one_uses_peers_one() -> None:
    ps = [LocalAgent("prefill", extra=SLOW_LEASE, rank=r, tp_size=2) for r in range(2)]
    d1 = LocalAgent("decode", extra=FAST, rank=1, tp_size=2)
    try:
        for r, p in enumerate(ps):
            p.fill(10 + r)
            RankSide(p.loop).apply(StepPlan(stages=[send("p", "tp", [1, 2])]))
        side = RankSide(d1.loop)
        assert side.rank == 1
        side.apply(StepPlan(recvs=[_order("d", "tp", (_ref(ps[0]), _ref(ps[1])), [3, 4],
                                          [1, 2])]))
        res = _Results(side)
        assert res.until(lambda: "d" in res.recving)
        assert res.failed == set()
        np.testing.assert_array_equal(d1.blocks([3, 4]), ps[1].blocks([1, 2]))
        assert not np.array_equal(d1.blocks([3, 4]), ps[0].blocks([1, 2]))
        # rank 0 of P still holds its blocks: nobody claimed them
        assert ps[0].loop.snapshot()["pending"] == 1
        assert ps[1].drain({"p"})["results"]["finished_sending"] == {"p"}
    finally:
        for a in [*ps, d1]:
            a.close()


def test_releases_and_watches_go_to_this_ranks_peer() -> None:
    ps = [LocalAgent("prefill", extra=SLOW_LEASE, rank=r, tp_size=2) for r in range(2)]
    d1 = LocalAgent("decode", extra=FAST, rank=1, tp_size=2)
    try:
        for p in ps:
            p.stage(send("p", "hit", [1, 2]))
        peers = (_ref(ps[0]), _ref(ps[1]))
        side = RankSide(d1.loop)
        side.apply(StepPlan(watches=[("hit", peers)]))
        side.apply(StepPlan(unwatches=[("hit", peers)],
                            releases=[("hit", peers, "decode had the prompt cached")]))
        assert ps[1].drain({"p"}, timeout=10)["results"]["finished_sending"] == {"p"}
        assert ps[0].drain({"p"}, timeout=0.5)["results"]["finished_sending"] == set()
        assert ps[0].loop.snapshot()["pending"] == 1
    finally:
        for a in [*ps, d1]:
            a.close()


def test_a_rank_without_a_peer_fails_its_receive_at_once() -> None:
    p = LocalAgent("prefill", extra=FAST)
    d1 = LocalAgent("decode", extra=FAST, rank=1, tp_size=2)
    try:
        side = RankSide(d1.loop)
        side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [3], [1])]))
        res = _Results(side)
        assert res.until(lambda: "d" in res.recving, timeout=5)
        assert res.failed == {"d"} and res.load_errors == set()
    finally:
        p.close()
        d1.close()


# -- results(): what vLLM learns ----------------------------------------------------------------


def test_finished_sending_waits_for_vllm_to_finish_the_request(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [3, 4], [1, 2])]))
    d_res, p_res = _Results(d_side), _Results(p_side)
    assert d_res.until(lambda: "d" in d_res.recving)
    assert d_res.failed == set()
    np.testing.assert_array_equal(d.blocks([3, 4]), p.blocks([1, 2]))
    # the loop released the blocks, but vLLM has not finished the request: not reported yet
    p_res.idle(0.5)
    assert p_res.sending == set()
    assert p_res.step({"p"})[0] == {"p"}
    assert p_res.step({"p"})[0] == set()  # reported once


def test_finished_sending_when_vllm_finished_first(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
    p_res = _Results(p_side)
    assert p_res.step({"p"})[0] == set()  # finished by vLLM, still pinned for D
    p_res.idle(0.3)
    assert p_res.sending == set()
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [3, 4], [1, 2])]))
    assert p_res.until(lambda: "p" in p_res.sending)  # no second finish needed


def test_finished_ids_of_other_requests_do_not_release(sides: Sides) -> None:
    p, _d, p_side, d_side = sides
    p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [3, 4], [1, 2])]))
    p_res = _Results(p_side)
    p_res.idle(1.0, finished={"other", "d"})
    assert p_res.sending == set()


def test_a_receive_planned_with_an_error_is_failed(sides: Sides) -> None:
    p, _d, _p_side, d_side = sides
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [], [], error="cannot plan")]))
    res = _Results(d_side)
    assert res.until(lambda: "d" in res.recving, timeout=5)
    assert res.failed == {"d"} and res.load_errors == set()


def test_a_refused_claim_is_failed_safely(sides: Sides) -> None:
    p, _d, p_side, d_side = sides
    p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [3, 4], [5, 6])]))  # not leased
    res = _Results(d_side)
    assert res.until(lambda: "d" in res.recving)
    assert res.failed == {"d"} and res.load_errors == set()


def test_receives_this_side_did_not_start_are_not_reported(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
    d.pull(pull("stranger", "t", p, [3, 4], [1, 2]))  # straight on the loop
    res = _Results(d_side)
    res.idle(1.0)
    assert res.recving == set()


class _Delayed(FaultyTransport):
    name = "memory"  # peers compare backend names: it still speaks the memory transport


def test_unsafe_failure_reports_load_errors_now_and_the_request_once_stopped() -> None:
    p = LocalAgent("prefill", extra=FAST)
    slow = _Delayed(MemoryTransport("slow-decode"), delay=3.0)
    d = LocalAgent("decode", extra={**FAST, "transfer_timeout_s": 0.5}, transport=slow)
    try:
        p_side, d_side = RankSide(p.loop), RankSide(d.loop)
        p_side.apply(StepPlan(stages=[send("p", "t", [1, 2])]))
        d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [5, 6], [1, 2])]))
        res = _Results(d_side)
        assert res.until(lambda: bool(res.load_errors), timeout=2.5)
        assert res.load_errors == {5, 6}  # vLLM fails the request now ...
        assert res.recving == set()  # ... but the READ may still land in 5 and 6
        assert d_side.take_load_errors() == set()  # taken once
        assert res.until(lambda: "d" in res.recving, timeout=10)
        assert res.failed == {"d"}
        assert d.loop.snapshot()["stats"]["transfer_timeout"] == 1
    finally:
        p.close()
        d.close()


def test_cancel_recvs_fails_a_waiting_push(sides: Sides) -> None:
    p, _d, _p_side, d_side = sides
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [5, 6])]))
    time.sleep(0.2)
    d_side.apply(StepPlan(cancel_recvs=["t"]))
    res = _Results(d_side)
    assert res.until(lambda: "d" in res.recving, timeout=5)  # well before push_timeout_s
    # P had confirmed the registration, so its blocks may be reported unsafe until P answered
    assert res.failed == {"d"} and res.load_errors <= {5, 6}


def test_cancel_sends_refuses_the_registration(sides: Sides) -> None:
    p, _d, p_side, d_side = sides
    p_side.apply(StepPlan(announces=["t"]))
    p_side.apply(StepPlan(cancel_sends=["t"]))  # the prefill request was aborted
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), [5, 6])]))
    res = _Results(d_side)
    assert res.until(lambda: "d" in res.recving, timeout=3)  # not push_timeout_s
    assert res.failed == {"d"}


# -- push: released after the forward ----------------------------------------------------------


def _registered(d_side: RankSide, p: LocalAgent, blocks: list[int]) -> None:
    d_side.apply(StepPlan(recvs=[_order("d", "t", (_ref(p),), blocks)]))
    deadline = time.monotonic() + 5
    while p.loop.snapshot()["stats"].get("push_registrations", 0) < 1:
        assert time.monotonic() < deadline, "decode never registered"
        time.sleep(0.02)
    time.sleep(0.2)  # and P confirmed it with D


def test_push_ready_is_released_only_after_the_forward(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    _registered(d_side, p, [5, 6])
    before = d.blocks([5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2])], prefill_done=["t"]))
    time.sleep(0.5)
    stats = p.loop.snapshot()["stats"]
    assert stats.get("push_sent", 0) == 0 and stats.get("push_failed", 0) == 0
    np.testing.assert_array_equal(d.blocks([5, 6]), before)  # nothing was written
    assert "kv_ready" not in (p.loop.recorder.get("t") or {})
    p_side.after_forward()
    assert "kv_ready" in (p.loop.recorder.get("t") or {})
    d_res, p_res = _Results(d_side), _Results(p_side)
    assert d_res.until(lambda: "d" in d_res.recving)
    assert d_res.failed == set()
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))
    assert p_res.until(lambda: "p" in p_res.sending, finished={"p"})


def test_results_releases_a_push_when_the_step_had_no_forward(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    _registered(d_side, p, [5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2])]))
    p_side.results(set())  # no wait_for_save this step
    d_res = _Results(d_side)
    assert d_res.until(lambda: "d" in d_res.recving) and d_res.failed == set()
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))


def test_the_write_is_posted_before_after_forward_returns(sides: Sides) -> None:
    """Wake on arrival, P's half: the worker hands the ready KV to the loop and waits until the
    loop took it, so the WRITE is posted at once rather than when the loop next gets the GIL."""
    p, d, p_side, d_side = sides
    _registered(d_side, p, [5, 6])
    assert p.loop.config.wake_on_arrival
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2])], prefill_done=["t"]))
    p_side.after_forward()
    events = p.loop.recorder.get("t") or {}
    assert {"kv_ready", "ready_seen", "write_posted"} <= set(events)
    assert events["kv_ready"] <= events["ready_seen"] <= events["write_posted"]
    d_res = _Results(d_side)
    assert d_res.until(lambda: "d" in d_res.recving) and d_res.failed == set()


class _Fence:
    def __init__(self) -> None:
        self.done = False

    def ready(self) -> bool:
        return self.done


def test_push_waits_for_the_fence_made_after_the_forward(local_pd: PD) -> None:
    p, d = local_pd
    fences: list[_Fence] = []

    def make() -> _Fence:
        fences.append(_Fence())
        return fences[-1]

    p_side, d_side = RankSide(p.loop, make), RankSide(d.loop)
    _registered(d_side, p, [5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2])]))
    assert fences == []  # no fence before the forward
    p_side.after_forward()
    assert len(fences) == 1
    time.sleep(0.4)
    assert p.loop.snapshot()["stats"].get("push_sent", 0) == 0  # device work not done
    fences[0].done = True
    d_res = _Results(d_side)
    assert d_res.until(lambda: "d" in d_res.recving) and d_res.failed == set()
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))
    p_side.after_forward()
    assert len(fences) == 1  # nothing left to release: no new fence


def _layer(agent: LocalAgent, name: str, ids: list[int]) -> Any:
    return agent.caches[name][ids]


def test_layer_saved_writes_each_layer_of_a_layerwise_push(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    _registered(d_side, p, [5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2], layerwise=True)]))
    p_side.layer_saved("layer.0")
    deadline = time.monotonic() + 5
    while not np.array_equal(_layer(d, "layer.0", [5, 6]), _layer(p, "layer.0", [1, 2])):
        assert time.monotonic() < deadline, "layer.0 was not written"
        time.sleep(0.02)
    assert not np.array_equal(_layer(d, "layer.1", [5, 6]), _layer(p, "layer.1", [1, 2]))
    d_res = _Results(d_side)
    d_res.idle(0.2)
    assert d_res.recving == set()  # not done before the last layer and the step's end
    p_side.layer_saved("layer.1")
    p_side.after_forward()
    assert d_res.until(lambda: "d" in d_res.recving) and d_res.failed == set()
    np.testing.assert_array_equal(d.blocks([5, 6]), p.blocks([1, 2]))
    assert p.loop.snapshot()["stats"]["push_layerwise"] == 1


def test_layer_saved_ignores_plans_that_are_not_layerwise(sides: Sides) -> None:
    p, d, p_side, d_side = sides
    _registered(d_side, p, [5, 6])
    before = d.blocks([5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2], layerwise=False)]))
    p_side.layer_saved("layer.0")
    time.sleep(0.4)
    np.testing.assert_array_equal(d.blocks([5, 6]), before)
    assert p.loop.snapshot()["stats"].get("push_sent", 0) == 0
    p_side.after_forward()
    d_res = _Results(d_side)
    assert d_res.until(lambda: "d" in d_res.recving) and d_res.failed == set()
    assert p.loop.snapshot()["stats"].get("push_layerwise", 0) == 0


# -- counters and timings ---------------------------------------------------------------------


def test_scheduler_counters_are_added_on_rank_zero_only() -> None:
    agents = [LocalAgent("engine", extra=FAST, rank=r, tp_size=2) for r in range(2)]
    try:
        for a in agents:
            RankSide(a.loop).apply(StepPlan(counters={"params_rejected": 2}))
        assert agents[0].loop.snapshot()["stats"]["params_rejected"] == 2
        assert "params_rejected" not in agents[1].loop.snapshot()["stats"]
    finally:
        for a in agents:
            a.close()


def test_first_steps_are_marked(sides: Sides) -> None:
    _p, d, _p_side, d_side = sides
    d_side.apply(StepPlan(marks=[("t", "first_step", 1234.5)]))
    assert (d.loop.recorder.get("t") or {})["first_step"] == pytest.approx(1234.5)


# -- the book and the rank together ---------------------------------------------------------


def _book(engine: str) -> HandoffBook:
    return HandoffBook(Config.load({}, env={}), engine, block_size=BLOCK)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_book_plans_drive_a_hand_off_end_to_end(local_pd: PD, mode: str) -> None:
    """P's book and rank, D's book and rank, wired the way the vLLM adapter wires them."""
    p, d = local_pd
    p_book, d_book = _book("prefill"), _book("decode")
    p_book.set_ranks([RankAddress(p.address, p.generation)])
    p_side, d_side = RankSide(p.loop), RankSide(d.loop)
    prompt = tokens(3)[:40]  # 40 tokens: 3 blocks, the last one partial
    p_book.on_new_request("p", {"do_remote_decode": True, "transfer_id": "e2e",
                                "transfer_mode": mode}, prompt)
    p_side.apply(p_book.take_plan())
    if mode == "push":
        probe = p_book.address_params()
        d_raw = {**probe, "do_remote_prefill": True, "transfer_id": "e2e",
                 "transfer_mode": "push"}
        d_book.on_new_request("d", d_raw, prompt)
        assert d_book.matched_tokens("d", 40, 16) == (24, True)
        d_book.after_alloc("d", [20, 21, 22, 23], 24, 40)
        d_side.apply(d_book.take_plan())
        time.sleep(0.3)
        p_book.prefill_complete("p", [4, 5, 6, 7], 40)
        p_side.apply(p_book.take_plan())
        p_side.after_forward()
        keep, _ = p_book.finished("p", True, [4, 5, 6, 7], 40)
    else:
        keep, answer = p_book.finished("p", True, [4, 5, 6, 7], 40)
        p_side.apply(p_book.take_plan())
        d_book.on_new_request("d", answer, prompt)
        assert d_book.matched_tokens("d", 40, 16) == (24, True)
        d_book.after_alloc("d", [20, 21, 22, 23], 24, 40)
        d_side.apply(d_book.take_plan())
    assert keep is True
    d_res, p_res = _Results(d_side), _Results(p_side)
    assert d_res.until(lambda: "d" in d_res.recving)
    assert d_res.failed == set()
    # the local hit (block 20) is untouched; blocks 21, 22 hold P's blocks 5, 6
    np.testing.assert_array_equal(d.blocks([21, 22]), p.blocks([5, 6]))
    assert not np.array_equal(d.blocks([20]), p.blocks([4]))
    assert d_book.transfer_done("d") == "e2e"
    assert p_res.until(lambda: "p" in p_res.sending, finished={"p"})
    assert p_book.transfer_done("p") == "e2e"


def test_a_planning_failure_on_decode_releases_the_prefill(local_pd: PD) -> None:
    p, d = local_pd
    p.stage(send("p", "t", [1, 2, 3], prompt=tokens(3)[:40]))
    d_book = _book("decode")
    raw = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
           "remote_port": int(p.address.rsplit(":", 1)[1]), "kvbridge_generation": p.generation,
           "remote_block_ids": [1, 2, 3], "transfer_id": "t", "transfer_mode": "pull"}
    d_book.on_new_request("d", raw, tokens(3)[:40])
    d_book.after_alloc("d", [20, 21], 40, 40)  # too few blocks: the plan fails
    d_side = RankSide(d.loop)
    d_side.apply(d_book.take_plan())
    res = _Results(d_side)
    assert res.until(lambda: "d" in res.recving, timeout=5) and res.failed == {"d"}
    # P hears about it well before its 3 s lease ends
    assert p.drain({"p"}, timeout=1.5)["results"]["finished_sending"] == {"p"}

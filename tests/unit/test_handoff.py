"""kvbridge.scheduling.handoff: vLLM's scheduler hooks as plain calls, one StepPlan per step.

The book is driven the way ``integrations/vllm.py`` drives it: ``on_new_request`` (once, with the
raw ``kv_transfer_params``), ``matched_tokens`` / ``after_alloc`` (D), ``prefill_complete`` (P,
push), ``finished`` (``request_finished``), ``transfer_done`` (the worker's results) and
``take_plan`` (``build_connector_meta``).
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import msgspec
import pytest

from kvbridge.config import Config, TransferMode
from kvbridge.params import PeerRef, TransferParams, parse
from kvbridge.scheduling.handoff import (
    REMEMBERED_TRANSFERS,
    HandoffBook,
    RankAddress,
    RecvOrder,
    StepPlan,
)
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.scheduling.specs import SendPlan

B = 16
PROMPT = list(range(1000, 1040))  # 40 tokens: 3 blocks, the last one partial
DIGEST = prompt_digest(PROMPT)
P_BLOCKS = [50, 51, 52, 53]  # the prompt's 3 blocks and one of decode room
D_BLOCKS = [60, 61, 62, 63]
RANKS = [RankAddress("tcp://127.0.0.1:7100", "gen-r0"),
         RankAddress("tcp://127.0.0.1:7101", "gen-r1")]
P_ADDR: dict[str, Any] = {"remote_host": "127.0.0.1", "remote_port": 7100,
                          "kvbridge_generation": "gen-p"}
P_REF = PeerRef("tcp://127.0.0.1:7100", "gen-p")


def _book(engine: str = "engine", tp: int = 1, ranks: bool = True,
          **config: Any) -> HandoffBook:
    book = HandoffBook(Config.load(config, env={}), engine, block_size=B, tp_size=tp)
    if ranks:
        book.set_ranks(RANKS[:tp] if tp <= 2 else
                       [RankAddress(f"tcp://127.0.0.1:{7100 + r}", f"gen-r{r}")
                        for r in range(tp)])
    return book


def _pull_leg(tid: str = "t-pull", **kw: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, **P_ADDR, "remote_block_ids": [7, 3, 9],
            "remote_num_tokens": len(PROMPT), "transfer_id": tid, "transfer_mode": "pull", **kw}


def _push_leg(tid: str = "t-push", **kw: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, **P_ADDR, "transfer_id": tid, "transfer_mode": "push",
            **kw}


def _plan_is_empty(plan: StepPlan) -> None:
    assert not plan
    assert not (plan.watches or plan.announces or plan.unwatches or plan.releases or plan.recvs
                or plan.stages or plan.push_ready or plan.cancel_recvs or plan.cancel_sends
                or plan.prefill_done)


# -- P, pull ---------------------------------------------------------------------------------


def test_prefill_pull_leg_stages_and_answers_where_to_read() -> None:
    book = _book("prefill-0", tp=2)
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    assert book.matched_tokens("r1", len(PROMPT), 0) == (0, False)  # P loads nothing
    _plan_is_empty(book.take_plan())  # a pull announces nothing before it finishes
    assert book.producers() == ["r1"]  # watched only to mark when its KV is complete
    book.prefill_complete("r1", P_BLOCKS, len(PROMPT))
    plan = book.take_plan()
    assert plan.prefill_done == ["t1"] and not plan.push_ready  # timing only: no hand-over
    assert book.producers() == []
    book.prefill_complete("r1", P_BLOCKS, len(PROMPT))  # a later step marks nothing twice
    assert book.take_plan().prefill_done == []
    keep, answer = book.finished("r1", True, P_BLOCKS, len(PROMPT))
    assert keep is True and answer is not None
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    assert answer["remote_block_ids"] == [50, 51, 52]  # the prompt's blocks, not decode room
    assert answer["remote_num_tokens"] == 40
    assert answer["remote_request_id"] == "r1"
    assert answer["transfer_id"] == "t1" and answer["transfer_mode"] == "pull"
    assert answer["remote_engine_id"] == "prefill-0"
    assert answer["remote_host"] == "127.0.0.1" and answer["remote_port"] == 7100
    assert answer["tp_size"] == 2
    assert answer["kvbridge_generation"] == "gen-r0"
    assert answer["kvbridge_peers"] == [{"address": r.address, "generation": r.generation}
                                        for r in RANKS]
    assert "kvbridge_error" not in answer
    plan = book.take_plan()
    assert plan.stages == [SendPlan("r1", "t1", (50, 51, 52), 40, DIGEST, False)]
    assert plan.counters == {"pull_staged": 1}
    assert not plan.push_ready and not plan.announces
    assert book.transfers_in_progress() == 1
    assert book.transfer_done("r1") == "t1"
    assert book.transfers_in_progress() == 0
    assert book.transfer_done("r1") is None


def test_prefill_answer_is_a_valid_decode_leg() -> None:
    p = _book("prefill-0", tp=2)
    p.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    _, answer = p.finished("r1", True, P_BLOCKS, len(PROMPT))
    params = parse(answer)
    params.check_decode_leg(TransferMode.PULL, len(PROMPT), B)
    d = _book("decode-0", tp=2)
    d.on_new_request("d1", answer, PROMPT)
    plan = d.take_plan()
    assert plan.watches == [("t1", (PeerRef(RANKS[0].address, "gen-r0"),
                                     PeerRef(RANKS[1].address, "gen-r1")))]
    assert d.matched_tokens("d1", len(PROMPT), 0) == (40, True)


def test_prefill_answer_without_tp_keeps_the_default_and_ipv6_round_trips() -> None:
    book = _book("prefill-0", ranks=False)
    book.set_ranks([RankAddress("tcp://[::1]:7100", "g6")])
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    _, answer = book.finished("r1", True, P_BLOCKS, len(PROMPT))
    assert answer is not None and "tp_size" not in answer  # a default is omitted
    assert answer["remote_host"] == "::1"
    params = parse(answer)
    assert params.tp_size == 1
    assert params.peer(0) == PeerRef("tcp://[::1]:7100", "g6")


def test_prefill_leg_without_a_transfer_id_gets_one() -> None:
    book = _book("prefill-0")
    book.on_new_request("r7", {"do_remote_decode": True}, PROMPT)
    _, answer = book.finished("r7", True, P_BLOCKS, len(PROMPT))
    assert answer is not None and answer["transfer_id"] == "prefill-0-r7"
    assert book.take_plan().stages[0].transfer_id == "prefill-0-r7"


def test_prefill_pull_leg_aborted_pins_nothing() -> None:
    book = _book("prefill-0")
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    assert book.finished("r1", False, P_BLOCKS, len(PROMPT)) == (False, None)
    _plan_is_empty(book.take_plan())
    assert book.transfers_in_progress() == 0


def test_prefill_auto_mode_is_pull_on_the_engine() -> None:
    book = _book("prefill-0", mode="push")
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1",
                               "transfer_mode": "auto"}, PROMPT)
    assert not book.take_plan().announces
    _, answer = book.finished("r1", True, P_BLOCKS, len(PROMPT))
    assert answer is not None and answer["transfer_mode"] == "pull"


# -- P, push --------------------------------------------------------------------------------------


def _push_prefill(book: HandoffBook, req: str = "r2", tid: str = "t2", **kw: Any) -> None:
    book.on_new_request(req, {"do_remote_decode": True, "transfer_id": tid,
                              "transfer_mode": "push", **kw}, PROMPT)


def test_prefill_push_leg_announces_then_hands_over_after_its_last_prefill_step() -> None:
    book = _book("prefill-0")
    _push_prefill(book)
    assert book.has_pending()
    plan = book.take_plan()
    assert plan.announces == ["t2"] and not plan.push_ready and not plan.stages
    assert not book.has_pending()
    assert book.producers() == ["r2"]
    book.prefill_complete("r2", P_BLOCKS, len(PROMPT))
    plan = book.take_plan()
    assert plan.push_ready == [SendPlan("r2", "t2", (50, 51, 52), 40, DIGEST, False)]
    assert plan.prefill_done == ["t2"]
    assert book.producers() == []
    assert book.transfers_in_progress() == 1
    book.prefill_complete("r2", P_BLOCKS, len(PROMPT))  # a later step hands nothing twice
    keep, answer = book.finished("r2", True, P_BLOCKS, len(PROMPT))
    assert keep is True and answer is not None
    assert answer["transfer_id"] == "t2" and answer["transfer_mode"] == "push"
    assert answer["remote_host"] == "127.0.0.1" and answer["remote_port"] == 7100
    assert "remote_block_ids" not in answer and "do_remote_prefill" not in answer
    _plan_is_empty(book.take_plan())
    assert book.transfer_done("r2") == "t2"
    assert book.transfers_in_progress() == 0


def test_prefill_push_leg_aborted_before_completion_cancels() -> None:
    book = _book("prefill-0")
    _push_prefill(book)
    book.take_plan()
    assert book.finished("r2", False, P_BLOCKS, len(PROMPT)) == (False, None)
    plan = book.take_plan()
    assert plan.cancel_sends == ["t2"] and not plan.push_ready
    assert book.transfers_in_progress() == 0
    assert book.producers() == []


def test_prefill_push_leg_aborted_after_hand_over_keeps_its_blocks() -> None:
    book = _book("prefill-0")
    _push_prefill(book)
    book.prefill_complete("r2", P_BLOCKS, len(PROMPT))
    book.take_plan()
    keep, _ = book.finished("r2", False, P_BLOCKS, len(PROMPT))
    assert keep is True  # the WRITE may still land: blocks come back with finished_sending
    assert not book.take_plan().cancel_sends


def test_prefill_push_leg_finished_without_a_completed_step_still_pushes() -> None:
    book = _book("prefill-0")
    _push_prefill(book)
    book.take_plan()
    keep, _ = book.finished("r2", True, P_BLOCKS, len(PROMPT))
    assert keep is True
    assert book.take_plan().push_ready == [SendPlan("r2", "t2", (50, 51, 52), 40, DIGEST,
                                                    False)]


@pytest.mark.parametrize(("config", "param", "want"), [
    (False, None, False), (True, None, True), (True, False, False), (False, True, True)])
def test_push_layerwise_from_config_or_request(config: bool, param: bool | None,
                                               want: bool) -> None:
    book = _book("prefill-0", layerwise=config)
    extra: dict[str, Any] = {} if param is None else {"kvbridge_layerwise": param}
    _push_prefill(book, **extra)
    book.prefill_complete("r2", P_BLOCKS, len(PROMPT))
    assert book.take_plan().push_ready[0].layerwise is want


def test_default_mode_from_config() -> None:
    book = _book("prefill-0", mode="push")
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    assert book.take_plan().announces == ["t1"]
    assert book.producers() == ["r1"]


# -- D -----------------------------------------------------------------------------------------


def test_decode_pull_leg_receives_the_missing_blocks() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t3"), PROMPT)
    plan = book.take_plan()
    assert plan.watches == [("t3", (P_REF,))]
    assert book.matched_tokens("d1", 40, 0) == (40, True)
    assert book.matched_tokens("d1", 40, 16) == (24, True)  # a local prefix hit of one block
    book.after_alloc("d1", D_BLOCKS, 24, 40)
    plan = book.take_plan()
    assert plan.unwatches == [("t3", (P_REF,))]
    assert plan.recvs == [RecvOrder("d1", "t3", TransferMode.PULL, (P_REF,), (61, 62), (3, 9), 1,
                                    40, DIGEST, remote_skip=1)]
    assert plan.recvs[0].error is None
    assert book.transfers_in_progress() == 1
    # vLLM asks again once the KV arrived: nothing more to load, nothing planned twice
    assert book.matched_tokens("d1", 40, 40) == (0, False)
    book.after_alloc("d1", D_BLOCKS, 24, 40)
    _plan_is_empty(book.take_plan())
    assert book.transfer_done("d1") == "t3"
    assert book.transfers_in_progress() == 0
    assert book.finished("d1", True, D_BLOCKS, 40) == (False, None)
    _plan_is_empty(book.take_plan())


def test_decode_pull_leg_without_a_local_hit() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t3"), PROMPT)
    book.after_alloc("d1", D_BLOCKS, 40, 40)
    (order,) = book.take_plan().recvs
    assert (order.local_ids, order.remote_ids, order.skip_blocks) == ((60, 61, 62), (7, 3, 9), 0)


def test_decode_push_leg() -> None:
    book = _book("decode-0")
    book.on_new_request("d2", _push_leg("t4"), PROMPT)
    assert book.take_plan().watches == [("t4", (P_REF,))]
    assert book.matched_tokens("d2", 40, 32) == (8, True)
    book.after_alloc("d2", D_BLOCKS, 8, 40)
    plan = book.take_plan()
    assert plan.unwatches == [("t4", (P_REF,))]
    assert plan.recvs == [RecvOrder("d2", "t4", TransferMode.PUSH, (P_REF,), (62,), (), 2, 40,
                                    DIGEST, remote_skip=2)]


def test_decode_legs_name_every_ranks_peer() -> None:
    book = _book("decode-0", tp=2)
    peers = [{"address": "tcp://10.0.0.1:7000", "generation": "g0"},
             {"address": "tcp://10.0.0.2:7001", "generation": "g1"}]
    book.on_new_request("d1", _pull_leg("t5", tp_size=2, kvbridge_peers=peers), PROMPT)
    refs = (PeerRef("tcp://10.0.0.1:7000", "g0"), PeerRef("tcp://10.0.0.2:7001", "g1"))
    assert book.take_plan().watches == [("t5", refs)]
    book.after_alloc("d1", D_BLOCKS, 40, 40)
    plan = book.take_plan()
    assert plan.unwatches == [("t5", refs)] and plan.recvs[0].peers == refs


def test_decode_full_local_hit_releases_the_prefill() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t3"), PROMPT)
    book.take_plan()
    assert book.matched_tokens("d1", 40, 40) == (0, False)
    book.after_alloc("d1", [], 0, 40)
    plan = book.take_plan()
    assert plan.recvs == []
    assert [(tid, peers) for tid, peers, _ in plan.releases] == [("t3", (P_REF,))]
    assert plan.unwatches == [("t3", (P_REF,))]
    assert plan.counters == {"recv_full_local_hit": 1}
    assert book.transfers_in_progress() == 0
    assert book.finished("d1", True, D_BLOCKS, 40) == (False, None)
    _plan_is_empty(book.take_plan())  # no second unwatch, no cancel


def test_decode_abort_while_receiving_keeps_the_blocks() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t3"), PROMPT)
    book.after_alloc("d1", D_BLOCKS, 40, 40)
    book.take_plan()
    assert book.finished("d1", False, D_BLOCKS, 40) == (True, None)
    plan = book.take_plan()
    assert plan.cancel_recvs == ["t3"] and not plan.unwatches
    assert book.transfers_in_progress() == 1  # until the worker says the transfer stopped
    assert book.transfer_done("d1") == "t3"
    assert book.transfers_in_progress() == 0


def test_decode_abort_before_allocation_unwatches() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _push_leg("t4"), PROMPT)
    book.take_plan()
    assert book.finished("d1", False, [], 40) == (False, None)
    plan = book.take_plan()
    assert plan.unwatches == [("t4", (P_REF,))]
    assert not plan.cancel_recvs and not plan.recvs
    assert book.matched_tokens("d1", 40, 0) == (0, False)  # forgotten


def test_decode_planning_failure_after_allocation_is_reported_on_the_order() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t3"), PROMPT)
    book.after_alloc("d1", D_BLOCKS[:2], 40, 40)  # fewer blocks than the prompt
    (order,) = book.take_plan().recvs
    assert order.error is not None and "allocated" in order.error
    assert order.local_ids == ()
    assert book.transfers_in_progress() == 1  # the worker reports it failed, then it is done


def test_every_watch_is_unwatched_once() -> None:
    book = _book("decode-0")
    for i, (alloc, abort) in enumerate([(True, False), (False, True), (True, True)]):
        book.on_new_request(f"d{i}", _push_leg(f"t{i}"), PROMPT)
        if alloc:
            book.after_alloc(f"d{i}", D_BLOCKS, 40, 40)
        book.finished(f"d{i}", not abort, D_BLOCKS, 40)
        book.transfer_done(f"d{i}")
    plan = book.take_plan()
    assert sorted(t for t, _ in plan.watches) == ["t0", "t1", "t2"]
    assert sorted(t for t, _ in plan.unwatches) == ["t0", "t1", "t2"]


# -- hostile params never raise from a hook -----------------------------------------------------


def _deep(n: int) -> Any:
    value: Any = 1
    for _ in range(n):
        value = [value]
    return value


#: (key, malformed value), as in tests/unit/test_params.py
MALFORMED: list[tuple[str, Any]] = [
    ("remote_block_ids", "abc"), ("remote_port", "port"), ("remote_engine_id", 5),
    ("transfer_mode", "sideways"), ("remote_host", "a host"), ("remote_host", "h" * 254),
    ("remote_port", 0), ("remote_port", 70000), ("remote_block_ids", [1, -1]),
    ("remote_block_ids", [0] * 200_000), ("remote_block_ids", [[1], 2]),
    ("remote_block_ids", _deep(100_000)), ("transfer_id", "has spaces"),
    ("transfer_id", "t" * 129), ("tp_size", 0),
    ("kvbridge_peers", [{"address": "bad", "generation": "g"}]),
    ("kvbridge_peers", [{"address": "tcp://h:1", "generation": "g", "extra": 1}]),
    ("kvbridge_probe", "true"), ("kvbridge_layerwise", "true"), ("remote_num_tokens", -1),
    ("kvbridge_error", "e" * 5000), ("transfer_mode", "x" * (1 << 20)),
    ("kvbridge_identity", "NOT-HEX-0123456"), ("kvbridge_identity", "a" * 17),
    ("kvbridge_identity", 7),
]
IDS = [f"{k}-{i}" for i, (k, _) in enumerate(MALFORMED)]


def _drive(book: HandoffBook, req: str, raw: Any, prompt: list[int] | None = PROMPT
           ) -> tuple[tuple[int, bool], tuple[bool, dict[str, Any] | None]]:
    book.on_new_request(req, raw, prompt)
    matched = book.matched_tokens(req, 40, 0)
    book.after_alloc(req, D_BLOCKS, 40, 40)
    book.prefill_complete(req, P_BLOCKS, 40)
    return matched, book.finished(req, True, P_BLOCKS, 40)


def _nothing_handed_off(plan: StepPlan, rejected: int) -> None:
    assert not (plan.watches or plan.announces or plan.unwatches or plan.releases or plan.recvs
                or plan.stages or plan.push_ready or plan.cancel_recvs or plan.cancel_sends)
    assert plan.counters.get("params_rejected") == rejected


@pytest.mark.parametrize(("key", "value"), MALFORMED, ids=IDS)
def test_hostile_prefill_leg_is_served_locally_and_answers_why(key: str, value: Any) -> None:
    book = _book("prefill-0")
    raw = {"do_remote_decode": True, "transfer_id": "t-1", "transfer_mode": "push", key: value}
    matched, (keep, answer) = _drive(book, "r1", raw)
    assert matched == (0, False) and keep is False
    assert answer is not None and set(answer) == {"kvbridge_error"}
    assert answer["kvbridge_error"].startswith(f"kv_transfer_params.{key}: ")
    assert len(answer["kvbridge_error"]) <= 2048  # fits the key's own bound
    parse(answer)  # the router can read it
    assert book.producers() == [] and book.transfers_in_progress() == 0
    _nothing_handed_off(book.take_plan(), 1)


@pytest.mark.parametrize(("key", "value"), MALFORMED, ids=IDS)
def test_hostile_decode_leg_is_served_locally(key: str, value: Any) -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t-1", **{key: value}), PROMPT)
    assert book.matched_tokens("d1", 40, 0) == (0, False)
    book.after_alloc("d1", D_BLOCKS, 0, 40)
    book.finished("d1", True, D_BLOCKS, 40)
    assert book.transfers_in_progress() == 0
    _nothing_handed_off(book.take_plan(), 1)


@pytest.mark.parametrize("raw", [[], ["do_remote_decode"], "do_remote_decode", 5, 1.5, True,
                                 b"{}", _deep(100_000)], ids=lambda r: type(r).__name__)
def test_non_object_params_are_served_locally(raw: Any) -> None:
    book = _book("engine")
    matched, (keep, _answer) = _drive(book, "r1", raw)
    assert matched == (0, False) and keep is False
    _nothing_handed_off(book.take_plan(), 1)


@pytest.mark.parametrize("raw", [
    _pull_leg("t-1", remote_port="port"),
    _pull_leg("t-1", transfer_mode="sideways"),
    _pull_leg("t-1", remote_num_tokens=39),  # refused after parsing
    [], "x",
], ids=["bad-port", "bad-mode", "token-count", "list", "str"])
def test_refused_request_that_is_no_prefill_leg_answers_nothing(raw: Any) -> None:
    book = _book("decode-0")
    book.on_new_request("d1", raw, PROMPT)
    assert book.finished("d1", True, D_BLOCKS, 40) == (False, None)


def test_counters_are_reported_once() -> None:
    book = _book("engine")
    for i, (key, value) in enumerate(MALFORMED[:5]):
        book.on_new_request(f"r{i}", {"do_remote_decode": True, key: value}, PROMPT)
    assert book.take_plan().counters == {"params_rejected": 5}
    assert book.take_plan().counters == {}


def test_random_params_never_raise_from_a_hook() -> None:
    """Valid legs with random keys replaced: every hook answers, and a hand-off is only ever
    planned for params that parse and pass the decode-leg rules."""
    rng = random.Random(7)
    pool: list[Any] = [None, True, False, 0, 1, -1, 40, 39, 2, 70000, "", "x y", "push", "pull",
                       "t-dup", "tcp://h:1", [], [7, 3, 9], [[7, 3, 9]], [7, 7, 9], [1, 2],
                       {"a": 1}, [{"address": "tcp://h:1", "generation": "g"}], 1.5, "true",
                       _deep(1000), "x" * 300]
    keys = [f.name for f in msgspec.structs.fields(TransferParams)]
    book = _book("engine")
    live: set[str] = set()
    seen = {"recv": 0, "stage": 0, "refused": 0}
    for i in range(1500):
        raw = rng.choice([_pull_leg(), _push_leg(),
                          {"do_remote_decode": True, "transfer_id": "t-p"}])
        raw = {**raw, "transfer_id": f"t{i}"}
        for key in rng.sample(keys, rng.choice([0, 0, 1, 1, 2, 3])):
            if rng.random() < 0.2:
                raw.pop(key, None)
            else:
                raw[key] = rng.choice(pool)
        req = f"q{i}"
        prompt = None if rng.random() < 0.05 else PROMPT
        computed = rng.choice([0, 16, 32, 40])
        book.on_new_request(req, raw, prompt)
        count, load = book.matched_tokens(req, 40, computed)
        assert (count > 0) is load
        if load:
            params = parse(raw)
            params.check_decode_leg(params.mode(TransferMode.PULL), 40, B)
            assert count == 40 - computed
        book.after_alloc(req, D_BLOCKS, count, 40)
        book.prefill_complete(req, P_BLOCKS, 40)
        plan = book.take_plan()
        assert all(o.error is None for o in plan.recvs)
        seen["recv"] += len(plan.recvs)
        seen["refused"] += plan.counters.get("params_rejected", 0)
        if rng.random() < 0.5:
            keep, answer = book.finished(req, rng.random() < 0.7, P_BLOCKS, 40)
            if answer is not None:
                parse(answer)
            seen["stage"] += len(book.take_plan().stages)
            book.transfer_done(req)
        else:
            live.add(req)
        if rng.random() < 0.3 and live:  # a live request ends later
            old = live.pop()
            book.finished(old, True, P_BLOCKS, 40)
            book.transfer_done(old)
    for req in live:
        book.finished(req, False, P_BLOCKS, 40)
        book.transfer_done(req)
    assert book.transfers_in_progress() == 0
    assert min(seen.values()) > 50, seen  # hand-offs and refusals were both exercised


# -- duplicates, mismatches, probes, embeddings ---------------------------------------------------


def test_duplicate_transfer_id_is_served_locally_and_the_first_is_unaffected() -> None:
    book = _book("prefill-0")
    leg = {"do_remote_decode": True, "transfer_id": "dup"}
    book.on_new_request("r1", leg, PROMPT)
    book.on_new_request("r2", leg, PROMPT)  # n > 1: two requests, one hand-off
    assert book.take_plan().counters == {"params_rejected": 1}
    keep, answer = book.finished("r2", True, P_BLOCKS, 40)
    assert keep is False and answer is not None
    assert answer["kvbridge_error"].startswith("kv_transfer_params.transfer_id: ")
    assert "r1" in answer["kvbridge_error"]
    # r2 finishing does not free r1's id
    book.on_new_request("r3", leg, PROMPT)
    assert book.finished("r3", True, P_BLOCKS, 40)[0] is False
    keep, answer = book.finished("r1", True, P_BLOCKS, 40)
    assert keep is True and answer is not None and answer["transfer_id"] == "dup"
    plan = book.take_plan()
    assert [s.req_id for s in plan.stages] == ["r1"]
    # once r1 finished, the id may be used again
    book.on_new_request("r4", leg, PROMPT)
    keep, answer = book.finished("r4", True, P_BLOCKS, 40)
    assert keep is True and answer is not None and "kvbridge_error" not in answer


def test_duplicate_transfer_id_on_decode() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _push_leg("dup"), PROMPT)
    book.on_new_request("d2", _push_leg("dup"), PROMPT)
    plan = book.take_plan()
    assert [t for t, _ in plan.watches] == ["dup"]
    assert plan.counters == {"params_rejected": 1}
    assert book.matched_tokens("d2", 40, 0) == (0, False)
    assert book.matched_tokens("d1", 40, 0) == (40, True)
    book.finished("d1", False, [], 40)
    book.on_new_request("d3", _push_leg("dup"), PROMPT)
    assert book.matched_tokens("d3", 40, 0) == (40, True)


@pytest.mark.parametrize("raw", [
    _pull_leg(remote_num_tokens=39),
    _pull_leg(remote_num_tokens=41),
    _push_leg(remote_num_tokens=39),
    _pull_leg(tp_size=2),
    _push_leg(tp_size=2),
    {k: v for k, v in _pull_leg().items() if k not in ("remote_host", "remote_port")},
    {k: v for k, v in _push_leg().items() if k != "remote_port"},
    {k: v for k, v in _pull_leg().items() if k != "remote_block_ids"},
    _pull_leg(remote_block_ids=[7, 3]),
    _pull_leg(remote_block_ids=[7, 7, 3]),
], ids=["tokens-39", "tokens-41", "push-tokens", "tp", "push-tp", "no-address", "no-port",
        "no-ids", "short-ids", "dup-ids"])
def test_decode_leg_that_does_not_fit_is_served_locally(raw: dict[str, Any]) -> None:
    book = _book("decode-0")
    book.on_new_request("d1", raw, PROMPT)
    assert book.matched_tokens("d1", 40, 0) == (0, False)
    book.after_alloc("d1", D_BLOCKS, 0, 40)
    assert book.finished("d1", True, D_BLOCKS, 40)[0] is False
    _nothing_handed_off(book.take_plan(), 1)


@pytest.mark.parametrize("leg", [_pull_leg, _push_leg])
def test_a_prefill_of_another_model_identity_is_refused_and_released(leg: Any) -> None:
    """A prefill engine whose answer names another model identity (other weights, or weights
    reloaded on one side only) is refused before anything is claimed or registered: the prompt
    is computed here, the refusal names both identities, and P is told to release at once."""
    book = _book("decode-0")
    book.identity = "aaaaaaaaaaaaaaaa"
    book.on_new_request("d1", leg(kvbridge_identity="bbbbbbbbbbbbbbbb"), PROMPT)
    assert book.matched_tokens("d1", 40, 0) == (0, False)
    plan = book.take_plan()
    [(tid, peers, why)] = plan.releases
    assert tid in ("t-pull", "t-push") and peers == (P_REF,)
    assert "bbbbbbbbbbbbbbbb" in why and "aaaaaaaaaaaaaaaa" in why
    assert plan.counters["identity_refused"] == 1 and plan.counters["params_rejected"] == 1
    # the same identity, or a prefill engine that names none: handed off as always
    for n, named in enumerate(({"kvbridge_identity": "aaaaaaaaaaaaaaaa"}, {})):
        book.on_new_request(f"ok{n}", leg(tid=f"t-ok{n}", **named), PROMPT)
        assert book.matched_tokens(f"ok{n}", 40, 0) == (40, True)


def test_answers_name_this_engines_identity() -> None:
    book = _book("prefill-0")
    assert parse(book.address_params()).kvbridge_identity is None  # not set: not named
    book.identity = "0123456789abcdef"
    assert parse(book.address_params()).kvbridge_identity == "0123456789abcdef"


def test_decode_leg_whose_peers_do_not_match_the_engine_tp_is_served_locally() -> None:
    book = _book("decode-0", tp=2)
    raw = _pull_leg(tp_size=2, kvbridge_peers=[{"address": "tcp://h:1", "generation": "g"}])
    book.on_new_request("d1", raw, PROMPT)
    assert book.matched_tokens("d1", 40, 0) == (0, False)


def test_probe_reports_the_kv_events_publisher_on_the_advertised_host() -> None:
    book = _book("prefill-0")
    book.kv_events = (5557, "kv")
    book.on_new_request("q1", {"kvbridge_probe": True}, [1, 2, 3])
    _, answer = book.finished("q1", True, [], 3)
    params = parse(answer)
    assert params.kvbridge_kv_events == "tcp://127.0.0.1:5557"
    assert params.kvbridge_kv_events_topic == "kv"
    six = _book("prefill-6", ranks=False)
    six.set_ranks([RankAddress("tcp://[::1]:7100", "g6")])
    six.kv_events = (6000, "")
    assert six.probe_params()["kvbridge_kv_events"] == "tcp://[::1]:6000"
    assert "kvbridge_kv_events_topic" not in six.probe_params()  # "" is the default
    # a hand-off answer does not carry it: only the probe reports it
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    _, answer = book.finished("r1", True, P_BLOCKS, len(PROMPT))
    assert answer is not None and "kvbridge_kv_events" not in answer


def test_kv_events_publisher_is_reported_only_when_a_proxy_can_subscribe() -> None:
    from types import SimpleNamespace as NS

    from kvbridge.integrations.vllm_meta import kv_events_publisher

    def cfg(endpoint: str, publisher: str = "zmq", on: bool = True, rank: int = 0,
            topic: str = "kv") -> Any:
        return NS(kv_events_config=NS(enable_kv_cache_events=on, publisher=publisher,
                                      endpoint=endpoint, topic=topic),
                  parallel_config=NS(data_parallel_rank=rank))

    assert kv_events_publisher(cfg("tcp://*:5557")) == (5557, "kv")
    assert kv_events_publisher(cfg("tcp://*:5557", rank=2)) == (5559, "kv")  # as vLLM offsets
    assert kv_events_publisher(cfg("tcp://[::]:5557", topic="")) == (5557, "")
    for bad in (cfg("tcp://*:0"), cfg("tcp://*:5557", on=False), cfg("tcp://*:5557", "null"),
                cfg("ipc:///tmp/kv"), cfg("tcp://10.0.0.9:5557"), cfg("tcp://*:x"),
                NS(kv_events_config=None)):
        assert kv_events_publisher(bad) is None


def test_tensor_parallel_decode_leg_needs_every_ranks_address() -> None:
    book = _book("decode-0", tp=2)
    book.on_new_request("d1", _pull_leg(tp_size=2), PROMPT)
    assert book.matched_tokens("d1", 40, 0) == (0, False)


def test_probe_answers_the_address_and_pins_nothing() -> None:
    book = _book("prefill-0", tp=2)
    book.on_new_request("q1", {"kvbridge_probe": True}, [1, 2, 3])
    assert book.matched_tokens("q1", 3, 0) == (0, False)
    book.prefill_complete("q1", [1], 3)
    keep, answer = book.finished("q1", True, [1], 3)
    assert keep is False and answer == book.address_params()
    params = parse(answer)
    assert params.remote_engine_id == "prefill-0" and params.tp_size == 2
    assert params.remote_host == "127.0.0.1" and params.remote_port == 7100
    assert params.kvbridge_peers == [PeerRef(r.address, r.generation) for r in RANKS]
    assert params.kvbridge_version
    assert not params.do_remote_decode and not params.do_remote_prefill
    plan = book.take_plan()
    assert not plan and not plan.prefill_done
    assert book.transfers_in_progress() == 0


def test_probe_before_the_ranks_are_known_answers_nothing() -> None:
    book = _book("prefill-0", ranks=False)
    book.on_new_request("q1", {"kvbridge_probe": True, "do_remote_decode": True}, [1])
    assert book.address_params() == {}
    assert book.finished("q1", True, [1], 1) == (False, None)
    _plan_is_empty(book.take_plan())


@pytest.mark.parametrize("raw", [{"do_remote_decode": True, "transfer_id": "t"},
                                 {"do_remote_decode": True, "transfer_mode": "push"},
                                 _pull_leg(), _push_leg()], ids=["pull", "push", "d-pull",
                                                                 "d-push"])
def test_prompt_without_token_ids_is_served_locally(raw: dict[str, Any]) -> None:
    book = _book("engine")
    matched, (keep, answer) = _drive(book, "e1", raw, prompt=None)
    assert matched == (0, False) and keep is False
    if raw.get("do_remote_decode"):
        assert answer is not None and answer["kvbridge_error"].startswith("prompt: ")
    _nothing_handed_off(book.take_plan(), 1)


def test_requests_without_a_hand_off_are_ignored() -> None:
    book = _book("engine")
    for i, raw in enumerate([None, {}, {"unknown": 1}, {"do_remote_decode": False}]):
        matched, finished = _drive(book, f"n{i}", raw)
        assert matched == (0, False) and finished == (False, None)
    plan = book.take_plan()
    _plan_is_empty(plan)
    assert plan.counters == {}


def test_each_request_is_parsed_once() -> None:
    book = _book("decode-0")
    book.on_new_request("d1", _push_leg("t1"), PROMPT)
    book.on_new_request("d1", {"remote_port": "bad"}, PROMPT)  # vLLM calls again: ignored
    plan = book.take_plan()
    assert len(plan.watches) == 1 and plan.counters == {}
    assert book.matched_tokens("d1", 40, 0) == (40, True)


def test_unknown_requests_are_no_ops() -> None:
    book = _book("engine")
    assert book.matched_tokens("ghost", 40, 0) == (0, False)
    book.after_alloc("ghost", D_BLOCKS, 40, 40)
    book.prefill_complete("ghost", P_BLOCKS, 40)
    assert book.finished("ghost", False, [], 40) == (False, None)
    assert book.transfer_done("ghost") is None
    _plan_is_empty(book.take_plan())


def test_step_plan_pickles() -> None:
    book = _book("decode-0", tp=2)
    peers = [{"address": "tcp://10.0.0.1:7000", "generation": "g0"},
             {"address": "tcp://10.0.0.2:7001", "generation": "g1"}]
    book.on_new_request("d1", _pull_leg("t5", tp_size=2, kvbridge_peers=peers), PROMPT)
    book.after_alloc("d1", D_BLOCKS, 24, 40)
    book.on_new_request("d2", {"remote_port": 0}, PROMPT)
    plan = book.take_plan()
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.recvs[0].peers[1] == PeerRef("tcp://10.0.0.2:7001", "g1")


# -- vLLM's clean-up request (issue 33 item 2) ------------------------------------------------

RELEASE_WHY = "the decode leg was rejected (vLLM's clean-up request)"


@pytest.mark.parametrize("leg", [_pull_leg("t-gone"), _push_leg("t-gone")])
def test_vllm_cleanup_releases_the_prefill_and_is_no_rejection(leg: dict[str, Any]) -> None:
    """vLLM's clean-up of a rejected decode leg (prompt [0], the leg's params, aborted at
    once): P is asked to release the transfer, counted apart from params_rejected, nothing is
    watched, received or kept here."""
    book = _book("decode-0")
    book.on_new_request("cmpl-x", leg, [0], cleanup=True)
    assert book.matched_tokens("cmpl-x", 1, 0) == (0, False)
    assert book.finished("cmpl-x", False, [], 1) == (False, None)
    plan = book.take_plan()
    assert plan.releases == [("t-gone", (P_REF,), RELEASE_WHY)]
    assert not (plan.watches or plan.unwatches or plan.recvs or plan.cancel_recvs)
    assert plan.counters == {"cleanup_requests": 1}
    assert book.transfers_in_progress() == 0


def test_the_cleanup_shape_from_a_client_is_still_a_rejection() -> None:
    """Prompt [0] with a decode leg's params, sent by a client (not aborted by vLLM): a real
    mismatch, served locally and counted as before; nothing is released."""
    book = _book("decode-0")
    book.on_new_request("r1", _pull_leg("t-gone"), [0])
    plan = book.take_plan()
    assert plan.counters == {"params_rejected": 1} and not plan.releases


@pytest.mark.parametrize("raw", [{"do_remote_prefill": True, "remote_block_ids": "abc"},
                                 {"do_remote_prefill": True, "transfer_id": "t-x"},
                                 {"do_remote_decode": True, "transfer_id": "t-x"}, [1, 2]])
def test_vllm_cleanup_that_names_nothing_releases_nothing(raw: Any) -> None:
    book = _book("decode-0")
    book.on_new_request("cmpl-x", raw, [0], cleanup=True)
    assert book.finished("cmpl-x", False, [], 1) == (False, None)
    plan = book.take_plan()
    assert plan.counters == {"cleanup_requests": 1} and not plan.releases
    assert not (plan.watches or plan.unwatches or plan.stages or plan.cancel_sends)


def test_vllm_cleanup_never_releases_a_transfer_a_request_here_named() -> None:
    """A hostile client gets vLLM to send a clean-up naming another request's transfer: while
    that request waits, receives, its receive is still stopping, or after it ended, nothing is
    released (a Cancel from this engine's connection would end that request's claim; and a
    claim P refused cancels nothing, so neither may the clean-up that follows the failure)."""
    book = _book("decode-0")
    book.on_new_request("d1", _pull_leg("t-live"), PROMPT)
    book.on_new_request("evil-1", _pull_leg("t-live"), [0], cleanup=True)  # waiting
    book.after_alloc("d1", D_BLOCKS, 40, 40)
    book.on_new_request("evil-2", _pull_leg("t-live"), [0], cleanup=True)  # receiving
    assert book.finished("d1", False, D_BLOCKS, 40) == (True, None)
    book.on_new_request("evil-3", _pull_leg("t-live"), [0], cleanup=True)  # still stopping
    assert book.transfer_done("d1") == "t-live"
    book.on_new_request("evil-4", _pull_leg("t-live"), [0], cleanup=True)  # it ended
    book.on_new_request("d2", _pull_leg("t-refused", remote_num_tokens=7), PROMPT)
    book.on_new_request("evil-5", _pull_leg("t-refused"), [0], cleanup=True)  # served locally
    plan = book.take_plan()
    assert not plan.releases
    assert [o.transfer_id for o in plan.recvs] == ["t-live"] and plan.cancel_recvs == ["t-live"]
    assert plan.counters == {"cleanup_requests": 5, "cleanup_ignored": 5, "params_rejected": 1}


def test_vllm_cleanup_remembers_a_bounded_number_of_transfers() -> None:
    book = _book("decode-0")
    book.on_new_request("d0", _pull_leg("t-old"), PROMPT)
    book.finished("d0", False, [], 40)
    for i in range(REMEMBERED_TRANSFERS):
        book.on_new_request(f"r{i}", {"transfer_id": f"t{i}"}, PROMPT)
    book.take_plan()
    book.on_new_request("cmpl-x", _pull_leg("t-old"), [0], cleanup=True)
    assert book.take_plan().releases == [("t-old", (P_REF,), RELEASE_WHY)]


def test_an_oversized_transfer_id_is_refused_and_not_remembered() -> None:
    """A client's transfer_id too long for the parser is a rejection, and the book does not
    keep it (the remembered ids are a bounded LookupBuffer of bounded keys)."""
    book = _book("decode-0")
    huge = "t" * 100_000
    book.on_new_request("r-huge", {"transfer_id": huge}, PROMPT)
    assert book.stats["params_rejected"] == 1
    assert huge not in book._named and len(book._named) == 0  # noqa: SLF001


def test_a_request_can_ask_to_be_left_out_of_the_flight_record() -> None:
    book = _book()
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    book.on_new_request("r2", {"do_remote_decode": True, "transfer_id": "t2",
                               "kvbridge_record": False}, PROMPT)
    book.on_new_request("r3", {"do_remote_decode": True, "kvbridge_record": "no"}, PROMPT)
    assert book.recorded("r1") and not book.recorded("r2")
    assert book.transfer_of("r2") == "t2"  # a hand-off like any other
    assert book.recorded("r3") and book.recorded("unknown")  # refused or unknown: as before

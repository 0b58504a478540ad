"""The proxy's routing policy as pure functions: picks, mode decisions, request bodies, probes."""

from __future__ import annotations

import copy
import math
import re

import pytest

from kvbridge import params
from kvbridge.config import TransferMode
from kvbridge.errors import ConfigError, ParamsError
from kvbridge.params import PeerRef, TransferParams
from kvbridge.proxy.reasons import pick_reason
from kvbridge.proxy.routing import (
    RETRYABLE,
    Cause,
    Decision,
    Pool,
    PrefillRefused,
    ProbeInfo,
    ProxyMode,
    RequestProblem,
    Retry,
    Role,
    control_addresses,
    decide,
    decode_body,
    new_transfer_id,
    normalize_url,
    parse_probe,
    plan_retry,
    prefill_body,
    probe_body,
    pull_decode_params,
    push_decode_params,
    read_prefill_answer,
    validate_request,
)

pytestmark = pytest.mark.timeout(30)


def pool(n: int, role: Role = Role.DECODE) -> Pool:
    return Pool(role, [f"127.0.0.1:{9000 + i}" for i in range(n)])


def test_pool_needs_engines_and_normalizes_urls() -> None:
    with pytest.raises(ConfigError, match="decode"):
        Pool(Role.DECODE, [])
    assert normalize_url("h:1") == "http://h:1"
    assert normalize_url(" http://h:1/ ") == "http://h:1"
    assert normalize_url("https://h") == "https://h"
    p = pool(2)
    assert p.by_url("http://127.0.0.1:9001") is p.engines[1]
    assert p.by_url("127.0.0.1:9000/") is p.engines[0]
    assert p.by_url("http://nowhere:1") is None


def test_pick_round_robin_when_equal_load() -> None:
    p = pool(3)
    urls = [p.pick().url for _ in range(6)]
    assert urls == [e.url for e in p.engines] * 2


def test_pick_least_loaded() -> None:
    p = pool(3)
    p.engines[0].in_flight = 2
    p.engines[1].in_flight = 0
    p.engines[2].in_flight = 1
    assert p.pick() is p.engines[1]
    # acquiring shifts load: a burst spreads instead of piling on one engine
    picks = []
    for _ in range(3):
        e = p.pick()
        e.acquire()
        picks.append(p.engines.index(e))
    assert sorted(e.in_flight for e in p.engines) == [2, 2, 2]
    assert picks.count(1) == 2


def test_acquire_release_counts() -> None:
    e = pool(1).engines[0]
    e.acquire()
    e.acquire()
    e.release()
    assert (e.in_flight, e.total) == (1, 2)
    e.release()
    e.release()  # never negative
    assert e.in_flight == 0


def test_pick_skips_engines_marked_down_until_cooldown() -> None:
    p = pool(2)
    p.engines[0].mark_down("refused", cooldown_s=10.0, now=100.0)
    assert p.engines[0].errors == 1 and p.engines[0].last_error == "refused"
    assert all(p.pick(now=101.0) is p.engines[1] for _ in range(4))
    assert p.engines[0].is_up(now=111.0)
    # every engine down: still pick one (the caller fails fast with a clear error)
    p.engines[1].mark_down("refused", cooldown_s=10.0, now=100.0)
    assert p.pick(now=101.0) in p.engines
    p.engines[0].mark_up()
    assert p.pick(now=101.0) is p.engines[0]


def test_least_in_flight_ignores_down_engines() -> None:
    p = pool(2)
    p.engines[0].in_flight = 0
    p.engines[1].in_flight = 5
    p.engines[0].mark_down("x", 10.0, now=0.0)
    assert p.least_in_flight(now=1.0) == 5
    assert p.least_in_flight(now=20.0) == 0


def test_pool_refuses_an_engine_listed_twice() -> None:
    with pytest.raises(ConfigError, match="twice"):
        Pool(Role.PREFILL, ["127.0.0.1:9000", "http://127.0.0.1:9000/"])


def test_pick_avoids_tried_engines_while_another_is_in_rotation() -> None:
    p = pool(3)
    tried = {p.engines[0].url, p.engines[1].url}
    assert all(p.pick(avoid=tried) is p.engines[2] for _ in range(3))
    assert p.has_untried(tried) and not p.has_untried({e.url for e in p.engines})
    # the untried engine is out of rotation: a tried one that is up beats it
    p.engines[2].mark_down("refused", math.inf, now=0.0)
    assert not p.has_untried(tried, now=1.0)
    assert p.pick(now=1.0, avoid=tried) in p.engines[:2]
    # everything tried and out: still one engine (the caller fails fast)
    for e in p.engines:
        e.mark_down("refused", math.inf, now=0.0)
    assert p.pick(now=1.0, avoid=tried) in p.engines


def test_health_checks_take_engines_out_and_back() -> None:
    e = pool(1).engines[0]
    # timeouts / non-200: out after `threshold` failures in a row; a pass resets the count
    assert not e.check_failed("timeout", refused=False, threshold=2, now=1.0)
    assert e.check_passed(started=1.5, now=2.0) is False and e.failed_checks == 0
    assert not e.check_failed("timeout", refused=False, threshold=2, now=3.0)
    assert e.check_failed("timeout", refused=False, threshold=2, now=4.0)
    assert not e.is_up(now=1e9) and e.last_error == "timeout"  # out until a check passes
    assert not e.check_failed("timeout", refused=False, threshold=2, now=5.0)  # already out
    assert e.check_passed(started=6.0, now=6.1) and e.is_up(now=6.1)
    # a refused connection takes it out at once
    assert e.check_failed("refused", refused=True, threshold=5, now=7.0)
    assert e.down_since == 7.0 and not e.is_up(now=8.0)
    # a check that began before the engine was taken out does not put it back
    e.check_passed(started=10.0, now=10.5)
    e.mark_down("connection reset", math.inf, now=11.0)
    assert not e.check_passed(started=10.8, now=11.2) and not e.is_up(now=11.2)
    assert e.check_passed(started=11.5, now=12.0) and e.is_up(now=12.0)


_RETRY_CASES = [
    # (mode, role, cause, other P, other D) -> plan
    ("pull", "prefill", Cause.UNREACHABLE, True, True, Retry("prefill_failed")),
    ("pull", "prefill", Cause.BROKEN, True, False, Retry("prefill_failed")),
    ("push", "prefill", Cause.SERVER_ERROR, True, False, Retry("prefill_failed")),
    ("pull", "prefill", Cause.SERVER_ERROR, False, True, None),  # no other P
    ("pull", "decode", Cause.UNREACHABLE, False, True,
     Retry("decode_unreachable", reuse_prefill=True)),
    ("pull", "decode", Cause.UNREACHABLE, True, False, None),  # P's answer needs another D
    ("pull", "decode", Cause.BROKEN, True, False, Retry("decode_failed")),
    ("pull", "decode", Cause.SERVER_ERROR, False, True, Retry("decode_failed")),
    ("push", "decode", Cause.UNREACHABLE, False, True, Retry("decode_failed")),
    ("push", "decode", Cause.BROKEN, True, False, Retry("decode_failed")),
    ("push", "decode", Cause.SERVER_ERROR, False, False, None),  # nowhere else to go
]


@pytest.mark.parametrize(("mode", "role", "cause", "other_p", "other_d", "plan"), _RETRY_CASES)
def test_plan_retry(mode: str, role: str, cause: Cause, other_p: bool, other_d: bool,
                    plan: Retry | None) -> None:
    got = plan_retry(ProxyMode(mode), Role(role), cause, retries=0, max_retries=1,
                     other_prefill=other_p, other_decode=other_d)
    assert got == plan


@pytest.mark.parametrize("cause", sorted(set(Cause) - RETRYABLE))
@pytest.mark.parametrize("role", list(Role))
def test_plan_retry_never_retries_what_the_request_or_a_bad_answer_caused(
    cause: Cause, role: Role
) -> None:
    """A 4xx, a refusal, a malformed (forged) answer or a spent timeout is final."""
    for mode in (ProxyMode.PULL, ProxyMode.PUSH):
        assert plan_retry(mode, role, cause, retries=0, max_retries=5, other_prefill=True,
                          other_decode=True) is None


def test_plan_retry_budget_and_modes() -> None:
    args = {"other_prefill": True, "other_decode": True}
    assert plan_retry(ProxyMode.PULL, Role.PREFILL, Cause.BROKEN, retries=1, max_retries=1,
                      **args) is None
    assert plan_retry(ProxyMode.PULL, Role.PREFILL, Cause.BROKEN, retries=1, max_retries=2,
                      **args) == Retry("prefill_failed")
    assert plan_retry(ProxyMode.PULL, Role.PREFILL, Cause.BROKEN, retries=0, max_retries=0,
                      **args) is None
    for mode in (ProxyMode.AUTO, ProxyMode.HEADROOM):
        with pytest.raises(ValueError, match="concrete"):
            plan_retry(mode, Role.PREFILL, Cause.BROKEN, retries=0, max_retries=1, **args)


def test_decide_fixed_modes_ignore_load() -> None:
    p = pool(1)
    p.engines[0].in_flight = 100
    assert decide(ProxyMode.PUSH, p, 4) == Decision(ProxyMode.PUSH, "configured")
    p.engines[0].in_flight = 0
    assert decide(ProxyMode.PULL, p, 4) == Decision(ProxyMode.PULL, "configured")


def test_decide_headroom_pushes_with_headroom_pulls_when_busy() -> None:
    p = pool(2)
    p.engines[0].in_flight = 4
    p.engines[1].in_flight = 3
    assert decide(ProxyMode.HEADROOM, p, 4) == Decision(ProxyMode.PUSH, "headroom")
    p.engines[1].in_flight = 4
    assert decide(ProxyMode.HEADROOM, p, 4) == Decision(ProxyMode.PULL, "busy")
    assert decide(ProxyMode.HEADROOM, p, 5).mode is ProxyMode.PUSH
    assert decide(ProxyMode.HEADROOM, p, 0).mode is ProxyMode.PULL  # headroom 0: always pull


def test_decide_leaves_auto_to_the_planner() -> None:
    """auto is the planner's (kvbridge.proxy.planner), not a load rule; plan is its other name."""
    for mode in (ProxyMode.AUTO, ProxyMode.PLAN, ProxyMode("plan")):
        with pytest.raises(ValueError, match="planner"):
            decide(mode, pool(1), 4)


def test_plan_is_another_name_of_auto() -> None:
    assert ProxyMode("plan") is ProxyMode.AUTO and ProxyMode.PLAN is ProxyMode.AUTO
    assert ProxyMode("headroom") is ProxyMode.HEADROOM
    assert [m.value for m in ProxyMode] == ["pull", "push", "auto", "headroom", "local"]
    assert ProxyMode.names() == ["pull", "push", "auto", "headroom", "local", "plan"]
    with pytest.raises(ValueError):
        ProxyMode("planner")


def test_transfer_ids_are_fresh() -> None:
    ids = {new_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"xfer-[0-9a-f]{32}", i) for i in ids)


BODY = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 50,
    "min_tokens": 5,
    "min_completion_tokens": 5,
    "max_completion_tokens": 50,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.0,
}


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
def test_prefill_body(mode: ProxyMode) -> None:
    original = copy.deepcopy(BODY)
    out = prefill_body(BODY, "xfer-1", mode)
    assert BODY == original  # the client's request is not mutated
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False
    for gone in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert gone not in out
    assert out["temperature"] == 0.0 and out["prompt"] == "hello"
    assert out["kv_transfer_params"] == params.prefill_request("xfer-1", mode)
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "transfer_id": "xfer-1",
        "transfer_mode": mode.value,
    }
    assert params.parse(out["kv_transfer_params"]).mode(TransferMode.AUTO) is mode.transfer


def test_prefill_body_adds_no_max_completion_tokens_and_rejects_auto() -> None:
    out = prefill_body({"prompt": "x"}, "xfer-2", ProxyMode.PULL)
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out
    for mode in (ProxyMode.AUTO, ProxyMode.HEADROOM, ProxyMode.LOCAL):
        with pytest.raises(ValueError):
            prefill_body({"prompt": "x"}, "xfer-2", mode)


PROBE_ANSWER = {
    "remote_engine_id": "P-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 2,
    "kvbridge_version": "0.1.0",
    "kvbridge_generation": "g-1",
    "kvbridge_peers": [
        {"address": "tcp://10.0.0.1:5600", "generation": "g-1"},
        {"address": "tcp://10.0.0.1:5601", "generation": "g-1r1"},
    ],
}


def test_the_planner_can_leave_d_tiers_out_of_a_hand_off() -> None:
    probe = parse_probe(PROBE_ANSWER)
    assert "kvbridge_tiers" not in push_decode_params(probe, "xfer-1")
    assert push_decode_params(probe, "xfer-1", tiers=False)["kvbridge_tiers"] is False
    answer = params.parse({"do_remote_prefill": True, "remote_block_ids": [1], "transfer_id": "t"})
    assert "kvbridge_tiers" not in pull_decode_params(answer, {"remote_block_ids": [1]})
    out = pull_decode_params(answer, {"remote_block_ids": [1]}, tiers=False)
    assert out == {"remote_block_ids": [1], "transfer_id": "t", "kvbridge_tiers": False}
    assert params.parse(out).kvbridge_tiers is False
    for bad in ("no", 0, 1, None.__class__.__name__, [False]):
        with pytest.raises(ParamsError, match="kvbridge_tiers"):
            params.parse({"kvbridge_tiers": bad})


def test_decode_bodies() -> None:
    kvp = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "transfer_id": "xfer-3"}
    out = decode_body({**BODY, "kv_transfer_params": {"client": 1}}, kvp)
    assert out["kv_transfer_params"] == kvp and out["kv_transfer_params"] is not kvp
    assert out["max_tokens"] == 50 and out["stream"] is True and out["min_tokens"] == 5
    probe = parse_probe(PROBE_ANSWER)
    d_params = push_decode_params(probe, "xfer-4")
    assert d_params == {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": "xfer-4",
        "remote_engine_id": "P-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "kvbridge_generation": "g-1",
        "kvbridge_peers": PROBE_ANSWER["kvbridge_peers"],
    }
    # what D parses is what the probe said, for every rank
    parsed = params.parse(d_params)
    assert parsed.peer(1) == PeerRef("tcp://10.0.0.1:5601", "g-1r1")
    assert parsed.mode(TransferMode.PULL) is TransferMode.PUSH


def test_probe_roundtrip_and_errors() -> None:
    body = probe_body("qwen")
    assert body == {
        "model": "qwen",
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": {"kvbridge_probe": True},
    }
    assert params.parse(body["kv_transfer_params"]).kvbridge_probe
    info = parse_probe(PROBE_ANSWER)
    assert (info.engine_id, info.host, info.port, info.tp_size) == ("P-1", "10.0.0.1", 5600, 2)
    assert info.version == "0.1.0" and info.generation == "g-1"
    assert info.addresses() == ["tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601"]
    plain = parse_probe({"remote_engine_id": "P", "remote_host": "h", "remote_port": 7})
    assert plain.tp_size == 1 and plain.generation is None and plain.version == "?"
    assert plain.addresses() == ["tcp://h:7"]
    with pytest.raises(ParamsError, match="KVBridgeConnector") as err:
        parse_probe(None)
    assert err.value.field == "kv_transfer_params"
    with pytest.raises(ParamsError) as err:
        parse_probe({**PROBE_ANSWER, "remote_port": None})
    assert err.value.field == "kv_transfer_params.remote_port"
    # strict types: no string-to-int coercion, the key is named
    for key, bad in [("remote_port", "5600"), ("tp_size", "two"), ("remote_engine_id", 5),
                     ("kvbridge_peers", [{"address": "nowhere"}])]:
        with pytest.raises(ParamsError) as err:
            parse_probe({**PROBE_ANSWER, key: bad})
        assert err.value.field == f"kv_transfer_params.{key}", (key, err.value)


def test_control_addresses() -> None:
    assert control_addresses(TransferParams()) == []
    assert control_addresses(TransferParams(remote_host="::1", remote_port=9)) == ["tcp://[::1]:9"]
    assert control_addresses(params.parse(PROBE_ANSWER)) == [
        "tcp://10.0.0.1:5600",
        "tcp://10.0.0.1:5601",
    ]


PULL_ANSWER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "P-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_block_ids": [3, 4, 5],
    "remote_num_tokens": 40,
    "transfer_id": "xfer-5",
    "transfer_mode": "pull",
    "kvbridge_generation": "g-1",
}


def test_read_prefill_answer_pull() -> None:
    answer = read_prefill_answer(PULL_ANSWER, "xfer-5", ProxyMode.PULL)
    assert answer.remote_block_ids == [3, 4, 5] and answer.kvbridge_generation == "g-1"
    wire = pull_decode_params(answer)
    assert params.parse(wire) == answer
    assert wire["remote_block_ids"] == [3, 4, 5] and wire["transfer_id"] == "xfer-5"
    # vLLM's per-group form is accepted; a stock answer without transfer_id gets the proxy's
    stock = {k: v for k, v in PULL_ANSWER.items() if k != "transfer_id"}
    stock["remote_block_ids"] = [[3, 4, 5]]
    answer = read_prefill_answer(stock, "xfer-5", ProxyMode.PULL)
    assert answer.transfer_id == "xfer-5" and answer.remote_block_ids == [3, 4, 5]


@pytest.mark.parametrize(
    ("raw", "mode", "field"),
    [
        (None, ProxyMode.PULL, "kv_transfer_params"),
        ([1, 2], ProxyMode.PUSH, "kv_transfer_params"),
        ({**PULL_ANSWER, "remote_block_ids": "abc"}, ProxyMode.PULL,
         "kv_transfer_params.remote_block_ids"),
        ({**PULL_ANSWER, "remote_port": "port"}, ProxyMode.PUSH, "kv_transfer_params.remote_port"),
        ({**PULL_ANSWER, "transfer_mode": "sideways"}, ProxyMode.PULL,
         "kv_transfer_params.transfer_mode"),
        ({**PULL_ANSWER, "transfer_id": "xfer-other"}, ProxyMode.PUSH,
         "kv_transfer_params.transfer_id"),
        ({**PULL_ANSWER, "remote_block_ids": None}, ProxyMode.PULL,
         "kv_transfer_params.remote_block_ids"),
        ({**PULL_ANSWER, "do_remote_prefill": False}, ProxyMode.PULL,
         "kv_transfer_params.do_remote_prefill"),
    ],
)
def test_read_prefill_answer_names_the_bad_key(raw: object, mode: ProxyMode, field: str) -> None:
    with pytest.raises(ParamsError) as err:
        read_prefill_answer(raw, "xfer-5", mode)
    assert err.value.field == field, err.value


def test_read_prefill_answer_push_needs_no_blocks() -> None:
    answer = read_prefill_answer({"transfer_id": "xfer-5", "transfer_mode": "push"}, "xfer-5",
                                 ProxyMode.PUSH)
    assert answer.remote_block_ids is None


@pytest.mark.parametrize(
    ("error", "malformed", "param"),
    [
        ("prompt: a hand-off needs token-id prompts", True, "prompt"),
        ("kv_transfer_params.transfer_id: xfer-1 is already used by request 7", True,
         "kv_transfer_params.transfer_id"),
        ("kv_transfer_params: must be a JSON object, not list", True, "kv_transfer_params"),
        ("cannot stage the blocks: lookup buffer full", False, None),
        ("LookupBufferFull: 4096 entries", False, None),
    ],
)
def test_prefill_refusal(error: str, malformed: bool, param: str | None) -> None:
    with pytest.raises(PrefillRefused) as err:
        read_prefill_answer({"kvbridge_error": error}, "xfer-5", ProxyMode.PULL)
    assert err.value.message == error
    assert err.value.malformed is malformed and err.value.param == param


def test_pick_reason() -> None:
    assert pick_reason([]) is None
    assert pick_reason(["done"]) is None
    assert pick_reason(["done", "failed: lease expired"]) == "lease expired"
    assert pick_reason(["in progress: waiting for the WRITE", "cancelled by decode: gone"]) == (
        "cancelled by decode: gone"
    )
    assert pick_reason(["in progress: waiting for the WRITE", "done"]) == (
        "in progress: waiting for the WRITE"
    )
    # the caller's order is the priority among equals (the failed leg's engine first)
    assert pick_reason(["failed: D side", "failed: P side"]) == "D side"


@pytest.mark.parametrize(
    ("body", "chat", "problem", "param"),
    [
        ({"prompt": "x"}, False, None, None),
        ({"prompt": [1, 2]}, False, None, None),  # token ids: one prompt
        ({"prompt": ["x"]}, False, None, None),  # a one-element batch is one prompt
        ({"prompt": [[1, 2]]}, False, None, None),
        ({"prompt": "x", "n": 1}, False, None, None),
        ({"prompt": "x", "n": None, "kv_transfer_params": None}, False, None, None),
        ({"messages": [{"role": "user", "content": "x"}]}, True, None, None),
        ([1], False, "JSON object", None),
        ({}, False, "'prompt'", "prompt"),
        ({"prompt": None}, False, "'prompt'", "prompt"),
        ({"prompt": 3}, False, "string or a list", "prompt"),
        ({"prompt": ["a", "b"]}, False, "batch of 2", "prompt"),
        ({"prompt": [[1], [2], [3]]}, False, "batch of 3", "prompt"),
        ({"prompt": ["a", [1]]}, False, "token ids", "prompt"),
        ({"prompt": [1, "a"]}, False, "token ids", "prompt"),
        ({"prompt": [True, 2]}, False, "token ids", "prompt"),
        ({"prompt": "x"}, True, "'messages'", "messages"),
        ({"messages": "hi"}, True, "list", "messages"),
        ({"prompt": "x", "max_tokens": "5"}, False, "max_tokens", "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, False, "max_tokens", "max_tokens"),
        ({"prompt": "x", "n": 2}, False, "'n' is 2", "n"),
        ({"messages": [], "n": 3}, True, "'n' is 3", "n"),
        ({"prompt": "x", "n": "2"}, False, "'n' must be an integer", "n"),
        ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}, False,
         "set by the proxy", "kv_transfer_params"),
    ],
)
def test_validate_request(body: object, chat: bool, problem: str | None,
                          param: str | None) -> None:
    why = validate_request(body, chat)
    if problem is None:
        assert why is None
    else:
        assert isinstance(why, RequestProblem) and problem in why.message, why
        assert why.param == param


def test_probe_info_is_the_parsed_answer() -> None:
    info = ProbeInfo(params.parse(PROBE_ANSWER))
    assert info == parse_probe(PROBE_ANSWER)

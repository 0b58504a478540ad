"""The proxy's routing policy as pure functions: picks, mode decisions, request bodies, probes."""

from __future__ import annotations

import copy
import re

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.routing import (
    Decision,
    Pool,
    ProbeInfo,
    ProxyMode,
    Role,
    decide,
    decode_body,
    new_transfer_id,
    normalize_url,
    parse_probe,
    prefill_body,
    probe_body,
    push_decode_params,
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


def test_decide_fixed_modes_ignore_load() -> None:
    p = pool(1)
    p.engines[0].in_flight = 100
    assert decide(ProxyMode.PUSH, p, 4) == Decision(ProxyMode.PUSH, "configured")
    p.engines[0].in_flight = 0
    assert decide(ProxyMode.PULL, p, 4) == Decision(ProxyMode.PULL, "configured")


def test_decide_auto_pushes_with_headroom_pulls_when_busy() -> None:
    p = pool(2)
    p.engines[0].in_flight = 4
    p.engines[1].in_flight = 3
    assert decide(ProxyMode.AUTO, p, 4) == Decision(ProxyMode.PUSH, "headroom")
    p.engines[1].in_flight = 4
    assert decide(ProxyMode.AUTO, p, 4) == Decision(ProxyMode.PULL, "busy")
    assert decide(ProxyMode.AUTO, p, 5).mode is ProxyMode.PUSH
    assert decide(ProxyMode.AUTO, p, 0).mode is ProxyMode.PULL  # headroom 0: auto = pull


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
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": "xfer-1",
        "transfer_mode": mode.value,
    }


def test_prefill_body_adds_no_max_completion_tokens_and_rejects_auto() -> None:
    out = prefill_body({"prompt": "x"}, "xfer-2", ProxyMode.PULL)
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out
    with pytest.raises(ValueError):
        prefill_body({"prompt": "x"}, "xfer-2", ProxyMode.AUTO)


def test_decode_bodies() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "transfer_id": "xfer-3"}
    out = decode_body({**BODY, "kv_transfer_params": {"client": 1}}, params)
    assert out["kv_transfer_params"] == params and out["kv_transfer_params"] is not params
    assert out["max_tokens"] == 50 and out["stream"] is True and out["min_tokens"] == 5
    probe = ProbeInfo("P-1", "10.0.0.1", 5600, 2, "0.1.0")
    assert push_decode_params(probe, "xfer-4") == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_mode": "push",
        "transfer_id": "xfer-4",
        "remote_engine_id": "P-1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
    }


def test_probe_roundtrip_and_errors() -> None:
    body = probe_body("qwen")
    assert body == {
        "model": "qwen",
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": {"kvbridge_probe": True},
    }
    answer = {
        "remote_engine_id": "P-1",
        "remote_host": "h",
        "remote_port": "5600",
        "tp_size": 1,
        "kvbridge_version": "0.1.0",
    }
    assert parse_probe(answer) == ProbeInfo("P-1", "h", 5600, 1, "0.1.0")
    with pytest.raises(ValueError, match="KVBridgeConnector"):
        parse_probe(None)
    with pytest.raises(ValueError, match="remote_port"):
        parse_probe({**answer, "remote_port": None})
    with pytest.raises(ValueError, match="malformed"):
        parse_probe({**answer, "tp_size": "two"})


@pytest.mark.parametrize(
    ("body", "chat", "problem"),
    [
        ({"prompt": "x"}, False, None),
        ({"prompt": [1, 2]}, False, None),
        ({"messages": [{"role": "user", "content": "x"}]}, True, None),
        ([1], False, "JSON object"),
        ({}, False, "'prompt'"),
        ({"prompt": None}, False, "'prompt'"),
        ({"prompt": 3}, False, "string or a list"),
        ({"prompt": "x"}, True, "'messages'"),
        ({"messages": "hi"}, True, "list"),
        ({"prompt": "x", "max_tokens": "5"}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, False, "max_tokens"),
    ],
)
def test_validate_request(body: object, chat: bool, problem: str | None) -> None:
    why = validate_request(body, chat)
    if problem is None:
        assert why is None
    else:
        assert why is not None and problem in why

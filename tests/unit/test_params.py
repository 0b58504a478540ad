"""kvbridge.params: the kv_transfer_params wire format is strict, bounded and never raises
anything but ParamsError (naming the key) whatever a client sends."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvbridge.config import TransferMode
from kvbridge.errors import KVBridgeError, ParamsError
from kvbridge.params import (
    MAX_BLOCK_IDS,
    MAX_TP,
    PeerRef,
    TransferParams,
    address_of,
    parse,
    parse_or_none,
    prefill_request,
    probe_request,
    push_decode_request,
    to_wire,
)

#: wire keys (``remote_block_groups`` holds a per-group ``remote_block_ids``; never a key)
KEYS: list[str] = [f.name for f in msgspec.structs.fields(TransferParams)
                   if f.name != "remote_block_groups"]
BOOL_KEYS = ["do_remote_decode", "do_remote_prefill", "kvbridge_layerwise", "kvbridge_probe",
             "kvbridge_tiers", "kvbridge_record"]
PEER = {"address": "tcp://127.0.0.1:5000", "generation": "gen-0"}


def _field_of(raw: Any) -> str:
    with pytest.raises(ParamsError) as info:
        parse(raw)
    assert isinstance(info.value, KVBridgeError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith(info.value.field + ": ")
    return info.value.field


def _nested_list(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _nested_dict(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# -- every key's type and bound ---------------------------------------------------------------

#: (key, a malformed value): the error must name exactly that key
MALFORMED: list[tuple[str, Any]] = [
    ("remote_block_ids", "abc"),
    ("remote_port", "port"),
    ("remote_engine_id", 5),
    ("transfer_mode", "sideways"),
    ("transfer_mode", "PULL"),
    ("transfer_mode", 1),
    ("remote_host", "a host"),
    ("remote_host", "h" * 254),
    ("remote_host", ""),
    ("remote_host", "host/path"),
    ("remote_port", 0),
    ("remote_port", 70000),
    ("remote_port", 65536),
    ("remote_port", -1),
    ("remote_port", 1.5),
    ("remote_port", True),
    ("remote_block_ids", [1, -1]),
    ("remote_block_ids", [0, 1 << 31]),
    ("remote_block_ids", [0] * 200_000),
    ("remote_block_ids", [True]),
    ("remote_block_ids", [1.0]),
    ("remote_block_ids", ["1"]),
    ("remote_block_ids", [1, [2]]),
    ("remote_block_ids", [[1], [2, "x"]]),  # two KV-cache groups, one malformed
    ("remote_block_ids", [[1], 2]),
    ("remote_block_ids", [[1]] * 65),  # more KV-cache groups than any model has
    ("remote_block_ids", [[1] * 70_000, [2] * 70_000]),  # too many ids in all
    ("remote_block_ids", [[1, "x"]]),
    ("remote_block_ids", {"0": 1}),
    ("remote_request_id", ""),
    ("remote_request_id", "r 1"),
    ("remote_num_tokens", -1),
    ("remote_num_tokens", (1 << 26) + 1),
    ("remote_num_tokens", "16"),
    ("transfer_id", "has spaces"),
    ("transfer_id", "t" * 129),
    ("transfer_id", ""),
    ("transfer_id", "caf\u00e9"),
    ("transfer_id", 7),
    ("tp_size", 0),
    ("tp_size", MAX_TP + 1),
    ("tp_size", None),
    ("tp_size", "2"),
    ("pp_size", 0),
    ("kvbridge_peers", [{"address": "bad", "generation": "g"}]),
    ("kvbridge_peers", [{"address": "tcp://h", "generation": "g"}]),
    ("kvbridge_peers", [{"address": "http://h:1", "generation": "g"}]),
    ("kvbridge_peers", [{"address": "tcp://h:123456", "generation": "g"}]),
    ("kvbridge_peers", [{**PEER, "extra": 1}]),
    ("kvbridge_peers", [{"address": PEER["address"]}]),
    ("kvbridge_peers", [{**PEER, "generation": ""}]),
    ("kvbridge_peers", [PEER, 5]),
    ("kvbridge_peers", "tcp://h:1"),
    ("kvbridge_peers", [PEER] * (MAX_TP + 1)),
    ("kvbridge_generation", ""),
    ("kvbridge_generation", "g" * 257),
    ("kvbridge_version", "v" * 65),
    ("kvbridge_error", "e" * 2049),
    ("kvbridge_error", 3),
    ("kvbridge_kv_events", "tcp://*:5557"),  # a wildcard is where vLLM binds, not an address
    ("kvbridge_kv_events", "tcp://0.0.0.0:5557"),
    ("kvbridge_kv_events", "tcp://[::]:5557"),
    ("kvbridge_kv_events", "tcp://h:0"),
    ("kvbridge_kv_events", "tcp://h:65536"),
    ("kvbridge_kv_events", "tcp://h"),
    ("kvbridge_kv_events", "ipc:///tmp/kv"),
    ("kvbridge_kv_events", "tcp://h:1 ; rm"),
    ("kvbridge_kv_events", "tcp://" + "h" * 300 + ":1"),
    ("kvbridge_kv_events", "tcp://h:1\n"),
    ("kvbridge_kv_events", 5557),
    ("kvbridge_kv_events_topic", "t" * 129),
    ("kvbridge_kv_events_topic", "caf\u00e9"),
    ("kvbridge_kv_events_topic", "a\nb"),
    ("kvbridge_kv_events_topic", 1),
    *[(key, "true") for key in BOOL_KEYS],
    *[(key, 1) for key in BOOL_KEYS],
    *[(key, None) for key in ("do_remote_decode", "do_remote_prefill", "kvbridge_probe")],
]


@pytest.mark.parametrize(("key", "value"), MALFORMED,
                         ids=[f"{k}-{str(v)[:24]}" for k, v in MALFORMED])
def test_malformed_value_names_its_key(key: str, value: Any) -> None:
    assert _field_of({key: value}) == f"kv_transfer_params.{key}"
    # the same bad key among good ones is still the one named
    assert _field_of({"do_remote_decode": True, "transfer_id": "t-1", key: value,
                      "proxy_extra": {"x": 1}}) == f"kv_transfer_params.{key}"


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("wrong", [{"x": 1}, 1.5, [[[]]], b"bytes"], ids=repr)
def test_every_key_refuses_a_wrong_type(key: str, wrong: Any) -> None:
    assert _field_of({key: wrong}) == f"kv_transfer_params.{key}"


#: (key, largest or smallest accepted value): the bounds are inclusive
ACCEPTED: list[tuple[str, Any]] = [
    ("remote_engine_id", "e" * 256),
    ("remote_engine_id", "!~"),
    ("remote_host", "h" * 253),
    ("remote_host", "::1"),
    ("remote_host", "fe80::1%eth0"),
    ("remote_host", "my-host_1.example"),
    ("remote_port", 1),
    ("remote_port", 65535),
    ("remote_block_ids", [0, (1 << 31) - 1]),
    ("remote_block_ids", [0] * MAX_BLOCK_IDS),
    ("remote_block_ids", []),
    ("remote_num_tokens", 0),
    ("remote_num_tokens", 1 << 26),
    ("transfer_id", "t" * 128),
    ("tp_size", 1),
    ("tp_size", MAX_TP),
    ("kvbridge_peers", [PEER] * MAX_TP),
    ("kvbridge_peers", [{"address": "tcp://[::1]:65535", "generation": "*"}]),
    ("kvbridge_version", "v" * 64),
    ("kvbridge_error", "e" * 2048),
    ("kvbridge_kv_events", "tcp://10.1.2.3:1"),
    ("kvbridge_kv_events", "tcp://[fe80::1%eth0]:65535"),
    ("kvbridge_kv_events", "tcp://engine-0.kv.svc:5557"),
    ("kvbridge_kv_events_topic", ""),
    ("kvbridge_kv_events_topic", "kv " * 42 + "xy"),
    ("transfer_mode", "auto"),
    ("transfer_mode", None),
    ("transfer_id", None),
]


@pytest.mark.parametrize(("key", "value"), ACCEPTED,
                         ids=[f"{k}-{str(v)[:24]}" for k, v in ACCEPTED])
def test_bounds_are_inclusive(key: str, value: Any) -> None:
    params = parse({key: value})
    got = getattr(params, key)
    if key == "kvbridge_peers":
        assert got == [PeerRef(**p) for p in value]
    elif key == "transfer_mode" and value is not None:
        assert got is TransferMode(value)
    else:
        assert got == value


def test_bools_are_bools() -> None:
    params = parse({k: True for k in BOOL_KEYS})
    assert all(getattr(params, k) is True for k in BOOL_KEYS)
    assert parse({"kvbridge_layerwise": False}).kvbridge_layerwise is False
    assert parse({}).kvbridge_layerwise is None
    assert parse({"kvbridge_record": False}).kvbridge_record is False
    assert parse({}).kvbridge_record is None


# -- non-objects, hostile sizes and shapes ------------------------------------------------------


@pytest.mark.parametrize("raw", [[], [{"do_remote_decode": True}], "x", "{}", 5, 1.5, True, b"{}",
                                 ("do_remote_decode",)], ids=repr)
def test_non_objects_are_refused_at_the_top(raw: Any) -> None:
    assert _field_of(raw) == "kv_transfer_params"
    params, err = parse_or_none(raw)
    assert params is None and err is not None and err.field == "kv_transfer_params"


def test_none_and_empty_are_the_defaults() -> None:
    assert parse(None) == TransferParams() == parse({})
    assert parse_or_none(None) == (TransferParams(), None)
    default = parse(None)
    assert not default.do_remote_decode and not default.do_remote_prefill
    assert default.tp_size == 1 and default.peer(0) is None


def test_non_string_keys_are_refused() -> None:
    assert _field_of({1: 2}) == "kv_transfer_params"


@pytest.mark.parametrize("raw", [
    {"remote_block_ids": _nested_list(100_000)},
    {"remote_block_ids": [_nested_list(100_000)]},
    {"kvbridge_peers": _nested_list(100_000)},
    {"kvbridge_peers": [{"address": _nested_list(100_000), "generation": "g"}]},
    {"kvbridge_peers": [_nested_dict(100_000)]},
    {"transfer_id": _nested_list(100_000)},
    {"remote_port": _nested_dict(100_000)},
], ids=["ids", "group", "peers", "address", "peer-dict", "transfer_id", "port"])
def test_deep_nesting_in_a_known_key_is_a_params_error(raw: dict[str, Any]) -> None:
    key = next(iter(raw))
    assert _field_of(raw) == f"kv_transfer_params.{key}"


def test_deep_nesting_in_an_unknown_key_is_ignored() -> None:
    raw = {"do_remote_decode": True, "proxy_list": _nested_list(100_000),
           "proxy_dict": _nested_dict(100_000)}
    assert parse(raw) == TransferParams(do_remote_decode=True)


def test_deep_nesting_at_the_top_is_refused() -> None:
    assert _field_of(_nested_list(100_000)) == "kv_transfer_params"


def test_a_10_mib_string() -> None:
    big = "x" * (10 << 20)
    t0 = time.monotonic()
    assert _field_of(big) == "kv_transfer_params"
    for key in ("transfer_id", "remote_host", "remote_engine_id", "kvbridge_error",
                "kvbridge_version"):
        assert _field_of({key: big}) == f"kv_transfer_params.{key}"
    assert _field_of({"kvbridge_peers": [{"address": big, "generation": "g"}]}) \
        == "kv_transfer_params.kvbridge_peers"
    assert parse({"proxy_note": big, "transfer_id": "t"}) == TransferParams(transfer_id="t")
    assert time.monotonic() - t0 < 10  # bounded work, not quadratic


@pytest.mark.parametrize("raw", [
    {"transfer_mode": "x" * (10 << 20)},
    {"kvbridge_peers": [{**PEER, "k" * (10 << 20): 1}]},
], ids=["enum-value", "unknown-peer-field"])
def test_error_messages_are_bounded(raw: dict[str, Any]) -> None:
    with pytest.raises(ParamsError) as info:
        parse(raw)
    assert len(str(info.value)) < 4096


@pytest.mark.parametrize(("key", "value"), [
    ("transfer_id", "t-1\n"), ("remote_host", "host\n"), ("remote_engine_id", "e\n"),
    ("kvbridge_generation", "g\n"),
    ("kvbridge_peers", [{"address": "tcp://h:1\n", "generation": "g"}]),
])
def test_a_trailing_newline_is_not_printable(key: str, value: Any) -> None:
    assert _field_of({key: value}) == f"kv_transfer_params.{key}"


def test_unknown_keys_are_ignored() -> None:
    raw = {"do_remote_decode": True, "transfer_id": "t-1", "x_router": {"weird": [1, "2"]},
           "remote_block_idz": "typo", "": None, "\u00e9": 1}
    assert parse(raw) == TransferParams(do_remote_decode=True, transfer_id="t-1")


def test_other_mappings_parse_like_dicts() -> None:
    import types
    from collections import OrderedDict

    want = TransferParams(do_remote_decode=True, transfer_id="t")
    assert parse(types.MappingProxyType({"do_remote_decode": True, "transfer_id": "t"})) == want
    assert parse(OrderedDict(do_remote_decode=True, transfer_id="t")) == want


# -- vLLM's per-group block ids ------------------------------------------------------------------


def test_one_kv_cache_group_is_flattened() -> None:
    assert parse({"remote_block_ids": [[4, 5, 6]]}).remote_block_ids == [4, 5, 6]
    assert parse({"remote_block_ids": [4, 5, 6]}).remote_block_ids == [4, 5, 6]
    assert parse({"remote_block_ids": [[]]}).remote_block_ids == []


@pytest.mark.parametrize("ids", [[[1], 2], [[1], [2, "x"]], [[1]] * 65,
                                 [[1] * 70_000, [2] * 70_000]], ids=lambda v: repr(v)[:30])
def test_malformed_per_group_block_ids_are_refused(ids: Any) -> None:
    with pytest.raises(ParamsError) as info:
        parse({"remote_block_ids": ids})
    assert info.value.field == "kv_transfer_params.remote_block_ids"


def test_per_group_block_ids_round_trip_as_vllm_sends_them() -> None:
    """A hybrid model's pull answer: P's table per KV-cache group (0: a dropped block)."""
    groups = [[0, 0, 7, 8], [0, 0, 9, 10], [3, 4, 5, 6]]
    params = parse({"remote_block_ids": groups, "remote_block_groups": [[1]]})
    assert params.remote_block_groups == groups and params.remote_block_ids is None
    assert to_wire(params) == {"remote_block_ids": groups}
    assert parse(to_wire(params)) == params


# -- check_decode_leg -------------------------------------------------------------------------

ADDR = {"remote_host": "10.0.0.7", "remote_port": 7000}


def _decode_leg(**kw: Any) -> TransferParams:
    return parse({"do_remote_prefill": True, **kw})


def _leg_error(params: TransferParams, mode: TransferMode = TransferMode.PULL,
               prompt: int = 48, block: int = 16) -> ParamsError:
    with pytest.raises(ParamsError) as info:
        params.check_decode_leg(mode, prompt, block)
    return info.value


@pytest.mark.parametrize("mode", [TransferMode.PULL, TransferMode.PUSH])
def test_decode_leg_needs_an_address(mode: TransferMode) -> None:
    for partial in ({}, {"remote_host": "h"}, {"remote_port": 7000}):
        err = _leg_error(_decode_leg(remote_block_ids=[1, 2, 3], **partial), mode)
        assert err.field == "kv_transfer_params.remote_host"


def test_decode_leg_address_from_peers_alone_is_enough() -> None:
    _decode_leg(kvbridge_peers=[PEER]).check_decode_leg(TransferMode.PUSH, 48, 16)
    _decode_leg(kvbridge_peers=[PEER], remote_block_ids=[1, 2, 3]).check_decode_leg(
        TransferMode.PULL, 48, 16)


def test_decode_leg_of_another_tp_size_needs_every_prefill_rank() -> None:
    # heterogeneous TP is the worker ranks' to map; the leg must name every prefill rank
    err = _leg_error(_decode_leg(**ADDR, tp_size=2), TransferMode.PUSH)
    assert err.field == "kv_transfer_params.kvbridge_peers" and "(2)" in err.message
    _decode_leg(**ADDR).check_decode_leg(TransferMode.PUSH, 48, 16)  # P TP 1, any D TP


def test_decode_leg_counts_remote_blocks_in_prefills_block_size() -> None:
    leg = _decode_leg(**ADDR, kvbridge_block_size=32, remote_block_ids=[1, 2])
    leg.check_decode_leg(TransferMode.PULL, 48, 16)  # 48 tokens are 2 blocks of 32
    err = _leg_error(_decode_leg(**ADDR, kvbridge_block_size=8, remote_block_ids=[1, 2, 3]))
    assert err.field == "kv_transfer_params.remote_block_ids" and "block size 8" in err.message


def test_decode_leg_peers_must_name_every_rank() -> None:
    short = _decode_leg(tp_size=2, kvbridge_peers=[PEER])
    assert _leg_error(short, TransferMode.PUSH).field == "kv_transfer_params.kvbridge_peers"
    long = _decode_leg(tp_size=2, kvbridge_peers=[PEER] * 3)
    assert _leg_error(long, TransferMode.PUSH).field == "kv_transfer_params.kvbridge_peers"
    _decode_leg(tp_size=2, kvbridge_peers=[PEER] * 2).check_decode_leg(TransferMode.PUSH, 48, 16)


def test_decode_leg_token_count_must_match_the_prompt() -> None:
    for n in (47, 49, 0):
        err = _leg_error(_decode_leg(**ADDR, remote_num_tokens=n), TransferMode.PUSH, prompt=48)
        assert err.field == "kv_transfer_params.remote_num_tokens"
    _decode_leg(**ADDR, remote_num_tokens=48).check_decode_leg(TransferMode.PUSH, 48, 16)
    _decode_leg(**ADDR).check_decode_leg(TransferMode.PUSH, 48, 16)  # absent: not checked


@pytest.mark.parametrize(("ids", "prompt", "what"), [
    (None, 48, "needs"),
    ([], 48, "needs"),
    ([1, 2], 48, "names 2 blocks"),
    ([1, 2, 3], 49, "names 3 blocks"),  # 49 tokens are 4 blocks: the last one partial
    ([1, 2, 3, 4], 48, "names 4 blocks"),
    ([1, 1, 2], 48, "duplicate"),
    ([[1, 2, 2]], 48, "duplicate"),
])
def test_decode_leg_pull_block_ids(ids: Any, prompt: int, what: str) -> None:
    raw: dict[str, Any] = dict(ADDR)
    if ids is not None:
        raw["remote_block_ids"] = ids
    err = _leg_error(_decode_leg(**raw), TransferMode.PULL, prompt=prompt)
    assert err.field == "kv_transfer_params.remote_block_ids"
    assert what in err.message


def test_decode_leg_pull_with_the_right_blocks_passes() -> None:
    _decode_leg(**ADDR, remote_block_ids=[9, 3, 7]).check_decode_leg(TransferMode.PULL, 48, 16)
    _decode_leg(**ADDR, remote_block_ids=[9, 3, 7, 1]).check_decode_leg(TransferMode.PULL, 49,
                                                                        16)
    # a push needs no block ids of the prefill engine
    _decode_leg(**ADDR).check_decode_leg(TransferMode.PUSH, 48, 16)


# -- peer(), mode(), address_of() --------------------------------------------------------------


def test_peer_from_host_and_port() -> None:
    params = parse({**ADDR})
    assert params.peer(0) == PeerRef("tcp://10.0.0.7:7000", "*")
    assert params.peer(1) is None
    with_gen = parse({**ADDR, "kvbridge_generation": "gen-9"})
    assert with_gen.peer(0) == PeerRef("tcp://10.0.0.7:7000", "gen-9")


def test_peer_ipv6_host_gets_brackets() -> None:
    assert parse({"remote_host": "::1", "remote_port": 5}).peer(0) == PeerRef("tcp://[::1]:5",
                                                                               "*")
    assert parse({"remote_host": "fe80::1%eth0", "remote_port": 5}).peer(0) \
        == PeerRef("tcp://[fe80::1%eth0]:5", "*")


def test_peer_of_a_bracketed_ipv6_host_is_not_double_bracketed() -> None:
    ref = parse({"remote_host": "[::1]", "remote_port": 5}).peer(0)
    assert ref is not None and ref.address == "tcp://[::1]:5"


def test_peer_prefers_kvbridge_peers_and_picks_by_rank() -> None:
    peers = [{"address": f"tcp://10.0.0.{r}:{6000 + r}", "generation": f"g{r}"} for r in range(3)]
    params = parse({**ADDR, "kvbridge_peers": peers})
    for r in range(3):
        assert params.peer(r) == PeerRef(peers[r]["address"], peers[r]["generation"])
    assert params.peer(3) is None
    assert address_of(params.kvbridge_peers, 2) == "tcp://10.0.0.2:6002"
    assert address_of(params.kvbridge_peers, 3) is None
    assert address_of(None, 0) is None and address_of([], 0) is None


def test_mode_defaults_and_auto_means_pull() -> None:
    assert parse({}).mode(TransferMode.PUSH) is TransferMode.PUSH
    assert parse({}).mode(TransferMode.AUTO) is TransferMode.PULL
    assert parse({"transfer_mode": "push"}).mode(TransferMode.PULL) is TransferMode.PUSH
    assert parse({"transfer_mode": "auto"}).mode(TransferMode.PUSH) is TransferMode.PULL
    assert parse({"transfer_mode": "pull"}).mode(TransferMode.PUSH) is TransferMode.PULL


# -- builders and to_wire --------------------------------------------------------------------


def test_to_wire_omits_defaults() -> None:
    assert to_wire(TransferParams()) == {}
    assert to_wire(TransferParams(tp_size=1, kvbridge_probe=False, do_remote_decode=False)) == {}
    wire = to_wire(TransferParams(tp_size=2, transfer_mode=TransferMode.PUSH,
                                  kvbridge_layerwise=False))
    assert wire == {"tp_size": 2, "transfer_mode": "push", "kvbridge_layerwise": False}
    assert type(wire["transfer_mode"]) is str
    json.dumps(wire)


@pytest.mark.parametrize("mode", list(TransferMode))
@pytest.mark.parametrize("layerwise", [None, True, False])
def test_prefill_request_round_trips(mode: TransferMode, layerwise: bool | None) -> None:
    wire = prefill_request("tid-1", mode, layerwise)
    json.dumps(wire)
    want: dict[str, Any] = {"do_remote_decode": True, "transfer_id": "tid-1",
                            "transfer_mode": mode.value}
    if layerwise is not None:
        want["kvbridge_layerwise"] = layerwise
    assert wire == want
    params = parse(json.loads(json.dumps(wire)))
    assert params.do_remote_decode and params.transfer_id == "tid-1"
    assert params.transfer_mode is mode and params.kvbridge_layerwise is layerwise


def test_probe_request_round_trips() -> None:
    assert probe_request() == {"kvbridge_probe": True}
    assert parse(probe_request()) == TransferParams(kvbridge_probe=True)


def test_push_decode_request_round_trips_from_a_probe_answer() -> None:
    answer = TransferParams(
        remote_engine_id="prefill-0", remote_host="::1", remote_port=7001, tp_size=2,
        kvbridge_generation="gen-a",
        kvbridge_peers=[PeerRef("tcp://[::1]:7001", "gen-a"), PeerRef("tcp://[::1]:7002", "gen-b")],
        kvbridge_version="1.0")
    prefill = parse(json.loads(json.dumps(to_wire(answer))))
    assert prefill == answer
    wire = push_decode_request(prefill, "tid-2", layerwise=True)
    params = parse(json.loads(json.dumps(wire)))
    assert params.do_remote_prefill and not params.do_remote_decode
    assert params.transfer_id == "tid-2" and params.transfer_mode is TransferMode.PUSH
    assert params.kvbridge_layerwise is True
    assert params.remote_engine_id == "prefill-0" and params.tp_size == 2
    assert params.kvbridge_peers == answer.kvbridge_peers
    assert params.kvbridge_generation == "gen-a"
    assert params.peer(1) == PeerRef("tcp://[::1]:7002", "gen-b")
    params.check_decode_leg(TransferMode.PUSH, 100, 16)
    assert to_wire(params) == wire


def test_parsed_params_round_trip_through_to_wire() -> None:
    raw = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h",
           "remote_port": 1, "remote_block_ids": [[3, 4]], "remote_request_id": "r",
           "remote_num_tokens": 20, "tp_size": 1, "transfer_id": "t", "transfer_mode": "pull",
           "kvbridge_peers": [PEER], "ignored": 1}
    params = parse(raw)
    assert parse(to_wire(params)) == params
    assert to_wire(params)["remote_block_ids"] == [3, 4]
    assert "tp_size" not in to_wire(params) and "ignored" not in to_wire(params)


# -- property: random JSON-ish values never raise anything but ParamsError ---------------------


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    scalars: list[Callable[[], Any]] = [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-3, 3),
        lambda: rng.choice([0, 1, 16, 65535, 65536, (1 << 31) - 1, 1 << 31, 1 << 26, 1 << 64,
                            -(1 << 63), 10 ** 40]),
        lambda: rng.choice([0.0, -1.5, 1e308, float("inf"), float("nan")]),
        lambda: "".join(rng.choice("ab:[]%. -_/\n\t\u00e9\x00~!")
                        for _ in range(rng.randint(0, 9))),
        lambda: rng.choice(["pull", "push", "auto", "PUSH", "true", "tcp://h:1", "::1", "",
                            "tcp://[::1]:80", "x" * 300]),
        lambda: rng.choice([b"bytes", (1, 2), frozenset({1}), 1j, object()]),
    ]
    if depth < 4 and rng.random() < 0.35:
        if rng.random() < 0.5:
            return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        keys = ["address", "generation", "x", *rng.sample(KEYS, 2)]
        return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if rng.random() < 0.1:
        return [{"address": f"tcp://h:{rng.randint(0, 99999)}", "generation": "g"}] \
            * rng.randint(0, 3)
    return rng.choice(scalars)()


def test_random_values_only_ever_raise_params_error() -> None:
    rng = random.Random(20260301)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(4000):
        raw: dict[Any, Any] = {}
        for key in rng.sample(KEYS + ["unknown_key"], rng.randint(1, 5)):
            raw[key] = _random_value(rng)
        try:
            params = parse(raw)
        except ParamsError as err:
            outcomes["error"] += 1
            named = err.field.removeprefix("kv_transfer_params").removeprefix(".")
            assert named == "" or named in raw, (err.field, raw)
            assert named != "unknown_key"
            continue
        outcomes["ok"] += 1
        assert parse(to_wire(params)) == params  # what parses re-parses from its wire form
        for mode in (TransferMode.PULL, TransferMode.PUSH):
            try:
                params.check_decode_leg(mode, rng.randint(0, 100), 16)
            except ParamsError:
                pass
        for rank in range(3):
            params.peer(rank)
    assert outcomes["ok"] > 100 and outcomes["error"] > 1000  # both sides were exercised

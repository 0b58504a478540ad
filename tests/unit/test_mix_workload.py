"""The seeded mixed workload of ``kvbridge bench mix`` (kvbridge.tools.bench.mix_workload)."""

from __future__ import annotations

import hashlib

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.mix_workload import (
    CHAT_MAX_LEN,
    CLASSES,
    DEFAULT_SHARES,
    DISK_PREFIX_LEN,
    DISK_SHARES,
    LONG_LEN,
    MAX_MODEL_LEN,
    SHORT_LEN,
    SYSTEM_LEN,
    TAIL_LEN,
    WARM_WINDOW,
    class_counts,
    generate_trace,
    parse_shares,
)
from kvbridge.tools.tiny_model import NUM_SPECIAL_TOKENS, VOCAB_SIZE


def test_same_seed_same_trace_and_another_seed_another() -> None:
    a = generate_trace(200, 4.0, seed=7)
    assert a == generate_trace(200, 4.0, seed=7)
    b = generate_trace(200, 4.0, seed=8)
    assert [r.prompt for r in a.requests] != [r.prompt for r in b.requests]


def test_another_rate_scales_the_arrivals_and_keeps_the_prompts() -> None:
    a = generate_trace(50, 2.0, seed=3)
    b = generate_trace(50, 8.0, seed=3)
    assert [(r.klass, r.prompt, r.max_tokens) for r in a.requests] == \
        [(r.klass, r.prompt, r.max_tokens) for r in b.requests]
    for x, y in zip(a.requests, b.requests, strict=True):
        assert x.arrival_s == pytest.approx(4 * y.arrival_s)


def test_arrivals_are_poisson_at_the_rate() -> None:
    t = generate_trace(2000, 5.0, seed=1)
    arrivals = [r.arrival_s for r in t.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert t.duration_s / 1999 == pytest.approx(1 / 5.0, rel=0.1)


def test_classes_come_in_their_expected_shares() -> None:
    t = generate_trace(2000, 4.0, seed=11)
    counts = t.counts()
    assert list(counts) == [k for k in CLASSES if k != "disk"]  # disk only with a share
    for k in counts:
        assert counts[k] / 2000 == pytest.approx(DEFAULT_SHARES[k], abs=0.04), k


def test_a_short_trace_has_its_shares_exactly() -> None:
    assert generate_trace(40, 2.0, seed=0).counts() == {"short": 10, "long": 6, "chat": 10,
                                                         "system": 8, "warm_d": 6}
    assert class_counts(3, DEFAULT_SHARES) == {"short": 1, "long": 0, "chat": 1, "system": 1,
                                               "warm_d": 0, "disk": 0}
    assert sum(class_counts(7, DEFAULT_SHARES).values()) == 7
    assert min(v for k, v in class_counts(5, DEFAULT_SHARES).items() if k != "disk") == 1
    for n in range(1, 12):
        for seed in range(5):
            t = generate_trace(n, 2.0, seed=seed, shares={"short": 1.0, "warm_d": 3.0})
            assert len(t.requests) == n and t.requests[0].klass == "short"


def test_lengths_are_bounded_and_ids_ordinary() -> None:
    t = generate_trace(600, 4.0, seed=5)
    for r in t.requests:
        assert 8 <= r.max_tokens <= 16
        assert len(r.prompt) + r.max_tokens <= MAX_MODEL_LEN
        assert all(NUM_SPECIAL_TOKENS <= i < VOCAB_SIZE for i in r.prompt)
        if r.klass == "short":
            assert SHORT_LEN[0] <= len(r.prompt) <= SHORT_LEN[1]
        elif r.klass == "long":
            assert LONG_LEN[0] <= len(r.prompt) <= LONG_LEN[1]
        elif r.klass == "chat":
            assert len(r.prompt) <= CHAT_MAX_LEN


def test_chat_history_grows_turn_by_turn() -> None:
    t = generate_trace(400, 4.0, seed=2)
    by_conv: dict[int, list[tuple[int, ...]]] = {}
    for r in t.requests:
        if r.klass == "chat":
            assert r.conversation is not None and r.turn is not None
            turns = by_conv.setdefault(r.conversation, [])
            assert r.turn == len(turns)
            if turns:  # the previous prompt, then its reply stand-in, then new user tokens
                prev = turns[-1]
                assert r.prompt[: len(prev)] == prev
                assert len(r.prompt) > len(prev) + 8
            turns.append(r.prompt)
    assert max(len(v) for v in by_conv.values()) >= 3


def test_system_requests_share_the_system_prompt() -> None:
    t = generate_trace(300, 4.0, seed=4)
    system = [r.prompt for r in t.requests if r.klass == "system"]
    assert len(system) > 10
    assert len({p[:SYSTEM_LEN] for p in system}) == 1
    assert len(set(system)) == len(system)


def test_warm_d_repeats_a_recent_prompt() -> None:
    t = generate_trace(300, 4.0, seed=6)
    warm = [r for r in t.requests if r.klass == "warm_d"]
    assert warm and t.requests[0].klass != "warm_d"
    for r in warm:
        assert r.prefix_of is not None and r.prefix_of < r.index
        earlier = t.requests[r.prefix_of]
        assert earlier.klass != "warm_d"
        assert r.index - r.prefix_of <= 2 * WARM_WINDOW + 8  # shortly before
        n = min(len(earlier.prompt), len(r.prompt))
        assert r.prompt[:n] == earlier.prompt[:n]


def test_shares_select_the_classes() -> None:
    t = generate_trace(100, 4.0, seed=1, shares={"short": 1.0})
    assert t.counts() == {"short": 100}
    t = generate_trace(100, 4.0, seed=1, shares=parse_shares("long=1,warm_d=1"))
    assert set(t.counts()) == {"long", "warm_d"}
    assert parse_shares("short=1,long=3") == {"short": 0.25, "long": 0.75, "chat": 0.0,
                                               "system": 0.0, "warm_d": 0.0, "disk": 0.0}


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"num_requests": 0}, "--num-requests"),
    ({"num_requests": 2.5}, "--num-requests"),
    ({"rate": 0.0}, "--rates"),
    ({"rate": -1.0}, "--rates"),
    ({"rate": float("nan")}, "--rates"),
    ({"max_tokens": (1, 4)}, "--max-tokens"),
    ({"max_tokens": (9, 8)}, "--max-tokens"),
    ({"max_tokens": (8, 900)}, "--max-tokens"),
    ({"shares": {"short": -1.0}}, "--shares"),
    ({"shares": {"nope": 1.0}}, "--shares"),
    ({"shares": {"short": 0.0}}, "--shares"),
    ({"shares": {"warm_d": 1.0}}, "--shares"),
    ({"shares": {"warm_d": 1.0, "disk": 1.0}}, "--shares"),
])
def test_bad_arguments_name_the_flag(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {"num_requests": 10, "rate": 2.0, "seed": 0, **kwargs}
    with pytest.raises(ConfigError, match=flag):
        generate_trace(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["short", "bogus=1", "short=x", "short=0"])
def test_bad_shares_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--shares"):
        parse_shares(text)


def test_a_trace_without_disk_is_the_one_from_before_the_class() -> None:
    """The digest of ``generate_trace(60, 3.0, seed=5)`` before the disk class existed: recorded
    runs stay reproducible."""
    t = generate_trace(60, 3.0, seed=5)
    rows = [(r.klass, r.arrival_s, r.prompt, r.max_tokens) for r in t.requests]
    assert hashlib.sha256(repr(rows).encode()).hexdigest() == (
        "94adb3fa0dfb900b64e07c49014ae82a2efab76db5fcb131acef15fcee5863ea")
    assert t.tier_prefixes() == []


def test_disk_requests_each_have_a_prefix_of_their_own() -> None:
    t = generate_trace(200, 4.0, seed=2, shares=DISK_SHARES)
    disk = [r for r in t.requests if r.klass == "disk"]
    assert len(disk) == 60 and t.counts()["disk"] == 60
    prefixes = t.tier_prefixes()
    assert [i for i, _ in prefixes] == [r.index for r in disk]
    assert all(len(p) == DISK_PREFIX_LEN == r.tier_prefix
               for (_, p), r in zip(prefixes, disk, strict=True))
    assert len({p for _, p in prefixes}) == len(disk)  # no two share a prefix
    for r in disk:
        assert TAIL_LEN[0] <= len(r.prompt) - DISK_PREFIX_LEN <= TAIL_LEN[1]
        assert all(NUM_SPECIAL_TOKENS <= i < VOCAB_SIZE for i in r.prompt)
    # nothing else starts with a disk prefix: only D's tier can hold it
    others = [r.prompt for r in t.requests if r.klass != "disk"]
    assert not any(o[:DISK_PREFIX_LEN] == p for o in others for _, p in prefixes)
    assert all(r.tier_prefix == 0 for r in t.requests if r.klass != "disk")
    assert generate_trace(200, 4.0, seed=2, shares=DISK_SHARES) == t
    assert generate_trace(200, 4.0, seed=3, shares=DISK_SHARES).tier_prefixes() != prefixes
    assert sum(DISK_SHARES.values()) == pytest.approx(1.0)

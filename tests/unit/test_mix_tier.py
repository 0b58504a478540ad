"""``kvbridge bench mix --disk-tier``'s pure parts (kvbridge.tools.bench.mix_tier): the slow
tier's schedule, a plan header's choice, and the flip counts around the injection."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.mix_tier import (
    SlowTier,
    choice_of,
    disk_tier_offload,
    flips,
    format_flips,
    kv_events_config,
    reads_tier,
)


def test_the_delay_is_written_before_request_n_and_cleared_before_n_plus_m() -> None:
    slow = SlowTier(10, 800.0, 5)
    writes = {i: slow.delay_before(i) for i in range(30) if slow.delay_before(i) is not None}
    assert writes == {10: 800.0, 15: 0.0}
    assert [i for i in range(30) if slow.slow(i)] == [10, 11, 12, 13, 14]
    assert slow.end == 15


@pytest.mark.parametrize(("args", "flag"), [
    ((-1, 800.0, 5), "--slow-tier-at"), ((True, 800.0, 5), "--slow-tier-at"),
    ((1, 0.0, 5), "--slow-tier-ms"), ((1, float("nan"), 5), "--slow-tier-ms"),
    ((1, 60_001.0, 5), "--slow-tier-ms"), ((1, 800.0, 0), "--slow-tier-for"),
])
def test_a_bad_schedule_names_its_flag(args: tuple[Any, float, Any], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        SlowTier(*args)


def test_a_plan_header_gives_the_path_and_whether_d_tiers_were_left_out() -> None:
    assert choice_of("path=local; est_ms=3.0; local=3.0; why=fastest") == "local"
    off = "path=pull; est_ms=40.0; local=900.0; push=41.0; pull=40.0; tiers=off; why=fastest"
    assert choice_of(off) == "pull tiers-off"
    assert choice_of("path=push; tiers=on; why=tie") == "push"
    assert choice_of(None) is choice_of("why=fastest") is None
    assert reads_tier("local") and reads_tier("push") and not reads_tier("pull tiers-off")
    assert reads_tier(None) is None


def _rec(index: int, klass: str, path: str, off: bool = False, ttft: float = 0.05,
         why: str = "fastest") -> dict[str, Any]:
    plan = f"path={path}; {'tiers=off; ' if off else ''}why={why}"
    return {"index": index, "klass": klass, "plan": plan, "ok": True, "ttft_s": ttft}


def test_flips_count_the_class_requests_from_the_injection_to_each_flip() -> None:
    slow = SlowTier(10, 800.0, 10)
    records = [_rec(i, "short", "local") for i in range(30)]
    disk = {2: ("local", False), 6: ("local", False), 11: ("local", False),
            13: ("local", False), 14: ("push", True), 17: ("pull", True), 19: ("pull", True),
            21: ("pull", True), 24: ("local", False), 28: ("local", False)}
    for i, (path, off) in disk.items():
        records[i] = _rec(i, "disk", path, off, ttft=0.9 if slow.slow(i) else 0.05)
    got = flips(reversed(records), slow)  # any order: sorted by index
    assert [r["index"] for r in got["requests"]] == sorted(disk)
    assert got["flip_after"] == {"class_requests": 3, "requests": 5, "index": 14}
    assert got["back_after"] == {"class_requests": 2, "requests": 5, "index": 24}
    assert (got["reads_tier_before"], got["reads_tier_during"], got["reads_tier_after"]) == (
        "2/2", "2/5", "2/3")
    row = got["requests"][2]
    assert row == {"index": 11, "slow": True, "choice": "local", "reads_tier": True,
                   "why": "fastest", "ok": True, "ttft_ms": 900.0}
    text = format_flips(got)
    assert "flipped off the tier at request 14: 3 disk request(s), 5 request(s)" in text
    assert "back on the tier at request 24: 2 disk request(s)" in text
    assert "#14   SLOW  push tiers-off" in text and "#2    fast  local" in text
    assert "#2 " not in format_flips(got, window=5)  # only near the start and the end


def test_a_flip_that_never_happens_says_so() -> None:
    slow = SlowTier(1, 500.0, 2)
    got = flips([_rec(i, "disk", "local") for i in range(5)], slow)
    assert got["flip_after"] is None and got["back_after"] == {
        "class_requests": 1, "requests": 1, "index": 3}
    assert "never flipped off the tier" in format_flips(got)
    assert flips([], slow)["reads_tier_during"] == "-"


def test_the_engine_settings_under_disk_tier() -> None:
    offload = disk_tier_offload("/tmp/x", "/tmp/x/ms")
    assert offload == {"tiers": [{"name": "slow_disk", "path": "/tmp/x",
                                  "capacity_bytes": "256MiB", "delay_file": "/tmp/x/ms"}]}
    events = kv_events_config(5557)
    assert events["endpoint"] == "tcp://*:5557" and events["publisher"] == "zmq"
    assert events["enable_kv_cache_events"] is True

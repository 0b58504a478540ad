"""The ``slow_disk`` fault-injection tier (:mod:`kvbridge.testing.slow_tier`), no vLLM: it is
the disk tier (the tier conformance suite, against its entry point), its reads take the delay
its control file says — changed while the tier lives — its writes are not slowed unless asked,
a hostile control file is no delay and one warning, and the configuration and the registry
(what ``kvbridge backends`` lists) find it."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvbridge import registry
from kvbridge.config import Config
from kvbridge.errors import ConfigError
from kvbridge.integrations import names
from kvbridge.offload.build import build_tiers
from kvbridge.offload.tier import Tier, TierContext
from kvbridge.testing import slow_tier
from kvbridge.testing.conformance import CHUNK, TierConformance, chunk_of
from kvbridge.testing.slow_tier import DelayFile, SlowDiskTier

pytestmark = pytest.mark.timeout(60)


class TestSlowDiskConformance(TierConformance):
    """The whole tier contract, through the ``slow_disk`` entry point, with a small delay on:
    it stores and loads exactly like ``disk``."""

    tier_name = "slow_disk"
    persistent = True
    secret = b"slow-disk-secret-0123456789abcdef"

    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "kv"), "capacity_bytes": 64 << 20, "read_delay_ms": 1}

    def corrupt(self, tier: Tier, key: str) -> bool:
        assert isinstance(tier, SlowDiskTier)
        path = tier._path(key)
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 0x5A
        path.write_bytes(bytes(blob))
        return True


def _tier(tmp_path: Path, **options: Any) -> SlowDiskTier:
    ctx = TierContext("slow_disk", CHUNK, "cd" * 16, {"path": str(tmp_path / "kv"), **options})
    return SlowDiskTier(ctx)


def _timed_load(tier: SlowDiskTier, keys: list[str]) -> tuple[float, list[bytes]]:
    start = time.monotonic()
    got = tier.load(keys)
    return time.monotonic() - start, got


def _set(path: Path, text: str) -> None:
    path.write_text(text)
    time.sleep(slow_tier.RECHECK_S + 0.02)  # the tier looks again after RECHECK_S


def test_reads_take_the_files_delay_changed_while_the_tier_lives(tmp_path: Path) -> None:
    ctl = tmp_path / "delay_ms"
    ctl.write_text("0")
    tier = _tier(tmp_path, delay_file=str(ctl))
    keys = [uuid.uuid4().hex for _ in range(3)]
    stored_at = time.monotonic()
    assert tier.store([(k, chunk_of(k)) for k in keys]) == keys
    assert time.monotonic() - stored_at < 0.15  # writes are not slowed
    fast, got = _timed_load(tier, keys)
    assert [bytes(g) for g in got] == [chunk_of(k) for k in keys]
    assert fast < 0.1

    _set(ctl, "200\n")
    slow, got = _timed_load(tier, keys)
    assert slow >= 0.2 and [bytes(g) for g in got] == [chunk_of(k) for k in keys]
    assert tier.stats()["slow_delays"] == 1 and tier.stats()["slow_delay_ms"] >= 200
    assert tier.stats()["slow_read_delay_ms_now"] == 200
    assert tier.contains(keys) == 3  # contains reads no chunk: never slowed
    assert _timed_load(tier, [])[0] < 0.05  # nothing to read: no delay

    _set(ctl, "0")
    again, _ = _timed_load(tier, keys)
    assert again < 0.1 and tier.stats()["slow_delays"] == 1

    ctl.unlink()
    time.sleep(slow_tier.RECHECK_S + 0.02)
    assert _timed_load(tier, keys)[0] < 0.1  # absent file: no delay
    assert "FAULT INJECTION" in tier.describe()
    tier.close()


def test_static_read_and_write_delays(tmp_path: Path) -> None:
    tier = _tier(tmp_path, read_delay_ms="120", write_delay_ms=80)
    (k,) = [uuid.uuid4().hex]
    start = time.monotonic()
    tier.store([(k, chunk_of(k))])
    assert time.monotonic() - start >= 0.08
    assert _timed_load(tier, [k])[0] >= 0.12
    stats = tier.stats()
    assert stats["slow_delays"] == 1 and stats["slow_write_delays"] == 1
    tier.close()
    for bad in ("-1", "nan", "soon", 60_001):
        with pytest.raises(ConfigError, match="read_delay_ms"):
            _tier(tmp_path, read_delay_ms=bad)
    with pytest.raises(ConfigError, match="delay_file"):
        _tier(tmp_path, delay_file=12)


@pytest.mark.parametrize("content", [
    "soon", "-5", "nan", "NaN", "inf", "1e9", "60001", "99999999999999999999999", "300ms",
    "0x10", "\xff\xfe", "1" * 200,
])
def test_hostile_contents_are_no_delay_and_one_warning(tmp_path: Path, caplog: Any,
                                                       content: str) -> None:
    ctl = tmp_path / "delay_ms"
    ctl.write_bytes(content.encode("latin-1"))
    tier = _tier(tmp_path, delay_file=str(ctl))
    k = uuid.uuid4().hex
    tier.store([(k, chunk_of(k))])
    with caplog.at_level(logging.WARNING, logger="kvbridge.offload"):
        for _ in range(2):
            elapsed, got = _timed_load(tier, [k])
            assert elapsed < 0.1 and [bytes(g) for g in got] == [chunk_of(k)]
            time.sleep(slow_tier.RECHECK_S + 0.01)  # re-read: still the same, no new line
        ctl.write_bytes(content.encode("latin-1"))  # rewritten unchanged: still one line
        time.sleep(slow_tier.RECHECK_S + 0.01)
        tier.load([k])
    lines = [r for r in caplog.records if "delay file" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert str(ctl) in lines[0].getMessage()
    assert tier.stats()["slow_delays"] == 0
    _set(ctl, "150")  # a good value again: the delay is back
    assert _timed_load(tier, [k])[0] >= 0.15
    tier.close()


def test_links_fifos_directories_and_unreadable_files_are_no_delay(tmp_path: Path,
                                                                   caplog: Any) -> None:
    target = tmp_path / "target"
    target.write_text("500")
    link = tmp_path / "link"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    locked = tmp_path / "locked"
    locked.write_text("500")
    locked.chmod(0)
    cases = [link, fifo, folder] + ([locked] if os.geteuid() != 0 else [])
    for path in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbridge.offload"):
            control = DelayFile(path)
            assert control.ms() == 0
            time.sleep(slow_tier.RECHECK_S + 0.01)
            assert control.ms() == 0
        lines = [r.getMessage() for r in caplog.records if "delay file" in r.getMessage()]
        assert len(lines) == 1 and str(path) in lines[0], (path, lines)
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbridge.offload"):
        assert DelayFile(empty).ms() == 0 and DelayFile(tmp_path / "absent").ms() == 0
    assert not [r for r in caplog.records if "delay file" in r.getMessage()]


def test_the_file_is_read_at_most_every_recheck_interval(tmp_path: Path) -> None:
    ctl = tmp_path / "delay_ms"
    ctl.write_text("5")
    control = DelayFile(ctl, recheck_s=0.3)
    assert control.ms() == 5
    ctl.write_text("7")
    assert control.ms() == 5  # cached
    time.sleep(0.32)
    assert control.ms() == 7
    assert DelayFile(ctl).ms() == 7


def test_the_configuration_builds_it(tmp_path: Path) -> None:
    ctl = tmp_path / "delay_ms"
    ctl.write_text("42")
    cfg = Config.load({"offload": {"tiers": [
        {"name": "slow_disk", "path": str(tmp_path / "kv"), "delay_file": str(ctl)}]}}, env={})
    tiers = build_tiers(cfg.offload_config(), CHUNK, "ef" * 16)
    assert [type(t) for t in tiers] == [SlowDiskTier]
    assert isinstance(tiers[0], SlowDiskTier) and tiers[0].current_read_delay_ms() == 42
    tiers[0].close()

    env = {"KVBRIDGE_OFFLOAD_TIERS": "dram,slow_disk",
           "KVBRIDGE_OFFLOAD_SLOW_DISK_PATH": str(tmp_path / "kv2"),
           "KVBRIDGE_OFFLOAD_SLOW_DISK_DELAY_FILE": str(ctl),
           "KVBRIDGE_OFFLOAD_SLOW_DISK_CAPACITY_BYTES": "1MiB"}
    cfg = Config.load({}, env=env)
    assert cfg.warnings == ()
    tiers = build_tiers(cfg.offload_config(), CHUNK, "ef" * 16)
    try:
        assert [t.name for t in tiers] == ["dram", "slow_disk"]
        slow = tiers[1]
        assert isinstance(slow, SlowDiskTier) and slow.capacity_bytes == 1 << 20
        assert slow.blocking and slow.managed  # the manager calls it off the engine's thread
        assert slow.current_read_delay_ms() == 42
    finally:
        for t in tiers:
            t.close()


def test_it_is_listed_loadable_but_gets_no_connector_name(monkeypatch: Any) -> None:
    real = registry._entry_points(registry.TIER_GROUP)
    assert "slow_disk" in real and "slow_disk" in registry.available_tiers()
    assert registry.load_tier_class("slow_disk") is SlowDiskTier
    # only the real slow_disk entry point: the other plugins' probes import torch (seconds)
    only = {"slow_disk": real["slow_disk"]}
    monkeypatch.setattr(registry, "_entry_points",
                        lambda group=registry.GROUP: only if group == registry.TIER_GROUP else {})
    (row,) = registry.tier_status()
    assert row.name == "slow_disk" and row.loadable and "FAULT INJECTION" in row.detail
    assert row.target == "kvbridge.testing.slow_tier:SlowDiskTier"
    assert all(c.backend != "slow_disk" for c in names.connector_names())

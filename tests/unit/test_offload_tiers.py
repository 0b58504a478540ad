"""The tier conformance suite against the built-in ``dram`` and ``disk`` tiers, plus the disk
tier's own crash-safety checks (leftover temporary files, truncated files, foreign files)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from kvbridge import registry
from kvbridge.errors import BackendNotFound, ConfigError
from kvbridge.offload.tier import Tier, TierContext
from kvbridge.offload.tiers.disk import DiskTier
from kvbridge.testing.conformance import CHUNK, TierConformance, chunk_of


class TestDramConformance(TierConformance):
    tier_name = "dram"


class TestDiskConformance(TierConformance):
    tier_name = "disk"
    persistent = True

    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "kv"), "capacity_bytes": 64 << 20}

    def corrupt(self, tier: Tier, key: str) -> bool:
        assert isinstance(tier, DiskTier)
        path = tier._path(key)
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 0x5A
        path.write_bytes(bytes(blob))
        return True



class TestDiskConformanceWithSecret(TestDiskConformance):
    """The whole tier contract again, with chunks MAC'd by the engine's secret (what an engine
    with a fleet or per-user secret runs; tests/process/test_local_files.py has the disk tier's
    hostile-file cases)."""

    secret = b"fleet-one-secret-0123456789abcdef"

def _disk(tmp_path: Path, ns: str | None = None) -> DiskTier:
    return DiskTier(TierContext("disk", CHUNK, ns or "ab" * 16, {"path": str(tmp_path)}))


def test_truncated_file_is_a_miss_and_removed(tmp_path: Path, caplog: Any) -> None:
    tier = _disk(tmp_path)
    k = uuid.uuid4().hex
    tier.store([(k, chunk_of(k))])
    path = tier._path(k)
    path.write_bytes(path.read_bytes()[:-1])
    assert tier.load([k]) == []
    assert not path.exists()
    assert "corrupted" in caplog.text


def test_leftover_temporary_files_are_removed_on_start(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    k = uuid.uuid4().hex
    tier.store([(k, chunk_of(k))])
    leftover = tier._path(k).parent / ".tmp-crashed"
    leftover.write_bytes(b"half a chunk")
    again = _disk(tmp_path)
    assert not leftover.exists()
    assert again.contains([k]) == 1


def test_file_under_another_key_name_is_a_miss(tmp_path: Path, caplog: Any) -> None:
    tier = _disk(tmp_path)
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    tier.store([(a, chunk_of(a))])
    dst = tier._path(b)
    dst.parent.mkdir(mode=0o700, exist_ok=True)  # prefix directories must be private
    dst.write_bytes(tier._path(a).read_bytes())  # a's file renamed to b: the key inside differs
    assert tier.load([b]) == []
    assert "key inside does not match" in caplog.text


@pytest.mark.parametrize("key", ["../../etc/passwd", "ABCDEF0123456789", "x" * 200, ""])
def test_hostile_keys_never_become_paths(tmp_path: Path, key: str) -> None:
    tier = _disk(tmp_path)
    with pytest.raises(ValueError):
        tier.contains([key])


def test_disk_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="path"):
        DiskTier(TierContext("disk", CHUNK, "ab" * 16, {}))


def test_capacity_smaller_than_a_chunk_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        _ = DiskTier(TierContext("disk", CHUNK, "ab" * 16,
                                 {"path": str(tmp_path), "capacity_bytes": 10}))


def test_tiers_are_entry_points() -> None:
    assert {"dram", "disk"} <= set(registry.available_tiers())
    with pytest.raises(BackendNotFound, match="did you mean 'disk'"):
        registry.load_tier_class("dsk")

"""The tier conformance suite against the ``lmcache`` tier (a real LMCache 0.5.6 engine, local
CPU backend, and local CPU + disk); and ``close`` draining LMCache's disk writes first."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed (see docs/backends/lmcache.md)")

from kvbridge.testing.conformance import TierConformance  # noqa: E402

pytestmark = [pytest.mark.lmcache]


class TestLMCacheConformance(TierConformance):
    tier_name = "lmcache"


class TestLMCacheDiskConformance(TierConformance):
    tier_name = "lmcache"

    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"capacity_bytes": 64 << 20, "disk_path": str(tmp_path / "lmcache"),
                "disk_capacity_bytes": 128 << 20}


def _disk_tier(tmp_path: Path) -> Any:
    from kvbridge import registry
    from kvbridge.offload.tier import TierContext
    from kvbridge.testing.conformance.tier import CHUNK

    cls = registry.load_tier_class("lmcache")
    return cls(TierContext("lmcache", CHUNK, "drain", {
        "capacity_bytes": 64 << 20, "disk_path": str(tmp_path / "lm"),
        "disk_capacity_bytes": 128 << 20}))


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> Any:
    """LMCache's disk writes take 20 ms each (an event lets a test hold them entirely)."""
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    go = threading.Event()
    go.set()
    write = LocalDiskBackend.write_file

    def slow(self: Any, buffer: Any, path: Any) -> Any:
        go.wait(60)
        time.sleep(0.02)
        return write(self, buffer, path)

    monkeypatch.setattr(LocalDiskBackend, "write_file", slow)
    return go


@pytest.mark.timeout(120)
def test_close_waits_for_disk_writes_before_destroying(tmp_path: Path, slow_disk: Any) -> None:
    """LMCache frees its CPU memory before its disk backend stops: destroying the engine under
    a write in flight crashed the process (SIGSEGV in CI). close() must drain them first."""
    from kvbridge.testing.conformance.tier import _keys, chunk_of

    tier = _disk_tier(tmp_path)
    seen: list[int] = []
    builder = tier._builder

    class Spy:
        def destroy(self, instance_id: str) -> None:
            seen.append(tier._pending_disk_writes())
            builder.destroy(instance_id)

    tier._builder = Spy()
    keys = _keys(20)
    assert len(tier.store([(k, chunk_of(k)) for k in keys])) == 20
    assert tier._pending_disk_writes() > 0  # the slow disk really left writes in flight
    tier.close()
    assert seen == [0]


@pytest.mark.timeout(120)
def test_close_leaves_a_stuck_engine_open_instead_of_crashing(
        tmp_path: Path, slow_disk: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import kvbridge_lmcache
    from kvbridge.testing.conformance.tier import _keys, chunk_of

    monkeypatch.setattr(kvbridge_lmcache, "_DRAIN_S", 0.2)
    tier = _disk_tier(tmp_path)
    slow_disk.clear()  # every write now blocks
    tier.store([(k, chunk_of(k)) for k in _keys(4)])
    with caplog.at_level("WARNING", logger="kvbridge.offload"):
        tier.close()
    assert "left open" in caplog.text
    slow_disk.set()  # let the writes finish, then clean up for real
    while tier._pending_disk_writes():
        time.sleep(0.01)
    tier._builder.destroy(tier._id)


def test_status_says_not_loadable_when_lmcache_does_not_import(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvbridge backends`` / the doctor: the tier is loadable only where LMCache imports."""
    import sys

    from kvbridge import registry

    assert {r.name: r for r in registry.tier_status()}["lmcache"].loadable
    monkeypatch.setitem(sys.modules, "lmcache.v1.cache_engine", None)  # as if not installed
    row = {r.name: r for r in registry.tier_status()}["lmcache"]
    assert not row.loadable
    assert "lmcache.v1.cache_engine" in row.detail and "pip install" in row.detail

"""The tier conformance suite against the ``lmcache`` tier (a real LMCache 0.5.6 engine, local
CPU backend, and local CPU + disk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed (see docs/backends/lmcache.md)")

from kvbridge.testing.tiers import TierConformance  # noqa: E402


class TestLMCacheConformance(TierConformance):
    tier_name = "lmcache"


class TestLMCacheDiskConformance(TierConformance):
    tier_name = "lmcache"

    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"capacity_bytes": 64 << 20, "disk_path": str(tmp_path / "lmcache"),
                "disk_capacity_bytes": 128 << 20}

"""The drain's write-out (kvbridge.offload.warm) over real KV memory and real dram/disk tiers:
most recently used first, bounded by bytes and time, a failing tier counted while the others
are written, once per engine, and the ``drain_only`` tier option."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout
from kvbridge.offload import warm
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.keys import block_keys, seed_key
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.offload.orders import LookupOrder, OffloadPlan, StoreOrder
from kvbridge.offload.seal import sealed_size
from kvbridge.offload.tier import Tier, TierContext

BS = 4
NB = 64
SEED = seed_key({"model": "m", "dtype": "float32"})


class Flaky(Tier):
    """A blocking tier that stores ``ok`` chunks, then fails: raising, or storing nothing."""

    def __init__(self, ctx: TierContext, ok: int, raises: bool) -> None:
        super().__init__(ctx)
        self.ok, self.raises = ok, raises
        self.chunks: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def contains(self, keys: Sequence[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.chunks:
            n += 1
        return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        return [self.chunks[k] for k in keys[:self.contains(keys)]]

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        done = []
        for key, chunk in items:
            if len(self.chunks) >= self.ok:
                if self.raises:
                    raise OSError("the shared store went away")
                break
            self.chunks[key] = chunk
            done.append(key)
        return done

    def evict(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.chunks.pop(k, None)


class Rank:
    """A fake engine rank's KV memory (vLLM CPU shape) + a manager with real tiers."""

    def __init__(self, tiers: list[Any], extra: Sequence[Tier] = (), **knobs: Any) -> None:
        self.kv = {f"layer{i}": np.zeros((NB, 2, BS, 8), dtype=np.float32) for i in range(3)}
        layout = KVLayout.from_tensors(self.kv, NB, BS)
        self.io = BlockIO(layout)
        cfg = OffloadConfig.parse({"tiers": tiers, **knobs})
        built = build_tiers(cfg, self.io.chunk_bytes, "cd" * 16)
        self.manager = OffloadManager(cfg, [*built[:1], *extra, *built[1:]], self.io,
                                      layout_fingerprint=layout.fingerprint())

    def store(self, req: str, keys: list[str], blocks: list[int]) -> None:
        for b in blocks:
            for t in self.kv.values():
                t[b] = float(b)
        self.manager.apply(OffloadPlan(stores=[StoreOrder(req, tuple(keys), tuple(blocks))]))
        assert self.manager.flush()

    def lookup(self, lid: str, keys: list[str]) -> int:
        self.manager.apply(OffloadPlan(lookups=[LookupOrder(lid, tuple(keys))]))
        assert self.manager.flush()
        return self.manager.take_answers()[lid]


def chunk_size() -> int:
    kv = {f"layer{i}": np.zeros((NB, 2, BS, 8), dtype=np.float32) for i in range(3)}
    return sealed_size(BlockIO(KVLayout.from_tensors(kv, NB, BS)).chunk_bytes)


def chains() -> list[list[str]]:
    return [block_keys(SEED, list(range(s, s + 3 * BS)), BS) for s in (0, 1000, 2000)]


def disk(path: Path, **options: Any) -> dict[str, Any]:
    return {"name": "disk", "path": str(path), **options}


def test_drain_only_tier_is_skipped_by_stores_and_the_write_out_takes_the_newest_heads_first(
        tmp_path: Path) -> None:
    r = Rank(["dram", disk(tmp_path, drain_only=True)], drain_write_bytes=4 * chunk_size())
    a, b, c = chains()
    for i, keys in enumerate((a, b, c)):  # c is the most recently used
        r.store(f"r{i}", keys, [3 * i, 3 * i + 1, 3 * i + 2])
    counters = r.manager.take_counters()
    assert counters["offload_stored_blocks_dram"] == 9
    assert "offload_stored_blocks_disk" not in counters and not list(tmp_path.rglob("*.kvb"))
    report = warm.write_out(r.manager, 4 * chunk_size(), 10.0)
    assert report.written == {"disk": 4} and not report.failed and not report.timed_out
    assert r.manager.take_counters()["offload_drain_written_blocks_disk"] == 4
    r.manager.close()  # no drain before: close writes out (its own budget; the 4 are present)
    again = Rank([disk(tmp_path)])  # the successor: only the shared disk
    try:
        # c whole, then b's head: whole prefixes from the head, never a tail without its head
        assert [again.lookup(f"L{i}", k) for i, k in enumerate((c, b, a))] == [3, 3, 2]
    finally:
        again.manager.close()


def test_the_byte_budget_counts_only_chunks_written_and_present_ones_are_skipped(
        tmp_path: Path) -> None:
    r = Rank(["dram", disk(tmp_path)])  # written through: the disk holds everything already
    try:
        for i, keys in enumerate(chains()):
            r.store(f"r{i}", keys, [3 * i, 3 * i + 1, 3 * i + 2])
        report = warm.write_out(r.manager, chunk_size(), 10.0)
        assert report.written == {} and report.present == {"disk": 9}
        assert r.manager.take_counters()["offload_drain_present_blocks_disk"] == 9
    finally:
        r.manager.close()


def test_the_time_budget_ends_the_write_out_and_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "BATCH", 3)  # the clock is read between batches
    r = Rank(["dram", disk(tmp_path, drain_only=True)], drain_write_bytes=0)
    try:
        for i, keys in enumerate(chains()):
            r.store(f"r{i}", keys, [3 * i, 3 * i + 1, 3 * i + 2])
        ticks = iter([0.0, 0.5, 5.0])  # start; one batch in time; the next one late
        report = warm.write_out(r.manager, 1 << 30, 1.0, clock=lambda: next(ticks))
        assert report.timed_out and report.written == {"disk": 3}
        assert warm.write_out(r.manager, 1 << 30, 0.0).timed_out  # no time: nothing written
        assert r.manager.take_counters()["offload_drain_timeouts"] == 2
    finally:
        r.manager.close()  # drain_write_bytes 0: close writes nothing more


@pytest.mark.parametrize("raises", [True, False])
def test_a_tier_failing_mid_write_out_is_counted_and_the_others_are_still_written(
        tmp_path: Path, raises: bool) -> None:
    flaky = Flaky(TierContext("flaky", chunk_size(), "cd" * 16), ok=16, raises=raises)
    r = Rank(["dram", disk(tmp_path, drain_only=True)], extra=[flaky])
    try:
        many = [block_keys(SEED, list(range(s, s + 4 * BS)), BS) for s in range(0, 6000, 1000)]
        for i, keys in enumerate(many):  # 24 chunks; flaky takes 16 by store, then fails
            r.store(f"r{i}", keys, [4 * i + j for j in range(4)])
        assert len(flaky.chunks) == 16
        flaky.ok = 21  # room for 5 of the 8 it lacks, then it fails mid-write-out
        r.manager.take_counters()
        report = warm.write_out(r.manager, 1 << 30, 10.0)  # flaky first, then disk
        assert report.written["disk"] == 24  # drain_only: none of it was there before
        # raising: the tier's call failed as a whole (the manager cannot know what it kept)
        assert report.written.get("flaky", 0) == (0 if raises else 5)
        assert report.failed["flaky"] == (8 if raises else 3)
        counters = r.manager.take_counters()
        assert counters["offload_drain_failed_flaky"] == report.failed["flaky"]
        assert counters["offload_drain_written_blocks_disk"] == 24
        assert counters.get("offload_tier_errors_flaky", 0) == int(raises)
    finally:
        r.manager.close()


def test_drain_writes_out_once_and_later_stores_reach_the_drain_only_tier(
        tmp_path: Path) -> None:
    r = Rank(["dram", disk(tmp_path, drain_only=True)])
    a, b, c = chains()
    try:
        r.store("a", a, [0, 1, 2])
        r.manager.drain()
        r.manager.drain()  # idempotent: one write-out
        assert r.manager.flush()
        counters = r.manager.take_counters()
        assert counters["offload_drain_written_blocks_disk"] == 3
        r.store("b", b, [3, 4, 5])  # draining: the store writes the disk tier itself
        assert r.manager.take_counters()["offload_stored_blocks_disk"] == 3
    finally:
        r.manager.close()
    assert "offload_drain_present_blocks_disk" not in r.manager.take_counters()  # not again
    assert len(list(tmp_path.rglob("*.kvb"))) == 6


def test_write_out_options_are_checked() -> None:
    cfg = OffloadConfig.parse({"tiers": ["dram", {"name": "disk", "path": "/x",
                                                  "drain_only": "yes"}],
                               "drain_write_bytes": "1MiB", "drain_write_s": "2.5"})
    assert cfg.drain_only("disk") and not cfg.drain_only("dram")
    assert cfg.drain_write_bytes == 1 << 20 and cfg.drain_write_s == 2.5
    assert OffloadConfig.parse(cfg.to_json()) == cfg
    for bad, what in [({"drain_only": "perhaps"}, "drain_only"),
                      ({"drain_write_s": "soon"}, "drain_write_s"),
                      ({"drain_write_s": -1}, "drain_write_s"),
                      ({"drain_write_s": 1e9}, "drain_write_s"),
                      ({"drain_write_bytes": "-5"}, "drain_write_bytes")]:
        raw: dict[str, Any] = {"tiers": ["dram"]}
        if "drain_only" in bad:
            raw["tiers"] = [{"name": "dram", **bad}]
        else:
            raw.update(bad)
        with pytest.raises(ConfigError, match=what):
            OffloadConfig.parse(raw)


def test_the_write_out_fills_a_managed_tiers_free_room_and_evicts_nothing(
        tmp_path: Path) -> None:
    r = Rank(["dram", disk(tmp_path, drain_only=True, capacity_bytes=5 * chunk_size())])
    try:
        for i, keys in enumerate(chains()):
            r.store(f"r{i}", keys, [3 * i, 3 * i + 1, 3 * i + 2])
        first = warm.write_out(r.manager, 1 << 30, 10.0)
        assert first.written == {"disk": 5}  # the newest chain, then the next one's head
        again = warm.write_out(r.manager, 1 << 30, 10.0)
        assert again.written == {}  # full: nothing evicted to make room
        assert "offload_evicted_blocks_disk" not in r.manager.take_counters()
        assert len(list(tmp_path.rglob("*.kvb"))) == 5
    finally:
        r.manager.close()

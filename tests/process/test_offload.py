"""Offload without vLLM: content keys, configuration, the worker-side manager over real KV
memory (numpy arrays laid out like vLLM's CPU cache) with real dram/disk tiers, and the
scheduler-side book driving it the way vLLM's scheduler does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.config import Config
from kvbridge.errors import ConfigError
from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.book import OffloadBook
from kvbridge.offload.config import OffloadConfig, parse_size
from kvbridge.offload.keys import block_keys, salted, seed_key
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.offload.orders import LoadOrder, LookupOrder, OffloadPlan, StoreOrder
from kvbridge.offload.seal import sealed_size

BS = 4
NB = 64
SEED = seed_key({"model": "m", "dtype": "float32"})


# -- keys ------------------------------------------------------------------------------------

def test_keys_chain_over_full_blocks_only() -> None:
    toks = list(range(10))
    keys = block_keys(SEED, toks, BS)
    assert len(keys) == 2  # the partial third block has no key
    assert block_keys(SEED, toks[:8], BS) == keys
    changed = block_keys(SEED, [99] + toks[1:], BS)
    assert changed[0] != keys[0] and changed[1] != keys[1]  # a changed prefix changes all
    tail = block_keys(SEED, toks[:4] + [99, 5, 6, 7], BS)
    assert tail[0] == keys[0] and tail[1] != keys[1]
    assert block_keys(SEED, toks, BS, limit=1) == keys[:1]


def test_keys_depend_on_identity_not_its_order() -> None:
    a = seed_key({"model": "m", "dtype": "float32"})
    assert a == seed_key({"dtype": "float32", "model": "m"})
    assert block_keys(a, range(8), BS) != block_keys(seed_key({"model": "m", "dtype": "bf16"}),
                                                     range(8), BS)


def test_keys_are_stable_across_processes() -> None:
    code = ("from kvbridge.offload.keys import block_keys, salted, seed_key;"
            "print(','.join(block_keys(seed_key({'model': 'm', 'dtype': 'float32'}),"
            " list(range(12)), 4)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "random", "PATH": ""}).stdout
    assert out.strip().split(",") == block_keys(SEED, list(range(12)), BS)


def test_keys_of_different_salts_never_meet() -> None:
    toks = list(range(3 * BS))
    plain = block_keys(SEED, toks, BS)
    a, b = (block_keys(salted(SEED, s), toks, BS) for s in ("tenant-A", "tenant-B"))
    assert salted(SEED, None) == salted(SEED, "") == SEED  # no salt: today's keys
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert a == block_keys(salted(SEED, "tenant-A"), toks, BS)  # stable


def test_book_stores_and_looks_up_under_the_requests_salt() -> None:
    book = OffloadBook(OffloadConfig.parse({"tiers": ["dram"]}), SEED, block_size=BS)
    prompt = list(range(3 * BS + 1))
    assert book.finished("a", True, prompt, [0, 1, 2, 3], salt="tenant-A")
    assert book.matched("b", prompt, 0, salt="tenant-B") is None  # a lookup goes out
    plan = book.take_plan()
    [store], [lookup] = plan.stores, plan.lookups
    assert store.keys == tuple(block_keys(salted(SEED, "tenant-A"), prompt, BS))
    assert lookup.keys == tuple(block_keys(salted(SEED, "tenant-B"), prompt, BS))[:3]


def test_keys_refuse_out_of_range_tokens() -> None:
    with pytest.raises(ValueError):
        block_keys(SEED, [-1, 0, 0, 0], BS)


# -- configuration ---------------------------------------------------------------------------

def test_config_parses_and_names_bad_keys(tmp_path: Path) -> None:
    cfg = OffloadConfig.parse({"tiers": ["dram", {"name": "disk", "path": str(tmp_path),
                                                  "capacity_bytes": "2MiB"}]})
    assert [t.name for t in cfg.tiers] == ["dram", "disk"]
    assert cfg.tiers[1].options["capacity_bytes"] == 2 << 20
    for bad, field in [({"tier": []}, "unknown key 'tier'"),
                       ({"tiers": [{"path": "x"}]}, r"offload.tiers\[0\]"),
                       ({"tiers": ["dram", "dram"]}, "listed twice"),
                       ({"tiers": [{"name": "dram", "capacity_bytes": "lots"}]},
                        "capacity_bytes"),
                       ({"tiers": ["dram"], "store": "maybe"}, "offload.store")]:
        with pytest.raises(ConfigError, match=field):
            OffloadConfig.parse(bad)
    assert parse_size("1.5KiB", "x") == 1536


def test_env_overrides_single_tier_options(tmp_path: Path) -> None:
    env = {"KVBRIDGE_OFFLOAD_TIERS": "dram,disk", "KVBRIDGE_OFFLOAD_DISK_PATH": str(tmp_path),
           "KVBRIDGE_OFFLOAD_DRAM_CAPACITY_BYTES": "1MiB", "KVBRIDGE_OFFLOAD_STORE": "false"}
    cfg = Config.load({"offload": {"tiers": [{"name": "dram", "capacity_bytes": 5}]}}, env=env)
    off = cfg.offload_config()
    assert [t.name for t in off.tiers] == ["dram", "disk"]
    assert off.tiers[0].options["capacity_bytes"] == 1 << 20
    assert off.tiers[1].options["path"] == str(tmp_path)
    assert off.store is False
    assert cfg.sources["offload"].startswith("env ")
    with pytest.raises(ConfigError, match="KVBRIDGE_OFFLOAD_NVME_PATH"):
        Config.load({}, env={"KVBRIDGE_OFFLOAD_TIERS": "dram",
                             "KVBRIDGE_OFFLOAD_NVME_PATH": "/x"})
    with pytest.raises(ConfigError, match="KVBRIDGE_OFFLOAD"):
        Config.load({}, env={"KVBRIDGE_OFFLOAD": "{not json"})


# -- the manager over real memory --------------------------------------------------------------

class Rank:
    """A fake engine rank's KV memory (vLLM CPU shape) + a manager with real tiers."""

    def __init__(self, tiers: list[Any], **knobs: Any) -> None:
        self.kv = {f"layer{i}": np.zeros((NB, 2, BS, 8), dtype=np.float32) for i in range(3)}
        self.layout = KVLayout.from_tensors(self.kv, NB, BS)
        self.io = BlockIO(self.layout)
        cfg = OffloadConfig.parse({"tiers": tiers, **knobs})
        self.manager = OffloadManager(cfg, build_tiers(cfg, self.io.chunk_bytes, "cd" * 16),
                                      self.io, layout_fingerprint=self.layout.fingerprint())

    def fill(self, block: int, value: float) -> None:
        for t in self.kv.values():
            t[block] = value + np.arange(2 * BS * 8).reshape(2, BS, 8)

    def block(self, block: int) -> list[np.ndarray]:
        return [t[block].copy() for t in self.kv.values()]

    def store(self, req: str, keys: list[str], blocks: list[int]) -> None:
        self.manager.apply(OffloadPlan(stores=[StoreOrder(req, tuple(keys), tuple(blocks))]))
        assert self.manager.flush()
        assert req in self.manager.take_stored()

    def lookup(self, lid: str, keys: list[str]) -> int:
        self.manager.apply(OffloadPlan(lookups=[LookupOrder(lid, tuple(keys))]))
        assert self.manager.flush()
        return self.manager.take_answers()[lid]

    def close(self) -> None:
        self.manager.close()


def _keys(n: int, salt: int = 0) -> list[str]:
    return block_keys(SEED, [salt] * 0 + list(range(salt, salt + n * BS)), BS)


def test_store_lookup_load_round_trip(tmp_path: Path) -> None:
    r = Rank(["dram", {"name": "disk", "path": str(tmp_path)}])
    try:
        keys = _keys(3)
        for b in (5, 6, 7):
            r.fill(b, b * 100.0)
        expect = [r.block(b) for b in (5, 6, 7)]
        r.store("req", keys, [5, 6, 7])
        assert r.lookup("L1", keys) == 3
        ok_errors = r.manager.apply(OffloadPlan(loads=[LoadOrder("L1", 0, (20, 21, 22))]))
        assert ok_errors == set()
        for b, want in zip((20, 21, 22), expect, strict=True):
            for got, w in zip(r.block(b), want, strict=True):
                np.testing.assert_array_equal(got, w)
        assert r.manager.take_counters()["offload_loaded_blocks"] == 3
    finally:
        r.close()


def test_disk_survives_restart_and_corruption_shortens_the_hit(tmp_path: Path) -> None:
    keys = _keys(4)
    first = Rank([{"name": "disk", "path": str(tmp_path)}])
    for b in range(4):
        first.fill(b, float(b))
    first.store("req", keys, [0, 1, 2, 3])
    tkeys = first.manager.tkeys(keys)
    disk = first.manager.tiers[0]
    first.close()
    path = disk._path(tkeys[2])  # type: ignore[attr-defined]
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF
    path.write_bytes(bytes(blob))
    again = Rank([{"name": "disk", "path": str(tmp_path)}])
    try:
        assert again.lookup("L", keys) == 2  # blocks 0, 1; block 2 is corrupted
        assert again.manager.take_counters()["offload_load_failed"] == 1
        assert again.lookup("L2", keys) == 2  # forgotten, not retried as a hit
    finally:
        again.close()


@pytest.mark.parametrize("where", ["payload", "digest"])
def test_a_byte_flipped_in_a_tier_is_caught_by_the_chunk_digest(where: str) -> None:
    """Every tier stores chunks sealed with their digest (kvbridge.offload.seal): a byte changed
    behind the tier's back (here in DRAM, which checks nothing itself) ends the hit at that
    block, is counted, and the chunk is dropped; the KV loaded is only what matched."""
    r = Rank(["dram"])
    try:
        keys = _keys(4)
        for b in range(4):
            r.fill(b, 10.0 * b)
        want = [r.block(b) for b in range(2)]
        r.store("req", keys, [0, 1, 2, 3])
        dram = r.manager.tiers[0]
        victim = r.manager.tkeys(keys)[2]
        blob = bytearray(dram._chunks[victim])  # type: ignore[attr-defined]
        blob[5 if where == "payload" else -3] ^= 0x40
        dram._chunks[victim] = bytes(blob)  # type: ignore[attr-defined]
        assert r.lookup("L", keys) == 2  # blocks 0 and 1; block 2 does not match its digest
        counters = r.manager.take_counters()
        assert counters["offload_digest_mismatch_dram"] == 1
        assert victim not in dram._chunks  # type: ignore[attr-defined]
        assert r.manager.apply(OffloadPlan(loads=[LoadOrder("L", 0, (20, 21))])) == set()
        for b, expect in zip((20, 21), want, strict=True):
            for got, w in zip(r.block(b), expect, strict=True):
                np.testing.assert_array_equal(got, w)
        assert r.lookup("L2", keys) == 2  # dropped, not found again
    finally:
        r.close()


def test_close_ends_the_write_behind_pipe_after_every_queued_store(tmp_path: Path) -> None:
    """The blocking tier is written behind through a FIFO pipe; closing the manager ends the
    stream after what was queued (nothing dropped), and a store that comes later still
    releases its blocks."""
    r = Rank([{"name": "disk", "path": str(tmp_path)}])
    chains = [_keys(2, salt) for salt in (0, 1000, 2000)]
    for i, keys in enumerate(chains):
        r.fill(2 * i, float(i))
        r.manager.apply(OffloadPlan(stores=[StoreOrder(f"r{i}", tuple(keys), (2 * i, 2 * i + 1))]))
    r.close()
    again = Rank([{"name": "disk", "path": str(tmp_path)}])
    try:
        assert [again.lookup(f"L{i}", keys) for i, keys in enumerate(chains)] == [2, 2, 2]
    finally:
        again.close()
    r.manager.apply(OffloadPlan(stores=[StoreOrder("late", tuple(_keys(1, 5000)), (9,))]))
    assert "late" in r.manager.take_stored()


def test_capacity_evicts_lru_tail_first(tmp_path: Path) -> None:
    probe = Rank(["dram"])
    chunk = sealed_size(probe.io.chunk_bytes)  # tiers hold sealed chunks
    probe.close()
    r = Rank([{"name": "dram", "capacity_bytes": chunk * 4}])
    try:
        a, b = _keys(3, 0), _keys(3, 1000)
        r.store("a", a, [0, 1, 2])
        r.store("b", b, [3, 4, 5])  # 6 chunks into 4: a's tail goes first
        assert r.lookup("LA", a) == 1
        assert r.lookup("LB", b) == 3
        assert r.manager.take_counters()["offload_evicted_blocks_dram"] == 2
        assert r.manager.snapshot()["tiers"][0]["used_bytes"] <= chunk * 4
    finally:
        r.close()


def test_lower_tier_hit_is_promoted(tmp_path: Path) -> None:
    probe = Rank(["dram"])
    chunk = sealed_size(probe.io.chunk_bytes)  # tiers hold sealed chunks
    probe.close()
    r = Rank([{"name": "dram", "capacity_bytes": chunk * 2},
              {"name": "disk", "path": str(tmp_path)}])
    try:
        a, b = _keys(2, 0), _keys(2, 500)
        r.store("a", a, [0, 1])
        r.store("b", b, [2, 3])  # a leaves dram, stays on disk
        r.manager.take_counters()
        assert r.lookup("L", a) == 2
        c = r.manager.take_counters()
        assert c["offload_hit_blocks_disk"] == 2 and c["offload_promoted_blocks"] == 2
        assert r.lookup("L2", a) == 2
        assert r.manager.take_counters()["offload_hit_blocks_dram"] == 2
    finally:
        r.close()


def test_staging_budget_and_release(tmp_path: Path) -> None:
    probe = Rank(["dram"])
    chunk = sealed_size(probe.io.chunk_bytes)  # tiers hold sealed chunks
    probe.close()
    r = Rank(["dram"], max_staged_bytes=chunk * 2)
    try:
        keys = _keys(3)
        r.store("a", keys, [0, 1, 2])
        assert r.lookup("L", keys) == 2  # budget: two chunks
        assert r.lookup("M", keys) == 0  # the budget is still held by L
        r.manager.apply(OffloadPlan(releases=["L"]))
        assert r.manager.snapshot()["staged_bytes"] == 0
        assert r.lookup("N", keys) == 2
    finally:
        r.close()


def test_staging_never_claimed_expires_and_then_does_not_serve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookups are a LookupBuffer with a lease of STAGE_TTL_S: staging the scheduler never
    loaded is dropped (budget given back), and a load arriving after that is a load error."""
    from kvbridge.offload import manager as mgr
    monkeypatch.setattr(mgr, "STAGE_TTL_S", 0.2)
    r = Rank(["dram"])
    try:
        keys = _keys(2)
        r.store("a", keys, [0, 1])
        assert r.lookup("L", keys) == 2
        assert r.manager.snapshot()["staged_bytes"] > 0
        time.sleep(0.3)
        r.manager.take_answers()  # collects what expired
        assert r.manager.snapshot()["staged_bytes"] == 0
        assert r.manager.take_counters()["offload_staging_expired"] == 1
        assert r.manager.apply(OffloadPlan(loads=[LoadOrder("L", 0, (4, 5))])) == {4, 5}
    finally:
        r.close()


def test_load_without_staging_reports_load_errors() -> None:
    r = Rank(["dram"])
    try:
        bad = r.manager.apply(OffloadPlan(loads=[LoadOrder("forged", 0, (1, 2))]))
        assert bad == {1, 2}
    finally:
        r.close()


# -- the book, driven like vLLM's scheduler ------------------------------------------------------

def test_book_and_manager_like_the_scheduler(tmp_path: Path) -> None:
    r = Rank(["dram"])
    book = OffloadBook(OffloadConfig.parse({"tiers": ["dram"]}), SEED, block_size=BS)
    try:
        prompt = list(range(3 * BS + 2))  # 3 full blocks + 2 tokens
        assert book.matched("A", prompt, 0) is None  # a lookup goes out
        r.manager.apply(book.take_plan())
        assert r.manager.flush()
        book.answered({k: {0: v} for k, v in r.manager.take_answers().items()})
        assert book.matched("A", prompt, 0) == 0  # nothing stored yet
        book.committed("A", list(range(4)), 0)
        for b in range(4):
            r.fill(b, 7.0 * b)
        want = [r.block(b) for b in range(3)]
        assert book.finished("A", True, prompt, [0, 1, 2, 3]) is True
        plan = book.take_plan()
        assert [len(s.keys) for s in plan.stores] == [3]
        r.manager.apply(plan)
        assert r.manager.flush() and "A" in r.manager.take_stored()
        # the same prompt again: a hit of 3 blocks, loaded into new blocks
        assert book.matched("B", prompt, 0) is None
        r.manager.apply(book.take_plan())
        r.manager.flush()
        book.answered({k: {0: v} for k, v in r.manager.take_answers().items()})
        assert book.matched("B", prompt, 0) == 3 * BS
        assert book.matched("B", prompt, BS) == 2 * BS  # vLLM found block 0 locally
        book.committed("B", [40, 41, 42, 43], 2 * BS)
        plan = book.take_plan()
        assert plan.loads == [LoadOrder(plan.loads[0].lookup_id, 1, (41, 42))]
        assert r.manager.apply(plan) == set()
        for b, w in zip((41, 42), want[1:], strict=True):
            for got, x in zip(r.block(b), w, strict=True):
                np.testing.assert_array_equal(got, x)
    finally:
        r.close()


def test_book_caps_the_hit_and_waits_for_every_rank() -> None:
    book = OffloadBook(OffloadConfig.parse({"tiers": ["dram"]}), SEED, block_size=BS,
                       tp_size=2)
    prompt = list(range(2 * BS))  # exactly two blocks: only one may come from a tier
    assert book.matched("A", prompt, 0) is None
    (lookup,) = book.take_plan().lookups
    assert len(lookup.keys) == 1
    book.answered({lookup.lookup_id: {0: 1}})
    assert book.matched("A", prompt, 0) is None  # rank 1 has not answered
    book.answered({lookup.lookup_id: {1: 0, 7: 5}})  # rank 7 does not exist: ignored
    assert book.matched("A", prompt, 0) == 0  # min over ranks
    book.answered({"nobody#9": {0: 3}})
    assert book.take_plan().releases == ["nobody#9"]


def test_book_is_off_without_tiers() -> None:
    book = OffloadBook(OffloadConfig.parse({}), SEED, block_size=BS)
    assert book.matched("A", list(range(40)), 0) == 0
    assert book.finished("A", True, list(range(40)), list(range(10))) is False
    assert not book.take_plan()

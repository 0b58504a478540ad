"""Tier chunk seals on and off (``checksum``): what an unsealed chunk is, that sealed and
unsealed engines never name the same chunk, and the documented cost of turning seals off (a
byte changed in a tier is not caught). The manager runs in-process with real dram/disk tiers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.config import Config
from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.keys import block_keys, namespace_of, seed_key
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.offload.orders import LoadOrder, LookupOrder, OffloadPlan, StoreOrder
from kvbridge.offload.seal import DIGEST_BYTES, open_prefix, seal, sealed_size, unseal

BS = 4
NB = 16
IDENTITY = {"model": "m", "dtype": "float32"}


# -- the seal functions --------------------------------------------------------------------------

def test_an_unsealed_chunk_is_its_payload() -> None:
    payload = bytes(range(256)) * 4
    assert sealed_size(len(payload)) == len(payload) + DIGEST_BYTES
    assert sealed_size(len(payload), sealed=False) == len(payload)
    assert seal(payload, sealed=False) is payload  # nothing computed, nothing copied
    kept, payloads, bad = open_prefix([payload, payload], len(payload), sealed=False)
    assert payloads == [payload, payload] and kept == payloads and not bad
    # only a chunk of the wrong length is refused (a sealed one, for instance)
    _, payloads, bad = open_prefix([payload, seal(payload)], len(payload), sealed=False)
    assert payloads == [payload] and bad


def test_a_flipped_byte_is_caught_sealed_and_not_unsealed() -> None:
    payload = bytes(range(256)) * 4
    sealed, bare = bytearray(seal(payload)), bytearray(seal(payload, sealed=False))
    sealed[7] ^= 0x10
    bare[7] ^= 0x10
    _, got, bad = open_prefix([bytes(sealed)], len(payload))
    assert got == [] and bad
    _, got, bad = open_prefix([bytes(bare)], len(payload), sealed=False)
    assert not bad and got == [bytes(bare)] and got[0] != payload  # the cost of turning it off


def test_an_opened_payload_is_a_read_only_view_not_a_copy() -> None:
    """A load copies each payload once, into the KV cache: opening a sealed chunk hands on a
    view into the tier's chunk (a copy there cost a DRAM hit 8 % of its TTFT)."""
    payload = bytes(range(256)) * 4
    chunk = seal(payload)
    view = unseal(chunk, len(payload))
    assert isinstance(view, memoryview) and view.obj is chunk and view.readonly
    assert view == payload and len(view) == len(payload)
    with pytest.raises(TypeError):
        view[0] = 1  # type: ignore[index]
    assert unseal(chunk[:-1], len(payload)) is None
    # a buffer the tier may reuse is copied before it is checked: changing it changes nothing
    reused = bytearray(chunk)
    kept = unseal(reused, len(payload))  # type: ignore[arg-type]
    assert kept is not None and kept.obj is not reused
    reused[:4] = b"\xff\xff\xff\xff"
    assert kept == payload


# -- keys and configuration ----------------------------------------------------------------------

def test_sealed_and_unsealed_keys_never_meet() -> None:
    on, off = seed_key(IDENTITY), seed_key(IDENTITY, sealed=False)
    assert on == seed_key(IDENTITY, sealed=True) and on != off
    toks = list(range(3 * BS))
    assert not set(block_keys(on, toks, BS)) & set(block_keys(off, toks, BS))
    assert namespace_of(on, "fp") != namespace_of(off, "fp")


@pytest.mark.parametrize(("raw", "env", "sealed"), [
    ({}, {}, True),
    ({"checksum": False}, {}, False),
    ({}, {"KVBRIDGE_CHECKSUM": "0"}, False),
    ({"checksum": False}, {"KVBRIDGE_CHECKSUM": "1"}, True),
])
def test_checksum_switches_the_tier_seals(raw: dict[str, Any], env: dict[str, str],
                                          sealed: bool) -> None:
    cfg = Config.load({"offload": {"tiers": ["dram"]}, **raw}, env=env)
    assert cfg.checksum is sealed and cfg.offload_config().sealed is sealed
    assert OffloadConfig.parse({"tiers": ["dram"]}).sealed  # sealed unless told


# -- the manager over real memory ----------------------------------------------------------------

class Rank:
    """A fake engine rank's KV memory (vLLM's CPU shape) and a manager with real tiers, sealed
    or not, its keys seeded as an engine's are."""

    def __init__(self, tiers: list[Any], sealed: bool) -> None:
        self.kv = {f"layer{i}": np.zeros((NB, 2, BS, 8), dtype=np.float32) for i in range(2)}
        self.layout = KVLayout.from_tensors(self.kv, NB, BS)
        self.io = BlockIO(self.layout)
        cfg = dataclasses.replace(OffloadConfig.parse({"tiers": tiers}), sealed=sealed)
        self.seed = seed_key(IDENTITY, sealed=sealed)
        ns = namespace_of(self.seed, self.layout.fingerprint())
        self.manager = OffloadManager(cfg, build_tiers(cfg, self.io.chunk_bytes, ns), self.io,
                                      layout_fingerprint=self.layout.fingerprint())

    def keys(self, n: int) -> list[str]:
        return block_keys(self.seed, list(range(n * BS)), BS)

    def fill(self, block: int, value: float) -> None:
        for t in self.kv.values():
            t[block] = value + np.arange(2 * BS * 8).reshape(2, BS, 8)

    def block(self, block: int) -> list[np.ndarray]:
        return [t[block].copy() for t in self.kv.values()]

    def store(self, keys: list[str], blocks: list[int]) -> None:
        self.manager.apply(OffloadPlan(stores=[StoreOrder("req", tuple(keys), tuple(blocks))]))
        assert self.manager.flush()
        assert "req" in self.manager.take_stored()

    def lookup(self, lid: str, keys: list[str]) -> int:
        self.manager.apply(OffloadPlan(lookups=[LookupOrder(lid, tuple(keys))]))
        assert self.manager.flush()
        return self.manager.take_answers()[lid]

    def load(self, lid: str, blocks: tuple[int, ...]) -> None:
        assert self.manager.apply(OffloadPlan(loads=[LoadOrder(lid, 0, blocks)])) == set()


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_unsealed_chunks_load_back_byte_exact(tier: str, tmp_path: Path) -> None:
    spec: Any = tier if tier == "dram" else {"name": "disk", "path": str(tmp_path)}
    r = Rank([spec], sealed=False)
    try:
        keys = r.keys(3)
        for b in range(3):
            r.fill(b, 100.0 * b)
        want = [r.block(b) for b in range(3)]
        r.store(keys, [0, 1, 2])
        assert r.manager.chunk_size == r.io.chunk_bytes  # no digest slot
        if tier == "dram":
            chunks = r.manager.tiers[0]._chunks  # type: ignore[attr-defined]
            assert {len(c) for c in chunks.values()} == {r.io.chunk_bytes}
        assert r.lookup("L", keys) == 3
        r.load("L", (10, 11, 12))
        for b, expect in zip((10, 11, 12), want, strict=True):
            for got, w in zip(r.block(b), expect, strict=True):
                np.testing.assert_array_equal(got, w)
        counters = r.manager.take_counters()
        assert counters["offload_loaded_blocks"] == 3
        assert not any(k.startswith("offload_digest_mismatch") for k in counters)
    finally:
        r.manager.close()


@pytest.mark.parametrize("sealed", [True, False])
def test_a_byte_flipped_in_dram_is_caught_only_when_sealed(sealed: bool) -> None:
    r = Rank(["dram"], sealed=sealed)
    try:
        keys = r.keys(2)
        r.fill(0, 1.0)
        r.fill(1, 2.0)
        r.store(keys, [0, 1])
        dram = r.manager.tiers[0]
        victim = r.manager.tkeys(keys)[1]
        blob = bytearray(dram._chunks[victim])  # type: ignore[attr-defined]
        blob[5] ^= 0x40
        dram._chunks[victim] = bytes(blob)  # type: ignore[attr-defined]
        hits = r.lookup("L", keys)
        counters = r.manager.take_counters()
        if sealed:
            assert hits == 1 and counters["offload_digest_mismatch_dram"] == 1
            return
        # unsealed: the changed chunk is served as it is — the documented cost
        assert hits == 2 and "offload_digest_mismatch_dram" not in counters
        r.load("L", (8, 9))
        assert r.io.read([9]) == [bytes(blob)]
    finally:
        r.manager.close()


def test_sealed_and_unsealed_engines_sharing_a_disk_miss_each_others_chunks(
        tmp_path: Path) -> None:
    """One disk directory, two engines of one model, checksum on and off: each stores the same
    prompt, each finds only its own chunks — a miss, never a digest mismatch."""
    spec = {"name": "disk", "path": str(tmp_path)}
    off, on = Rank([spec], sealed=False), Rank([spec], sealed=True)
    try:
        off.fill(0, 3.0)
        off.store(off.keys(1), [0])
        assert on.lookup("L", on.keys(1)) == 0
        assert on.lookup("L2", off.keys(1)) == 0  # another namespace too
        on.fill(0, 3.0)
        on.store(on.keys(1), [0])
        assert on.lookup("L3", on.keys(1)) == 1 and off.lookup("L4", off.keys(1)) == 1
        for r in (on, off):
            counters = r.manager.take_counters()
            assert not any(k.startswith(("offload_digest_mismatch", "offload_load_failed"))
                           for k in counters), counters
    finally:
        on.manager.close()
        off.manager.close()


def test_an_unsealed_chunk_is_never_valid_to_a_sealing_engine() -> None:
    """Even under its key (which the seeds keep apart), a bare payload does not open."""
    off, on = Rank(["dram"], sealed=False), Rank(["dram"], sealed=True)
    try:
        off.fill(0, 4.0)
        keys = off.keys(1)
        off.store(keys, [0])
        [tkey] = off.manager.tkeys(keys)
        bare = off.manager.tiers[0]._chunks[tkey]  # type: ignore[attr-defined]
        kept, payloads = on.manager._opened(on.manager.tiers[0], [tkey], [bare])
        assert kept == payloads == []
    finally:
        on.manager.close()
        off.manager.close()

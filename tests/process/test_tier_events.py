"""The offload tiers' KV events: a real manager over real tiers streams what each tier stored
and evicted (kvbridge.offload.events), and the scheduler turns it into vLLM's own event classes
(kvbridge.integrations.vllm_events), encoded as vLLM's publisher encodes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.events import TierEvent, TierEvents
from kvbridge.offload.keys import block_keys, seed_key
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.offload.orders import LookupOrder, OffloadPlan, StoreOrder
from kvbridge.offload.seal import sealed_size

BS = 4
NB = 32
SEED = seed_key({"model": "m"})


def _manager(tiers: list[Any], events: bool = True, rank: int = 0) -> OffloadManager:
    kv = {f"l{i}": np.zeros((NB, 2, BS, 8), dtype=np.float32) for i in range(2)}
    layout = KVLayout.from_tensors(kv, NB, BS)
    io = BlockIO(layout)
    cfg = OffloadConfig.parse({"tiers": tiers})
    return OffloadManager(cfg, build_tiers(cfg, io.chunk_bytes, "ab" * 16), io,
                          layout_fingerprint=layout.fingerprint(), rank=rank, events=events)


def _store(m: OffloadManager, req: str, salt: int, blocks: list[int]) -> list[bytes]:
    keys = block_keys(SEED, list(range(salt, salt + len(blocks) * BS)), BS)
    hashes = [f"h-{salt}-{i}".encode() for i in range(len(blocks))]
    m.apply(OffloadPlan(stores=[StoreOrder(req, tuple(keys), tuple(blocks), tuple(hashes))]))
    assert m.flush()
    return hashes


def test_stores_and_evictions_stream_per_tier_with_their_medium(tmp_path: Path) -> None:
    chunk = sealed_size(_manager(["dram"], events=False).io.chunk_bytes)
    m = _manager([{"name": "dram", "capacity_bytes": 4 * chunk},
                  {"name": "disk", "path": str(tmp_path)}])
    try:
        a = _store(m, "a", 0, [0, 1, 2])
        events = m.take_events()
        assert {(e.kind, e.tier, e.medium, e.hashes) for e in events} == {
            ("stored", "dram", "CPU", tuple(a)), ("stored", "disk", "STORAGE", tuple(a))}
        b = _store(m, "b", 1000, [3, 4])  # 5 chunks into 4: a's tail leaves dram
        events = m.take_events()
        assert TierEvent("removed", "dram", "CPU", (a[2],)) in events
        assert TierEvent("stored", "dram", "CPU", tuple(b)) in events
        assert m.take_events() == []  # taken once
        # a hit in disk promoted into dram: a store event for dram, with the hashes kept
        m.apply(OffloadPlan(lookups=[LookupOrder("L", tuple(
            block_keys(SEED, list(range(0, 3 * BS)), BS)))]))
        assert m.flush()
        promoted = [e for e in m.take_events() if e.kind == "stored" and e.tier == "dram"]
        assert any(a[2] in e.hashes for e in promoted)
    finally:
        m.close()


def test_off_or_not_rank_zero_streams_nothing(tmp_path: Path) -> None:
    for m in (_manager(["dram"], events=False), _manager(["dram"], rank=1)):
        try:
            _store(m, "a", 0, [0, 1])
            assert m.take_events() == []
        finally:
            m.close()


def test_a_full_stream_drops_and_counts_never_blocks() -> None:
    dropped: list[int] = []
    ev = TierEvents(True, capacity=2, on_drop=dropped.append)
    for i in range(5):
        ev.stored("dram", "CPU", [bytes([i])])
    ev.stored("dram", "CPU", [None])  # unknown hashes are not events
    assert [e.hashes for e in ev.take()] == [(b"\0",), (b"\1",)] and sum(dropped) == 3


def _request(prompt: list[int], salt: str | None = None) -> Any:
    """A vLLM request whose block hashes vLLM itself computed (sha256, as vLLM's default)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request("r", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BS, sha256))


def test_the_book_speaks_vllms_event_classes_with_vllms_hashes() -> None:
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    from kvbridge.integrations.vllm_events import TierEventBook

    prompt = list(range(100, 100 + 3 * BS + 1))
    req = _request(prompt, salt="tenant-A")
    book = TierEventBook(BS)
    hashes = book.remember(req, 3)
    assert list(hashes) == [bytes(h) for h in req.block_hashes[:3]]
    book.add([TierEvent("stored", "disk", "STORAGE", hashes[:2]),
              TierEvent("removed", "dram", "CPU", hashes[1:2]),
              TierEvent("stored", "dram", "CPU", (b"never-remembered",))])
    out = book.take()
    assert book.take() == [] and book.stats["kv_events_unknown"] == 1
    stored = [e for e in out if isinstance(e, BlockStored)]
    # named as vLLM names its own blocks (int hashes unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    assert [e.block_hashes for e in stored] == [[ext(hashes[0])], [ext(hashes[1])]]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == ext(hashes[0])
    assert stored[1].token_ids == prompt[BS:2 * BS] and stored[1].block_size == BS
    assert {e.medium for e in stored} == {"STORAGE"} and stored[0].ownership == "disk"
    assert stored[0].extra_keys is not None  # the cache salt, as vLLM publishes its own
    [removed] = [e for e in out if isinstance(e, BlockRemoved)]
    assert removed.block_hashes == [ext(hashes[1])] and removed.medium == "CPU"
    # what vLLM's publisher sends, a subscriber decodes with vLLM's classes
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=out))
    back = msgspec.msgpack.decode(wire, type=KVEventBatch)
    assert back.events == out

"""The precise prefix index from KV events (kvbridge.proxy.kvevents): hand-built vLLM batches."""

from __future__ import annotations

import tracemalloc
from typing import Any

import msgspec
import pytest

from kvbridge.proxy.kvevents import MAX_PAYLOAD, EventIndex
from kvbridge.proxy.prefixes import PrefixIndex, prompt_of

MODEL = "tiny"
IDS = list(range(1000, 1000 + 200))  # 6 blocks of 32 and 8 tokens


def stored(hashes: list[Any], parent: Any, tokens: list[int], *, bs: int = 32,
           medium: str | None = None, extra: list[Any] | None = None, **kw: Any) -> dict[str, Any]:
    """A BlockStored as vLLM encodes it (a tagged map; omit_defaults)."""
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes,
                          "parent_block_hash": parent, "token_ids": tokens, "block_size": bs,
                          "lora_id": None, "medium": medium, "lora_name": None, **kw}
    if extra is not None:
        ev["extra_keys"] = extra
    return ev


def removed(hashes: list[Any], medium: str | None = None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), None])


def store_prompt(ix: EventIndex, ids: list[int], salt: str | None = None,
                 medium: str | None = None, bs: int = 32, tag: bytes = b"h",
                 first_event_blocks: int | None = None) -> list[bytes]:
    """Store ``ids``'s whole blocks as vLLM would (hashes are opaque: any unique bytes)."""
    n = len(ids) // bs
    hashes = [tag + bytes([i]) for i in range(n)]
    extra: list[Any] = [[salt] if salt and i == 0 else None for i in range(n)]
    k = n if first_event_blocks is None else first_event_blocks
    events = [stored(hashes[:k], None, ids[:k * bs], bs=bs, medium=medium, extra=extra[:k])]
    if k < n:
        events.append(stored(hashes[k:], hashes[k - 1], ids[k * bs:n * bs], bs=bs,
                             medium=medium, extra=extra[k:]))
    assert ix.apply(batch(*events))
    return hashes


def body(ids: list[int], salt: str | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "prompt": ids}
    if salt is not None:
        b["cache_salt"] = salt
    return b


def test_units_match_the_prompts_like_the_approximate_index() -> None:
    ix = EventIndex(MODEL)
    store_prompt(ix, IDS, first_event_blocks=2)  # two events: the second chains on the first
    p = prompt_of(body(IDS), chat=False)
    approx = PrefixIndex()
    approx.record("u", prompt_of(body(IDS[:192]), chat=False))
    assert ix.held(p) == {"GPU": 192.0, "CPU": 0.0, "STORAGE": 0.0}
    assert ix.held(p)["GPU"] == approx.held("u", p)
    assert ix.held_units(p.units) == 12
    # a prompt of only whole blocks: the last token is never counted held
    q = prompt_of(body(IDS[:64]), chat=False)
    assert ix.held(q)["GPU"] == 63.0
    # another continuation shares the first blocks only
    other = IDS[:40] + [7] * 100
    assert ix.held(prompt_of(body(other), chat=False))["GPU"] == 32.0
    # a text prompt or another model is held nowhere
    assert sum(ix.held(prompt_of({"model": MODEL, "prompt": "x" * 500}, chat=False)).values()) == 0
    assert sum(ix.held(prompt_of({"model": "other", "prompt": IDS}, chat=False)).values()) == 0


@pytest.mark.parametrize("bs", [16, 48, 8])
def test_block_sizes_that_are_not_two_units(bs: int) -> None:
    ix = EventIndex(MODEL)
    store_prompt(ix, IDS, bs=bs, first_event_blocks=3)
    whole = len(IDS) // bs * bs // 16 * 16
    assert ix.held(prompt_of(body(IDS), chat=False))["GPU"] == whole


def test_salt_isolation() -> None:
    ix = EventIndex(MODEL)
    store_prompt(ix, IDS, salt="A")
    assert ix.held(prompt_of(body(IDS, "A"), chat=False))["GPU"] == 192.0
    assert sum(ix.held(prompt_of(body(IDS, "B"), chat=False)).values()) == 0
    assert sum(ix.held(prompt_of(body(IDS), chat=False)).values()) == 0
    # salted and unsalted blocks of the same tokens live side by side
    store_prompt(ix, IDS, tag=b"u")
    assert ix.held(prompt_of(body(IDS), chat=False))["GPU"] == 192.0
    assert ix.held(prompt_of(body(IDS, "A"), chat=False))["GPU"] == 192.0


def test_media_order_and_removal() -> None:
    ix = EventIndex(MODEL)
    hashes = store_prompt(ix, IDS, medium="STORAGE")
    ix.apply(batch(stored(hashes[:4], None, IDS[:128], medium="CPU")))
    ix.apply(batch(stored(hashes[:2], None, IDS[:64])))  # medium None: GPU
    p = prompt_of(body(IDS), chat=False)
    assert ix.held(p) == {"GPU": 64.0, "CPU": 64.0, "STORAGE": 64.0}
    ix.apply(batch(removed(hashes[:1])))  # GPU drops block 0: CPU still has it
    assert ix.held(p) == {"GPU": 32.0, "CPU": 96.0, "STORAGE": 64.0}
    ix.apply(batch(removed(hashes[:1], "CPU"), removed(hashes[:1], "STORAGE")))
    assert sum(ix.held(p).values()) == 0  # the first unit is held nowhere: nothing counts
    ix.apply(batch(stored(hashes[:1], None, IDS[:32], medium="CPU")))
    assert ix.held(p) == {"GPU": 32.0, "CPU": 96.0, "STORAGE": 64.0}
    ix.apply(batch({"type": "AllBlocksCleared"}))
    assert ix.held(p) == {"GPU": 0.0, "CPU": 128.0, "STORAGE": 64.0}


def test_missed_parent_lora_and_extra_keys_are_skipped_and_counted() -> None:
    ix = EventIndex(MODEL)
    ix.apply(batch(stored([b"c1"], b"never-seen", IDS[32:64])))
    assert ix.stats["unknown_parent"] == 1 and ix.size() == 0
    ix.apply(batch(stored([b"l0"], None, IDS[:32], lora_name="adapter")))
    ix.apply(batch(stored([b"l1"], None, IDS[:32], lora_id=3)))
    assert ix.stats["lora"] == 2
    ix.apply(batch(stored([b"m0"], None, IDS[:32], extra=[[["img", 0]]])))  # multimodal
    ix.apply(batch(stored([b"m1"], None, IDS[:32], extra=[["salt", "embeds"]])))
    ix.apply(batch(stored([b"r0", b"r1"], None, IDS[:64], extra=[None, ["late"]])))
    assert ix.stats["extra_keys"] == 3
    ix.apply(batch(stored([b"g"], None, IDS[:32], group_idx=1)))
    ix.apply(batch(stored([b"x"], None, IDS[:32], medium="TAPE")))
    assert ix.stats["other_group"] == 1 and ix.stats["unknown_medium"] == 1
    p = prompt_of(body(IDS), chat=False)
    assert ix.held(p)["GPU"] == 32.0  # only r0, stored before its child's bad keys


@pytest.mark.parametrize("payload", [
    b"", b"\x00", b"garbage" * 10, msgspec.msgpack.encode({"a": 1}),
    msgspec.msgpack.encode([1.0]), msgspec.msgpack.encode([1.0, "x"]),
    msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]),
    msgspec.msgpack.encode([1.0, [stored([b"a"], None, [-1] * 32)]]),
    msgspec.msgpack.encode([1.0, [stored([b"a"], None, ["t"] * 32)]]),
    msgspec.msgpack.encode([1.0, [stored([b"a"], None, [1 << 40] * 32)]]),
    msgspec.msgpack.encode([1.0, [stored([b"a" * 65], None, [1] * 32)]]),
    msgspec.msgpack.encode([1.0, [stored([1.5], None, [1] * 32)]]),
    b"\x91" * 100_000,  # deep nesting
], ids=range(14))
def test_malformed_batches_are_counted_and_change_nothing(payload: bytes) -> None:
    ix = EventIndex(MODEL)
    store_prompt(ix, IDS)
    before = ix.size()
    assert ix.apply(payload) is False
    assert ix.stats["malformed_batches"] == 1 and ix.size() == before


def test_contradictory_events_and_huge_payloads() -> None:
    ix = EventIndex(MODEL)
    ix.apply(batch(stored([b"a"], None, IDS[:31])))  # 31 tokens for one block of 32
    ix.apply(batch(stored([b"a"], None, [1] * 10**6, bs=10**6)))  # absurd block size
    ix.apply(batch(stored([b"a"], None, [], bs=0)))
    ix.apply(batch(stored([b"a", b"b"], None, IDS[:64], extra=[None])))
    assert ix.stats["malformed_events"] == 4 and ix.size() == 0
    assert ix.apply(b"\x00" * (MAX_PAYLOAD + 1)) is False
    assert ix.stats["oversized_batches"] == 1


def test_memory_is_bounded_by_the_capacity() -> None:
    ix = EventIndex(MODEL, capacity=64)
    tracemalloc.start()
    try:
        for r in range(200):
            ids = [r * 1000 + i for i in range(320)]
            store_prompt(ix, ids, tag=r.to_bytes(4, "big"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ix.size() == 64 and ix.stats["blocks_evicted"] == 200 * 10 - 64
    assert len(ix._units) == 64 * 2
    assert peak < 4 << 20
    last = [199 * 1000 + i for i in range(320)]
    assert ix.held(prompt_of(body(last), chat=False))["GPU"] == 319.0
    with pytest.raises(ValueError):
        EventIndex(MODEL, capacity=0)


def test_large_blocks_are_bounded_by_their_units_too() -> None:
    ix = EventIndex(MODEL, capacity=4)  # at most 32 unit names
    for r in range(10):
        ix.apply(batch(stored([b"big%d" % r], None, [r] * 256, bs=256)))  # 16 units each
    assert len(ix._units) <= 32 and ix.size() == 2
    assert ix.held(prompt_of(body([9] * 257), chat=False))["GPU"] == 256.0

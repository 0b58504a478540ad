"""Heterogeneous TP and block size: the mapping (kvbridge.scheduling.mapping), byte-exact.

Every shape here is run through the descriptor math on numpy caches (kvbridge.testing.hetero):
prefill's caches hold distinct random values; each decode rank's cache after the hand-off must
equal a reference re-sharded/re-blocked token by token, every byte written exactly once, and
prefill untouched. Shapes that cannot start as real engines on this host (TP 4, 8) live here.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.heads import HeadSplit, rank_heads
from kvbridge.scheduling.mapping import (
    Shape,
    Share,
    Span,
    consumers,
    descriptors,
    idle,
    pair,
    reads,
    serves,
    side,
    side_bytes,
    side_descriptors,
    sources,
)
from kvbridge.testing.hetero import Rank, engine, expected_decode, run

# (total KV heads, prefill TP, decode TP, prefill block, decode block)
SHAPES = [
    (4, 1, 1, 32, 32), (4, 2, 2, 32, 32),
    (4, 1, 2, 32, 32), (4, 2, 1, 32, 32), (4, 1, 4, 32, 32), (4, 4, 1, 32, 32),
    (8, 2, 8, 32, 32), (8, 8, 2, 32, 32),
    (2, 1, 4, 32, 32), (2, 4, 1, 32, 32), (2, 4, 2, 32, 32), (2, 8, 4, 32, 32),
    (2, 4, 8, 32, 32),
    (4, 1, 1, 32, 64), (4, 1, 1, 32, 128), (4, 1, 1, 64, 32), (4, 1, 1, 128, 32),
    (4, 1, 2, 32, 64), (4, 2, 1, 64, 32), (2, 4, 1, 32, 128), (4, 2, 4, 128, 32),
]


def _digest(descs: np.ndarray) -> str:
    import ctypes

    h = hashlib.blake2b(digest_size=16)
    for addr, length, _ in descs.tolist():
        h.update(ctypes.string_at(addr, length))
    return h.hexdigest()


def _handoff(prefill: list[Rank], decode: list[Rank], num_tokens: int, skip: int,
             direction: str, seed: int = 0) -> None:
    """Move a prompt from every prefill rank to every decode rank; check it byte-exactly."""
    rng = np.random.default_rng(seed)
    pb, db = prefill[0].shape.block_size, decode[0].shape.block_size
    split = decode[0].shape.heads
    assert split is not None
    total = split.total_heads
    p_ids = [int(x) for x in rng.permutation(prefill[0].layout.num_blocks)[:-(-num_tokens // pb)]]
    d_ids = [int(x) for x in rng.permutation(decode[0].layout.num_blocks)[:-(-num_tokens // db)]]
    first = skip * db
    span = Span(first, num_tokens)
    p_first = first // pb
    before_p = [r.buf.copy() for r in prefill]
    g = math.gcd(pb, db)
    moved_tokens = -(-num_tokens // g) * g - first
    for d, rank in enumerate(decode):
        want = expected_decode(prefill, p_ids, rank, d_ids, first, num_tokens)
        counter = rank.written()
        for share in sources(total, len(prefill), len(decode), d):
            src = prefill[share.rank]
            if direction == "pull":  # decode computes both halves and READs
                subs = pair(rank.layout, rank.shape, d_ids[skip:], skip, src.layout, src.shape,
                            p_ids[p_first:], p_first, share, span)
                local, remote = descriptors(subs)
                run(local, remote, (rank, counter))
                # the prefill rank computes its half alone (to check a claim) and agrees
                half = side(src.layout, src.shape, rank.shape, share, p_ids[p_first:], p_first,
                            span)
                assert side_bytes(half) == int(remote[:, 1].sum())
                assert _digest(side_descriptors(half)) == _digest(remote)
            else:  # prefill computes both halves and WRITEs
                subs = pair(src.layout, src.shape, p_ids[p_first:], p_first, rank.layout,
                            rank.shape, d_ids[skip:], skip, share, span)
                local, remote = descriptors(subs)
                run(remote, local, (rank, counter))
                half = side(rank.layout, rank.shape, src.shape, share, d_ids[skip:], skip, span)
                assert _digest(side_descriptors(half)) == _digest(remote)
        for got, exp in zip(rank.layers, want, strict=True):
            np.testing.assert_array_equal(got, exp)
        assert counter.max() == 1, "a byte was written twice"
        per_token = 2 * split.head_dim * 4 * rank.shape.heads.heads  # type: ignore[union-attr]
        assert int(counter.sum()) == len(rank.layers) * moved_tokens * per_token
    for r, b in zip(prefill, before_p, strict=True):
        np.testing.assert_array_equal(r.buf, b)


@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-tp{}to{}-b{}to{}".format(*s))
def test_handoff_is_byte_exact(shape: tuple[int, int, int, int, int], direction: str) -> None:
    total, p_tp, d_tp, pb, db = shape
    for num_tokens, skip in ((150, 0), (300, 1)):
        prefill = engine(p_tp, pb, total=total, seed=1)
        decode = engine(d_tp, db, total=total, seed=2)
        _handoff(prefill, decode, num_tokens, skip, direction)


def test_opaque_slabs_move_whole_heads_but_refuse_another_block_size() -> None:
    prefill = engine(1, 32, total=4, kind="opaque", seed=3)
    decode = engine(2, 32, total=4, kind="opaque", seed=4)
    _handoff(prefill, decode, 150, 1, "pull")  # TP 1 -> 2: whole head slabs
    other = engine(1, 64, total=4, kind="opaque")[0]
    with pytest.raises(LayoutMismatch, match="opaque inside a head: block_size 32 here and 64"):
        side(prefill[0].layout, prefill[0].shape, other.shape, Share(0, 0, 4), list(range(8)), 0,
             Span(0, 200))


@pytest.mark.parametrize("kind", ["split", "outer"])
@pytest.mark.parametrize("shape", [(4, 1, 2, 32, 32), (4, 2, 1, 32, 64), (2, 4, 1, 64, 32)],
                         ids=str)
def test_other_head_major_interiors(shape: tuple[int, int, int, int, int], kind: str) -> None:
    total, p_tp, d_tp, pb, db = shape
    prefill = engine(p_tp, pb, total=total, kind=kind, seed=3)
    decode = engine(d_tp, db, total=total, kind=kind, seed=4)
    _handoff(prefill, decode, 200, 1, "pull")


def test_identical_shapes_move_whole_blocks_as_before() -> None:
    p, d = engine(2, 32, seed=1)[1], engine(2, 32, seed=2)[1]
    subs = pair(d.layout, d.shape, [3, 4, 5], 0, p.layout, p.shape, [7, 8, 9], 0,
                Share(1, 2, 2), Span(0, 96))
    assert len(subs) == 1 and subs[0].local is d.layout and subs[0].remote is p.layout
    # and without head descriptions at all, only identical shapes map
    bare = Shape(2, 1, 32, None)
    subs = pair(d.layout, bare, [3], 0, p.layout, bare, [7], 0, None, Span(0, 32))
    assert len(subs) == 1


@pytest.mark.parametrize(("pb", "db", "expect"), [(32, 64, 2), (32, 128, 4), (128, 32, 4)])
def test_block_ratio_gives_one_affine_sub_transfer_per_offset(pb: int, db: int,
                                                              expect: int) -> None:
    p, d = engine(1, pb)[0], engine(1, db)[0]
    n = 4 * max(pb, db)
    subs = pair(d.layout, d.shape, list(range(n // db)), 0, p.layout, p.shape,
                list(range(10, 10 + n // pb)), 0, Share(0, 0, 4), Span(0, n))
    assert len(subs) == expect
    if pb < db:  # P 32 -> D 64: P's ids [0::2] fill the first halves, [1::2] the second
        np.testing.assert_array_equal(subs[0].remote_ids, np.arange(10, 10 + n // pb)[0::expect])
        np.testing.assert_array_equal(subs[0].local_ids, np.arange(n // db))
    # each view, per layer and head: V is one plane of min(pb, db) tokens; K (dim-major in
    # vLLM's CPU blocks) one plane of min(pb, db) elements per head dimension
    assert len(subs[0].local.planes) == 2 * 4 * (8 + 1)
    sizes = sorted({p.block_bytes for p in subs[0].local.planes})
    assert sizes == [min(pb, db) * 4, min(pb, db) * 8 * 4]


def test_who_reads_what_covers_every_head_once() -> None:
    for total, p_tp, d_tp in [(4, 1, 2), (4, 2, 1), (2, 4, 1), (2, 4, 2), (2, 8, 4), (2, 1, 4),
                              (8, 2, 8), (2, 4, 8)]:
        released: list[int] = []
        for d in range(d_tp):
            first, n = rank_heads(total, d_tp, d)
            got = [h for s in sources(total, p_tp, d_tp, d)
                   for h in range(s.first_head, s.first_head + s.heads)]
            assert got == list(range(first, first + n))  # each own head exactly once
            for s in sources(total, p_tp, d_tp, d):  # ... from a rank that holds it
                pf, pn = rank_heads(total, p_tp, s.rank)
                assert pf <= s.first_head and s.first_head + s.heads <= pf + pn
            released += idle(total, p_tp, d_tp, d)
        served = {p for p in range(p_tp) if consumers(total, p_tp, d_tp, p)}
        assert sorted(released) == sorted(set(range(p_tp)) - served)  # released exactly once
        assert len(released) == len(set(released))


def test_reads_and_serves_agree_and_refuse_strangers() -> None:
    p = [r.shape for r in engine(4, 32, total=2)]  # prefill replicates each head twice
    d = [r.shape for r in engine(2, 32, total=2)]
    assert reads(d[1], p[3]) == Share(3, 1, 1)
    assert serves(p[3], d[1]) == (Share(1, 1, 1), frozenset({1}))
    with pytest.raises(LayoutMismatch, match="decode rank 0 of tensor-parallel 2 reads nothing"):
        reads(d[0], p[2])
    with pytest.raises(LayoutMismatch, match="reads nothing from prefill rank 1"):
        serves(p[1], d[0])
    bare = Shape(1, 0, 32, None)  # an engine without heads: whole blocks, its own rank only
    assert reads(bare, bare) is None and serves(bare, bare) == (None, frozenset({0}))


def test_prefill_replicas_spread_over_decode_ranks() -> None:
    # 2 heads, prefill TP 4 (each head on 2 ranks), decode TP 4 (each head on 2 ranks)
    assert [sources(2, 4, 4, d)[0].rank for d in range(4)] == [0, 1, 2, 3]
    assert consumers(2, 4, 1, 0) == [Share(0, 0, 1)] and consumers(2, 4, 1, 1) == []
    assert idle(2, 4, 1, 0) == [1, 3]


@pytest.mark.parametrize(("pb", "db"), [(32, 48), (64, 96)])
def test_block_sizes_that_do_not_divide_are_refused(pb: int, db: int) -> None:
    p, d = engine(1, pb)[0], engine(1, db)[0]
    with pytest.raises(LayoutMismatch, match=f"block_size {db} here and {pb} at the peer"):
        pair(d.layout, d.shape, [0], 0, p.layout, p.shape, [0], 0, Share(0, 0, 4),
             Span(0, 16))


def test_hybrid_kv_groups_map_between_identical_shapes_only() -> None:
    from dataclasses import replace

    from kvbridge.groups import GroupKind, KVGroup

    p, d = engine(1, 32)[0], engine(2, 32)[0]
    groups = (KVGroup(GroupKind.FULL, 32, None, (0,)),
              KVGroup(GroupKind.SLIDING, 32, 64, (1,)))
    grouped = replace(p.layout, groups=groups)
    refs = [4, 5, 6]  # block refs pass through untouched between identical shapes
    assert side(grouped, p.shape, p.shape, None, refs, 0, Span(0, 96))[0][0] is grouped
    with pytest.raises(LayoutMismatch, match="hybrid model's KV-cache groups"):
        side(grouped, p.shape, d.shape, Share(0, 0, 2), refs, 0, Span(0, 96))


def test_unmappable_inputs_are_refused() -> None:
    p, d = engine(1, 32)[0], engine(2, 32)[0]
    share = Share(0, 0, 2)
    with pytest.raises(LayoutMismatch, match="does not describe its KV heads"):
        pair(d.layout, Shape(2, 0, 32, None), [0], 0, p.layout, p.shape, [0], 0, share,
             Span(0, 32))
    with pytest.raises(LayoutMismatch, match="not all on this rank"):
        side(d.layout, d.shape, p.shape, Share(0, 2, 2), [0], 0, Span(0, 32))
    with pytest.raises(LayoutError, match="do not cover"):
        side(d.layout, d.shape, engine(1, 64)[0].shape, share, [0], 0, Span(0, 200))
    with pytest.raises(LayoutError, match="boundary"):
        side(d.layout, d.shape, engine(1, 64)[0].shape, share, [0, 1], 0, Span(16, 64))
    with pytest.raises(LayoutMismatch, match="cannot be split"):
        sources(4, 3, 1, 0)
    with pytest.raises(LayoutMismatch, match="outside"):
        consumers(4, 2, 1, 5)


def test_head_split_checks_forged_offsets_and_sizes() -> None:
    rank = engine(2, 32)[1]
    split = rank.shape.heads
    assert split is not None
    split.check(rank.layout, 2, 1)
    forged = HeadSplit(total_heads=4, first_head=0, heads=2, head_dim=8)
    with pytest.raises(LayoutMismatch, match=r"holds KV heads \[0, 2\).*holds \[2, 4\)"):
        forged.check(rank.layout, 2, 1, "the peer")
    with pytest.raises(LayoutMismatch, match="do not hold"):
        HeadSplit(total_heads=4, first_head=2, heads=2, head_dim=7).check(rank.layout, 2, 1)
    with pytest.raises(LayoutMismatch, match="outside"):
        split.check(rank.layout, 2, 2)
    assert rank_heads(2, 8, 5) == (1, 1) and rank_heads(8, 2, 1) == (4, 4)

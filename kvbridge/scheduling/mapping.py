"""Heterogeneous hand-offs: which peer ranks a rank moves KV with, and which bytes.

Two engines may differ in tensor parallelism and in block size. This module answers, with no
I/O and no vLLM:

* **who** — :func:`sources` (the prefill ranks a decode rank reads each of its KV heads from,
  exactly once), :func:`consumers` (the decode ranks a prefill rank serves) and :func:`idle`
  (prefill ranks nobody reads from, which a decode rank must release). When prefill replicates a
  head (TP above the model's KV heads) one replica serves it, chosen by the decode rank, so no
  byte is read or written twice; when decode replicates a head every replica receives it.
* **what** — :func:`side` and :func:`pair`: the sub-transfers of one (rank, peer rank) part, as
  pairs of :class:`~kvbridge.layout.KVLayout` *views* (same planes, bases shifted to the shared
  heads and token offset, ``block_bytes`` the shared sub-range, stride unchanged) with the block
  ids each view is indexed by. :func:`kvbridge.layout.descriptor_pair` turns each pair into
  descriptors (:func:`descriptors`).

Geometry (:mod:`kvbridge.heads`): a block of a plane is ``[outer, heads, inner, slab]``.
With equal block sizes a part is, per plane and outer index, one range of whole heads (the
whole plane when both ranks hold the same heads: today's homogeneous transfer, unchanged).
With block sizes ``P`` and ``D`` (one dividing the other) the unit is ``g = min(P, D)`` tokens
of one head and part: prompt chunk ``c`` (tokens ``[c*g, (c+1)*g)``) lies in block ``c*g // B``
at token offset ``c*g % B`` of a side with block size ``B``; in a token-major slab that is one
range, in a dim-major one (vLLM CPU's K) one range of ``g`` elements per head dimension. Chunks
are grouped by ``c mod (max/g)``; inside a group both sides' offsets are constant and their
block indices advance by a constant step, so each group is one sub-transfer whose views are
affine in the block id (for P 32 → D 64: one over P's ids ``[0::2]`` into the first half of D's
blocks, one over ``[1::2]`` into the second half). Opaque slabs refuse another block size.

The order of sub-transfers, planes and blocks is a pure function of both sides' *shapes*
(never of addresses), so each side can compute its own half alone — a prefill rank checks a
pull's byte count and checksum without the decode rank's layout — and the two halves always
describe the same byte stream.

Pure functions; thread-safe (views are cached).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.heads import HeadSplit, check_tp, rank_heads
from kvbridge.layout import DescriptorArray, KVLayout, KVPlane, descriptor_pair

__all__ = [
    "Shape", "Share", "Span", "SubTransfer", "sources", "consumers", "idle", "reads", "serves",
    "side", "pair", "parts",
    "descriptors", "side_bytes", "side_descriptors", "check_block_sizes",
]

Ids = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Shape:
    """One rank's geometry as the mapping needs it (no addresses). ``heads`` None: the engine
    does not describe its heads, so it only exchanges KV with an identical shape."""

    tp_size: int
    rank: int
    block_size: int
    heads: HeadSplit | None = None

    def whole(self) -> tuple[int, int] | None:
        """``(first head, count)`` of this rank, or None when unknown."""
        return None if self.heads is None else (self.heads.first_head, self.heads.heads)


@dataclass(frozen=True)
class Share:
    """The KV heads ``[first_head, first_head + heads)`` moved between this rank and peer
    rank ``rank``."""

    rank: int
    first_head: int
    heads: int


@dataclass(frozen=True)
class Span:
    """The prompt tokens a hand-off moves: from ``first_token`` (the decode side's local prefix
    hit, whole decode blocks) to the end of a ``num_tokens`` prompt."""

    first_token: int
    num_tokens: int


@dataclass(frozen=True)
class SubTransfer:
    """``local_ids[i]`` of the ``local`` view moves to/from ``remote_ids[i]`` of ``remote``."""

    local: KVLayout
    local_ids: Ids
    remote: KVLayout
    remote_ids: Ids


def parts(subs: Sequence[SubTransfer]) -> list[tuple[KVLayout, Ids, KVLayout, Ids]]:
    """``subs`` as the ``(local, local ids, remote, remote ids)`` parts
    :func:`~kvbridge.blocks.submit_parts` and :func:`~kvbridge.blocks.prepare_parts` take."""
    return [(x.local, x.local_ids, x.remote, x.remote_ids) for x in subs]


# -- who ------------------------------------------------------------------------------------


def sources(total: int, p_tp: int, d_tp: int, d_rank: int) -> list[Share]:
    """The prefill ranks decode rank ``d_rank`` reads its heads from (runs of heads merged).

    Raises :class:`LayoutMismatch` when either TP size cannot split ``total`` heads."""
    check_tp(total, p_tp)
    first, n = rank_heads(total, d_tp, d_rank)
    out: list[Share] = []
    for h in range(first, first + n):
        if p_tp <= total:
            p = h // (total // p_tp)
        else:  # each head lives on `reps` prefill ranks: spread decode ranks over them
            reps = p_tp // total
            p = h * reps + d_rank % reps
        last = out[-1] if out else None
        if last is not None and last.rank == p and last.first_head + last.heads == h:
            out[-1] = Share(p, last.first_head, last.heads + 1)
        else:
            out.append(Share(p, h, 1))
    return out


def consumers(total: int, p_tp: int, d_tp: int, p_rank: int) -> list[Share]:
    """The decode ranks that read from prefill rank ``p_rank`` (``Share.rank``: the decode
    rank), and which heads each reads."""
    if not 0 <= p_rank < p_tp:
        raise LayoutMismatch(f"rank {p_rank} outside tensor-parallel size {p_tp}")
    return [Share(d, s.first_head, s.heads) for d in range(d_tp)
            for s in sources(total, p_tp, d_tp, d) if s.rank == p_rank]


def idle(total: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """Prefill ranks no decode rank reads from (they replicate heads another replica serves)
    that decode rank ``d_rank`` must release (rank ``p`` is released by ``p % d_tp``)."""
    if p_tp <= total:
        return []
    used = {s.rank for d in range(d_tp) for s in sources(total, p_tp, d_tp, d)}
    return [p for p in range(p_tp) if p not in used and p % d_tp == d_rank]


def reads(decode: Shape, prefill: Shape) -> Share | None:
    """The heads decode rank ``decode`` reads from prefill rank ``prefill`` (None: whole
    blocks, when either does not describe its heads). Raises :class:`LayoutMismatch` when it
    reads nothing from that rank."""
    if decode.heads is None or prefill.heads is None:
        return None
    share = next((s for s in sources(decode.heads.total_heads, prefill.tp_size,
                                     decode.tp_size, decode.rank)
                  if s.rank == prefill.rank), None)
    if share is None:
        raise LayoutMismatch(f"decode rank {decode.rank} of tensor-parallel {decode.tp_size} "
                             f"reads nothing from prefill rank {prefill.rank} of "
                             f"{prefill.tp_size}")
    return share


def serves(prefill: Shape, decode: Shape) -> tuple[Share | None, frozenset[int]]:
    """The heads prefill rank ``prefill`` serves decode rank ``decode`` (None: whole blocks),
    and every decode rank of that TP size it serves. Raises :class:`LayoutMismatch` when it
    serves ``decode`` nothing."""
    if prefill.heads is None:
        return None, frozenset({decode.rank})
    all_ = consumers(prefill.heads.total_heads, prefill.tp_size, decode.tp_size, prefill.rank)
    share = next((c for c in all_ if c.rank == decode.rank), None)
    if share is None:
        raise LayoutMismatch(f"decode rank {decode.rank} of tensor-parallel {decode.tp_size} "
                             f"reads nothing from prefill rank {prefill.rank} of "
                             f"{prefill.tp_size}")
    return share, frozenset(c.rank for c in all_)


def check_block_sizes(mine: int, theirs: int) -> None:
    """Raise :class:`LayoutMismatch` unless one block size divides the other."""
    if mine <= 0 or theirs <= 0 or (mine % theirs and theirs % mine):
        raise LayoutMismatch(f"block_size {mine} here and {theirs} at the peer: heterogeneous "
                             "block sizes must divide one another")


# -- what -----------------------------------------------------------------------------------


def side(layout: KVLayout, mine: Shape, other: Shape, share: Share | None,
         ids: Sequence[int] | Ids, first_block: int, span: Span) -> list[tuple[KVLayout, Ids]]:
    """This rank's half of one part: ``(view, block ids)`` per sub-transfer, in the order
    both sides agree on.

    ``ids`` are this rank's blocks of the prompt from prompt block ``first_block`` on;
    ``share`` the heads moved (None: all of them, only for identical shapes). Raises
    :class:`LayoutMismatch` for shapes that cannot be mapped and :class:`LayoutError` when
    ``ids`` do not cover ``span``.
    """
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if _identical(mine, other, share):
        return [(layout, arr)] if arr.size else []
    if layout.groups:
        raise LayoutMismatch("a hybrid model's KV-cache groups move between engines of one TP "
                             f"size and block size only (tensor-parallel {mine.tp_size}/block "
                             f"{mine.block_size} here, {other.tp_size}/{other.block_size} at "
                             "the peer)")
    split = mine.heads
    if split is None or other.heads is None or share is None:
        raise LayoutMismatch(
            f"tensor-parallel {mine.tp_size}/block {mine.block_size} here, "
            f"{other.tp_size}/{other.block_size} at the peer, and "
            f"{'this engine' if split is None else 'the peer'} does not describe its KV heads "
            "(a head-major KV layout is needed to map heads and blocks)")
    if not (split.first_head <= share.first_head
            and share.first_head + share.heads <= split.first_head + split.heads):
        raise LayoutMismatch(f"heads [{share.first_head}, {share.first_head + share.heads}) "
                             f"are not all on this rank ({split.first_head}+{split.heads})")
    check_block_sizes(mine.block_size, other.block_size)
    bm, bo = mine.block_size, other.block_size
    g, period = math.gcd(bm, bo), math.lcm(bm, bo)
    if span.first_token % g or not 0 <= span.first_token < span.num_tokens:
        raise LayoutError(f"first token {span.first_token} of a {span.num_tokens}-token prompt "
                          f"is not on a {g}-token boundary")
    c0, c1 = span.first_token // g, -(-span.num_tokens // g)
    groups, per_block, step = period // g, bm // g, period // bm
    out: list[tuple[KVLayout, Ids]] = []
    for j in range(min(groups, c1 - c0)):
        c = c0 + j
        count = -(-(c1 - c) // groups)
        index = (c // per_block - first_block) + step * np.arange(count, dtype=np.int64)
        if index[0] < 0 or index[-1] >= arr.size:
            raise LayoutError(f"{arr.size} block ids from prompt block {first_block} do not "
                              f"cover tokens [{span.first_token}, {span.num_tokens})")
        offset = (c % per_block) * g
        view = _view(layout, split, bm, bo, share.first_head, share.heads, offset)
        out.append((view, arr[index]))
    return out


def pair(local: KVLayout, local_shape: Shape, local_ids: Sequence[int] | Ids,
         local_first: int, remote: KVLayout, remote_shape: Shape,
         remote_ids: Sequence[int] | Ids, remote_first: int, share: Share | None,
         span: Span) -> list[SubTransfer]:
    """Both halves of one part (see :func:`side`), zipped into sub-transfers."""
    mine = side(local, local_shape, remote_shape, share, local_ids, local_first, span)
    theirs = side(remote, remote_shape, local_shape, share, remote_ids, remote_first, span)
    if len(mine) != len(theirs):  # both come from the same span and sizes: a bug if hit
        raise LayoutError(f"{len(mine)} local sub-transfers, {len(theirs)} remote")
    return [SubTransfer(lv, li, rv, ri) for (lv, li), (rv, ri) in zip(mine, theirs, strict=True)]


def descriptors(subs: Sequence[SubTransfer]) -> tuple[DescriptorArray, DescriptorArray]:
    """The local and remote descriptor arrays of ``subs``, concatenated in order."""
    pairs = [descriptor_pair(s.local, s.local_ids, s.remote, s.remote_ids) for s in subs]
    if len(pairs) == 1:
        return pairs[0]
    if not pairs:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty.copy()
    return (np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs]))


def side_bytes(half: Sequence[tuple[KVLayout, Ids]]) -> int:
    """Bytes one side of a part moves (block refs count their group's planes)."""
    return sum(view.nbytes(ids) for view, ids in half)


def side_descriptors(half: Sequence[tuple[KVLayout, Ids]]) -> DescriptorArray:
    """One side's descriptors (the byte stream a checksum covers), in plan order."""
    parts = [view.descriptors(ids) for view, ids in half]
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)


def _identical(mine: Shape, other: Shape, share: Share | None) -> bool:
    """Both ranks hold exactly the shared heads in blocks of one size: whole blocks move."""
    if mine.block_size != other.block_size:
        return False
    if mine.heads is None or other.heads is None:
        return (mine.tp_size, mine.rank) == (other.tp_size, other.rank)
    whole = mine.whole()
    return whole == other.whole() and (share is None or (share.first_head, share.heads) == whole)


@functools.lru_cache(maxsize=128)  # a few per peer shape (x layers for layer-wise push)
def _view(layout: KVLayout, split: HeadSplit, bm: int, bo: int, first_head: int, heads: int,
          offset: int) -> KVLayout:
    """The view of ``layout`` on heads ``[first_head, +heads)``, ``offset`` tokens into each
    slab, ``gcd(bm, bo)`` tokens long (whole slabs of consecutive heads merged when equal)."""
    isz = split.itemsize(layout)
    slab = split.slab_elements(bm) * isz  # bytes of one [N, head_dim] slab
    local = first_head - split.first_head
    planes: list[KVPlane] = []
    if bm == bo:  # whole slabs: the shared heads are one range per (plane, outer)
        for p in layout.planes:
            for o in range(split.outer):
                start = (o * split.heads + local) * split.inner * slab
                planes.append(KVPlane(f"{p.layer}/{o}:{first_head}+{heads}", p.base + start,
                                      p.block_stride, heads * split.inner * slab))
        return _derived(layout, planes, bm)
    if not split.order:
        raise LayoutMismatch(f"blocks of {split.interior or 'this'} format are opaque inside a "
                             f"head: block_size {bm} here and {bo} at the peer cannot be mapped")
    g, hd = math.gcd(bm, bo), split.head_dim
    for p in layout.planes:
        for o in range(split.outer):
            for h in range(local, local + heads):
                for i in range(split.inner):
                    start = p.base + ((o * split.heads + h) * split.inner + i) * slab
                    label = f"{p.layer}/{o}:{h}.{i}@{offset}"
                    if split.order[o * split.inner + i] == "t":  # [N, head_dim]: one range
                        planes.append(KVPlane(label, start + offset * hd * isz, p.block_stride,
                                              g * hd * isz))
                    else:  # [head_dim, N]: g tokens of each dimension's row
                        planes.extend(KVPlane(f"{label}d{d}", start + (d * bm + offset) * isz,
                                              p.block_stride, g * isz) for d in range(hd))
    return _derived(layout, planes, g)


def _derived(layout: KVLayout, planes: list[KVPlane], block_size: int) -> KVLayout:
    return KVLayout(tuple(planes), layout.num_blocks, block_size, layout.dtype, layout.device)

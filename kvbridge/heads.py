"""Which KV heads one tensor-parallel rank holds, and where they sit inside its blocks.

A :class:`HeadSplit` completes a :class:`~kvbridge.layout.KVLayout` for heterogeneous tensor
parallelism and block sizes: with it, a rank's share of a peer's block is a computable byte
range. It describes *head-major* block interiors only, where one block of one plane is::

    [outer, heads, inner, block_size, head_dim]   (elements of the layout's dtype)

``outer * inner * planes_per_layer`` is the number of KV parts (2: K and V). vLLM's CPU
attention backend (``KVCacheLayout.LBHNC``) keeps one plane per layer whose blocks are
``[heads, 2, block_size, head_dim]``: ``outer=1, inner=2``. A split layout with separate K and
V planes of ``[heads, block_size, head_dim]`` blocks is ``outer=1, inner=1``. Layouts whose
heads are interleaved per token (``[block_size, heads, head_dim]``) have no HeadSplit: such
engines exchange KV only with engines of the same TP size and block size.

Heads are spread over ranks as vLLM does it: with ``tp <= total`` rank ``r`` holds the
``total/tp`` heads from ``r*total/tp``; with ``tp > total`` each head is replicated on
``tp/total`` consecutive ranks and rank ``r`` holds head ``r // (tp/total)``.

Pure and immutable; the wire form is bounded like every control message field.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.layout import KVLayout

__all__ = ["HeadSplit", "rank_heads", "check_tp"]

_MAX_HEADS = 1 << 16
HeadCount = Annotated[int, msgspec.Meta(ge=1, le=_MAX_HEADS)]


def check_tp(total: int, tp: int) -> None:
    """Raise :class:`LayoutMismatch` unless ``tp`` ranks can share ``total`` KV heads."""
    if total < 1 or tp < 1:
        raise LayoutMismatch(f"{total} KV heads over tensor-parallel {tp}: both must be >= 1")
    if (tp <= total and total % tp) or (tp > total and tp % total):
        raise LayoutMismatch(f"{total} KV heads cannot be split over tensor-parallel {tp} "
                             "(one must divide the other)")


def rank_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """``(first head, number of heads)`` rank ``rank`` of ``tp`` holds (see the module
    docstring). Raises :class:`LayoutMismatch` for an impossible split or rank."""
    check_tp(total, tp)
    if not 0 <= rank < tp:
        raise LayoutMismatch(f"rank {rank} outside tensor-parallel size {tp}")
    if tp <= total:
        n = total // tp
        return rank * n, n
    return rank // (tp // total), 1


class HeadSplit(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's KV heads and block interior (see the module docstring)."""

    total_heads: HeadCount
    """KV heads of the model (all ranks together, before replication)."""
    first_head: Annotated[int, msgspec.Meta(ge=0, lt=_MAX_HEADS)]
    heads: HeadCount
    """KV heads this rank holds: ``[first_head, first_head + heads)``."""
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    outer: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    inner: Annotated[int, msgspec.Meta(ge=1, le=2)] = 2

    @classmethod
    def for_rank(cls, total_heads: int, tp: int, rank: int, head_dim: int, *, outer: int = 1,
                 inner: int = 2) -> HeadSplit:
        first, n = rank_heads(total_heads, tp, rank)
        return cls(total_heads=total_heads, first_head=first, heads=n, head_dim=head_dim,
                   outer=outer, inner=inner)

    def slab_elements(self, block_size: int) -> int:
        """Elements of one ``[block_size, head_dim]`` slab (one head, one part)."""
        return block_size * self.head_dim

    def itemsize(self, layout: KVLayout) -> int:
        """Bytes per element implied by ``layout``'s block bytes (all planes must agree)."""
        per_block = self.outer * self.heads * self.inner * self.slab_elements(layout.block_size)
        sizes = {p.block_bytes for p in layout.planes}
        if len(sizes) != 1 or next(iter(sizes)) % per_block:
            raise LayoutError(
                f"blocks of {sorted(sizes)} bytes do not hold {self.outer}x{self.heads} heads x "
                f"{self.inner} parts x {layout.block_size} tokens x head dim {self.head_dim}")
        return next(iter(sizes)) // per_block

    def check(self, layout: KVLayout, tp: int, rank: int, who: str = "this engine") -> None:
        """Raise :class:`LayoutMismatch` unless this split is rank ``rank`` of ``tp``'s and fits
        ``layout`` (the canonical heads, whole elements per block)."""
        first, n = rank_heads(self.total_heads, tp, rank)
        if (self.first_head, self.heads) != (first, n):
            raise LayoutMismatch(
                f"{who} says rank {rank} of tensor-parallel {tp} holds KV heads "
                f"[{self.first_head}, {self.first_head + self.heads}) of {self.total_heads}; "
                f"that rank holds [{first}, {first + n})")
        try:
            self.itemsize(layout)
        except LayoutError as exc:
            raise LayoutMismatch(f"{who}: {exc}") from None

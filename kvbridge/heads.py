"""Which KV heads one tensor-parallel rank holds, and where they sit inside its blocks.

A :class:`HeadSplit` completes a :class:`~kvbridge.layout.KVLayout` for heterogeneous tensor
parallelism and block sizes: with it, a rank's share of a peer's block is a computable byte
range. It describes *head-major* block interiors only, where one block of one plane is::

    [outer, heads, inner, slab]   (a slab: block_size x head_dim elements of one head and part)

``outer * inner * planes_per_layer`` is the number of KV parts (2: K and V). ``order`` says,
per part (``outer * inner`` letters), how its slab is laid out: ``t`` token-major
``[block_size, head_dim]``, ``d`` dim-major ``[head_dim, block_size]``; empty means the slab is
opaque (a kernel-private format): whole slabs still move between TP sizes, but a block cannot be
cut by token, so the block size must be equal. ``interior`` names the format; two engines must
agree on it (equal block sizes included: a whole block of one format is garbage in another).

vLLM's CPU attention backend (``KVCacheLayout.LBHNC``, ISA ``vec``/``vec16``) keeps one plane per
layer whose blocks are ``[heads, (K: [head_dim, N], V: [N, head_dim])]``: ``outer=1, inner=2,
order="dt"`` (measured by writing known values through its ``cpu_attn_reshape_and_cache``).
Separate K and V planes of ``[heads, N, head_dim]`` blocks are ``outer=1, inner=1, order="t"``.
Layouts whose heads are interleaved per token (``[N, heads, head_dim]``) have no HeadSplit: such
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
    order: Annotated[str, msgspec.Meta(max_length=4, pattern="^[td]*$")] = ""
    """Per part: ``t`` token-major slab, ``d`` dim-major; empty: opaque (equal blocks only)."""
    interior: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """The name of the block format (e.g. ``vllm-cpu:vec``); both sides must agree."""

    @classmethod
    def for_rank(cls, total_heads: int, tp: int, rank: int, head_dim: int, *, outer: int = 1,
                 inner: int = 2, order: str = "", interior: str = "") -> HeadSplit:
        first, n = rank_heads(total_heads, tp, rank)
        return cls(total_heads=total_heads, first_head=first, heads=n, head_dim=head_dim,
                   outer=outer, inner=inner, order=order, interior=interior)

    def like(self, tp: int, rank: int) -> HeadSplit:
        """The same model and block format, as rank ``rank`` of ``tp`` holds it."""
        return HeadSplit.for_rank(self.total_heads, tp, rank, self.head_dim, outer=self.outer,
                                  inner=self.inner, order=self.order, interior=self.interior)

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
        if self.order and len(self.order) != self.outer * self.inner:
            raise LayoutMismatch(f"{who}: order {self.order!r} does not name "
                                 f"{self.outer * self.inner} KV parts")
        if (self.first_head, self.heads) != (first, n):
            raise LayoutMismatch(
                f"{who} says rank {rank} of tensor-parallel {tp} holds KV heads "
                f"[{self.first_head}, {self.first_head + self.heads}) of {self.total_heads}; "
                f"that rank holds [{first}, {first + n})")
        try:
            self.itemsize(layout)
        except LayoutError as exc:
            raise LayoutMismatch(f"{who}: {exc}") from None

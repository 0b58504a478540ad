"""KV-cache groups and block refs: what a hybrid model's KV cache looks like to kvbridge.

vLLM's hybrid KV-cache manager splits a model's attention layers into *groups* (Gemma 3: its
sliding-window layers and its full-attention layers). Each group has its own block table per
request, drawn from one shared pool of block ids, and its own rule for which blocks it keeps: a
full-attention group keeps every block of the prompt, a sliding-window group frees the blocks that
fell out of its window and puts vLLM's *null block* in their place. A :class:`KVGroup` describes
one group: its kind, block size, window, and which planes of the engine's
:class:`~kvbridge.layout.KVLayout` hold its layers.

**Block refs.** A hand-off moves blocks of several groups, each to the planes of its own group.
Rather than thread a list per group through every plan and message, kvbridge names one block of
one group by one integer, ``block * G + group`` on an engine with ``G`` groups
(:func:`to_refs`, :func:`split_refs`). With one group (every non-hybrid engine) a ref *is* the
block id, so nothing changes there. Lists of refs are kept group-major, prompt order inside a
group; descriptor building (:func:`kvbridge.layout.descriptor_pair`) routes each ref to its
group's planes.

**Suffixes.** Whatever a group keeps of a prompt is a run of blocks ending at the prompt's last
block (a sliding window only ever drops a prefix). So a hand-off is, per group, "the last *k*
blocks": P leases the blocks it still holds, D asks for the ones it lacks (those it neither had
cached nor saw dropped by its own window), and both sides pair them by position from the end
(:func:`group_counts`, :func:`suffix_of`).

Pure values and functions; thread-safe.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.errors import LayoutError, LayoutMismatch

__all__ = [
    "GroupKind", "KVGroup", "GroupWire", "MAX_GROUPS", "check_groups", "to_refs", "split_refs",
    "group_counts", "suffix_of", "describe_groups",
]

#: Most KV-cache groups an engine may announce (Gemma-3-27B has 6; a hostile peer gets no more).
MAX_GROUPS = 64


class GroupKind(enum.StrEnum):
    """How a group decides which of a prompt's blocks it keeps."""

    FULL = "full"
    """Every block (full attention)."""
    SLIDING = "sliding"
    """Only the blocks still inside the window; vLLM's null block replaces the others."""


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: ``planes`` index the engine layout's planes holding its layers."""

    kind: GroupKind
    block_size: int
    window: int | None = None
    planes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise LayoutError(f"a KV-cache group needs block_size > 0, got {self.block_size}")
        if (self.kind is GroupKind.SLIDING) != (self.window is not None):
            raise LayoutError("a sliding-window group needs a window, and only it has one")
        if self.window is not None and self.window <= 0:
            raise LayoutError(f"a sliding window must be > 0 tokens, got {self.window}")

    def describe(self) -> str:
        """``sliding window 48, block size 32`` or ``full attention, block size 32``."""
        if self.kind is GroupKind.SLIDING:
            return f"sliding window {self.window}, block size {self.block_size}"
        return f"full attention, block size {self.block_size}"

    def to_wire(self) -> GroupWire:
        return GroupWire(self.kind.value, self.block_size, self.window or 0, list(self.planes))

    @classmethod
    def from_wire(cls, wire: GroupWire) -> KVGroup:
        """Inverse of :meth:`to_wire`; :class:`LayoutError` for an inconsistent group."""
        try:
            kind = GroupKind(wire.kind)
        except ValueError:
            raise LayoutError(f"unknown KV-cache group kind {wire.kind!r}") from None
        return cls(kind, wire.block_size, wire.window or None, tuple(wire.planes))


class GroupWire(msgspec.Struct, frozen=True, array_like=True):
    """A :class:`KVGroup` on the wire (``window`` 0: none), bounded like the rest of a layout."""

    kind: Annotated[str, msgspec.Meta(max_length=16)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    window: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)]
    planes: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=1 << 14)]],
                      msgspec.Meta(max_length=1 << 14)]


def describe_groups(groups: Sequence[KVGroup]) -> str:
    """``3 (sliding window 48, …; full attention, …)``, or ``1 (no hybrid KV cache)``."""
    if not groups:
        return "1 (no hybrid KV cache)"
    return f"{len(groups)} ({'; '.join(g.describe() for g in groups)})"


def check_groups(mine: Sequence[KVGroup], theirs: Sequence[KVGroup]) -> None:
    """Raise :class:`LayoutMismatch` naming the first difference (count, then per group: kind,
    block size, window, layers). ``()`` is an engine without groups."""
    if len(mine) != len(theirs):
        raise LayoutMismatch(
            f"KV-cache groups differ: {describe_groups(mine)} here, {describe_groups(theirs)} at "
            "the peer (a hybrid model needs vLLM's hybrid KV-cache manager on both sides, or "
            "--disable-hybrid-kv-cache-manager on both)")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for what, x, y in (("kind", a.kind.value, b.kind.value),
                           ("block size", a.block_size, b.block_size),
                           ("sliding window", a.window, b.window),
                           ("layers (planes)", a.planes, b.planes)):
            if x != y:
                raise LayoutMismatch(f"KV-cache group {i} differs in {what}: {a.describe()} "
                                     f"here, {b.describe()} at the peer")


# -- block refs -----------------------------------------------------------------------------


def to_refs(group: int, block_ids: Sequence[int], num_groups: int) -> tuple[int, ...]:
    """Refs of ``block_ids`` of ``group`` on an engine with ``num_groups`` groups."""
    if not 0 <= group < max(num_groups, 1):
        raise LayoutError(f"group {group} outside [0, {num_groups})")
    if num_groups <= 1:
        return tuple(int(b) for b in block_ids)
    return tuple(int(b) * num_groups + group for b in block_ids)


def split_refs(refs: Sequence[int] | npt.NDArray[np.integer[Any]],
               num_groups: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(groups, block_ids)`` of ``refs`` as two int64 arrays (vectorised)."""
    arr = np.asarray(refs, dtype=np.int64).reshape(-1)
    if num_groups <= 1:
        return np.zeros(arr.size, dtype=np.int64), arr
    return arr % num_groups, arr // num_groups


def group_counts(refs: Sequence[int], num_groups: int) -> list[int]:
    """How many of ``refs`` name each group."""
    groups, _ = split_refs(refs, num_groups)
    return [int(n) for n in np.bincount(groups, minlength=max(num_groups, 1))]


def suffix_of(held: Sequence[int], counts: Sequence[int], num_groups: int) -> tuple[int, ...]:
    """For each group, the last ``counts[g]`` of ``held``'s refs of that group, group-major.

    ``held`` is one side's refs of a prompt (each group's kept blocks, ending at the prompt's
    last block). Raises :class:`LayoutError` naming the group when it holds fewer than asked.
    """
    arr = np.asarray(held, dtype=np.int64).reshape(-1)
    groups, _ = split_refs(arr, num_groups)
    out: list[npt.NDArray[np.int64]] = []
    for g, want in enumerate(counts):
        mine = arr[groups == g]
        if want > mine.size:
            raise LayoutError(f"group {g}: {want} blocks asked, {mine.size} held (a sliding "
                              "window dropped the rest)")
        out.append(mine[mine.size - want:])
    return tuple(int(r) for r in np.concatenate(out).tolist()) if out else ()

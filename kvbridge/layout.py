"""KV-cache geometry and vectorised, coalesced descriptor building.

A :class:`KVLayout` describes where an engine's KV blocks live: for every layer, one or more
*planes* (K and V separately, or K and V interleaved inside a block as vLLM's CPU backend does),
each a sequence of equally spaced blocks. From it, :func:`descriptor_pair` turns two lists of block
ids into two equal-length descriptor arrays, merging runs of consecutive blocks (on both sides at
once) into single descriptors. Everything is numpy; nothing here loops over blocks in Python.

Descriptor arrays are ``int64`` arrays of shape ``(N, 3)``: address, length, device id — the form
NIXL's ``prep_xfer_dlist`` takes directly.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge.errors import LayoutError, LayoutMismatch
from kvbridge.groups import MAX_GROUPS, GroupWire, KVGroup, check_groups, split_refs

__all__ = [
    "KVPlane", "KVLayout", "PlaneWire", "LayoutWire", "descriptor_pair", "check_block_ids",
    "block_runs", "fill_ranges", "int_ids", "DescriptorArray", "LayoutKey",
]

DescriptorArray = npt.NDArray[np.int64]
#: What identifies a layout's memory and block routing: plane table bytes (base, stride, block
#: bytes per plane), num_blocks, device, dtype, block_size, groups (see :attr:`KVLayout.key`).
LayoutKey = tuple[bytes, int, int, str, int, tuple[Any, ...]]

_MAX_PLANES = 1 << 14


class PlaneWire(msgspec.Struct, frozen=True, array_like=True):
    """One KV plane on the wire: ``block i`` is ``[base + i*stride, +block_bytes)``."""

    layer: Annotated[str, msgspec.Meta(max_length=256)]
    base: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    stride: Annotated[int, msgspec.Meta(ge=1, le=(1 << 48))]
    block_bytes: Annotated[int, msgspec.Meta(ge=1, le=(1 << 48))]


class LayoutWire(msgspec.Struct, frozen=True, kw_only=True):
    """A :class:`KVLayout` on the wire: typed and bounded, so a peer cannot send anything else."""

    planes: Annotated[list[PlaneWire], msgspec.Meta(min_length=1, max_length=_MAX_PLANES)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    device: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = 0
    groups: Annotated[list[GroupWire], msgspec.Meta(max_length=MAX_GROUPS)] = []


@dataclass(frozen=True)
class KVPlane:
    """One layer's blocks in one plane: ``block i`` is ``[base + i*block_stride, +block_bytes)``."""

    layer: str
    base: int
    block_stride: int
    block_bytes: int

    @property
    def dense(self) -> bool:
        """True when consecutive blocks touch, so runs of blocks can merge into one range."""
        return self.block_stride == self.block_bytes


@dataclass(frozen=True)
class KVLayout:
    """The geometry of one engine rank's KV cache (see the module docstring).

    ``groups`` are vLLM's KV-cache groups of a hybrid model (:mod:`kvbridge.groups`), each naming
    its planes; ``()`` is an engine with one block table for every plane. With groups, block ids
    given to this layout are block refs (``block * len(groups) + group``).
    """

    planes: tuple[KVPlane, ...]
    num_blocks: int
    block_size: int
    dtype: str
    device: int = 0
    groups: tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        if not self.planes:
            raise LayoutError("a KV layout needs at least one plane")
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise LayoutError(
                f"num_blocks ({self.num_blocks}) and block_size ({self.block_size}) must be > 0"
            )
        if len(self.groups) > MAX_GROUPS:
            raise LayoutError(f"{len(self.groups)} KV-cache groups; at most {MAX_GROUPS}")
        for i, group in enumerate(self.groups):
            bad = [p for p in group.planes if not 0 <= p < len(self.planes)]
            if bad or len(set(group.planes)) != len(group.planes):
                raise LayoutError(f"KV-cache group {i} names planes {list(group.planes)}; the "
                                  f"layout has {len(self.planes)} (each at most once)")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, Any],
        num_blocks: int,
        block_size: int,
        *,
        block_dim: int | None = None,
    ) -> KVLayout:
        """Build a layout from per-layer KV tensors (torch tensors or numpy arrays).

        The block dimension is ``block_dim`` or else the first dimension of size ``num_blocks``.
        Dimensions before it become planes (e.g. ``(2, num_blocks, …)`` gives a K and a V plane);
        dimensions after it must be contiguous, so one block of one plane is one byte range. This
        covers vLLM's CPU layout ``(num_blocks, 2, block_size, heads*head_dim)`` and the GPU
        layouts ``(2, num_blocks, block_size, heads, head_dim)``.

        Raises :class:`LayoutError` naming the layer and the problem.
        """
        if not kv_caches:
            raise LayoutError("no KV-cache tensors were given")
        planes: list[KVPlane] = []
        dtypes: set[str] = set()
        devices: set[int] = set()
        for name, tensor in kv_caches.items():
            info = _TensorInfo.of(tensor)
            dtypes.add(info.dtype)
            devices.add(info.device)
            dim = block_dim
            if dim is None:
                if num_blocks not in info.shape:
                    raise LayoutError(
                        f"layer {name!r}: no dimension of size num_blocks={num_blocks} in shape "
                        f"{info.shape}"
                    )
                dim = info.shape.index(num_blocks)
            if not 0 <= dim < len(info.shape) or info.shape[dim] != num_blocks:
                raise LayoutError(
                    f"layer {name!r}: dimension {dim} of shape {info.shape} is not num_blocks"
                )
            inner_shape = info.shape[dim + 1 :]
            inner_strides = info.strides[dim + 1 :]
            expected = info.itemsize
            for size, stride in zip(reversed(inner_shape), reversed(inner_strides), strict=True):
                if size != 1 and stride != expected:
                    raise LayoutError(
                        f"layer {name!r}: a block is not contiguous (shape {info.shape}, strides "
                        f"{info.strides} bytes); a permuted KV layout is not supported"
                    )
                expected *= size
            block_bytes = expected
            block_stride = info.strides[dim]
            outer = [
                (sz, st) for sz, st in zip(info.shape[:dim], info.strides[:dim], strict=True)
            ]
            offsets = np.zeros(1, dtype=np.int64)
            for size, stride in outer:
                offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
            for k, off in enumerate(offsets.tolist()):
                label = name if len(offsets) == 1 else f"{name}#{k}"
                planes.append(KVPlane(label, info.ptr + int(off), block_stride, block_bytes))
        if len(dtypes) != 1 or len(devices) != 1:
            raise LayoutError(
                f"layers disagree on dtype {sorted(dtypes)} or device {sorted(devices)}"
            )
        return cls(tuple(planes), num_blocks, block_size, dtypes.pop(), devices.pop())

    # -- identity -------------------------------------------------------------------------------

    def geometry(self) -> dict[str, Any]:
        """Everything two engines must agree on to exchange blocks (no addresses, no counts)."""
        geometry: dict[str, Any] = {
            "planes": [[p.layer, p.block_bytes] for p in self.planes],
            "block_size": self.block_size,
            "dtype": self.dtype,
        }
        if self.groups:  # absent without groups: fingerprints of older engines stay the same
            geometry["groups"] = [[g.kind.value, g.block_size, g.window, list(g.planes)]
                                  for g in self.groups]
        return geometry

    def fingerprint(self) -> str:
        """A short stable hash of :meth:`geometry`, exchanged in handshakes."""
        blob = json.dumps(self.geometry(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatch` naming the first field on which the layouts differ."""
        if self.dtype != other.dtype:
            raise LayoutMismatch(f"dtype differs: {self.dtype} here, {other.dtype} at the peer")
        if self.block_size != other.block_size:
            raise LayoutMismatch(
                f"block_size differs: {self.block_size} here, {other.block_size} at the peer"
            )
        check_groups(self.groups, other.groups)
        if len(self.planes) != len(other.planes):
            raise LayoutMismatch(
                f"number of KV planes differs: {len(self.planes)} here, {len(other.planes)} at "
                "the peer (different model, layer count or K/V split)"
            )
        for mine, theirs in zip(self.planes, other.planes, strict=True):
            if mine.block_bytes != theirs.block_bytes:
                raise LayoutMismatch(
                    f"bytes per block of {mine.layer!r} differ: {mine.block_bytes} here, "
                    f"{theirs.block_bytes} at the peer (heads, head dim or dtype)"
                )

    @functools.cached_property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across all layers and planes."""
        return sum(p.block_bytes for p in self.planes)

    @property
    def num_groups(self) -> int:
        """Block tables per request: ``len(groups)``, or 1 for an engine without groups."""
        return max(len(self.groups), 1)

    def nbytes(self, refs: Sequence[int] | npt.NDArray[np.integer[Any]]) -> int:
        """Bytes a transfer of ``refs`` moves (each ref counts the planes of its group)."""
        if not self.groups:
            return self.bytes_per_block * len(refs)
        groups, _ = split_refs(refs, self.num_groups)
        counts = np.bincount(groups, minlength=self.num_groups)
        per_group = [sum(self.planes[i].block_bytes for i in g.planes) for g in self.groups]
        return int(np.dot(counts, np.asarray(per_group, dtype=np.int64)))

    def block_ids(self, refs: Sequence[int]) -> list[int]:
        """The block ids (vLLM's) that ``refs`` name, in order."""
        return [int(b) for b in split_refs(refs, self.num_groups)[1].tolist()]

    @functools.cached_property
    def _group_layouts(self) -> tuple[KVLayout | None, ...]:
        """Per group: this layout restricted to its planes, without groups (None: no planes)."""
        return tuple(
            KVLayout(tuple(self.planes[i] for i in g.planes), self.num_blocks, self.block_size,
                     self.dtype, self.device) if g.planes else None
            for g in self.groups)

    def regions(self) -> list[tuple[int, int]]:
        """Disjoint ``(address, length)`` ranges covering every plane, for memory registration."""
        spans = sorted(
            (p.base, p.base + (self.num_blocks - 1) * p.block_stride + p.block_bytes)
            for p in self.planes
        )
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(s, e - s) for s, e in merged]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for the wire (see :meth:`from_dict`)."""
        out: dict[str, Any] = {
            "planes": [[p.layer, p.base, p.block_stride, p.block_bytes] for p in self.planes],
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "device": self.device,
        }
        if self.groups:
            out["groups"] = [msgspec.to_builtins(g.to_wire()) for g in self.groups]
        return out

    def to_wire(self) -> LayoutWire:
        """The typed wire form (see :meth:`from_wire`)."""
        return LayoutWire(
            planes=[PlaneWire(p.layer, p.base, p.block_stride, p.block_bytes) for p in self.planes],
            num_blocks=self.num_blocks, block_size=self.block_size, dtype=self.dtype,
            device=self.device, groups=[g.to_wire() for g in self.groups],
        )

    @classmethod
    def from_wire(cls, wire: LayoutWire) -> KVLayout:
        """Inverse of :meth:`to_wire`. The wire types bound every field; this also refuses
        planes whose blocks overlap each other (a stride smaller than a block)."""
        for p in wire.planes:
            if p.stride < p.block_bytes:
                raise LayoutError(f"plane {p.layer!r}: stride {p.stride} is smaller than its "
                                  f"blocks ({p.block_bytes} bytes)")
            if p.base + (wire.num_blocks - 1) * p.stride + p.block_bytes > (1 << 63) - 1:
                raise LayoutError(f"plane {p.layer!r} runs past the end of the address space")
        planes = tuple(KVPlane(p.layer, p.base, p.stride, p.block_bytes) for p in wire.planes)
        groups = tuple(KVGroup.from_wire(g) for g in wire.groups)
        return cls(planes, wire.num_blocks, wire.block_size, wire.dtype, wire.device, groups)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`; raises :class:`LayoutError` on malformed input."""
        try:
            planes = tuple(
                KVPlane(str(n), int(b), int(s), int(l)) for n, b, s, l in data["planes"]
            )
            groups = tuple(KVGroup.from_wire(msgspec.convert(g, GroupWire))
                           for g in data.get("groups", ()))
            return cls(
                planes,
                int(data["num_blocks"]),
                int(data["block_size"]),
                str(data["dtype"]),
                int(data.get("device", 0)),
                groups,
            )
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
            raise LayoutError(f"malformed layout metadata: {exc!r}") from exc

    # -- descriptors ----------------------------------------------------------------------------

    @functools.cached_property
    def _plane_table(self) -> npt.NDArray[np.int64]:
        """``(3, planes)`` int64: rows base, block_stride, block_bytes (cached; frozen layout)."""
        table = np.array(
            [[p.base, p.block_stride, p.block_bytes] for p in self.planes], dtype=np.int64
        )
        out = np.ascontiguousarray(table.T)
        out.flags.writeable = False
        return out

    @property
    def plane_table(self) -> npt.NDArray[np.int64]:
        """``(3, planes)`` int64, read-only: rows base, block stride, block bytes."""
        return self._plane_table

    @functools.cached_property
    def _dense(self) -> bool:
        return all(p.dense for p in self.planes)

    @functools.cached_property
    def dense_planes(self) -> npt.NDArray[np.bool_]:
        """Per plane: consecutive blocks touch (stride == block bytes)."""
        return np.asarray(self._plane_table[1] == self._plane_table[2])

    @functools.cached_property
    def key(self) -> LayoutKey:
        """Equal for two layouts that describe the same memory the same way (every plane's base,
        stride and block bytes, block count, device, dtype, block size, KV-cache groups; not the
        layer names). Transports key prepared state by it; computed once per object."""
        groups = tuple((g.kind.value, g.block_size, g.window, g.planes) for g in self.groups)
        return (self._plane_table.tobytes(), self.num_blocks, self.device, self.dtype,
                self.block_size, groups)

    def extents(self) -> list[tuple[int, int]]:
        """``(address, length)`` of each plane from its first block to the end of its last."""
        return [(p.base, (self.num_blocks - 1) * p.block_stride + p.block_bytes)
                for p in self.planes]

    def descriptors(
        self, block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> DescriptorArray:
        """Descriptors for ``block_ids`` on this side alone, contiguous runs coalesced."""
        return descriptor_pair(self, block_ids, self, block_ids)[0]

    def plane_indices(self, layer: str) -> list[int]:
        """Indices of the planes of ``layer`` (its K/V planes, or its single plane)."""
        return [i for i, p in enumerate(self.planes)
                if p.layer == layer or p.layer.startswith(layer + "#")]

    def select(self, plane_indices: Sequence[int]) -> KVLayout:
        """The same layout restricted to some planes (e.g. one layer, for per-layer transfers).
        Groups keep their selected planes (a group may end up with none: its refs move
        nothing)."""
        if not plane_indices:
            raise LayoutError("select() needs at least one plane")
        if len(plane_indices) == len(self.planes) and all(
                i == j for i, j in enumerate(plane_indices)):
            return self  # every plane in order: this layout (and its cached tables and key)
        where = {old: new for new, old in enumerate(plane_indices)}
        groups = tuple(KVGroup(g.kind, g.block_size, g.window,
                               tuple(where[i] for i in g.planes if i in where))
                       for g in self.groups)
        return KVLayout(tuple(self.planes[i] for i in plane_indices), self.num_blocks,
                        self.block_size, self.dtype, self.device, groups)


def int_ids(values: Sequence[int] | npt.NDArray[np.integer[Any]],
            side: str = "local") -> npt.NDArray[np.int64]:
    """``values`` as a flat int64 array; :class:`LayoutError` unless they are integers (no
    floats, bools, strings, or Python ints beyond int64)."""
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{side} block ids are not a list of integers: {exc}") from None
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype.kind not in "iu":
        raise LayoutError(f"{side} block ids must be integers, not {raw.dtype}")
    if raw.dtype.kind == "u" and raw.dtype.itemsize == 8 and int(raw.max()) >= 1 << 63:
        raise LayoutError(f"{side} block id out of range: {int(raw.max())}")
    return raw.astype(np.int64, copy=False).reshape(-1)


def check_block_ids(
    block_ids: Sequence[int] | npt.NDArray[np.integer[Any]], num_blocks: int, side: str = "local"
) -> npt.NDArray[np.int64]:
    """Validate a list of block ids: integers in ``[0, num_blocks)``, no duplicates."""
    ids = int_ids(block_ids, side)
    if ids.size == 0:
        return ids
    ordered = np.sort(ids)  # one sort gives the range and the duplicates (O(n log n), ~20 µs/1k)
    lo, hi = int(ordered[0]), int(ordered[-1])
    if lo < 0 or hi >= num_blocks:
        raise LayoutError(f"{side} block id out of range [0, {num_blocks}): min {lo}, max {hi}")
    if ordered.size > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        raise LayoutError(f"{side} block ids contain duplicates")
    return ids


def descriptor_pair(
    local: KVLayout,
    local_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    remote: KVLayout,
    remote_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> tuple[DescriptorArray, DescriptorArray]:
    """Two equal-length descriptor arrays moving ``local_ids[i] <-> remote_ids[i]`` in every plane.

    Runs where both the local and the remote ids increase by one are merged into one descriptor
    per plane (when the plane is dense on both sides). Order: plane-major, then run order.
    With KV-cache groups the ids are block refs: each pair moves the planes of its group, and
    the order is group by group. Raises :class:`LayoutMismatch` for incompatible layouts and
    :class:`LayoutError` for bad ids.
    """
    if local.groups or remote.groups:
        return _grouped_pair(local, local_ids, remote, remote_ids)
    return _plane_pair(local, local_ids, remote, remote_ids)


def _grouped_pair(
    local: KVLayout,
    local_refs: Sequence[int] | npt.NDArray[np.integer[Any]],
    remote: KVLayout,
    remote_refs: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> tuple[DescriptorArray, DescriptorArray]:
    local.check_compatible(remote)
    n = local.num_groups
    lg, lids = split_refs(local_refs, n)
    rg, rids = split_refs(remote_refs, n)
    if lids.size != rids.size:
        raise LayoutError(f"{lids.size} local block ids but {rids.size} remote block ids")
    if not np.array_equal(lg, rg):
        raise LayoutError("local and remote block refs name different KV-cache groups")
    check_block_ids(lids, local.num_blocks, "local")  # one pool: no block in two groups
    check_block_ids(rids, remote.num_blocks, "remote")
    parts = [
        _plane_pair(mine, lids[lg == g], theirs, rids[rg == g])
        for g, (mine, theirs) in enumerate(zip(local._group_layouts, remote._group_layouts,
                                               strict=True))
        if mine is not None and theirs is not None
    ]
    if not parts:
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty.copy()
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def _plane_pair(
    local: KVLayout,
    local_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
    remote: KVLayout,
    remote_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> tuple[DescriptorArray, DescriptorArray]:
    local.check_compatible(remote)
    lids = check_block_ids(local_ids, local.num_blocks, "local")
    rids = check_block_ids(remote_ids, remote.num_blocks, "remote")
    if lids.size != rids.size:
        raise LayoutError(f"{lids.size} local block ids but {rids.size} remote block ids")
    empty = np.zeros((0, 3), dtype=np.int64)
    if lids.size == 0:
        return empty, empty.copy()

    starts, counts = block_runs(lids, rids, local._dense and remote._dense)
    # Fresh pages are most of what a 100k-descriptor request costs, so both outputs share one
    # allocation (numpy asks for transparent huge pages from 4 MiB on: a few faults, not
    # thousands) and are written in place, with no temporaries of the output's size.
    planes, runs = len(local.planes), starts.size
    both = np.empty((2, planes, runs, 3), dtype=np.int64)
    fill_ranges(both[0], local._plane_table, lids[starts], counts, local.device)
    fill_ranges(both[1], remote._plane_table, rids[starts], counts, remote.device)
    return both[0].reshape(planes * runs, 3), both[1].reshape(planes * runs, 3)


def block_runs(
    local_ids: npt.NDArray[np.int64], remote_ids: npt.NDArray[np.int64], merge: bool
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(starts, counts)``: positions in the id lists where a run begins and its length.

    With ``merge``, a run is a stretch where both the local and the remote ids step by one;
    without, every block is its own run. O(blocks), vectorised.
    """
    n = local_ids.size
    if not merge or n <= 1:
        return np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    brk = np.flatnonzero((np.diff(local_ids) != 1) | (np.diff(remote_ids) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    counts = np.diff(np.append(starts, n))
    return starts, counts


def fill_ranges(
    out: npt.NDArray[np.int64], table: npt.NDArray[np.int64], first_ids: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64], device: int | None = None,
) -> None:
    """Write the byte ranges of block runs, plane-major, into ``out`` in place.

    ``table`` is a ``(3, planes)`` plane table (rows base, stride, block bytes; a layout's, or
    some of its columns); run ``j`` covers blocks ``first_ids[j] .. + counts[j] - 1``.
    ``out`` is an int64 array of shape ``(planes, runs, 2 or 3)``: address, length and, when
    given, ``device``. A run of more than one block is only meaningful for a
    dense plane (see :func:`block_runs`).
    """
    addr = out[:, :, 0]
    np.multiply(table[1][:, None], first_ids[None, :], out=addr)
    np.add(addr, table[0][:, None], out=addr)
    np.multiply(table[2][:, None], counts[None, :], out=out[:, :, 1])
    if device is not None:
        out[:, :, 2] = device


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int
    ptr: int
    dtype: str
    device: int

    @classmethod
    def of(cls, t: Any) -> _TensorInfo:
        if isinstance(t, np.ndarray):
            return cls(
                tuple(int(s) for s in t.shape),
                tuple(int(s) for s in t.strides),
                int(t.itemsize),
                int(t.ctypes.data),
                str(t.dtype),
                0,
            )
        try:  # a torch.Tensor, read through its public attributes (no torch import here)
            itemsize = int(t.element_size())
            dev = getattr(t, "device", None)
            index = getattr(dev, "index", None)
            return cls(
                tuple(int(s) for s in t.shape),
                tuple(int(s) * itemsize for s in t.stride()),
                itemsize,
                int(t.data_ptr()),
                str(t.dtype).removeprefix("torch."),
                int(index) if index is not None else 0,
            )
        except AttributeError as exc:
            raise LayoutError(f"not a tensor or numpy array: {type(t).__name__}") from exc

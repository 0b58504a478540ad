"""Transfers by block id over prepared layout pairs: an optional capability of a transport.

The core moves KV blocks: local blocks ``local_ids[i]`` <-> remote blocks ``remote_ids[i]`` in
every plane (or some planes) of a *(local layout, peer, remote layout)* pair. Spelling that out
as descriptor arrays (:func:`~kvbridge.layout.descriptor_pair`) costs planes × runs rows per
side and per transfer — 131 072 for a scattered 16k-token Qwen3-32B request — before the
transport even starts, and the transport then checks every row again. A :class:`BlockTransport`
instead *prepares* the pair once and then takes transfers described by block ids:

* :meth:`BlockTransport.prepare_blocks` checks that the two layouts are compatible and that
  every plane of the local layout lies in this transport's registered memory and every plane of
  the remote one in the peer's, and builds the transport's native state (NIXL: prepared
  descriptor lists over every block of every plane). Pairs are cached by ``(peer, local.key,
  remote.key)`` — the layouts' full plane tables, addresses included — so any two compatible
  layouts work (views with offset bases, planes whose blocks do not touch), and the cache entries
  of a peer are dropped when it is removed or re-added.
* :meth:`BlockTransport.submit_blocks` validates the ids at the boundary in O(blocks) (in
  range, no duplicates, equal counts, plane indices) into a :class:`BlockRequest` and hands it
  to the transport, which turns it into whatever it moves bytes with (index arrays, iovecs …),
  coalescing runs of consecutive ids where it can. Nothing here loops over planes or blocks in
  Python.

The core calls the module functions :func:`prepare_blocks` and :func:`submit_blocks`, which work
with *any* :class:`~kvbridge.transport.Transport`: a transport that is not a
:class:`BlockTransport` (a third-party backend, a test wrapper) gets the descriptor arrays and
``submit`` as before.

Contract of :meth:`BlockTransport.prepare_blocks` (blocking: it may prepare native state):
:class:`LayoutMismatch` for incompatible layouts, :class:`UnknownPeer` for a peer this transport
does not know, :class:`DescriptorError` when a plane lies outside registered memory,
:class:`TransportClosed`. Thread-safe.

Contract of :meth:`BlockTransport.submit_blocks`: that of
:meth:`~kvbridge.transport.Transport.submit` (non-blocking, a notification only after the bytes
landed and only on success, same handle states), plus: :class:`LayoutError` for ids out of
range, duplicated, of unequal counts, or bad plane indices; :class:`UnknownPeer` for a pair whose
peer was removed or re-added since it was prepared; :class:`DescriptorError` for a pair another
transport prepared or a notification that is not bytes — all raised before anything is posted.
The handle's ``count`` is the number of byte ranges (planes × runs) and ``nbytes`` the bytes.

**Prepared ahead.** :meth:`BlockTransport.prepare_request` does everything of a submit that
does not need the bytes to be final — validation is the caller's (:class:`BlockRequest`), the
native request is the transport's (NIXL: ``make_prepped_xfer``) — so that
:meth:`BlockTransport.post_prepared` (or :meth:`PreparedRequest.post`) later only posts: a push
builds its WRITE while the forward that writes the KV is still running. The core calls
:func:`prepare_parts`, the ahead-of-time twin of :func:`submit_parts`. Every prepared request
must be posted or discarded (:meth:`~BlockTransport.discard_prepared`, which frees its native
state); both are thread-safe, and posting raises what ``submit_blocks`` would (a peer removed
meanwhile: :class:`UnknownPeer`).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvbridge.errors import DescriptorError, LayoutError, TransportClosed, UnknownPeer
from kvbridge.groups import split_refs
from kvbridge.layout import (
    KVLayout,
    LayoutKey,
    block_runs,
    check_block_ids,
    fill_ranges,
    int_ids,
)
from kvbridge.transport import (
    Op,
    TransferHandle,
    Transport,
    as_descriptors,
    check_notification,
    check_within,
)

__all__ = [
    "BlockPair", "BlockPart", "BlockRequest", "BlockTransport", "BlockIds", "LandingCopy",
    "PreparedRequest",
    "prepare_blocks", "prepare_parts", "submit_blocks", "submit_request", "submit_parts",
    "check_in_regions",
]

I64 = npt.NDArray[np.int64]
BlockIds = Sequence[int] | npt.NDArray[np.integer[Any]]


@dataclass(eq=False)
class BlockPair:
    """A prepared (local layout, peer, remote layout). ``native`` is the transport's own state;
    ``live`` turns False when the peer is removed or re-added (``evicted``: dropped from a full
    cache only, prepared again on use)."""

    peer: str
    local: KVLayout
    remote: KVLayout
    owner: BlockTransport | None = None
    native: Any = None
    live: bool = True
    evicted: bool = False


LandingCopy = Callable[[npt.NDArray[np.uint64], int, int], "bytes | None"]
"""A copy the caller of a request supplies (:attr:`PreparedRequest.landing`): ``(moves, stop,
progress) -> result``, ``moves`` C-contiguous ``(n, 3)`` uint64 rows of (dst, src, length) in
the request's local order, ``stop`` the address of an int32 the transport sets when it is
closed, ``progress`` where :attr:`PreparedRequest.progress` is here (0: none); it copies every
row (or, once ``stop`` is set, returns None), keeps the word at ``progress`` at the bytes copied
so far where it can, and returns what it learnt on the way (the digests of what landed), which
the transport puts on the handle (``TransferHandle.landed``)."""


@dataclass(eq=False)
class PreparedRequest:
    """A request built ahead (:meth:`BlockTransport.prepare_request`); post it or discard it.

    ``landing``, set by the caller before posting: a transport that copies the whole request
    itself through memory it mapped (shm) copies with it instead of its own copy, on its own
    thread, and puts its result on the handle; any other transport (or shm where some range is
    not mapped) ignores it and ``TransferHandle.landed`` stays None. ``progress``, with it: the
    address, in the peer's registered memory, of an 8-byte word the copy keeps at the bytes it
    copied (a push's receiver hashes behind it: :mod:`kvbridge.scheduling.follow`); passed to
    ``landing`` only where 8 aligned bytes there are mapped, else ignored."""

    op: Op
    pair: BlockPair
    req: BlockRequest
    notification: bytes | None
    native: Any = None  # the transport's request, None once posted or discarded (or never)
    done: bool = False
    landing: LandingCopy | None = None
    progress: int = 0

    def post(self) -> TransferHandle:
        """:meth:`BlockTransport.post_prepared` on the transport that prepared it."""
        assert self.pair.owner is not None
        return self.pair.owner.post_prepared(self)

    def discard(self) -> None:
        """:meth:`BlockTransport.discard_prepared` on the transport that prepared it."""
        assert self.pair.owner is not None
        self.pair.owner.discard_prepared(self)

    def takes_landing(self) -> bool:
        """Whether, posted with :attr:`landing` set, it is copied with it (shm, every range
        mapped), so that its handle's ``landed`` is that copy's result; False on a transport
        that moves the bytes itself (its ``landed`` stays None)."""
        owner = self.pair.owner
        return owner is not None and self.native is not None and owner._takes_landing(self.native)


@dataclass(frozen=True, eq=False)
class BlockPart:
    """The blocks of a request that move in the same planes: all of them on an engine without
    KV-cache groups, one group's on a hybrid one."""

    planes: I64 | None  # plane indices, None = every plane
    local_ids: I64
    remote_ids: I64
    starts: I64  # run starts (positions in the id lists)
    counts: I64  # run lengths
    plane_count: int

    @property
    def blocks(self) -> int:
        return int(self.local_ids.size)

    @property
    def runs(self) -> int:
        return int(self.starts.size)


@dataclass(frozen=True, eq=False)
class BlockRequest:
    """One transfer by block ids, validated against a pair's layouts (see :meth:`build`)."""

    parts: tuple[BlockPart, ...]
    nbytes: int
    blocks: int  # ids (block refs on a hybrid engine) given

    @classmethod
    def build(cls, local: KVLayout, remote: KVLayout, local_ids: BlockIds, remote_ids: BlockIds,
              planes: Sequence[int] | I64 | None = None) -> BlockRequest:
        """Validate in O(blocks + planes); raise :class:`LayoutError` naming the problem.

        The layouts are a compatible pair (the caller checked). With KV-cache groups the ids are
        block refs (``block × groups + group``, :mod:`kvbridge.groups`): each moves in its
        group's planes (among ``planes``), group by group. Runs of ids consecutive on both
        sides are coalesced where every plane they move in is dense on both sides.
        """
        sel = _check_planes(planes, len(local.planes))
        if not local.groups:
            lids = check_block_ids(local_ids, local.num_blocks, "local")
            rids = check_block_ids(remote_ids, remote.num_blocks, "remote")
            _same_count(lids, rids)
            parts = [_part(local, remote, sel, lids, rids)] if lids.size else []
            count = lids.size
        else:
            lrefs, rrefs = int_ids(local_ids, "local"), int_ids(remote_ids, "remote")
            _same_count(lrefs, rrefs)
            count = lrefs.size
            lg, lids = split_refs(lrefs, local.num_groups)
            rg, rids = split_refs(rrefs, local.num_groups)
            if not np.array_equal(lg, rg):
                raise LayoutError("local and remote block refs name different KV-cache groups")
            check_block_ids(lids, local.num_blocks, "local")  # one pool: no block twice
            check_block_ids(rids, remote.num_blocks, "remote")
            parts = []
            for g, group in enumerate(local.groups):
                mine = np.asarray(group.planes, dtype=np.int64)
                if sel is not None:
                    mine = mine[np.isin(mine, sel)]
                which = lg == g
                if mine.size and which.any():
                    parts.append(_part(local, remote, mine, lids[which], rids[which]))
        nbytes = sum(_part_bytes(local, p) for p in parts)
        return cls(tuple(parts), nbytes, int(count))  # not np.size(local_ids): a list would
        # be converted a second time (~25 µs per 1 024 ids)

    @property
    def runs(self) -> int:
        return sum(p.runs for p in self.parts)

    @property
    def count(self) -> int:
        """Byte ranges per side: planes × runs, summed over the parts."""
        return sum(p.plane_count * p.runs for p in self.parts)

    @property
    def entries(self) -> int:
        """Block-plane pairs per side (one per plane and id, runs not coalesced)."""
        return sum(p.plane_count * p.blocks for p in self.parts)

    def descriptors(self, pair: BlockPair, columns: int = 3) -> tuple[I64, I64]:
        """The byte ranges as two ``(count, columns)`` int64 arrays — address, length and
        (``columns=3``) device — in the order of :func:`descriptor_pair` (part by part,
        plane-major). O(planes × runs): transports call it off the caller's thread, or not
        at all."""
        both = np.empty((2, self.count, columns), dtype=np.int64)
        ldev = pair.local.device if columns == 3 else None
        rdev = pair.remote.device if columns == 3 else None
        lt, rt = pair.local.plane_table, pair.remote.plane_table
        at = 0
        for p in self.parts:
            n = p.plane_count * p.runs
            lpt, rpt = (lt, rt) if p.planes is None else (lt[:, p.planes], rt[:, p.planes])
            for side, table, ids, dev in ((0, lpt, p.local_ids, ldev), (1, rpt, p.remote_ids,
                                                                         rdev)):
                out = both[side, at:at + n].reshape(p.plane_count, p.runs, columns)
                fill_ranges(out, table, ids[p.starts], p.counts, dev)
            at += n
        return both[0], both[1]


def _same_count(lids: I64, rids: I64) -> None:
    if lids.size != rids.size:
        raise LayoutError(f"{lids.size} local block ids but {rids.size} remote block ids")


def _part(local: KVLayout, remote: KVLayout, planes: I64 | None, lids: I64,
          rids: I64) -> BlockPart:
    ldense, rdense = local.dense_planes, remote.dense_planes
    if planes is None:
        merge, k = bool(ldense.all() and rdense.all()), len(local.planes)
    else:
        merge, k = bool(ldense[planes].all() and rdense[planes].all()), int(planes.size)
    starts, counts = block_runs(lids, rids, merge)
    return BlockPart(planes, lids, rids, starts, counts, k)


def _part_bytes(layout: KVLayout, part: BlockPart) -> int:
    per_block = (layout.bytes_per_block if part.planes is None
                 else int(layout.plane_table[2][part.planes].sum()))
    return per_block * part.blocks


def _check_planes(planes: Sequence[int] | I64 | None, total: int) -> I64 | None:
    if planes is None:
        return None
    try:
        sel = np.asarray(planes, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LayoutError(f"plane indices are not integers: {exc}") from None
    if sel.size == 0:
        raise LayoutError("a transfer needs at least one plane")
    if int(sel.min()) < 0 or int(sel.max()) >= total:
        raise LayoutError(f"plane index out of range [0, {total}): min {int(sel.min())}, "
                          f"max {int(sel.max())}")
    if np.unique(sel).size != sel.size:
        raise LayoutError("plane indices contain duplicates")
    if sel.size == total and bool((sel == np.arange(total)).all()):
        return None
    return sel


def check_in_regions(layout: KVLayout, regions: Sequence[tuple[int, int]], what: str) -> None:
    """Raise :class:`DescriptorError` unless every plane of ``layout`` (first block to the end
    of the last) lies inside one of ``regions`` (``(address, length)`` pairs). O(planes)."""
    spans = as_descriptors([(a, n, 0) for a, n in layout.extents()], what)
    check_within(spans, regions, what)


class BlockTransport(Transport):
    """A :class:`Transport` with the prepared, block-id data path (see the module docstring).

    Subclasses implement :meth:`_prepare_blocks` and :meth:`_submit_blocks`, may override
    :meth:`_release_blocks`, and call :meth:`_forget_blocks` when a peer is removed or
    replaced (and ``_forget_blocks(None)`` on close).
    """

    #: Most prepared pairs kept (least recently used are dropped and prepared again on use).
    max_block_pairs: ClassVar[int] = 1024

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        self._pairs: OrderedDict[tuple[str, LayoutKey, LayoutKey], BlockPair] = OrderedDict()
        self._pairs_lock = threading.Lock()
        self._pairs_epoch = 0  # counts _forget_blocks calls: a preparation that overlaps one
        # is not cached

    def prepare_blocks(self, peer: str, local: KVLayout, remote: KVLayout) -> BlockPair:
        """The prepared pair for ``(peer, local, remote)``, from the cache or prepared now."""
        key = (peer, local.key, remote.key)
        while True:
            if self._closed:
                raise TransportClosed(f"{self.name} transport {self.agent_name!r} is closed")
            with self._pairs_lock:
                hit = self._pairs.get(key)
                if hit is not None:
                    self._pairs.move_to_end(key)
                    return hit
                epoch = self._pairs_epoch
            local.check_compatible(remote)
            pair = BlockPair(peer, local, remote, owner=self)
            pair.native = self._prepare_blocks(pair)
            drop = [pair]
            with self._pairs_lock:
                hit = self._pairs.get(key)
                if hit is None and epoch == self._pairs_epoch:
                    self._pairs[key] = pair
                    drop.clear()
                    while len(self._pairs) > self.max_block_pairs:
                        _, old = self._pairs.popitem(last=False)
                        old.evicted = True
                        drop.append(old)
            for old in drop:
                old.live = False
                self._release_blocks(old)
            if pair.live:
                return pair
            # another thread cached this pair meanwhile (use it), or a peer was forgotten while
            # preparing (this one may belong to the replaced peer): look again

    def submit_blocks(
        self, op: Op, pair: BlockPair, local_ids: BlockIds, remote_ids: BlockIds,
        notification: bytes | None = None, planes: Sequence[int] | I64 | None = None,
    ) -> TransferHandle:
        """Post ``local_ids[i] <-> remote_ids[i]`` in the pair's planes (or ``planes``)."""
        pair = self._current(pair)
        req = BlockRequest.build(pair.local, pair.remote, local_ids, remote_ids, planes)
        return self.submit_request(op, pair, req, notification)

    def submit_request(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None = None) -> TransferHandle:
        """Post a request already validated against ``pair``'s layouts (for wrappers)."""
        pair = self._current(pair)
        check_notification(self, notification)
        return self._submit_blocks(op, pair, req, notification)

    def prepare_request(self, op: Op, pair: BlockPair, req: BlockRequest,
                        notification: bytes | None = None) -> PreparedRequest:
        """Build ``req`` for a later :meth:`post_prepared` (see the module docstring). May
        block briefly (native request creation); raises what :meth:`submit_request` would
        before posting."""
        pair = self._current(pair)
        check_notification(self, notification)
        prep = PreparedRequest(op, pair, req, notification)
        prep.native = self._prepare_request(op, pair, req, notification)
        return prep

    def post_prepared(self, prep: PreparedRequest) -> TransferHandle:
        """Post a prepared request (once; non-blocking, like :meth:`submit_request`)."""
        if prep.done:
            raise DescriptorError("this prepared request was already posted or discarded")
        prep.done = True
        native, prep.native = prep.native, None
        if native is not None and (self._closed or not prep.pair.live):
            self._discard_prepared(native)  # built on a pair dropped since: not postable
            native = None
        if native is None:  # submit as usual (re-preparing an evicted pair; or raising)
            return self.submit_request(prep.op, prep.pair, prep.req, prep.notification)
        return self._post_prepared(prep, native)

    def discard_prepared(self, prep: PreparedRequest) -> None:
        """Give up a prepared request that will not be posted (idempotent)."""
        prep.done = True
        native, prep.native = prep.native, None
        if native is not None:
            self._discard_prepared(native)

    def _prepare_request(self, op: Op, pair: BlockPair, req: BlockRequest,
                         notification: bytes | None) -> Any:
        """The transport's native request for ``req``, or None (default: nothing is built
        ahead; :meth:`post_prepared` then submits as usual)."""
        return None

    def _post_prepared(self, prep: PreparedRequest, native: Any) -> TransferHandle:
        """Post ``native`` (from :meth:`_prepare_request`); owns it from here on."""
        raise NotImplementedError  # only reached when _prepare_request returned something

    def _discard_prepared(self, native: Any) -> None:
        """Free ``native`` (from :meth:`_prepare_request`), never posted."""

    def _takes_landing(self, native: Any) -> bool:
        """Whether ``native`` (from :meth:`_prepare_request`) would be copied with a
        :attr:`PreparedRequest.landing` (:meth:`PreparedRequest.takes_landing`)."""
        return False

    def _current(self, pair: BlockPair) -> BlockPair:
        if self._closed:
            raise TransportClosed(f"{self.name} transport {self.agent_name!r} is closed")
        if not isinstance(pair, BlockPair) or pair.owner is not self:
            raise DescriptorError(f"{self.name} {self.agent_name!r}: the block pair was not "
                                  "prepared by this transport")
        if pair.live:
            return pair
        if pair.evicted:
            return self.prepare_blocks(pair.peer, pair.local, pair.remote)
        raise UnknownPeer(f"{self.name} {self.agent_name!r}: peer {pair.peer!r} was removed or "
                          "re-added since the blocks were prepared")

    def _forget_blocks(self, peer: str | None) -> None:
        """Drop the prepared pairs of ``peer`` (every pair for None) and release them."""
        with self._pairs_lock:
            self._pairs_epoch += 1
            keys = [k for k in self._pairs if peer is None or k[0] == peer]
            gone = [self._pairs.pop(k) for k in keys]
        for pair in gone:
            pair.live = False
            self._release_blocks(pair)

    @abstractmethod
    def _prepare_blocks(self, pair: BlockPair) -> Any:
        """Check the pair against registered memory and the peer; return native state."""

    @abstractmethod
    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        """Post a validated request (see :meth:`submit_blocks`)."""

    def _release_blocks(self, pair: BlockPair) -> None:
        """Release a dropped pair's native state (no transfer may use it any more, but ones
        already posted may still run). Default: nothing."""


# -- what the core calls ---------------------------------------------------------------------------


def prepare_blocks(transport: Transport, peer: str, local: KVLayout,
                   remote: KVLayout) -> BlockPair:
    """``transport.prepare_blocks`` where it has one; else a pair for the descriptor path
    (compatibility checked, nothing prepared)."""
    if isinstance(transport, BlockTransport):
        return transport.prepare_blocks(peer, local, remote)
    local.check_compatible(remote)
    return BlockPair(peer, local, remote)


def submit_blocks(
    transport: Transport, op: Op, pair: BlockPair, local_ids: BlockIds, remote_ids: BlockIds,
    notification: bytes | None = None, planes: Sequence[int] | I64 | None = None,
) -> TransferHandle:
    """Post a transfer by block ids through any transport (see the module docstring)."""
    if isinstance(transport, BlockTransport):
        return transport.submit_blocks(op, pair, local_ids, remote_ids, notification, planes)
    req = BlockRequest.build(pair.local, pair.remote, local_ids, remote_ids, planes)
    return submit_request(transport, op, pair, req, notification)


def prepare_parts(
    transport: Transport, op: Op, peer: str,
    parts: Sequence[tuple[KVLayout, BlockIds, KVLayout, BlockIds]],
    notification: bytes | None = None,
) -> PreparedRequest | None:
    """What :func:`submit_parts` would post, built now to be posted later
    (:meth:`PreparedRequest.post`): validated, with the transport's native request. None where
    nothing can be built ahead — a transport that is not a :class:`BlockTransport`, or several
    parts — and the caller submits when the time comes, as usual. Raises what
    :func:`submit_parts` would before posting."""
    if len(parts) != 1 or not isinstance(transport, BlockTransport):
        return None
    local, lids, remote, rids = parts[0]
    pair = transport.prepare_blocks(peer, local, remote)
    req = BlockRequest.build(pair.local, pair.remote, lids, rids)
    return transport.prepare_request(op, pair, req, notification)


def submit_request(transport: Transport, op: Op, pair: BlockPair, req: BlockRequest,
                   notification: bytes | None = None) -> TransferHandle:
    """Post a validated request: natively, or as descriptor arrays through ``submit``."""
    if isinstance(transport, BlockTransport):
        return transport.submit_request(op, pair, req, notification)
    loc, rem = req.descriptors(pair)
    return transport.submit(op, pair.peer, loc, rem, notification)



def submit_parts(
    transport: Transport, op: Op, peer: str,
    parts: Sequence[tuple[KVLayout, BlockIds, KVLayout, BlockIds]],
    notification: bytes | None = None,
) -> TransferHandle:
    """One transfer made of ``(local layout, local ids, remote layout, remote ids)`` parts (the
    sub-transfers of a heterogeneous-TP or block-size mapping, each between views), as one
    handle. One part takes the block path (:func:`prepare_blocks` + :func:`submit_blocks`);
    several are validated part by part and posted as one descriptor list through ``submit``
    (the transports have no multi-pair request yet)."""
    if len(parts) == 1:
        local, lids, remote, rids = parts[0]
        pair = prepare_blocks(transport, peer, local, remote)
        return submit_blocks(transport, op, pair, lids, rids, notification)
    halves: list[tuple[I64, I64]] = []
    for local, lids, remote, rids in parts:
        local.check_compatible(remote)
        pair = BlockPair(peer, local, remote)
        halves.append(BlockRequest.build(local, remote, lids, rids).descriptors(pair))
    empty = np.zeros((0, 3), dtype=np.int64)
    loc = np.concatenate([h[0] for h in halves]) if halves else empty
    rem = np.concatenate([h[1] for h in halves]) if halves else empty.copy()
    return transport.submit(op, peer, loc, rem, notification)

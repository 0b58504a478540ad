"""How :class:`~kvbridge_nixl.transport.NixlTransport` turns transfers into NIXL requests.

:class:`RequestBuilder` is a mixin of the transport: it builds requests and owns the NIXL
descriptor lists they index.

* Block path: a layout's *strided* list (:func:`strided`, one row per plane covering every block)
  is prepared once per layout (``prep_xfer_dlist``); a request is two int32 index arrays
  (:func:`indices`) given to ``make_prepped_xfer``, or — when the ids form long runs — the
  coalesced ranges given to ``initialize_xfer``.
* Descriptor path: descriptors that fit a prepared *grid* (:mod:`kvbridge_nixl._grid`, one per
  side and granule, an LRU of :data:`MAX_GRIDS`) become indices into it.
* Lists that fall out of a cache are *retired*, and released only once nothing is in flight
  (:meth:`RequestBuilder._release_retired`).

Every method here runs with the transport's lock held and never blocks beyond the native call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.blocks import BlockPair, BlockRequest
from kvbridge.layout import KVLayout, LayoutKey
from kvbridge.transport import DescriptorArray, Op, TransferHandle
from kvbridge_nixl._agent import NixlOptions
from kvbridge_nixl._grid import Grid, granule_of, region_table
from kvbridge_nixl._peer import PeerState, PreparedPair

__all__ = ["RequestBuilder", "indices", "strided", "I32", "I64"]

log = logging.getLogger("kvbridge.transport.nixl")

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
#: prepared grids kept per side (least recently used are retired)
MAX_GRIDS = 4
_AUTO_GRANULE_CAP = 64 << 10
_AUTO_GRANULE_MIN = 1 << 10
#: the block path posts coalesced ranges directly when runs <= blocks / this
_DIRECT_RUN_FACTOR = 4


def strided(layout: KVLayout) -> I64:
    """NIXL's compressed list over every block of every plane: rows (address, block bytes,
    device, stride, count); entry ``plane * num_blocks + block``."""
    t = layout.plane_table
    out = np.empty((t.shape[1], 5), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = t[0], t[2], layout.device
    out[:, 3], out[:, 4] = t[1], layout.num_blocks
    return out


def indices(planes: I64 | None, total: int, num_blocks: int, ids: I64, out: I32) -> I32:
    """Entries ``plane * num_blocks + id`` of a strided list, plane-major, as int32, written
    into ``out`` (at least planes × ids long); returns the used part."""
    first = np.arange(total, dtype=np.int32) if planes is None else planes.astype(np.int32)
    first *= np.int32(num_blocks)
    used = out[: first.size * ids.size].reshape(first.size, ids.size)
    np.add(first[:, None], ids.astype(np.int32)[None, :], out=used)
    return used.reshape(-1)


class RequestBuilder:
    """Mixin of :class:`~kvbridge_nixl.transport.NixlTransport` (see the module docstring); the
    transport's constructor sets every attribute declared here."""

    agent_name: str
    settings: NixlOptions
    stats: dict[str, int]
    _agent: Any
    _lock: threading.RLock
    _regions: list[tuple[int, int, int]]
    _mem_type: str | None
    _local_grids: OrderedDict[int, Any]
    _layout_dlists: OrderedDict[LayoutKey, Any]
    _scratch: I32
    _retired_dlists: list[Any]
    _inflight: dict[int, tuple[TransferHandle, PeerState]]
    _ahead: int

    def _prep(self, agent: str, layout: KVLayout, mem: str) -> Any:
        t0 = time.perf_counter()
        handle = self._agent.prep_xfer_dlist(agent, strided(layout), mem)
        self.stats["block_dlists"] += 1
        log.debug("nixl: prepared %d planes x %d blocks for %s in %.2f ms", len(layout.planes),
                  layout.num_blocks, agent, (time.perf_counter() - t0) * 1e3)
        return handle

    def _block_args(self, pair: BlockPair, req: BlockRequest) -> tuple[bool, I64 | I32,
                                                                        I64 | I32]:
        """What NIXL gets for ``req`` (kvbridge's own per-transfer work, no NIXL call; the
        lock is held): ``(True, ranges, ranges)`` — the coalesced ``(N, 3)`` ranges, when the
        ids form long runs — or ``(False, indices, indices)`` into the prepared lists.

        The index arrays live in one scratch buffer reused by every transfer: NIXL resolves
        the indices inside ``make_prepped_xfer`` and keeps none of them, and fresh arrays of
        this size fault their pages in again after NIXL's own frees (~240 faults per scattered
        16k-token request, measured)."""
        if req.runs * _DIRECT_RUN_FACTOR <= req.blocks:
            loc, rem = req.descriptors(pair)
            return True, loc, rem
        total = len(pair.local.planes)
        n = req.entries  # one index per plane and id, runs or not
        if self._scratch.size < 2 * n:
            self._scratch = np.empty(2 * n, dtype=np.int32)
        at = 0
        for p in req.parts:
            m = p.plane_count * p.blocks
            indices(p.planes, total, pair.local.num_blocks, p.local_ids,
                     self._scratch[at:at + m])
            indices(p.planes, total, pair.remote.num_blocks, p.remote_ids,
                     self._scratch[n + at:n + at + m])
            at += m
        return False, self._scratch[:n], self._scratch[n:2 * n]

    def _make_blocks(self, op: Op, pair: BlockPair, args: tuple[bool, I64 | I32, I64 | I32],
                     notif: bytes) -> Any:
        """The NIXL request for :meth:`_block_args`' output (native calls only; lock held)."""
        prep: PreparedPair = pair.native
        direct, local, remote = args
        if direct:
            self.stats["block_direct"] += 1
            return self._agent.initialize_xfer(
                op.value, self._agent.get_xfer_descs(local, self._mem_type or "DRAM"),
                self._agent.get_xfer_descs(remote, prep.peer.mem_type), pair.peer, notif)
        self.stats["block_prepped"] += 1
        return self._agent.make_prepped_xfer(op.value, prep.local, local, prep.remote, remote,
                                             notif)

    def _make_prepped(
        self, op: Op, peer: PeerState, local: DescriptorArray, remote: DescriptorArray, notif: bytes
    ) -> Any:
        """A transfer over prepared grids, or ``None`` if the descriptors do not fit one."""
        granule = self._pick_granule(peer, local, remote)
        if granule is None:
            return None
        lgrid_h, lgrid = self._grid(self._local_grids, "NIXL_INIT_AGENT", self._regions,
                                    self._mem_type or "DRAM", granule)
        rgrid_h, rgrid = self._grid(peer.grids, peer.name, peer.regions, peer.mem_type, granule)
        lidx, ridx = lgrid.indices(local), rgrid.indices(remote)
        if lidx is None or ridx is None or lidx.size != ridx.size:
            return None
        return self._agent.make_prepped_xfer(op.value, lgrid_h, lidx, rgrid_h, ridx, notif)

    def _pick_granule(
        self, peer: PeerState, local: DescriptorArray, remote: DescriptorArray
    ) -> int | None:
        if self.settings.granule:
            g = self.settings.granule
        else:
            common = np.gcd(granule_of(local, region_table(self._regions)),
                            granule_of(remote, region_table(peer.regions)))
            if common <= 0:
                return None
            cached = [k for k in peer.grids if common % k == 0 and k in self._local_grids]
            if cached:
                return max(cached)
            g = min(int(common) & -int(common), _AUTO_GRANULE_CAP)  # largest power of two
            if g < _AUTO_GRANULE_MIN:
                return None
        limit = self.settings.max_prepped_entries
        if Grid.entries_for(self._regions, g) > limit or Grid.entries_for(peer.regions, g) > limit:
            return None
        return g

    def _grid(
        self, cache: OrderedDict[int, Any], agent: str, regions: list[tuple[int, int, int]],
        mem: str, granule: int,
    ) -> tuple[Any, Grid]:
        """The prepared dlist handle and grid for ``granule`` (LRU of :data:`MAX_GRIDS`)."""
        hit = cache.get(granule)
        if hit is not None:
            cache.move_to_end(granule)
            return hit  # type: ignore[no-any-return]
        grid = Grid(regions, granule)
        t0 = time.perf_counter()
        handle = self._agent.prep_xfer_dlist(agent, grid.descriptors(), mem)
        self.stats["grids"] += 1
        log.debug("nixl: prepared %d-entry grid (granule %d) for %s in %.1f ms", grid.size,
                  granule, agent, (time.perf_counter() - t0) * 1e3)
        cache[granule] = (handle, grid)
        while len(cache) > MAX_GRIDS:
            _, (old, _) = cache.popitem(last=False)
            self._retired_dlists.append(old)
        return handle, grid

    def _retire(self, cache: OrderedDict[int, Any]) -> None:
        """Drop cached grids; their NIXL handles are released once nothing is in flight."""
        self._retired_dlists.extend(h for h, _ in cache.values())
        cache.clear()
        self._release_retired()

    def _release_retired(self) -> None:
        if self._inflight or self._ahead or not self._retired_dlists:
            return
        for h in self._retired_dlists:
            try:
                self._agent.release_dlist_handle(h)
            except Exception as exc:  # noqa: BLE001 - best effort, logged
                log.warning("nixl: releasing a prepared descriptor list failed: %r", exc)
        self._retired_dlists.clear()

"""What the scheduler side tells each worker rank about offload, once per step (pickled by vLLM).

Keys here are *scheduler keys* (:func:`kvbridge.offload.keys.block_keys`); each rank turns them
into its own tier keys. Every lookup ends with exactly one :class:`LoadOrder` or one release.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LookupOrder", "LoadOrder", "StoreOrder", "OffloadPlan"]


@dataclass(frozen=True)
class LookupOrder:
    """Find the longest prefix of ``keys`` in the tiers and stage it (verified) in host memory."""

    lookup_id: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class LoadOrder:
    """Copy staged chunks ``[first, first + len(block_ids))`` of a lookup into ``block_ids``
    before this step's forward, then drop the lookup's staging."""

    lookup_id: str
    first: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoreOrder:
    """Copy ``block_ids`` (a finished request's full prompt blocks) out and store them under
    ``keys``; the request's blocks stay held until the copy is done (``finished_sending``)."""

    req_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    #: vLLM's block hashes of the same blocks, which the tiers' KV events name (empty when
    #: KV events are off)
    hashes: tuple[bytes, ...] = ()


@dataclass
class OffloadPlan:
    lookups: list[LookupOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    stores: list[StoreOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.lookups or self.loads or self.releases or self.stores)

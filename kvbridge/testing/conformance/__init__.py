"""The conformance suites: pytest classes a backend's or a tier's test module subclasses.

* :class:`TransportConformance` (:mod:`.transport`) — the :class:`~kvbridge.transport.Transport`
  contract against a real peer, with :class:`BlockConformance` (:mod:`.blocks`, the block path)
  and :class:`HostilePeerConformance` (:mod:`.hostile_peer`, relayed, forged and stale peers
  refused) mixed in.
* :class:`TierConformance` (:mod:`.tier`) — the :class:`~kvbridge.offload.tier.Tier` contract.
* :class:`LookupBufferConformance` (:mod:`.lookup`) — the :class:`~kvbridge.lookup.LookupBuffer`
  contract, as each home of a buffer builds it.

Each module's docstring says how to subclass it and what it checks.
"""

from __future__ import annotations

from kvbridge.testing.conformance.blocks import BlockConformance
from kvbridge.testing.conformance.hostile_peer import HostilePeerConformance
from kvbridge.testing.conformance.lookup import FakeClock, LookupBufferConformance
from kvbridge.testing.conformance.tier import CHUNK, TierConformance, chunk_of
from kvbridge.testing.conformance.transport import BLOCK_SIZES, Pair, TransportConformance

__all__ = [
    "BLOCK_SIZES",
    "CHUNK",
    "BlockConformance",
    "FakeClock",
    "HostilePeerConformance",
    "LookupBufferConformance",
    "Pair",
    "TierConformance",
    "TransportConformance",
    "chunk_of",
]

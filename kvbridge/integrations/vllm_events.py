"""The offload tiers' KV events, in vLLM's format, published by vLLM's own publisher.

With ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` vLLM
publishes ``BlockStored`` / ``BlockRemoved`` events for its own KV cache (medium ``GPU``, or the
CPU cache of a CPU engine). :class:`TierEventBook` adds the tiers' (medium ``CPU`` for ``dram``,
``STORAGE`` for disks and remote stores; ``ownership`` the tier's name), with vLLM's block hashes,
token ids and extra keys, so Dynamo's KV router and llm-d's precise prefix-cache scorer count
kvbridge tier hits with the same hashes as vLLM's own blocks:

1. when a request's blocks are stored (``request_finished``), :meth:`TierEventBook.remember`
   keeps what a ``BlockStored`` needs of each block, by its vLLM block hash (at most
   :data:`MAX_BLOCKS`, least recently remembered forgotten first), and returns the hashes the
   store order carries to the workers;
2. rank 0's manager streams what each tier stored and evicted (:mod:`kvbridge.offload.events`);
   the worker sends it with its per-step metadata;
3. :meth:`TierEventBook.add` turns it into vLLM's event classes; the connector's
   ``take_events`` hands them to vLLM's scheduler, which publishes them with its own.

A stored block whose details were forgotten is not published (counted
``kv_events_unknown``); a removal needs only the hash. The scheduler thread owns the book.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

from kvbridge.lookup import LookupBuffer, Overflow
from kvbridge.offload.events import TierEvent

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["TierEventBook", "MAX_BLOCKS"]

#: blocks whose event details the scheduler remembers (their last stores)
MAX_BLOCKS = 1 << 17


@dataclass(frozen=True)
class _Block:
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None
    lora_name: str | None


class TierEventBook:
    """See the module docstring."""

    def __init__(self, block_size: int, capacity: int = MAX_BLOCKS) -> None:
        self.block_size = block_size
        self._blocks: LookupBuffer[bytes, _Block] = LookupBuffer(
            "kv events", capacity, overflow=Overflow.EVICT_LRU)
        self._out: list[KVCacheEvent] = []
        self.stats: Counter[str] = Counter()

    def remember(self, request: Request, n: int) -> tuple[bytes, ...]:
        """The vLLM block hashes of ``request``'s first ``n`` blocks (fewer if vLLM hashed
        fewer), each remembered for its ``BlockStored``."""
        hashes = [bytes(h) for h in list(getattr(request, "block_hashes", ()) or ())[:n]]
        tokens = request.prompt_token_ids or []
        lora = request.lora_request.name if getattr(request, "lora_request", None) else None
        bs = self.block_size
        for i, h in enumerate(hashes):
            try:
                extra, _ = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)
            except Exception:  # noqa: BLE001 - a request shape vLLM's helper does not know
                extra = None
            if not self._blocks.touch((h,)):
                self._blocks.insert(h, _Block(hashes[i - 1] if i else None,
                                              tuple(tokens[i * bs:(i + 1) * bs]), extra, lora))
        return tuple(hashes)

    def add(self, events: list[TierEvent]) -> None:
        """Turn the workers' tier events into vLLM's (see :meth:`take`)."""
        before = len(self._out)
        for e in events:
            if e.kind == "removed":
                self._out.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in e.hashes],
                    medium=e.medium, ownership=e.tier))
                continue
            for h in e.hashes:
                block = self._blocks.get(h)
                if block is None:
                    self.stats["kv_events_unknown"] += 1
                    continue
                self._out.append(BlockStored(
                    block_hashes=[maybe_convert_block_hash(h)],
                    parent_block_hash=(None if block.parent is None
                                       else maybe_convert_block_hash(block.parent)),
                    token_ids=list(block.token_ids), block_size=self.block_size,
                    lora_id=None, medium=e.medium, lora_name=block.lora_name,
                    extra_keys=to_event_extra_keys([block.extra_keys]),
                    ownership=e.tier))
        self.stats["kv_events_published"] += len(self._out) - before

    def take(self) -> list[KVCacheEvent]:
        """The events made since the last call (vLLM publishes them)."""
        out, self._out = self._out, []
        return out

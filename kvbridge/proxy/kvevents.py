"""What one engine holds, from its KV events: the proxy's precise prefix index (pure, no I/O).

vLLM publishes, with ``--kv-events-config`` (publisher ``zmq``), a batch of events per engine
step: ``BlockStored`` (block hashes, their parent's hash, the blocks' token ids, the block size,
the medium, extra keys), ``BlockRemoved`` (hashes, medium) and ``AllBlocksCleared``. kvbridge's
connector adds its offload tiers' (medium ``CPU`` for ``dram``, ``STORAGE`` for disks and remote
stores). :class:`EventIndex` turns one engine's batches into the proxy's own unit names
(:func:`kvbridge.proxy.prefixes.chain_tokens`, keyed by the engine's model name and the block's
``cache_salt``), so that :meth:`EventIndex.held` answers, for a request's
:class:`~kvbridge.proxy.prefixes.Prompt`, how many of its leading tokens the engine holds and on
which medium — what the engine would really find, not what the proxy remembers sending.

Rules (each skip is counted in :attr:`EventIndex.stats`, never raised):

- a block is named from its parent's chain: a block whose parent the index does not know (an
  event was missed, or the parent was forgotten) is skipped, and so are its descendants in the
  same event (``unknown_parent``);
- the salt: vLLM adds the request's ``cache_salt`` to the extra keys of a prompt's *first*
  block only (``generate_block_hash_extra_keys``: ``start_token_idx == 0``), and publishes it
  untagged (``to_event_extra_keys``: the bare string). A root block's extra keys must be absent
  or exactly one string (its salt); any other block's must be absent; LoRA (``lora_name`` or
  ``lora_id``), multimodal or prompt-embeds keys make the block unmatched by any proxy prompt,
  so it is skipped (``extra_keys``, ``lora``); the salt of a child is its root's;
- only whole :data:`~kvbridge.proxy.prefixes.UNIT_TOKENS`-token units count: a block size that
  is not a multiple carries its remainder to its children;
- media: ``GPU`` (also a missing medium), ``CPU``, ``STORAGE``; :meth:`EventIndex.held` counts
  a unit once, under the fastest medium that holds it. ``BlockRemoved`` takes that medium off
  the block (a block no medium holds stays known, for its children's names, until evicted);
  ``AllBlocksCleared`` takes ``GPU`` off every block;
- events of a KV-cache group other than the first (``group_idx`` > 0) are skipped
  (``other_group``): the first group's blocks are the prefix;
- hostile input: a payload is decoded into this module's own structs (a mirror of vLLM's wire
  format; the proxy never imports vLLM) with bounds on every list; a payload that does not
  decode is dropped whole (``malformed_batches``), an event that contradicts itself (token
  count ≠ hashes × block size, a block size outside [1, :data:`MAX_BLOCK_SIZE`]) is dropped
  (``malformed_events``).

Bounded: at most ``capacity`` blocks and ``8 × capacity`` unit names per engine (least recently
stored forgotten first: large blocks hold more units). Not thread-safe: the proxy's event loop
owns it.
"""

from __future__ import annotations

import collections
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from kvbridge.proxy.prefixes import UNIT_TOKENS, Prompt, chain_tokens, unit_key

__all__ = ["Batch", "DEFAULT_BLOCKS", "MAX_BLOCK_SIZE", "MAX_PAYLOAD", "MEDIA", "EventIndex"]

MEDIA = ("GPU", "CPU", "STORAGE")
"""Media fastest first; :meth:`EventIndex.held` answers under these names."""
DEFAULT_BLOCKS = 1 << 16
"""Blocks remembered per engine unless told otherwise (2M tokens at block size 32)."""
MAX_BLOCK_SIZE = 4096
"""Largest block size an event may name."""
MAX_PAYLOAD = 8 << 20
"""Largest batch payload decoded (bytes); a longer one is dropped."""
_MAX_EVENTS = 1 << 16
_MAX_BLOCKS_PER_EVENT = 1 << 16
_MAX_TOKENS_PER_EVENT = 1 << 20
_BIT = {m: 1 << i for i, m in enumerate(MEDIA)}

# -- vLLM's wire format (vllm/distributed/kv_events.py), mirrored with bounds --------------------

_Hash = Annotated[bytes, msgspec.Meta(max_length=64)] | int
_Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_Str = Annotated[str, msgspec.Meta(max_length=1024)]


class _Stored(msgspec.Struct, tag="BlockStored", frozen=True):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=_MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: _Hash | None = None
    token_ids: Annotated[list[_Token], msgspec.Meta(max_length=_MAX_TOKENS_PER_EVENT)] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: _Str | None = None
    lora_name: _Str | None = None
    extra_keys: Annotated[list[list[object] | None],
                          msgspec.Meta(max_length=_MAX_BLOCKS_PER_EVENT)] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", frozen=True):
    block_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=_MAX_BLOCKS_PER_EVENT)]
    medium: _Str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True):
    pass


class Batch(msgspec.Struct, array_like=True, frozen=True):
    """One published batch (vLLM's ``KVEventBatch``), as :meth:`EventIndex.decode` reads it."""

    ts: float
    events: Annotated[list[_Stored | _Removed | _Cleared], msgspec.Meta(max_length=_MAX_EVENTS)]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(Batch)


@dataclass
class _Block:
    key: bytes
    """The root's unit key (model and salt)."""
    tail: bytes
    """The name of the last whole unit up to this block's end (b"": none yet)."""
    carry: tuple[int, ...]
    """Token ids after that unit (fewer than a unit), carried to the children."""
    units: tuple[bytes, ...]
    """The units this block completes."""
    media: int = 0
    """Bit set of :data:`MEDIA` holding it."""


@dataclass
class EventIndex:
    """One engine's blocks, from its KV events (module docstring). ``model``: the model name
    requests name (its units are keyed by it)."""

    model: str
    capacity: int = DEFAULT_BLOCKS
    stats: Counter[str] = field(default_factory=Counter)
    _blocks: collections.OrderedDict[bytes | int, _Block] = field(
        default_factory=collections.OrderedDict)
    _units: dict[bytes, bytes | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    # -- input ------------------------------------------------------------------------------

    def apply(self, payload: bytes) -> bool:
        """Apply one published batch (msgpack); False, and nothing changed, when it is not one.
        Never raises."""
        batch = self.decode(payload)
        if batch is None:
            return False
        self.apply_batch(batch)
        return True

    def decode(self, payload: bytes) -> Batch | None:
        """One published batch, decoded (None, counted, when it is not one). Never raises."""
        if len(payload) > MAX_PAYLOAD:
            self.stats["oversized_batches"] += 1
            return None
        try:
            return _DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError,
                RecursionError, OverflowError):
            self.stats["malformed_batches"] += 1
            return None

    def apply_batch(self, batch: Batch) -> None:
        """Apply a batch :meth:`decode` returned."""
        self.stats["batches"] += 1
        for event in batch.events:
            if isinstance(event, _Stored):
                self._stored(event)
            elif isinstance(event, _Removed):
                self._removed(event)
            else:
                self.clear_medium("GPU")

    def _stored(self, e: _Stored) -> None:
        n = len(e.block_hashes)
        if (not 1 <= e.block_size <= MAX_BLOCK_SIZE or len(e.token_ids) != n * e.block_size
                or (e.extra_keys is not None and len(e.extra_keys) not in (0, n))):
            self.stats["malformed_events"] += 1
            return
        bit = _BIT.get(e.medium or "GPU")
        if bit is None:
            self.stats["unknown_medium"] += n
            return
        if e.group_idx:
            self.stats["other_group"] += n
            return
        if e.lora_name is not None or e.lora_id:
            self.stats["lora"] += n
            return
        parent = None if e.parent_block_hash is None else self._blocks.get(e.parent_block_hash)
        if e.parent_block_hash is not None and parent is None:
            self.stats["unknown_parent"] += n
            return
        for i, h in enumerate(e.block_hashes):
            extra = e.extra_keys[i] if e.extra_keys else None
            carry: tuple[int, ...]
            if parent is None:  # the prompt's first block: its extra keys are its salt
                if extra and (len(extra) != 1 or not isinstance(extra[0], str)):
                    self.stats["extra_keys"] += n - i
                    return
                salt = extra[0] if extra else None
                key = unit_key(self.model, salt if isinstance(salt, str) else None)
                tail, carry = b"", ()
            else:
                if extra:
                    self.stats["extra_keys"] += n - i
                    return
                key, tail, carry = parent.key, parent.tail, parent.carry
            own = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
            tokens: tuple[int, ...] = (*carry, *own)
            whole = len(tokens) // UNIT_TOKENS * UNIT_TOKENS
            units = chain_tokens(tokens[:whole], key, tail)
            block = self._blocks.get(h)
            if block is None or block.key != key:
                if block is not None:
                    self._drop_units(h, block)
                block = _Block(key, units[-1] if units else tail, tokens[whole:], units)
                self._blocks[h] = block
                for u in units:
                    self._units[u] = h
            block.media |= bit
            self._blocks.move_to_end(h)
            self.stats["blocks_stored"] += 1
            parent = block
        while len(self._blocks) > self.capacity or len(self._units) > self.capacity * 8:
            old, gone = self._blocks.popitem(last=False)
            self._drop_units(old, gone)
            self.stats["blocks_evicted"] += 1

    def _drop_units(self, h: bytes | int, block: _Block) -> None:
        for u in block.units:
            if self._units.get(u) == h:
                del self._units[u]

    def _removed(self, e: _Removed) -> None:
        bit = _BIT.get(e.medium or "GPU")
        if bit is None:
            self.stats["unknown_medium"] += len(e.block_hashes)
            return
        if e.group_idx:
            return
        for h in e.block_hashes:
            block = self._blocks.get(h)
            if block is not None and block.media & bit:
                block.media &= ~bit
                self.stats["blocks_removed"] += 1

    def clear_medium(self, medium: str) -> None:
        """No block is held on ``medium`` any more (``AllBlocksCleared``: ``GPU``)."""
        bit = _BIT[medium]
        for block in self._blocks.values():
            block.media &= ~bit
        self.stats["cleared"] += 1

    # -- output -----------------------------------------------------------------------------

    def held(self, prompt: Prompt) -> dict[str, float]:
        """Tokens of ``prompt``'s leading units the engine holds, per medium (each unit once,
        under the fastest medium that holds it; up to the first unit none holds), capped at the
        prompt's tokens less one (vLLM always computes the last). Only a token-id prompt can
        match (a text prompt's units are of bytes): any other is held nowhere."""
        out = dict.fromkeys(MEDIA, 0.0)
        if not prompt.token_ids:
            return out
        room = max(0.0, prompt.tokens - 1)
        for name in prompt.units:
            h = self._units.get(name)
            block = None if h is None else self._blocks.get(h)
            if block is None or not block.media or room <= 0:
                break
            medium = MEDIA[(block.media & -block.media).bit_length() - 1]
            take = min(prompt.unit_tokens, room)
            out[medium] += take
            room -= take
        return out

    def held_units(self, names: Sequence[bytes]) -> int:
        """How many of ``names`` (leading) any medium holds (tests, admin)."""
        n = 0
        for name in names:
            h = self._units.get(name)
            block = None if h is None else self._blocks.get(h)
            if block is None or not block.media:
                break
            n += 1
        return n

    def size(self) -> int:
        """Blocks known (held on some medium or not)."""
        return len(self._blocks)

"""The :class:`Tier` contract: where offloaded KV chunks live (host memory, disk, a remote store).

A *chunk* is the KV of one block on one worker rank, across all its layers: exactly
``TierContext.chunk_bytes`` bytes, named by a hex key (:func:`kvbridge.offload.keys.tier_key`).
Tiers store and return whole chunks; they never see vLLM, block ids or addresses.

Contract every tier implements (the conformance suite :mod:`kvbridge.testing.conformance.tier`
checks it):

- **Blocking.** Every method may block (disk and network I/O). The manager calls them from its
  own I/O thread, one call at a time, except for tiers that set ``blocking = False`` (their
  methods return in microseconds and are thread-safe), which it may also call from the engine's
  thread. No method is called after :meth:`Tier.close`.
- **All or nothing per chunk.** A chunk is either stored whole or absent: a crash, a full disk
  or a failed network call must never leave a short or mixed chunk that a later ``load``
  returns. ``load`` returns only chunks that are complete and verified (a tier that can be
  corrupted behind its back checks a checksum; one that others may write to checks a MAC keyed
  by :attr:`TierContext.secret`); a corrupted or truncated chunk is a *miss*, logged once at
  WARNING and removed. A chunk the tier cannot prove it wrote (its MAC is keyed by another
  secret: another fleet's, on a shared store) is a miss too, never KV, and is left in place.
- **Partial failure.** ``contains`` and ``load`` work on a key sequence and stop at the first
  miss (a prefix is only useful up to its first hole). ``store`` stores what it can and returns
  the keys it stored; ``evict`` of an absent key is not an error. Exceptions are allowed (the
  manager catches them, logs the tier's name and counts a miss or a failed store) but a tier
  should prefer returning less.
- **Capacity.** With ``managed = True`` the manager keeps the tier's LRU index and calls
  ``evict`` to stay under ``capacity_bytes``; ``entries()`` lets a persistent tier's index be
  rebuilt after a restart. A tier whose server evicts on its own (a shared remote store) sets
  ``managed = False`` and answers ``contains`` truthfully instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbridge.errors import ConfigError, KVBridgeError

__all__ = ["Tier", "TierContext", "TierError"]


class TierError(KVBridgeError):
    """A tier cannot work at all (bad options, unreachable server); names the tier."""


@dataclass(frozen=True)
class TierContext:
    """What a tier is built with."""

    #: the tier's name in the configuration (``dram``, ``disk``, ``lmcache``, …)
    name: str
    #: size of every chunk (one block of one rank, all layers)
    chunk_bytes: int
    #: identifies the model + KV layout family; shared tiers may prefix their keys with it
    namespace: str
    #: the tier's options from the ``offload`` configuration (``capacity_bytes``, ``path``, …)
    options: Mapping[str, Any] = field(default_factory=dict)
    #: the engine's secret (:func:`kvbridge.trust.resolve`), for tiers that authenticate what
    #: they store (the ``disk`` tier's per-chunk MAC); None: the engine runs without one
    secret: bytes | None = field(default=None, repr=False)

    def option(self, key: str, default: Any, kind: Callable[[Any], Any]) -> Any:
        """``options[key]`` converted to ``kind``; a bad value is a :class:`ConfigError`."""
        raw = self.options.get(key, default)
        try:
            return kind(raw) if raw is not None else None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"offload tier {self.name!r}: bad value for {key}: {raw!r} "
                              f"({exc})") from exc


class Tier(ABC):
    """See the module docstring. Subclasses take one argument, the :class:`TierContext`."""

    #: the manager keeps the LRU index and enforces ``capacity_bytes`` (see module docstring)
    managed: ClassVar[bool] = True
    #: methods are fast and thread-safe (the engine thread may call them directly)
    blocking: ClassVar[bool] = True
    #: default capacity when the configuration names none (bytes)
    default_capacity: ClassVar[int] = 1 << 30
    #: the storage medium its KV events name (vLLM's ``BlockStored.medium``: ``"CPU"`` for
    #: host memory, ``"STORAGE"`` for disks and remote stores)
    medium: ClassVar[str] = "STORAGE"

    def __init__(self, ctx: TierContext) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.capacity_bytes: int = int(ctx.option("capacity_bytes", self.default_capacity, int))
        if self.capacity_bytes < ctx.chunk_bytes:
            raise ConfigError(f"offload tier {ctx.name!r}: capacity_bytes "
                              f"({self.capacity_bytes}) is smaller than one chunk "
                              f"({ctx.chunk_bytes} bytes)")

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` this tier holds (stops at the first absent one)."""

    @abstractmethod
    def load(self, keys: Sequence[str]) -> list[bytes]:
        """The leading chunks of ``keys`` that are present and verified, in order.

        Stops at the first miss; a corrupted or truncated chunk counts as a miss (WARNING,
        removed). Every returned object is exactly ``chunk_bytes`` long and owned by the caller.
        """

    @abstractmethod
    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        """Store ``(key, chunk)`` pairs; return the keys stored whole (the others are absent)."""

    @abstractmethod
    def evict(self, keys: Sequence[str]) -> None:
        """Remove ``keys`` (absent ones are ignored)."""

    def entries(self) -> list[tuple[str, int]]:
        """``(key, bytes)`` of what survives from a previous run, oldest first (default: none)."""
        return []

    def describe(self) -> str:
        """One line for logs and ``kvbridge config``."""
        return f"{self.name} (capacity {self.capacity_bytes} bytes)"

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; idempotent."""


def check_chunk(ctx: TierContext, key: str, data: bytes) -> None:
    """Raise :class:`ValueError` unless ``data`` is one chunk (shared by the built-in tiers)."""
    if len(data) != ctx.chunk_bytes:
        raise ValueError(f"chunk {key} is {len(data)} bytes, expected {ctx.chunk_bytes}")


def is_key(key: str) -> bool:
    """A well-formed tier key (hex, bounded): what may become a file or object name."""
    return 8 <= len(key) <= 128 and all(c in "0123456789abcdef" for c in key)



"""Content keys for KV blocks: a chained hash over full token blocks.

Key ``i`` names the KV of block ``i`` of a prompt *given everything before it*: it hashes key
``i-1`` and the block's token ids, and key ``-1`` (the seed) hashes what makes KV comparable at
all: the model identity and the KV geometry. Two engines that compute the same key hold the same
bytes for that block; a different model, dtype, block size, head layout or prefix gives a
different key. Keys are blake2b digests of explicit little-endian bytes — never Python's
``hash()``, which is salted per process — so they are equal across processes, hosts and restarts.

Only *full* blocks get keys: a partial last block is never stored or looked up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["seed_key", "salted", "block_keys", "tier_key", "namespace_of", "KEY_BYTES"]

#: digest size of a key (hex strings are twice as long)
KEY_BYTES = 16


def seed_key(identity: Mapping[str, str], *, sealed: bool = True) -> bytes:
    """The chain's seed from ``identity`` (model, dtype, KV geometry…; order-independent) and
    whether the tiers' chunks are ``sealed`` (:mod:`kvbridge.offload.seal`; the ``checksum``
    setting)."""
    blob = json.dumps(dict(identity), sort_keys=True, separators=(",", ":")).encode()
    # v2: chunks sealed with XXH3-128 (kvbridge.offload.seal); v1's BLAKE3-sealed chunks are
    # other keys, so misses, never digest mismatches. Unsealed chunks (no digest) are other
    # keys again: an engine that seals never reads one as a sealed chunk, nor the reverse
    version = b"kvbridge-kv-v2\0" if sealed else b"kvbridge-kv-v2-unsealed\0"
    return hashlib.blake2b(version + blob, digest_size=KEY_BYTES).digest()


def salted(seed: bytes, salt: str | None) -> bytes:
    """The chain's seed for a request with vLLM's ``cache_salt`` ``salt``: requests under
    different salts (tenants) never share a key, so never a tier entry. No salt: ``seed``."""
    if not salt:
        return seed
    return hashlib.blake2b(seed + salt.encode("utf-8", "surrogatepass"), digest_size=KEY_BYTES,
                           person=b"kvbridge-salt").digest()


def block_keys(seed: bytes, tokens: Sequence[int], block_size: int,
               limit: int | None = None) -> list[str]:
    """Hex keys of the full blocks of ``tokens`` (at most ``limit`` of them), in order.

    Pure and deterministic; ``O(len(tokens))``. Token ids must fit in 32 bits (vLLM's do).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, max(0, limit))
    if n == 0:
        return []
    arr = np.asarray(tokens[: n * block_size], dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 1 << 32):
        raise ValueError("token ids must be in [0, 2**32)")
    raw = arr.astype("<u4").tobytes()
    step = block_size * 4
    keys: list[str] = []
    prev = seed
    for i in range(n):
        prev = hashlib.blake2b(prev + raw[i * step:(i + 1) * step],
                               digest_size=KEY_BYTES).digest()
        keys.append(prev.hex())
    return keys


def tier_key(key: str, layout_fingerprint: str, rank: int, tp_size: int) -> str:
    """The name one worker rank stores ``key`` under: its shard of the block, for its layout."""
    blob = f"{key}|{layout_fingerprint}|{rank}/{tp_size}".encode()
    return hashlib.blake2b(blob, digest_size=KEY_BYTES).hexdigest()


def namespace_of(seed: bytes, layout_fingerprint: str) -> str:
    """A directory/object-name prefix for one model + KV layout (hex, filesystem-safe)."""
    return hashlib.blake2b(seed + layout_fingerprint.encode(), digest_size=KEY_BYTES).hexdigest()

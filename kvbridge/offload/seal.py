"""One digest per chunk, stored with it in every tier and checked wherever it is loaded.

A tier returns what it was given or reports a miss — unless something broke between: a bit
flipped in host memory, a remote store (Mooncake Store, LMCache) that returned another object's
bytes, a file changed behind the disk tier's back. Each tier checks what it can (the disk
tier's MAC, Mooncake Store's frame CRC); this check is the same for every tier, built in by the
manager: a chunk is stored *sealed* — the payload followed by :data:`DIGEST_BYTES` of XXH3-128
of it, computed once, by the engine that stored it (from its own KV cache) — and opened on every
load, in any engine. A chunk whose digest does not match is a miss from that block on (the
prompt is recomputed), counted and logged, never KV in use.

Tiers hold chunks of :func:`sealed_size` bytes, the size they are configured with.

XXH3-128 — the hash of the hand-off digests (:mod:`kvbridge.scheduling.digests`), so one
block's bytes are checked with one function from the engine that computed them to every engine
that loads them — runs at 15–40 GB/s per core, about four times BLAKE3 (the seals' hash before
format 2); docs/benchmarks.md has the measured cost. It is fed in pieces that keep the GIL
(:mod:`kvbridge.hashing`). Like BLAKE3 unkeyed, it catches changed
bytes, not a writer that recomputes the digest: a tier others may write to checks its own MAC.

**Unsealed** (``checksum: false``, which turns the hand-off digests off too): a chunk is its
payload alone — no digest computed on store, none checked on load, no 16-byte slot (the tiers
are configured with the payload size); only a chunk of the wrong length is still refused. The
cost, documented and tested: a byte changed in a tier is KV in use. Whether chunks are sealed
is part of the offload key seed (:func:`kvbridge.offload.keys.seed_key`), so an engine that
seals and one that does not never name the same chunk: sharing a tier, each misses the other's
entries — never reads an unsealed chunk as sealed (or the reverse), never counts one as a
mismatch.

Pure functions; thread-safe.
"""

from __future__ import annotations

import hmac

from kvbridge.hashing import xxh3_128
from kvbridge.offload.blocks import Payload

__all__ = ["DIGEST_BYTES", "seal", "unseal", "sealed_size", "open_prefix"]

#: bytes of the digest that follows each payload
DIGEST_BYTES = 16


def sealed_size(payload_bytes: int, sealed: bool = True) -> int:
    """The size of a chunk of ``payload_bytes`` as tiers hold it (unsealed: the payload)."""
    return payload_bytes + DIGEST_BYTES if sealed else payload_bytes


def _digest(payload: Payload) -> bytes:
    return xxh3_128(payload)


def seal(payload: bytes, sealed: bool = True) -> bytes:
    """``payload`` followed by its digest (unsealed: ``payload`` itself, not copied)."""
    return payload + _digest(payload) if sealed else payload


def unseal(chunk: bytes, payload_bytes: int) -> memoryview | None:
    """The payload of a sealed ``chunk`` of a ``payload_bytes`` payload, or None when its length
    or digest is not right. A read-only view into ``chunk``, not a copy: the load path copies
    each payload once, into the KV cache (a copy here cost a DRAM hit 8 % of its TTFT). Only an
    immutable ``bytes`` is viewed: a tier that breaks its contract and returns a buffer it may
    reuse (a ``bytearray``, a view) has it copied first, so what was checked cannot change."""
    if len(chunk) != payload_bytes + DIGEST_BYTES:
        return None
    if type(chunk) is not bytes:
        chunk = bytes(chunk)
    view = memoryview(chunk).toreadonly()
    if not hmac.compare_digest(_digest(view[:payload_bytes]), view[payload_bytes:]):
        return None
    return view[:payload_bytes]


def open_prefix(chunks: list[bytes], payload_bytes: int, sealed: bool = True
                ) -> tuple[list[bytes], list[Payload], bool]:
    """The sealed chunks of ``chunks`` up to the first that does not open, their payloads (views
    into the chunks, :func:`unseal`), and whether one did not (a load ends at the first bad
    chunk: a prefix is only useful up to its first hole). Unsealed: the chunks are their
    payloads, unchecked but for their length."""
    payloads: list[Payload] = []
    for chunk in chunks:
        payload = unseal(chunk, payload_bytes) if sealed else (
            chunk if len(chunk) == payload_bytes else None)
        if payload is None:
            return chunks[:len(payloads)], payloads, True
        payloads.append(payload)
    return chunks, payloads, False

"""The offload-tier conformance suite: a pytest class every tier's test module subclasses.

Usage::

    from kvbridge.testing.conformance import TierConformance

    class TestDiskConformance(TierConformance):
        tier_name = "disk"                             # entry-point name in kvbridge.tiers
        persistent = True                              # chunks survive close + reopen

        def options(self, tmp_path):                   # the tier's options for one test
            return {"path": str(tmp_path / "kv"), "capacity_bytes": 1 << 20}

        def corrupt(self, tier, key):                  # optional: damage a stored chunk
            ...; return True                           # (False/None = cannot: test skipped)

What is checked, on real tier instances (no mocks): round trips are byte-exact; ``contains``
and ``load`` stop at the first absent key; ``store`` returns what it stored, copies its input
(the caller may reuse its buffer) and refuses a chunk of the wrong size; overwrite; ``evict``
(absent keys included); many keys; namespaces do not see each other (two engines of different
models sharing one store); ``close`` twice; for persistent tiers, a reopened instance still
loads every chunk and lists it in ``entries()``; where the subclass can corrupt a chunk, the
corrupted chunk is a miss, never different bytes.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvbridge import registry
from kvbridge.offload.tier import Tier, TierContext

__all__ = ["TierConformance", "chunk_of"]

CHUNK = 4096 + 64  # not a power of two on purpose


def chunk_of(key: str, size: int = CHUNK) -> bytes:
    """Deterministic pseudo-random bytes for ``key`` (differs between keys)."""
    seed = key.encode()
    out = bytearray()
    counter = 0

    while len(out) < size:
        out += hashlib.blake2b(seed + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def _keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


class TierConformance:
    """See the module docstring."""

    tier_name: ClassVar[str] = ""
    persistent: ClassVar[bool] = False
    chunk_bytes: ClassVar[int] = CHUNK
    #: the engine secret the tiers are built with (:attr:`TierContext.secret`)
    secret: ClassVar[bytes | None] = None

    # -- hooks -----------------------------------------------------------------------------

    def options(self, tmp_path: Path) -> dict[str, Any]:
        """The tier's options for one test (default: a 64 MiB capacity)."""
        return {"capacity_bytes": 64 << 20}

    def corrupt(self, tier: Tier, key: str) -> bool | None:
        """Damage the stored chunk ``key`` behind the tier's back; False = not possible."""
        return False

    # -- fixtures ----------------------------------------------------------------------------

    @pytest.fixture
    def make(self, tmp_path: Path) -> Iterator[Any]:
        made: list[Tier] = []
        opts = self.options(tmp_path)
        default_ns = uuid.uuid4().hex

        def make(namespace: str | None = None, **extra: Any) -> Tier:
            cls = registry.load_tier_class(self.tier_name)
            ctx = TierContext(self.tier_name, self.chunk_bytes, namespace or default_ns,
                              {**opts, **extra}, secret=self.secret)
            tier: Tier = cls(ctx)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()

    @pytest.fixture
    def tier(self, make: Any) -> Tier:
        t: Tier = make()
        return t

    # -- tests -------------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_round_trip_is_byte_exact(self, tier: Tier) -> None:
        keys = _keys(5)
        assert sorted(tier.store([(k, chunk_of(k)) for k in keys])) == sorted(keys)
        assert tier.contains(keys) == 5
        got = tier.load(keys)
        assert len(got) == 5
        for k, data in zip(keys, got, strict=True):
            assert len(data) == self.chunk_bytes and bytes(data) == chunk_of(k)

    @pytest.mark.timeout(60)
    def test_contains_and_load_stop_at_first_absent_key(self, tier: Tier) -> None:
        a, hole, c = _keys(3)
        tier.store([(a, chunk_of(a)), (c, chunk_of(c))])
        assert tier.contains([a, hole, c]) == 1
        assert [bytes(x) for x in tier.load([a, hole, c])] == [chunk_of(a)]
        assert tier.contains([hole, a]) == 0
        assert tier.load([hole]) == []
        assert tier.contains([]) == 0 and tier.load([]) == []

    @pytest.mark.timeout(60)
    def test_store_copies_its_input(self, tier: Tier) -> None:
        (k,) = _keys(1)
        buf = bytearray(chunk_of(k))
        tier.store([(k, bytes(buf))])
        view = bytearray(chunk_of(k))
        tier.store([(k, memoryview(view).tobytes())])
        view[:16] = b"\xff" * 16
        buf[:16] = b"\xff" * 16
        assert bytes(tier.load([k])[0]) == chunk_of(k)

    @pytest.mark.timeout(60)
    def test_wrong_size_chunk_is_refused(self, tier: Tier) -> None:
        (k,) = _keys(1)
        try:
            stored = tier.store([(k, b"\0" * (self.chunk_bytes - 1))])
        except ValueError:
            stored = []
        assert k not in stored
        assert tier.contains([k]) == 0 and tier.load([k]) == []

    @pytest.mark.timeout(60)
    def test_overwrite_and_evict(self, tier: Tier) -> None:
        a, b, absent = _keys(3)
        tier.store([(a, chunk_of(b))])
        tier.store([(a, chunk_of(a)), (b, chunk_of(b))])
        assert bytes(tier.load([a])[0]) == chunk_of(a)
        tier.evict([a, absent])
        assert tier.contains([a]) == 0 and tier.load([a]) == []
        assert tier.contains([b]) == 1
        tier.evict([absent])

    @pytest.mark.timeout(120)
    def test_many_keys(self, tier: Tier) -> None:
        keys = _keys(200)
        assert len(tier.store([(k, chunk_of(k)) for k in keys])) == 200
        assert tier.contains(keys) == 200
        got = tier.load(keys)
        assert [bytes(g) for g in got] == [chunk_of(k) for k in keys]

    @pytest.mark.timeout(60)
    def test_namespaces_are_isolated(self, make: Any) -> None:
        one, two = make(uuid.uuid4().hex), make(uuid.uuid4().hex)
        (k,) = _keys(1)
        one.store([(k, chunk_of(k))])
        assert two.contains([k]) == 0 and two.load([k]) == []
        assert one.contains([k]) == 1

    @pytest.mark.timeout(60)
    def test_close_is_idempotent(self, make: Any) -> None:
        t = make()
        t.close()
        t.close()

    @pytest.mark.timeout(120)
    def test_survives_reopen(self, make: Any) -> None:
        if not self.persistent:
            pytest.skip(f"tier {self.tier_name!r} is not persistent")
        ns = uuid.uuid4().hex
        first = make(ns)
        keys = _keys(4)
        first.store([(k, chunk_of(k)) for k in keys])
        first.close()
        again = make(ns)
        assert again.contains(keys) == 4
        assert [bytes(x) for x in again.load(keys)] == [chunk_of(k) for k in keys]
        listed = [k for k, _ in again.entries()]
        assert set(keys) <= set(listed)

    @pytest.mark.timeout(60)
    def test_corrupted_chunk_is_a_miss_never_wrong_bytes(self, tier: Tier) -> None:
        a, b = _keys(2)
        tier.store([(a, chunk_of(a)), (b, chunk_of(b))])
        if not self.corrupt(tier, b):
            pytest.skip(f"the test cannot corrupt tier {self.tier_name!r}")
        got = tier.load([a, b])
        assert [bytes(x) for x in got] == [chunk_of(a)]
        assert tier.load([b]) == []



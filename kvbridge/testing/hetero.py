"""Engines of any TP size and block size as numpy KV caches, for heterogeneous-mapping tests.

:func:`engine` builds every rank of one engine: per layer a float32 cache in one of the
head-major interiors of :data:`KINDS` (``cpu``: vLLM's CPU layout, tensors ``(blocks, heads,
block_size, 2*head_dim)`` whose memory per head is K as ``[head_dim, N]`` then V as
``[N, head_dim]``, as its kernel writes them; ``split``: separate K and V planes of
``[heads, N, head_dim]``; ``outer``: ``[K|V, heads, N, head_dim]`` in one plane; ``opaque``: the
``cpu`` memory with a head split that does not say how a slab is ordered), all layers in one
flat byte buffer so a test can count how often every byte was written.

:func:`logical` reads a rank's K and V of one block as ``[local heads, N, head_dim]`` views
whatever the interior, and :func:`expected_decode` builds what a decode rank must hold after a
hand-off
from the prefill ranks' caches, token by token (the reference the descriptor math is checked
against). :func:`run` executes descriptor pairs with ``memmove`` (a READ: remote → local).

Test helpers only; no transport, no threads.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.config import Config
from kvbridge.heads import HeadSplit
from kvbridge.layout import DescriptorArray, KVLayout
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.mapping import Shape, sources
from kvbridge.testing.agents import LocalAgent
from kvbridge.transport import Transport

__all__ = ["Rank", "engine", "logical", "expected_decode", "run", "KINDS", "HeteroAgent"]

KINDS = ("cpu", "split", "outer", "opaque")
_INTERIOR = {"cpu": (1, 2, "dt"), "split": (1, 1, "t"), "outer": (2, 1, "tt"),
             "opaque": (1, 2, "")}  # (outer, inner, order)


@dataclass
class Rank:
    """One rank's cache: ``layers`` arrays carved out of ``buf``."""

    shape: Shape
    layout: KVLayout
    buf: np.ndarray[Any, np.dtype[np.uint8]]
    layers: list[np.ndarray[Any, np.dtype[np.float32]]]
    kind: str

    def written(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """A zeroed write counter, one per byte of ``buf``."""
        return np.zeros(self.buf.size, dtype=np.int64)


def engine(tp: int, block_size: int, *, total: int = 4, head_dim: int = 8, layers: int = 2,
           num_blocks: int = 24, kind: str = "cpu", seed: int = 0) -> list[Rank]:
    """Every rank of one engine, caches filled with distinct random values."""
    outer, inner, order = _INTERIOR[kind]
    ranks = []
    for r in range(tp):
        split = HeadSplit.for_rank(total, tp, r, head_dim, outer=outer, inner=inner, order=order,
                                   interior=f"test:{kind}")
        h = split.heads
        cpu = (num_blocks, h, block_size, 2 * head_dim)
        shape = {"cpu": cpu, "opaque": cpu, "split": (2, num_blocks, h, block_size, head_dim),
                 "outer": (num_blocks, 2, h, block_size, head_dim)}[kind]
        per = int(np.prod(shape))
        buf = np.zeros(per * 4 * layers, dtype=np.uint8)
        arrays = [buf[i * per * 4:(i + 1) * per * 4].view(np.float32).reshape(shape)
                  for i in range(layers)]
        rng = np.random.default_rng(seed * 1000 + r)
        for a in arrays:
            a[...] = rng.standard_normal(a.shape, dtype=np.float32)
        caches = {f"layer.{i}": a for i, a in enumerate(arrays)}
        layout = KVLayout.from_tensors(caches, num_blocks, block_size,
                                       block_dim=1 if kind == "split" else 0)
        ranks.append(Rank(Shape(tp, r, block_size, split), layout, buf, arrays, kind))
    return ranks


def logical(rank: Rank, layer: int, block: int) -> tuple[np.ndarray[Any, Any],
                                                         np.ndarray[Any, Any]]:
    """``(K, V)`` of ``block`` in ``layer``, each ``[local heads, N, head_dim]`` (views)."""
    a = rank.layers[layer]
    if rank.kind in ("cpu", "opaque"):
        h, n, two_d = a.shape[1:]
        d = two_d // 2
        flat = a[block].reshape(h, 2 * n * d)
        return (flat[:, :n * d].reshape(h, d, n).transpose(0, 2, 1),
                flat[:, n * d:].reshape(h, n, d))
    kv = a[:, block] if rank.kind == "split" else a[block]
    return kv[0], kv[1]


def expected_decode(prefill: list[Rank], p_ids: list[int], decode: Rank, d_ids: list[int],
                    first_token: int, num_tokens: int) -> list[np.ndarray[Any, Any]]:
    """What ``decode``'s layers must hold after receiving prompt tokens ``[first_token,
    num_tokens)`` (rounded up to the common chunk) from ``prefill`` (``p_ids``/``d_ids``: each
    side's block ids of the whole prompt)."""
    d_split = decode.shape.heads
    assert d_split is not None
    total = d_split.total_heads
    pb, db = prefill[0].shape.block_size, decode.shape.block_size
    g = int(np.gcd(pb, db))
    end = -(-num_tokens // g) * g
    out = [a.copy() for a in decode.layers]
    view = Rank(decode.shape, decode.layout, decode.buf, out, decode.kind)
    owner = {}
    for s in sources(total, len(prefill), decode.shape.tp_size, decode.shape.rank):
        for h in range(s.first_head, s.first_head + s.heads):
            owner[h] = s.rank
    for layer in range(len(out)):
        for t in range(first_token, end):
            dst = logical(view, layer, d_ids[t // db])
            for hl in range(d_split.heads):
                h = d_split.first_head + hl
                src_rank = prefill[owner[h]]
                ps = src_rank.shape.heads
                assert ps is not None
                src = logical(src_rank, layer, p_ids[t // pb])
                for part in (0, 1):
                    dst[part][hl, t % db] = src[part][h - ps.first_head, t % pb]
    return out


def run(local: DescriptorArray, remote: DescriptorArray,
        counts: tuple[Rank, np.ndarray[Any, Any]] | None = None) -> None:
    """Copy every ``remote`` range into its ``local`` range (a READ); with ``counts``
    ``(rank, counter)``, count each written byte of that rank's buffer."""
    assert local.shape == remote.shape
    for (la, ln, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        assert ln == rn
        ctypes.memmove(la, ra, ln)
        if counts is not None:
            rank, counter = counts
            start = la - rank.buf.ctypes.data
            assert 0 <= start and start + ln <= rank.buf.size, "write outside the rank's cache"
            counter[start:start + ln] += 1


class HeteroAgent(LocalAgent):
    """A transfer loop over ``rank``'s caches, with its head split (see the module
    docstring); the methods are :class:`~kvbridge.testing.agents.LocalAgent`'s."""

    def __init__(self, engine_id: str, rank: Rank, extra: dict[str, Any] | None = None, *,
                 transport: Transport | None = None) -> None:
        self.cache = rank
        self.caches = {f"layer.{i}": a for i, a in enumerate(rank.layers)}
        self.layout = rank.layout
        self.config = Config.load({"backend": "memory", **(extra or {})}, env={})
        self.loop = TransferLoop(self.config, engine_id, rank.layout, rank=rank.shape.rank,
                                 tp_size=rank.shape.tp_size, compat={"model": "test"},
                                 transport=transport, heads=rank.shape.heads)
        self.address = self.loop.control_address
        self.generation = self.loop.generation
        self._streams = {}

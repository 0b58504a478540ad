"""``lmcache``: an LMCache 0.5.6 engine as an offload tier (entry point in ``kvbridge.tiers``).

LMCache's vLLM connectors need CUDA (``torch.cuda.Stream``); its cache engine and its
``LocalCPUBackend`` / ``LocalDiskBackend`` do not. This tier drives a real ``LMCacheEngine``
through kvbridge's own CPU implementation of LMCache's ``GPUConnectorInterface``
(:class:`_ChunkConnector`), which copies between kvbridge chunks and LMCache memory objects.

Configuration. LMCache's own: ``LMCACHE_CONFIG_FILE``, else ``LMCACHE_*`` variables, with the
tier's options where kvbridge owns them (:mod:`kvbridge_lmcache.config`).

Mapping. One kvbridge chunk (one block of one rank, all layers: ``chunk_bytes`` bytes) is one
LMCache chunk of ``T`` tokens (LMCache's ``chunk_size``; ``CHUNK_TOKENS`` = 16 unless the
LMCache configuration sets it) whose "KV" is a ``uint8`` tensor of shape
``(1, 1, T, 1, ceil(chunk_bytes / T))`` — the chunk padded with zeros.
The token ids LMCache hashes are derived from the kvbridge key and the namespace
(blake2b → 16 16-bit ids, cut or padded with zeros to ``T``), so each chunk is its own
one-chunk "prompt" and two namespaces never meet. kvbridge already chains its keys over the
real prompt, so nothing is lost by LMCache not seeing the tokens. LMCache evicts on its own
(``managed = False``).

Blocking: calls run LMCache's engine synchronously (memory copies, disk writes through its
backends); the manager calls them from its I/O thread. Partial failure: ``load`` stops at the
first chunk LMCache does not return whole; ``store`` verifies with a lookup and returns only
the keys LMCache holds afterwards.

LMCache hashes token tuples with Python's ``hash()`` unless ``PYTHONHASHSEED`` is set: chunks
written to its disk backend are then found again only by a process with the same seed (a
WARNING says so at start-up when it is unset).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar

from kvbridge.errors import BackendUnavailable
from kvbridge.offload.tier import Tier, TierContext, TierError, check_chunk

from .config import DEFAULT_CHUNK_TOKENS, build_config

__all__ = ["LMCacheTier", "CHUNK_TOKENS"]

log = logging.getLogger("kvbridge.offload")

#: tokens per LMCache chunk unless the LMCache configuration sets ``chunk_size``
CHUNK_TOKENS = DEFAULT_CHUNK_TOKENS
_ids = itertools.count()
_build_lock = threading.Lock()
_DRAIN_S = 30.0  # the longest close() waits for LMCache's disk writes
#: the longest store (overwrite) and evict wait for disk writes LMCache already queued before
#: they clear a chunk: back-pressure while the disk is behind, bounded when it is stuck
_CLEAR_DRAIN_S = 2.0


def _import() -> tuple[Any, Any, Any, Any, Any]:
    try:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.gpu_connector import GPUConnectorInterface
        from lmcache.v1.metadata import LMCacheMetadata
    except ImportError as exc:
        raise BackendUnavailable(f"offload tier 'lmcache' cannot load: {exc} — install: pip "
                                 "install --no-deps lmcache==0.5.6 sortedcontainers aiofile "
                                 "(after the CPU torch; docs/backends/lmcache.md)") from exc
    return torch, LMCacheEngineBuilder, LMCacheEngineConfig, GPUConnectorInterface, \
        LMCacheMetadata


def _connector_class(base: Any, torch: Any) -> Any:
    class _ChunkConnector(base):  # type: ignore[misc]
        """LMCache's GPU-connector interface over host tensors: ``kvcaches`` is one chunk."""

        def __init__(self, shape: tuple[int, ...]) -> None:
            self.shape = shape

        def get_shape(self, num_tokens: int) -> Any:
            return torch.Size([1, 1, num_tokens, 1, self.shape[4]])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            dst = memory_obj.tensor  # LMCache's own format: heads and head dim merged
            dst.copy_(kw["kvcaches"][:, :, start:end].reshape(dst.shape))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            dst = kw["kvcaches"][:, :, start:end]
            dst.copy_(memory_obj.tensor.reshape(dst.shape))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                             **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None,
                           ends: Any = None, **kw: Any) -> None:
            for m, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
                self.to_gpu(m, s, e, **kw)

    return _ChunkConnector


class LMCacheTier(Tier):
    """See the module docstring. Options: ``capacity_bytes`` (LMCache local CPU, default
    1 GiB), ``disk_path`` (enables LocalDisk), ``disk_capacity_bytes`` (default 10 GiB); each
    may be set in LMCache's own configuration instead (:mod:`kvbridge_lmcache.config`)."""

    managed: ClassVar[bool] = False
    #: ``KVBridgeLMCacheConnector`` (kvbridge.integrations.names)
    connector_word: ClassVar[str] = "LMCache"
    #: what to install when LMCache is missing (kvbridge.registry.install_hint)
    install_hint: ClassVar[str] = ("pip install --no-deps lmcache==0.5.6 sortedcontainers "
                                   "aiofile, after the CPU torch (docs/backends/lmcache.md)")

    @classmethod
    def probe(cls) -> str:
        """One line for ``kvbridge backends`` and the doctor: LMCache (and torch) import here;
        raises :class:`BackendUnavailable` with the install hint when they do not."""
        _import()
        try:
            return f"ok (lmcache {version('lmcache')})"
        except PackageNotFoundError:
            return "ok"

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        torch, builder, config_cls, base, metadata_cls = _import()
        self._torch = torch
        self._builder = builder
        if "PYTHONHASHSEED" not in os.environ:
            log.warning("offload tier %s: PYTHONHASHSEED is not set; LMCache's own hashing then "
                        "differs between processes (its disk backend is not reused after a "
                        "restart). Set PYTHONHASHSEED=0 in the engine's environment", ctx.name)
        setup = build_config(ctx, config_cls, self.capacity_bytes)
        self.capacity_bytes = setup.capacity_bytes
        self.chunk_tokens: int = setup.chunk_tokens
        #: the ``LMCacheEngineConfig`` the engine runs with, and where it came from
        self.lmcache_config: Any = setup.config
        self.config_source = setup.source
        width = -(-ctx.chunk_bytes // self.chunk_tokens)
        self._shape = (1, 1, self.chunk_tokens, 1, width)
        self._id = f"kvbridge-{ctx.name}-{ctx.namespace[:12]}-{os.getpid()}-{next(_ids)}"
        try:
            meta = metadata_cls(model_name=f"kvbridge/{ctx.namespace}", world_size=1,
                                local_world_size=1, worker_id=0, local_worker_id=0,
                                kv_dtype=torch.uint8, kv_shape=self._shape)
            with _build_lock:
                self._engine = builder.get_or_create(
                    self._id, setup.config, meta, _connector_class(base, torch)(self._shape),
                    None, None)
                self._engine.post_init()
        except Exception as exc:  # noqa: BLE001 - LMCache raises many kinds
            raise TierError(f"offload tier {ctx.name!r}: LMCache engine failed to start: "
                            f"{type(exc).__name__}: {exc}") from exc
        self._closed = False

    def _tokens(self, key: str) -> Any:
        digest = hashlib.blake2b(f"{self.ctx.namespace}/{key}".encode(),
                                 digest_size=2 * CHUNK_TOKENS).digest()
        ids = [int.from_bytes(digest[2 * i:2 * i + 2], "little") for i in range(CHUNK_TOKENS)]
        # another chunk_size: the same ids, cut or padded with zeros (LMCache hashes the tuple)
        ids = (ids + [0] * self.chunk_tokens)[:self.chunk_tokens]
        return self._torch.tensor(ids, dtype=self._torch.long)

    def _live(self) -> Any:
        if self._closed:
            raise TierError(f"offload tier {self.name!r} is closed")
        return self._engine

    def contains(self, keys: Sequence[str]) -> int:
        engine = self._live()
        n = 0
        for key in keys:
            if engine.lookup(self._tokens(key)) < self.chunk_tokens:
                break
            n += 1
        return n

    def load(self, keys: Sequence[str]) -> list[bytes]:
        engine = self._live()
        torch = self._torch
        out: list[bytes] = []
        for key in keys:
            buf = torch.zeros(self._shape, dtype=torch.uint8)
            got = engine.retrieve(self._tokens(key), kvcaches=buf)
            if int(got.sum().item()) < self.chunk_tokens:
                break
            out.append(buf.numpy().tobytes()[:self.ctx.chunk_bytes])
        return out

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        engine = self._live()
        torch = self._torch
        stored = []
        pad = self._shape[4] * self.chunk_tokens - self.ctx.chunk_bytes
        for key, data in items:
            check_chunk(self.ctx, key, data)
            raw = bytearray(data) + bytes(pad)
            buf = torch.frombuffer(raw, dtype=torch.uint8).reshape(self._shape)
            tokens = self._tokens(key)
            # LMCache keeps an existing chunk: replace it, once its disk backend wrote what it
            # accepted (a write still queued would land after the clear: stale bytes on disk)
            self._drain_disk_writes(_CLEAR_DRAIN_S)
            engine.clear(tokens)
            engine.store(tokens, kvcaches=buf)
            if engine.lookup(tokens) >= self.chunk_tokens:
                stored.append(key)
        return stored

    def evict(self, keys: Sequence[str]) -> None:
        engine = self._live()
        # a queued write of a key would bring it back after the clear
        self._drain_disk_writes(_CLEAR_DRAIN_S)
        for key in keys:
            engine.clear(self._tokens(key))

    def describe(self) -> str:
        return (f"{self.name} (LMCache engine {self._id}, CPU {self.capacity_bytes} bytes, "
                f"config from {self.config_source})")

    def _pending_disk_writes(self) -> int:
        """Chunks LMCache's disk backend accepted but has not written yet (0 without disk)."""
        manager = getattr(self._engine, "storage_manager", None)
        backends = getattr(manager, "storage_backends", None) or {}
        return sum(len(getattr(b.disk_worker, "put_tasks", ()))
                   for b in list(backends.values()) if hasattr(b, "disk_worker"))

    def _drain_disk_writes(self, timeout: float) -> int:
        """Wait (polling every 5 ms, at most ``timeout`` s) until LMCache's disk backend has
        written every chunk it accepted; the number still pending (0: drained). Without a disk
        backend, or with nothing queued, it returns at once. A store or evict that still finds
        writes queued after the bound clears anyway (the disk is stuck: those writes are
        too)."""
        deadline = time.monotonic() + timeout
        while (pending := self._pending_disk_writes()) and time.monotonic() < deadline:
            time.sleep(0.005)
        return pending

    def close(self) -> None:
        """Destroy the LMCache engine once its disk backend has written what it accepted.

        LMCache 0.5.6 closes its CPU allocator before its disk backend, so a disk write still
        in flight at ``destroy`` reads freed memory and the process dies (SIGSEGV, seen in CI).
        Blocks until those writes are done (bounded by ``_DRAIN_S``); if they are not, the
        engine is left alive (a leak, logged) rather than destroyed under its writer."""
        if self._closed:
            return
        self._closed = True
        if pending := self._drain_disk_writes(_DRAIN_S):
            log.warning("offload tier %s: LMCache still writes %d chunk(s) to disk after %.0f s;"
                        " its engine is left open (destroying it now would crash the process)",
                        self.name, pending, _DRAIN_S)
            return
        try:
            self._builder.destroy(self._id)
        except Exception as exc:  # noqa: BLE001
            log.warning("offload tier %s: LMCache close failed: %s", self.name, exc)

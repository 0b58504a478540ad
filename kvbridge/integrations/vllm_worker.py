"""vLLM's worker hooks (worker role, one per tensor-parallel rank) → kvbridge's rank side.

:class:`WorkerSide` turns the KV cache vLLM registers into a :class:`~kvbridge.layout.KVLayout`
(with its KV-cache groups and, where kvbridge can map them, the rank's KV heads), starts the
rank's :class:`~kvbridge.scheduling.loop.TransferLoop` and offload manager under a
:class:`~kvbridge.scheduling.rank.RankSide`, and hands it each step's plan.
:class:`~kvbridge.integrations.vllm.KVBridgeConnector` calls it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from kvbridge import registry, trust
from kvbridge.config import Config
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.groups import KVGroup
from kvbridge.heads import HeadSplit
from kvbridge.host.hugepages import back_with_huge_pages
from kvbridge.integrations.vllm_groups import group_layers, with_groups
from kvbridge.integrations.vllm_meta import (
    KVBridgeHandshake,
    KVBridgeMetadata,
    identity_digest,
    kv_events_enabled,
    model_identity,
    traces_enabled,
)
from kvbridge.layout import KVLayout
from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.keys import namespace_of, seed_key
from kvbridge.offload.manager import OffloadManager, build_tiers
from kvbridge.scheduling.fences import CudaFence, Fence
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.rank import RankSide
from kvbridge.scheduling.spans import HandoffSpans
from kvbridge.scheduling.wake import WakeSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide", "maps_memory"]

log = logging.getLogger("kvbridge.connector")


def maps_memory(backend: str) -> bool:
    """``backend``'s transport can move a host KV cache onto shared memory for same-host peers
    (its class declares :attr:`~kvbridge.transport.Capabilities.map_memory`). A compose
    transport declares its capabilities only once built from its members: not here."""
    try:
        cls = registry.load_class(backend)
    except KVBridgeError:
        return False
    return bool(cls.capabilities.map_memory)


class WorkerSide:
    """vLLM's worker hooks → :class:`RankSide`; runs on the model-runner thread."""

    def __init__(self, config: Config, engine_id: str, *, block_size: int, tp_size: int,
                 groups: tuple[KVGroup, ...], vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.groups = groups
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.side: RankSide | None = None
        self._wake = WakeSender()
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - not initialised in some test harnesses
            self.rank = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = with_groups(
            KVLayout.from_tensors(kv_caches, self._kv_cache_config.num_blocks,
                                  self.block_size),
            self.groups, group_layers(self._kv_cache_config), kv_caches)
        mc = self._vllm_config.model_config
        hf = mc.hf_config
        compat = {  # block size and TP size are the layout's and head split's to check
            "model_type": str(getattr(hf, "model_type", "?")),
            "num_hidden_layers": str(getattr(hf, "num_hidden_layers", "?")),
            "dtype": str(mc.dtype).removeprefix("torch."),
            "cache_dtype": str(self._vllm_config.cache_config.cache_dtype),
            # weights and tokenizer by content (kvbridge.fingerprint), dtypes, quantization,
            # kvbridge version: a peer of another model is refused at the handshake
            "model_identity": identity_digest(
                model_identity(self._vllm_config, self.config.model_identity)),
        }
        on_gpu = any(str(getattr(t, "device", "cpu")).startswith("cuda")
                     for t in kv_caches.values())
        on_cpu = all(str(getattr(t, "device", "cpu")) == "cpu" for t in kv_caches.values())
        if self.config.huge_pages and on_cpu:
            # before any transport registers (and perhaps pins) the memory; vLLM has only
            # just allocated it, zeroed, and nothing writes it yet
            log.info("kvbridge rank %d: %s", self.rank,
                     back_with_huge_pages(layout.regions()).describe())
        # a fresh CPU KV cache may move onto shared memory for same-host peers to map, where
        # the backend can (nothing pins or writes it yet); the operator's backend_options win
        mapped = {"map_memory": True} if (
            on_cpu and self.config.map_kv_cache and maps_memory(self.config.backend)) else {}
        config = self.config
        if on_gpu and config.checksum:  # digests read the KV from the host
            log.info("kvbridge rank %d: hand-off digests are off (the KV cache is in GPU "
                     "memory)", self.rank)
            config = dataclasses.replace(config, checksum=False)
        loop = TransferLoop(config, self.engine_id, layout, rank=self.rank,
                            tp_size=self.tp_size, compat=compat,
                            heads=self._head_split(kv_caches, layout),
                            transport_defaults=mapped)
        try:
            offload = self._offload(layout, on_gpu)
        except BaseException:
            loop.close()
            raise
        if config.flight_recorder and traces_enabled(self._vllm_config):
            loop.trace_spans(HandoffSpans(loop.recorder, self.engine_id, self.rank))
        self.side = RankSide(loop, self._cuda_fence if on_gpu else None, offload)
        loop.on_progress(self._wake.poke)
        rank = self.rank
        loop.on_arrival(lambda req_id, tid: self._wake.arrived(rank, req_id, tid))
        if offload is not None:
            offload.on_progress(self._wake.poke)
            offload.count_into(loop.add_counters)

    def _head_split(self, kv_caches: dict[str, Any], layout: KVLayout) -> HeadSplit | None:
        """This rank's KV heads when kvbridge can map them (heterogeneous TP and block size):
        vLLM's CPU attention backend (``KVCacheLayout.LBHNC``, tensors ``(blocks, heads,
        block_size, 2*head_dim)``), whose kernel keeps per head K as ``[head_dim, N]`` then V
        as ``[N, head_dim]`` for its ``vec``/``vec16`` ISAs (``order="dt"``); other ISAs'
        slabs are kept opaque (TP maps, block sizes must be equal). None for other backends and
        for hybrid models (KV-cache groups): they exchange KV only with engines of the same TP
        size and block size."""
        vc, tp = self._vllm_config, self.tp_size
        mc = vc.model_config
        try:
            from vllm.platforms import current_platform
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            resolved = vc.cache_config.get_resolved_kv_cache_layout().name
            total, local = mc.get_total_num_kv_heads(), mc.get_num_kv_heads(vc.parallel_config)
            head_dim, cpu = mc.get_head_size(), current_platform.is_cpu()
            expected = (layout.num_blocks, local, self.block_size, 2 * head_dim)
            if not cpu or resolved != "LBHNC" or layout.groups or any(
                    tuple(t.shape) != expected for t in kv_caches.values()):
                log.info("KV layout %s on %s: no head split (heterogeneous TP and block size "
                         "are not mapped for it)", resolved, "CPU" if cpu else "this device")
                return None
            cache_dtype = str(vc.cache_config.cache_dtype)
            isa = _get_attn_isa(mc.dtype, self.block_size, head_dim, cache_dtype)
            order = "dt" if isa in ("vec", "vec16") and cache_dtype == "auto" else ""
            split = HeadSplit.for_rank(total, tp, self.rank, head_dim, order=order,
                                       interior=f"vllm-cpu:{isa}:{cache_dtype}")
            if split.heads != local:
                return None
            split.check(layout, tp, self.rank)
        except (KVBridgeError, AttributeError, ImportError, ValueError, TypeError) as exc:
            log.info("no KV head split for this engine (%s): heterogeneous TP and block size "
                     "are not mapped for it", exc)
            return None
        log.info("KV heads [%d, %d) of %d, block format %s: heterogeneous TP%s mapped",
                 split.first_head, split.first_head + split.heads, total, split.interior,
                 " and block size" if order else "")
        return split

    def _offload(self, layout: KVLayout, on_gpu: bool) -> OffloadManager | None:
        cfg = self.config.offload_config()
        if not cfg.enabled:
            return None
        if on_gpu:
            raise ConfigError("offload tiers need the KV cache in host memory (CPU engines); "
                              "GPU offload is not built yet: remove 'offload' from the config")
        seed = seed_key(model_identity(self._vllm_config, self.config.model_identity),
                        sealed=cfg.sealed)  # sealed and unsealed chunks never meet
        namespace = namespace_of(seed, layout.fingerprint())
        io = BlockIO(layout)
        # the disk tier's MAC is keyed by the engine's secret
        tiers = build_tiers(cfg, io.chunk_bytes, namespace,
                            secret=trust.resolve(self.config).secret)
        return OffloadManager(cfg, tiers, io, layout_fingerprint=layout.fingerprint(),
                              rank=self.rank, tp_size=self.tp_size,
                              events=kv_events_enabled(self._vllm_config))

    @staticmethod
    def _cuda_fence() -> Fence | None:
        return CudaFence()

    def handshake_metadata(self) -> KVBridgeHandshake | None:
        if self.side is None:
            return None
        loop = self.side.loop
        return KVBridgeHandshake(loop.control_address, self.engine_id, loop.generation)

    def on_metadata(self, meta: KVBridgeMetadata) -> None:
        if self.side is None:
            return
        if meta.wake_address:  # every rank: with TP, each rank's completion is a wake-up
            self._wake.connect(meta.wake_address, meta.wake_secret)
        self.side.apply(meta.plan)

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
        self._wake.close()

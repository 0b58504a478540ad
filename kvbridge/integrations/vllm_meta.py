"""What crosses vLLM's boundaries: the connector's metadata types, and what kvbridge reads of
vLLM's configuration (the engine's model identity and parallel sizes).

The metadata types travel between vLLM's scheduler and workers (vLLM serialises them):
:class:`KVBridgeMetadata` scheduler → worker each step, :class:`KVBridgeWorkerMeta` worker →
scheduler each step, :class:`KVBridgeHandshake` worker → scheduler at start-up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbridge.offload.keys import weights_fingerprint
from kvbridge.scheduling.handoff import StepPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgeMetadata", "KVBridgeHandshake", "KVBridgeWorkerMeta", "model_identity",
           "parallel_sizes"]


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM: Any to mypy
    """Scheduler → worker, once per step."""

    plan: StepPlan
    wake_address: str | None = None
    #: the engine's :attr:`~kvbridge.scheduling.wake.EngineWake.secret` (with wake_address,
    #: when direct arrival is on): lets a rank send arrivals the engine trusts
    wake_secret: bytes | None = None


@dataclass
class KVBridgeHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker → scheduler at start-up: where this rank's control channel listens."""

    control_address: str
    engine_id: str
    generation: str


@dataclass
class KVBridgeWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler, once per step: offload lookup answers (lookup id → rank → blocks)."""

    answers: dict[str, dict[int, int]]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {k: dict(v) for k, v in self.answers.items()}
        if isinstance(other, KVBridgeWorkerMeta):
            for lid, ranks in other.answers.items():
                merged.setdefault(lid, {}).update(ranks)
        return KVBridgeWorkerMeta(merged)


def model_identity(vllm_config: VllmConfig) -> dict[str, str]:
    """What makes two engines' KV for the same tokens identical: the seed of offload keys."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    try:
        hf = json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str)
    except Exception:  # noqa: BLE001 - an exotic config: fall back to its repr
        hf = repr(mc.hf_config)
    tp, _ = parallel_sizes(vllm_config)
    return {
        "model": str(mc.model), "revision": str(getattr(mc, "revision", None)),
        "weights": weights_fingerprint(str(mc.model)),
        "hf_config": hashlib.blake2b(hf.encode(), digest_size=16).hexdigest(),
        "dtype": str(mc.dtype), "cache_dtype": str(cc.cache_dtype),
        "block_size": str(cc.block_size), "tp_size": str(tp),
        "quantization": str(getattr(mc, "quantization", None)),
    }


def parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    """The engine's tensor- and pipeline-parallel sizes."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "tensor_parallel_size", 1)), int(getattr(pc, "pipeline_parallel_size",
                                                                    1))

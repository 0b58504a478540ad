"""What crosses vLLM's boundaries: the connector's metadata types, and what kvbridge reads of
vLLM's configuration (the engine's model identity and parallel sizes).

The metadata types travel between vLLM's scheduler and workers (vLLM serialises them):
:class:`KVBridgeMetadata` scheduler → worker each step, :class:`KVBridgeWorkerMeta` worker →
scheduler each step, :class:`KVBridgeHandshake` worker → scheduler at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvbridge.fingerprint import checkpoint_digest
from kvbridge.messages import PROTOCOL_VERSION
from kvbridge.offload.events import TierEvent
from kvbridge.scheduling.handoff import StepPlan
from kvbridge.tracing import parse_traceparent

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgeMetadata", "KVBridgeHandshake", "KVBridgeWorkerMeta", "model_identity",
           "identity_digest", "kv_events_enabled", "parallel_sizes", "traces_enabled",
           "trace_parent"]


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
    """Worker → scheduler, once per step: offload lookup answers (lookup id → rank → blocks)
    and rank 0's tier KV events (:mod:`kvbridge.offload.events`)."""

    answers: dict[str, dict[int, int]]
    tier_events: list[TierEvent] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {k: dict(v) for k, v in self.answers.items()}
        events = list(self.tier_events)
        if isinstance(other, KVBridgeWorkerMeta):
            for lid, ranks in other.answers.items():
                merged.setdefault(lid, {}).update(ranks)
            events += other.tier_events
        return KVBridgeWorkerMeta(merged, events)


#: HF config keys that say where a checkpoint was loaded from, not what it computes
_WHERE_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})


def model_identity(vllm_config: VllmConfig, declared: str | None = None) -> dict[str, str]:
    """What makes two engines' KV for the same tokens identical: the seed of offload keys, and
    (:func:`identity_digest`) part of every handshake.

    ``weights`` names the checkpoint by content (:func:`kvbridge.fingerprint.checkpoint_digest`
    of the model directory, and of the tokenizer's when it is another one), never by path or
    modification time; a model given by hub name by its name and declared revision. ``declared``
    (the ``model_identity`` setting) replaces it, for an operator who knows better."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    try:
        hf_dict = {k: v for k, v in mc.hf_config.to_dict().items() if k not in _WHERE_KEYS}
        hf = json.dumps(hf_dict, sort_keys=True, default=str)
    except Exception:  # noqa: BLE001 - an exotic config: fall back to its repr
        hf = repr(mc.hf_config)
    tp, _ = parallel_sizes(vllm_config)
    if declared is not None:
        weights = "declared:" + declared
    else:
        weights = _content(str(mc.model), getattr(mc, "revision", None))
        tokenizer = str(getattr(mc, "tokenizer", "") or mc.model)
        if os.path.realpath(tokenizer) != os.path.realpath(str(mc.model)):
            weights += "|tokenizer:" + _content(tokenizer,
                                                getattr(mc, "tokenizer_revision", None))
    return {
        "weights": weights,
        "hf_config": hashlib.blake2b(hf.encode(), digest_size=16).hexdigest(),
        "dtype": str(mc.dtype), "cache_dtype": str(cc.cache_dtype),
        "block_size": str(cc.block_size), "tp_size": str(tp),
        "quantization": str(getattr(mc, "quantization", None)),
        "kvbridge": str(PROTOCOL_VERSION),
    }


def _content(path: str, revision: object) -> str:
    digest = checkpoint_digest(path)
    if digest is not None:
        return "content:" + digest
    return f"name:{path}@{revision}"  # a hub name: only its revision tells versions apart


def identity_digest(identity: dict[str, str]) -> str:
    """A short digest of a :func:`model_identity` for handshakes, less what the layout and head
    split check themselves (block size, TP size): engines of other block or TP sizes may still
    exchange KV of one model."""
    comparable = {k: v for k, v in identity.items() if k not in ("block_size", "tp_size")}
    blob = json.dumps(comparable, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8, person=b"kvbridge-model").hexdigest()


def kv_events_enabled(vllm_config: VllmConfig) -> bool:
    """vLLM publishes KV events (``--kv-events-config``): the tiers then add theirs."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def traces_enabled(vllm_config: VllmConfig) -> bool:
    """vLLM traces requests (``--otlp-traces-endpoint``): it passes each request's
    ``traceparent`` to its engine core and sets up OpenTelemetry in every engine process."""
    cfg = getattr(vllm_config, "observability_config", None)
    return bool(cfg is not None and getattr(cfg, "otlp_traces_endpoint", None))


def trace_parent(request: Any) -> str | None:
    """A request's ``traceparent`` as vLLM kept it (``Request.trace_headers``, the client's or
    the proxy's header), or None when it has none or it is not a valid one (any length: vLLM
    passes the header on as it came; a valid one is at most 256 characters)."""
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    try:
        value = headers.get("traceparent")
    except Exception:  # noqa: BLE001 - not a mapping: no trace context
        return None
    return value if parse_traceparent(value) is not None else None


def kv_events_publisher(vllm_config: VllmConfig) -> tuple[int, str] | None:
    """``(port, topic)`` of the ZeroMQ PUB socket vLLM binds for its KV events, when a proxy
    can subscribe to it: events on, publisher ``zmq``, endpoint a wildcard bind
    ``tcp://*:PORT`` (or ``tcp://[::]:PORT``) with a fixed port (vLLM offsets it by the
    data-parallel rank, as here). None otherwise: an ``ipc://``/``inproc://`` endpoint, port 0
    (the OS picks it and vLLM does not say which), or a connect endpoint (vLLM connects out)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False):
        return None
    if getattr(cfg, "publisher", None) != "zmq":
        return None
    endpoint = str(getattr(cfg, "endpoint", "") or "")
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not endpoint.startswith("tcp://") or host not in ("*", "[::]", "::"):
        return None
    try:
        base = int(port)
    except ValueError:
        return None
    pc = getattr(vllm_config, "parallel_config", None)
    rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    if not 1 <= base + rank <= 65535 or base == 0:
        return None
    return base + rank, str(getattr(cfg, "topic", "") or "")


def parallel_sizes(vllm_config: VllmConfig) -> tuple[int, int]:
    """The engine's tensor- and pipeline-parallel sizes."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "tensor_parallel_size", 1)), int(getattr(pc, "pipeline_parallel_size",
                                                                    1))

"""kvbridge's counters in vLLM's stats shape: ``KVConnectorStats`` and Prometheus series.

vLLM asks each worker's connector for :class:`KVBridgeStats` after every step
(``get_kv_connector_stats``), sums them over the workers (:meth:`KVBridgeStats.aggregate`),
ships ``to_dict()`` to the API-server process, rebuilds them there by connector name
(``build_kv_connector_stats``, also inside vLLM's ``MultiConnector``), logs
:meth:`KVBridgeStats.reduce` as its periodic ``KV Transfer metrics:`` line and feeds
:class:`KVBridgePromMetrics`, which exports ``vllm:kvbridge_<counter>_total`` per engine.

The payload is ``{"counters": {name: increment}}``: the increments of the rank's transfer-loop
counters since the previous step. Only the names in :data:`EXPORTED` become Prometheus series
(bounded cardinality, whatever a newer worker sends); the log line shows every non-zero one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgeStats", "KVBridgePromMetrics", "EXPORTED", "delta"]

#: Counters exported as ``vllm:kvbridge_<name>_total``, with what moves them.
EXPORTED: dict[str, str] = {
    "pull_bytes": "bytes D read from P (pull)",
    "push_bytes": "bytes P wrote into D (push)",
    "push_received_bytes": "bytes D received by push",
    "recv_ok": "requests whose KV arrived complete on D",
    "recv_failed": "requests whose KV did not arrive (recomputed or failed per policy)",
    "recv_full_local_hit": "requests D found entirely in its own prefix cache",
    "pull_served": "pulls P served",
    "push_sent": "pushes P completed",
    "push_failed": "pushes that failed",
    "push_timeout": "pushes D stopped waiting for",
    "transfer_timeout": "READ/WRITE that exceeded transfer_timeout_s",
    "lease_expired": "requests whose blocks P released after D stopped renewing",
    "checksum_mismatch": "transfers whose end-to-end checksum did not match",
    "peer_gone": "peers found gone (restarted or unreachable)",
    "params_rejected": "requests whose kv_transfer_params were refused",
    "offload_lookups": "offload tier lookups",
    "offload_hit_requests": "requests served partly from an offload tier",
    "offload_hit_tokens": "prompt tokens loaded from an offload tier",
    "offload_store_requests": "requests whose prompt blocks were stored to the tiers",
    "offload_load_failed": "tier chunks that failed to load (the rest was recomputed)",
}


def delta(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The positive increments from ``before`` to ``now``."""
    return {k: int(v) - int(before.get(k, 0)) for k, v in now.items()
            if int(v) > int(before.get(k, 0))}


def _counters(data: Mapping[str, Any] | None) -> dict[str, int]:
    raw = (data or {}).get("counters", {})
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): int(v) for k, v in raw.items()
            if isinstance(v, int) and not isinstance(v, bool) and v > 0}


class KVBridgeStats(KVConnectorStats):
    """Counter increments of one interval (see the module docstring)."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(data={"counters": _counters(data)})

    @property
    def counters(self) -> dict[str, int]:
        c: dict[str, int] = self.data["counters"]
        return c

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        mine = self.counters
        for k, v in _counters(other.data).items():
            mine[k] = mine.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.counters.items()))

    def is_empty(self) -> bool:
        return not self.counters


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`EXPORTED` name, one child per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for name, doc in EXPORTED.items():
            metric = self._counter_cls(name=f"vllm:kvbridge_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._series[name] = {idx: metric.labels(*values)
                                  for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, n in _counters(transfer_stats_data).items():
            per_engine = self._series.get(name)
            if per_engine is not None and engine_idx in per_engine:
                per_engine[engine_idx].inc(n)

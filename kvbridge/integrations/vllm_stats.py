"""kvbridge's counters and per-transfer samples in vLLM's stats shape, and their Prometheus series.

vLLM asks each worker's connector for :class:`KVBridgeStats` after every step
(``get_kv_connector_stats``), merges them over the workers (:meth:`KVBridgeStats.aggregate`),
ships ``to_dict()`` to the API-server process, rebuilds them there by connector name
(``build_kv_connector_stats``, also inside vLLM's ``MultiConnector``), logs
:meth:`KVBridgeStats.reduce` as its periodic ``KV Transfer metrics:`` line and feeds
:class:`KVBridgePromMetrics` (docs/metrics.md lists every series).

The payload (``data``), every part optional:

- ``counters``: ``{name: increment}`` of the rank's transfer-loop counters since the last step;
  those in :data:`EXPORTED` become ``vllm:kvbridge_<name>_total``.
- ``transfers``: ``[[mode, backend, peer, outcome, seconds, bytes, descriptors], …]``, one per
  finished READ / WRITE (:mod:`kvbridge.scheduling.observations`);
- ``handoffs``: ``[[mode, backend, peer, seconds], …]``, one per finished hand-off on D;
- ``phases``: ``[[phase, seconds], …]``, one per hand-off phase the rank's flight recorder
  timed (:data:`~kvbridge.scheduling.recorder.PHASES`; other names are dropped);
- ``events``: ``[[event, mode, backend, peer, count], …]``, failure events of
  :data:`~kvbridge.scheduling.observations.EVENTS` (peer ``-`` where the rank does not know it);
- ``dropped``: samples the rank could not keep (its buffer was full).

Anything malformed is dropped when the payload is parsed (it crosses a process boundary), label
values are cut to 64 characters and each labelled series family holds at most
:data:`MAX_LABEL_SETS` label sets (later ones are counted under peer ``other``), so the number of
series stays bounded.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbridge.scheduling.observations import EVENTS
from kvbridge.scheduling.recorder import PHASES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVBridgeStats", "KVBridgePromMetrics", "EXPORTED", "delta", "MAX_LABEL_SETS"]

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
    "handoff_stalled": "hand-offs D gave up after stall_s without progress",
    "lease_expired": "requests whose blocks P released after D stopped renewing",
    "checksum_mismatch": "hand-offs whose landed KV did not match the prefill engine's digests",
    "peer_gone": "peers found gone (restarted or unreachable)",
    "params_rejected": "requests whose kv_transfer_params were refused",
    "offload_lookups": "offload tier lookups",
    "offload_hit_requests": "requests served partly from an offload tier",
    "offload_hit_tokens": "prompt tokens loaded from an offload tier",
    "offload_store_requests": "requests whose prompt blocks were stored to the tiers",
    "offload_load_failed": "tier chunks that failed to load (the rest was recomputed)",
    "offload_drain_written_blocks": "chunks a drain wrote from local into lasting tiers",
}

#: Most label sets (mode, backend, peer[, outcome]) one series family keeps.
MAX_LABEL_SETS = 64
_MAX_SAMPLES = 8192
_MODES = ("pull", "push")
_PHASES = frozenset(p for p, _, _ in PHASES)
_OUTCOMES = ("ok", "failed")
_TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0)
_BYTE_BUCKETS = tuple(float(2 ** (10 + 2 * i)) for i in range(12))  # 1 KiB .. 4 TiB
_DESC_BUCKETS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
                 1048576.0)


def delta(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The positive increments from ``before`` to ``now``."""
    return {k: int(v) - int(before.get(k, 0)) for k, v in now.items()
            if int(v) > int(before.get(k, 0))}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and v == v and 0 <= v < 1e18


def _label(v: Any) -> str | None:
    return v[:64] if isinstance(v, str) and v else None


def _counters(data: Mapping[str, Any]) -> dict[str, int]:
    raw = data.get("counters", {})
    if not isinstance(raw, Mapping):
        return {}
    return {str(k)[:64]: int(v) for k, v in raw.items() if _int(v) and v > 0}


def _transfers(data: Mapping[str, Any]) -> list[list[Any]]:
    out = []
    raw = data.get("transfers", [])
    for s in raw[:_MAX_SAMPLES] if isinstance(raw, list) else []:
        if (isinstance(s, (list, tuple)) and len(s) == 7 and s[0] in _MODES
                and s[3] in _OUTCOMES and _label(s[1]) and _label(s[2])
                and _num(s[4]) and _int(s[5]) and _int(s[6]) and s[5] >= 0 and s[6] >= 0):
            out.append([s[0], _label(s[1]), _label(s[2]), s[3], float(s[4]), s[5], s[6]])
    return out


def _handoffs(data: Mapping[str, Any]) -> list[list[Any]]:
    out = []
    raw = data.get("handoffs", [])
    for s in raw[:_MAX_SAMPLES] if isinstance(raw, list) else []:
        if (isinstance(s, (list, tuple)) and len(s) == 4 and s[0] in _MODES
                and _label(s[1]) and _label(s[2]) and _num(s[3])):
            out.append([s[0], _label(s[1]), _label(s[2]), float(s[3])])
    return out


def _phases(data: Mapping[str, Any]) -> list[list[Any]]:
    raw = data.get("phases", [])
    return [[s[0], float(s[1])] for s in (raw[:_MAX_SAMPLES] if isinstance(raw, list) else [])
            if isinstance(s, (list, tuple)) and len(s) == 2 and s[0] in _PHASES
            and _num(s[1])]


def _events(data: Mapping[str, Any]) -> list[list[Any]]:
    out = []
    raw = data.get("events", [])
    for s in raw[:_MAX_SAMPLES] if isinstance(raw, list) else []:
        if (isinstance(s, (list, tuple)) and len(s) == 5 and s[0] in EVENTS and s[1] in _MODES
                and _label(s[2]) and _label(s[3]) and _int(s[4]) and s[4] > 0):
            out.append([s[0], s[1], _label(s[2]), _label(s[3]), s[4]])
    return out


def _parse(data: Mapping[str, Any] | None) -> dict[str, Any]:
    data = data if isinstance(data, Mapping) else {}
    dropped = data.get("dropped", 0)
    return {"counters": _counters(data), "transfers": _transfers(data),
            "handoffs": _handoffs(data), "events": _events(data), "phases": _phases(data),
            "dropped": dropped if _int(dropped) and dropped > 0 else 0}


class KVBridgeStats(KVConnectorStats):
    """One interval's counter increments and samples (see the module docstring)."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        super().__init__(data=_parse(data))

    @property
    def counters(self) -> dict[str, int]:
        c: dict[str, int] = self.data["counters"]
        return c

    def reset(self) -> None:
        self.data: dict[str, Any] = _parse(None)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data if isinstance(other, KVBridgeStats) else _parse(other.data)
        mine = self.counters
        for k, v in theirs["counters"].items():
            mine[k] = mine.get(k, 0) + v
        for key in ("transfers", "handoffs", "events", "phases"):
            room = _MAX_SAMPLES - len(self.data[key])
            self.data[key].extend(theirs[key][:max(0, room)])
            self.data["dropped"] += max(0, len(theirs[key]) - max(0, room))
        self.data["dropped"] += theirs["dropped"]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line: the counters that moved, then transfer and hand-off summaries."""
        out: dict[str, int | float] = dict(sorted(self.counters.items()))
        transfers, handoffs = self.data["transfers"], self.data["handoffs"]
        if transfers:
            wire = [s[4] for s in transfers]
            out["transfers"] = len(transfers)
            out["transfers_failed"] = sum(1 for s in transfers if s[3] == "failed")
            out["transfer_ms_p50"] = round(statistics.median(wire) * 1e3, 3)
            out["transfer_ms_max"] = round(max(wire) * 1e3, 3)
            out["transfer_MiB"] = round(sum(s[5] for s in transfers) / (1 << 20), 3)
        if handoffs:
            times = [s[3] for s in handoffs]
            out["handoffs"] = len(handoffs)
            out["handoff_ms_p50"] = round(statistics.median(times) * 1e3, 3)
            out["handoff_ms_max"] = round(max(times) * 1e3, 3)
        if self.data["dropped"]:
            out["samples_dropped"] = self.data["dropped"]
        return out

    def is_empty(self) -> bool:
        return not (self.counters or self.data["transfers"] or self.data["handoffs"]
                    or self.data["events"] or self.data["phases"])


class _Family:
    """One labelled series family (mode, backend, peer[, outcome]) with bounded label sets."""

    def __init__(self, metric: Any, per_engine: dict[int, list[object]]) -> None:
        self._metric = metric
        self._per_engine = per_engine
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, engine_idx: int, labels: tuple[str, ...]) -> Any:
        key = (engine_idx, *labels)
        found = self._children.get(key)
        if found is None:
            base = self._per_engine.get(engine_idx)
            if base is None:
                return None
            if len(self._children) >= MAX_LABEL_SETS and len(labels) > 2:  # peer → "other"
                labels = (labels[0], labels[1], "other", *labels[3:])
                key = (engine_idx, *labels)
                found = self._children.get(key)
                if found is not None:
                    return found
            found = self._children[key] = self._metric.labels(*base, *labels)
        return found


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbridge_*`` series, one child per engine (and per mode, backend, peer)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for name, doc in EXPORTED.items():
            metric = self._counter_cls(name=f"vllm:kvbridge_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._series[name] = {idx: metric.labels(*values)
                                  for idx, values in per_engine_labelvalues.items()}
        where = [*labelnames, "mode", "backend", "peer"]

        def family(kind: type, name: str, doc: str, labels: list[str],
                   buckets: tuple[float, ...] | None = None) -> _Family:
            kw: dict[str, Any] = {"name": name, "documentation": doc, "labelnames": labels}
            if buckets is not None:
                kw["buckets"] = list(buckets)
            return _Family(kind(**kw), per_engine_labelvalues)

        h, c = self._histogram_cls, self._counter_cls
        self._transfers = family(c, "vllm:kvbridge_transfers", "finished READ/WRITE transfers "
                                 "by outcome", [*where, "outcome"])
        self._wire = family(h, "vllm:kvbridge_transfer_seconds", "one transfer, posted to "
                            "finished (the wire)", where, _TIME_BUCKETS)
        self._bytes = family(h, "vllm:kvbridge_transfer_bytes", "bytes of one transfer", where,
                             _BYTE_BUCKETS)
        self._descs = family(h, "vllm:kvbridge_transfer_descriptors", "descriptors of one "
                             "transfer", where, _DESC_BUCKETS)
        self._events = family(c, "vllm:kvbridge_events", "failure events (lease expired, "
                              "checksum mismatch, push/transfer timeout, push failed, receive "
                              "failed) by event", [*where, "event"])
        self._handoff = family(h, "vllm:kvbridge_handoff_seconds", "D: load started to KV "
                               "usable (claim + READ + confirm, or registration to DONE)", where,
                               _TIME_BUCKETS)

        self._phase = family(h, "vllm:kvbridge_phase_seconds", "one phase of a hand-off as "
                             "this engine timed it on its own clock (docs/why.md)",
                             [*labelnames, "phase"], _TIME_BUCKETS)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = _parse(transfer_stats_data)
        for name, n in data["counters"].items():
            per_engine = self._series.get(name)
            if per_engine is not None and engine_idx in per_engine:
                per_engine[engine_idx].inc(n)
        for mode, backend, peer, outcome, seconds, nbytes, descs in data["transfers"]:
            where = (mode, backend, peer)
            child = self._transfers.child(engine_idx, (*where, outcome))
            if child is None:
                return  # an engine vLLM never declared
            child.inc()
            self._wire.child(engine_idx, where).observe(seconds)
            self._bytes.child(engine_idx, where).observe(nbytes)
            self._descs.child(engine_idx, where).observe(descs)
        for mode, backend, peer, seconds in data["handoffs"]:
            child = self._handoff.child(engine_idx, (mode, backend, peer))
            if child is not None:
                child.observe(seconds)
        for phase, seconds in data["phases"]:
            child = self._phase.child(engine_idx, (phase,))
            if child is not None:
                child.observe(seconds)
        for event, mode, backend, peer, n in data["events"]:
            child = self._events.child(engine_idx, (mode, backend, peer, event))
            if child is not None:
                child.inc(n)

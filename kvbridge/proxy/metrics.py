"""The proxy's Prometheus metrics, rendered in the text exposition format (no dependency).

Single event loop use only (not thread-safe). Names, all prefixed ``kvbridge_proxy_``:

- ``requests_total{mode,outcome}`` — finished client requests; ``mode`` is the mode used
  (push | pull | none when rejected before routing), ``outcome`` one of :data:`OUTCOMES`.
- ``mode_decisions_total{configured,chosen,reason}`` — every routing decision (auto's choice).
- ``in_flight{engine,role}`` — the proxy's open requests per engine (gauge).
- ``engine_requests_total{engine,role}``, ``engine_errors_total{engine,role}`` — per engine.
- ``errors_total{kind}`` — failures by kind (prefill, decode, probe, timeout, bad_request, …).
- ``retries_total{reason}`` — requests dispatched a second time (``prefill_restarted``: a push
  whose D leg failed because P restarted, retried once as a pull).
- ``probes_dropped_total{reason}`` — cached probe answers forgotten (``generation_changed``: P
  answered with a new generation; ``prefill_failed`` / ``decode_failed``: a push leg failed).
- ``reason_queries_total{outcome}`` — control-channel ``TransferQuery`` calls made to explain a
  failed leg (``answered``: the rank knew the transfer; ``unknown``; ``error``: no answer).
- ``ttft_seconds{mode}`` — histogram: request received → first byte of D's stream sent
  (streaming requests only: that is the first token the client sees).
- ``request_duration_seconds{mode}`` — histogram: request received → response complete.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from kvbridge.proxy.routing import Engine

__all__ = ["ProxyMetrics", "OUTCOMES", "BUCKETS"]

OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "cancelled")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_Labels = tuple[tuple[str, str], ...]
_EngineValue = Callable[[Engine], int]


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt_labels(labels: _Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


class ProxyMetrics:
    """Counters and histograms of one proxy; :meth:`render` gives the /metrics text."""

    def __init__(self) -> None:
        self.requests: dict[_Labels, int] = defaultdict(int)
        self.decisions: dict[_Labels, int] = defaultdict(int)
        self.errors: dict[_Labels, int] = defaultdict(int)
        self.retries: dict[_Labels, int] = defaultdict(int)
        self.probes_dropped: dict[_Labels, int] = defaultdict(int)
        self.reason_queries: dict[_Labels, int] = defaultdict(int)
        self.ttft: dict[_Labels, _Histogram] = {}
        self.duration: dict[_Labels, _Histogram] = {}

    def request_done(self, mode: str, outcome: str) -> None:
        self.requests[(("mode", mode), ("outcome", outcome))] += 1

    def decision(self, configured: str, chosen: str, reason: str) -> None:
        self.decisions[(("configured", configured), ("chosen", chosen), ("reason", reason))] += 1

    def error(self, kind: str) -> None:
        self.errors[(("kind", kind),)] += 1

    def retry(self, reason: str) -> None:
        self.retries[(("reason", reason),)] += 1

    def probe_dropped(self, reason: str) -> None:
        self.probes_dropped[(("reason", reason),)] += 1

    def reason_query(self, outcome: str) -> None:
        self.reason_queries[(("outcome", outcome),)] += 1

    def observe_ttft(self, mode: str, seconds: float) -> None:
        self.ttft.setdefault((("mode", mode),), _Histogram(BUCKETS)).observe(seconds)

    def observe_duration(self, mode: str, seconds: float) -> None:
        self.duration.setdefault((("mode", mode),), _Histogram(BUCKETS)).observe(seconds)

    def render(self, engines: Iterable[Engine]) -> str:
        """The Prometheus text exposition of every metric, engines' live gauges included."""
        p = "kvbridge_proxy_"
        lines: list[str] = []

        def counter(name: str, help_: str, data: dict[_Labels, int]) -> None:
            lines.append(f"# HELP {p}{name} {help_}")
            lines.append(f"# TYPE {p}{name} counter")
            for labels, value in sorted(data.items()):
                lines.append(f"{p}{name}{_fmt_labels(labels)} {value}")

        def histogram(name: str, help_: str, data: dict[_Labels, _Histogram]) -> None:
            lines.append(f"# HELP {p}{name} {help_}")
            lines.append(f"# TYPE {p}{name} histogram")
            for labels, h in sorted(data.items()):
                cumulative = 0
                for bound, n in zip((*h.buckets, float("inf")), h.counts, strict=True):
                    cumulative += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lab = _fmt_labels((*labels, ("le", le)))
                    lines.append(f"{p}{name}_bucket{lab} {cumulative}")
                lines.append(f"{p}{name}_sum{_fmt_labels(labels)} {h.sum:.6f}")
                lines.append(f"{p}{name}_count{_fmt_labels(labels)} {h.count}")

        counter("requests_total", "Client requests by mode used and outcome.", self.requests)
        counter("mode_decisions_total", "Routing decisions (auto: push or pull).", self.decisions)
        counter("errors_total", "Failures by kind.", self.errors)
        counter("retries_total", "Requests dispatched a second time, by reason.", self.retries)
        counter("probes_dropped_total", "Cached probe answers forgotten, by reason.",
                self.probes_dropped)
        counter("reason_queries_total", "Control-channel queries explaining a failed leg.",
                self.reason_queries)

        engines = list(engines)
        per_engine: list[tuple[str, str, _EngineValue]] = [
            ("in_flight", "gauge", lambda e: e.in_flight),
            ("engine_requests_total", "counter", lambda e: e.total),
            ("engine_errors_total", "counter", lambda e: e.errors),
        ]
        helps = {
            "in_flight": "Open proxy requests per engine.",
            "engine_requests_total": "Requests sent per engine.",
            "engine_errors_total": "Connection-level failures per engine.",
        }
        for name, kind, get in per_engine:
            lines.append(f"# HELP {p}{name} {helps[name]}")
            lines.append(f"# TYPE {p}{name} {kind}")
            for e in engines:
                lab = _fmt_labels((("engine", e.url), ("role", e.role.value)))
                lines.append(f"{p}{name}{lab} {get(e)}")

        histogram("ttft_seconds", "Time to first streamed byte as seen at the proxy.", self.ttft)
        histogram("request_duration_seconds", "Request received to response done.", self.duration)
        return "\n".join(lines) + "\n"

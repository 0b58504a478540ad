"""The proxy's Prometheus metrics, kept with ``prometheus_client`` in a registry of its own.

One :class:`ProxyMetrics` per proxy, each with a private ``CollectorRegistry``, so several
proxies in one process (tests, one per mode) never collide. Used from the proxy's event loop;
``prometheus_client`` objects are thread-safe anyway. Names, all prefixed ``kvbridge_proxy_``:

- ``requests_total{mode,outcome}`` — finished client requests; ``mode`` is the mode used
  (push | pull | none when rejected before routing), ``outcome`` one of :data:`OUTCOMES`.
- ``mode_decisions_total{configured,chosen,reason}`` — every routing decision: the planner's
  (``configured="auto"``, also for ``plan``), headroom's, or a mode fixed by ``--mode`` or the
  header.
- ``in_flight{engine,role}`` — the proxy's open requests per engine (gauge, read at scrape).
- ``engine_up{engine,role}`` — 1 while the engine is in rotation, 0 while it is out (gauge).
- ``engine_requests_total{engine,role}``, ``engine_errors_total{engine,role}`` — per engine.
- ``errors_total{kind}`` — failures by kind (prefill, decode, probe, timeout, bad_request, …).
- ``retries_total{mode,reason}`` — dispatches made again after an engine failed one before any
  byte reached the client; ``mode`` is the failed dispatch's, ``reason`` one of
  :data:`RETRY_REASONS` (docs/proxy.md, "Fleets").
- ``probes_dropped_total{reason}`` — cached probe answers forgotten (``identity_changed``: P's
  weights were reloaded; ``generation_changed``: P
  answered with a new generation; ``prefill_failed`` / ``decode_failed``: a push leg failed).
- ``reason_queries_total{outcome}`` — control-channel ``TransferQuery`` calls made to explain a
  failed leg (``answered``: the rank knew the transfer; ``unknown``; ``error``: no answer).
- ``discovery_changes_total{role,change}`` — engines discovery added, drained, removed or
  resumed (:mod:`kvbridge.proxy.discovery`); ``discovery_errors_total{source}`` — rounds in
  which a source (``dns``, ``file``) failed. Both published at zero.
- ``ttft_seconds{mode}`` — histogram: request received → first byte of D's stream sent
  (streaming requests only: that is the first token the client sees).
- ``request_duration_seconds{mode}`` — histogram: request received → response complete.
- ``upstream_seconds{role}`` — histogram: a request to an engine sent → its response headers
  received (for D, in streaming mode, about its time to first token, KV wait included).
- ``prefill_leg_seconds{mode}`` — histogram: P's one-token prefill leg, sent → answer read.
- ``socket_wait_seconds`` — histogram: how long a request's bytes waited in the proxy's socket
  before its handler ran (a lower bound from the kernel, :mod:`kvbridge.proxy.arrival`; 0 under
  one scheduler tick). Its tail growing is the proxy's event loop, or its host, falling behind.

Every label value comes from a fixed set or from the configured engine URLs, so the number of
series is bounded by the deployment, never by clients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.proxy.credit import KvAdmission, KvCredit
from kvbridge.proxy.members import EngineState
from kvbridge.proxy.routing import Engine

__all__ = ["ProxyMetrics", "OUTCOMES", "BUCKETS", "RETRY_REASONS", "RETRY_MODES",
           "DISCOVERY_CHANGES", "DISCOVERY_SOURCES"]

OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "cancelled")
#: ``retries_total`` reasons: another P after a P leg failed; another D with P's answer (pull, D
#: unreachable); a fresh dispatch after D failed; a push retried as a pull after P restarted.
RETRY_REASONS = ("prefill_failed", "decode_unreachable", "decode_failed", "prefill_restarted")
#: the modes a dispatch that can be retried runs in (``retries_total``'s ``mode``)
RETRY_MODES = ("pull", "push")
#: ``discovery_changes_total``'s ``change`` and ``discovery_errors_total``'s ``source``
DISCOVERY_CHANGES = ("added", "drained", "removed", "resumed")
DISCOVERY_SOURCES = ("dns", "file")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_P = "kvbridge_proxy_"


class _Engines(Collector):
    """Per-engine series, read from the routing table's live engines at scrape time."""

    def __init__(self) -> None:
        self.engines: Callable[[], Iterable[Engine]] = lambda: ()
        self.credit: KvCredit | None = None

    def collect(self) -> Iterator[Any]:
        engines = list(self.engines())
        series: list[tuple[Any, Callable[[Engine], int]]] = [
            (GaugeMetricFamily(_P + "in_flight", "Open proxy requests per engine.",
                               labels=["engine", "role"]), lambda e: e.in_flight),
            (CounterMetricFamily(_P + "engine_requests", "Requests sent per engine.",
                                 labels=["engine", "role"]), lambda e: e.total),
            (CounterMetricFamily(_P + "engine_errors", "Connection-level failures per engine.",
                                 labels=["engine", "role"]), lambda e: e.errors),
            (GaugeMetricFamily(_P + "engine_up", "1 while the engine is in rotation, else 0.",
                               labels=["engine", "role"]), lambda e: int(e.is_up())),
            (GaugeMetricFamily(_P + "engine_handoffs", "Hand-offs an engine serves beyond its "
                               "open requests (a pull's P until D's answer ended).",
                               labels=["engine", "role"]), lambda e: e.handoffs),
        ]
        for family, get in series:
            for e in engines:
                family.add_metric([e.url, e.role.value], get(e))
            yield family
        state = GaugeMetricFamily(_P + "engine_state", "1 for the engine's state (joining, "
                                  "active, draining, drained, dead), 0 for the others.",
                                  labels=["engine", "role", "state"])
        for e in engines:
            now = e.state
            for s in EngineState:
                state.add_metric([e.url, e.role.value, s.value], int(s is now))
        yield state
        if self.credit is None or self.credit.mode is KvAdmission.OFF:
            return
        credit = GaugeMetricFamily(_P + "kv_credit_blocks", "KV blocks a decode engine may "
                                   "still be given (capacity minus admitted requests' needs).",
                                   labels=["engine"])
        capacity = GaugeMetricFamily(_P + "kv_capacity_blocks", "A decode engine's KV cache "
                                     "as this proxy may commit it, in blocks.", labels=["engine"])
        for e in engines:
            cap = self.credit.capacity.get(e.url)
            left = self.credit.credit(e)
            if cap is not None and left is not None:
                credit.add_metric([e.url], left)
                capacity.add_metric([e.url], cap.blocks)
        yield credit
        yield capacity
        yield GaugeMetricFamily(_P + "kv_queued", "Requests waiting for KV credit.",
                                value=self.credit.queued())


class ProxyMetrics:
    """Counters and histograms of one proxy; :meth:`render` gives the /metrics text."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, labels: Sequence[str]) -> Counter:
            return Counter(_P + name, doc, labelnames=labels, registry=r)

        def histogram(name: str, doc: str, labels: Sequence[str]) -> Histogram:
            return Histogram(_P + name, doc, labelnames=labels, buckets=BUCKETS, registry=r)

        self._requests = counter("requests", "Client requests by mode used and outcome.",
                                 ("mode", "outcome"))
        self._decisions = counter("mode_decisions",
                                  "Routing decisions (auto: the planner; headroom: push or pull).",
                                  ("configured", "chosen", "reason"))
        self._errors = counter("errors", "Failures by kind.", ("kind",))
        self._retries = counter("retries", "Dispatches made again after an engine failed one, "
                                "by the failed dispatch's mode and reason.", ("mode", "reason"))
        # Published at zero (a fixed set): rate() and increase() count the first retry too, and
        # a dashboard shows 0 rather than "no data" on a healthy proxy.
        for mode in RETRY_MODES:
            for reason in RETRY_REASONS:
                self._retries.labels(mode, reason)
        self._probes_dropped = counter("probes_dropped", "Cached probe answers forgotten, by "
                                       "reason.", ("reason",))
        self._reason_queries = counter("reason_queries", "Control-channel queries explaining a "
                                       "failed leg.", ("outcome",))
        self._discovery = counter("discovery_changes", "Engines discovery added, drained, "
                                  "removed or resumed.", ("role", "change"))
        self._discovery_errors = counter("discovery_errors", "Discovery rounds in which a "
                                         "source failed.", ("source",))
        for role in ("prefill", "decode"):
            for change in DISCOVERY_CHANGES:
                self._discovery.labels(role, change)
        for source in DISCOVERY_SOURCES:
            self._discovery_errors.labels(source)
        self._ttft = histogram("ttft_seconds", "Time to first streamed byte as seen at the "
                               "proxy.", ("mode",))
        self._duration = histogram("request_duration_seconds", "Request received to response "
                                   "done.", ("mode",))
        self._upstream = histogram("upstream_seconds", "Request to an engine sent to its "
                                   "response headers received.", ("role",))
        self._prefill_leg = histogram("prefill_leg_seconds", "P's prefill leg, sent to answer "
                                      "read.", ("mode",))
        self._socket_wait = histogram("socket_wait_seconds", "Time a request waited in the "
                                      "proxy's socket before its handler ran (a lower bound).",
                                      ())
        self._engines = _Engines()
        r.register(self._engines)

    def watch_credit(self, credit: KvCredit) -> None:
        """Publish ``credit``'s per-engine KV credit (only while admission is on)."""
        self._engines.credit = credit

    def request_done(self, mode: str, outcome: str) -> None:
        self._requests.labels(mode, outcome).inc()

    def decision(self, configured: str, chosen: str, reason: str) -> None:
        self._decisions.labels(configured, chosen, reason).inc()

    def error(self, kind: str) -> None:
        self._errors.labels(kind).inc()

    def retry(self, mode: str, reason: str) -> None:
        self._retries.labels(mode, reason).inc()

    def probe_dropped(self, reason: str) -> None:
        self._probes_dropped.labels(reason).inc()

    def reason_query(self, outcome: str) -> None:
        self._reason_queries.labels(outcome).inc()

    def discovery_change(self, role: str, change: str) -> None:
        self._discovery.labels(role, change).inc()

    def discovery_error(self, source: str) -> None:
        self._discovery_errors.labels(source).inc()

    def observe_ttft(self, mode: str, seconds: float) -> None:
        self._ttft.labels(mode).observe(seconds)

    def observe_duration(self, mode: str, seconds: float) -> None:
        self._duration.labels(mode).observe(seconds)

    def observe_upstream(self, role: str, seconds: float) -> None:
        self._upstream.labels(role).observe(seconds)

    def observe_prefill_leg(self, mode: str, seconds: float) -> None:
        self._prefill_leg.labels(mode).observe(seconds)

    def observe_socket_wait(self, seconds: float) -> None:
        self._socket_wait.observe(seconds)

    def chosen_modes(self) -> dict[str, int]:
        """How many routing decisions chose each mode (``push`` / ``pull``), over all reasons."""
        out: dict[str, int] = {}
        for metric in self._decisions.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    chosen = s.labels.get("chosen", "?")
                    out[chosen] = out.get(chosen, 0) + int(s.value)
        return out

    def render(self, engines: Iterable[Engine]) -> str:
        """The Prometheus text exposition of every metric, engines' live gauges included."""
        listed = list(engines)
        self._engines.engines = lambda: listed
        return generate_latest(self.registry).decode()

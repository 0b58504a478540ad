"""OpenTelemetry spans of the proxy, following vLLM's own tracing configuration.

With ``--otlp-traces-endpoint URL`` (default ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, the names
vLLM uses) the proxy makes one ``kvbridge.request`` span per client request, and under it one
``kvbridge.prefill`` and one ``kvbridge.decode`` span per leg it sends (a retry: new legs). Each
leg's request to its engine carries a W3C ``traceparent`` naming that leg's span, so a vLLM
engine started with its own ``--otlp-traces-endpoint`` puts its request span under it: the
hand-off is one trace in any OTLP backend. Without an endpoint the proxy makes no span but
passes a client's valid ``traceparent`` (and ``tracestate``) on to both engines as it came
(:func:`pass_on`), so vLLM's spans still join the client's trace. With one, a client's valid
``traceparent`` is continued (the request span is its child, ``tracestate`` goes along
unchanged); a malformed one is ignored (a new trace, never an error). The exporter is vLLM's
choice too: OTLP over gRPC unless ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is ``http/protobuf``;
the service name is ``kvbridge-proxy`` unless ``$OTEL_SERVICE_NAME`` says otherwise.

Contract:

- This module imports no OpenTelemetry package at import time; :class:`ProxyTracing` imports the
  SDK when it is built, and only a proxy with an endpoint builds one. Without one, the proxy's
  cost is a ``None`` check per request and per leg, and a header lookup per request. The SDK
  missing while an endpoint is set is a :class:`~kvbridge.errors.ConfigError` at start, naming
  what to install.
- :func:`parse_traceparent` is pure and total: any string (oversized, non-ASCII, wrong version,
  all-zero ids) gives a :class:`TraceParent` or None, never a raise.
- Spans are exported in the background (a batch processor); :meth:`ProxyTracing.shutdown`
  flushes them. Export failures are the SDK's to log; they never fail a request.
- Runs on the proxy's one event loop: a :class:`RequestTrace` is not thread-safe.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tracing import TRACEPARENT_MAX, TraceParent, parse_traceparent

__all__ = ["TraceParent", "parse_traceparent", "pass_on", "ProxyTracing", "RequestTrace",
           "ENDPOINT_ENV", "PROTOCOL_ENV", "TRACEPARENT_MAX"]

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
#: longest ``tracestate`` passed on (W3C: 32 members of at most 256 characters … keep it small)
TRACESTATE_MAX = 512


def _tracestate(value: str | None) -> str | None:
    """``tracestate`` to pass on unchanged, when it is short printable ASCII."""
    if (not isinstance(value, str) or not value or len(value) > TRACESTATE_MAX
            or not value.isascii() or not value.isprintable()):
        return None
    return value


def pass_on(incoming: Mapping[str, str], out: dict[str, str]) -> None:
    """Copy a valid ``traceparent`` (and then a usable ``tracestate``) from ``incoming`` into
    ``out`` as they came (tracing off); an invalid one is dropped."""
    value = incoming.get("traceparent")
    if value is not None and parse_traceparent(value) is not None:
        out["traceparent"] = value.strip(" \t")
        state = _tracestate(incoming.get("tracestate"))
        if state is not None:
            out["tracestate"] = state


class ProxyTracing:
    """The proxy's tracer (see the module docstring): builds the SDK's provider and exporter.

    ``exporter``: an SDK ``SpanExporter`` to use instead of OTLP (tests: the in-memory one),
    exported synchronously, span by span.
    """

    def __init__(self, endpoint: str, exporter: Any = None) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode
        except ImportError as exc:
            raise ConfigError(
                "--otlp-traces-endpoint needs the OpenTelemetry SDK and an OTLP exporter: pip "
                f"install opentelemetry-sdk opentelemetry-exporter-otlp ({exc})") from None
        self._kind, self._status, self._code = SpanKind, Status, StatusCode
        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "kvbridge-proxy"}
        self.provider = TracerProvider(resource=Resource.create(attrs))
        if exporter is None:
            exporter = _otlp_exporter(endpoint)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvbridge.proxy")

    def start(self, headers: Mapping[str, str], rid: str, path: str,
              start_ns: int | None = None) -> RequestTrace:
        """The span of one client request, under the client's ``traceparent`` if it is valid;
        ``start_ns``: when it started (wall clock, ns), else now: the proxy passes the time its
        bytes reached its socket (:mod:`kvbridge.proxy.arrival`)."""
        from opentelemetry import trace

        parent = parse_traceparent(headers.get("traceparent"))
        ctx = None
        if parent is not None:
            remote = trace.SpanContext(parent.trace_id, parent.span_id, is_remote=True,
                                       trace_flags=trace.TraceFlags(parent.flags & 0xFF))
            ctx = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        span = self.tracer.start_span("kvbridge.request", context=ctx, kind=self._kind.SERVER,
                                      attributes={"kvbridge.request_id": rid,
                                                  "http.route": path}, start_time=start_ns)
        state = _tracestate(headers.get("tracestate")) if parent is not None else None
        return RequestTrace(self, span, state)

    def shutdown(self) -> None:
        """Export what is pending and stop (bounded by the SDK's own timeouts)."""
        self.provider.shutdown()


def _otlp_exporter(endpoint: str) -> Any:
    """vLLM's choice of exporter: gRPC unless ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is
    ``http/protobuf``."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            return OTLPSpanExporter(endpoint=endpoint, insecure=True)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )
            return HttpExporter(endpoint=endpoint)
    except ImportError as exc:
        raise ConfigError(f"--otlp-traces-endpoint with {PROTOCOL_ENV}={protocol} needs "
                          f"opentelemetry-exporter-otlp: {exc}") from None
    raise ConfigError(f"{PROTOCOL_ENV} must be grpc or http/protobuf (as for vLLM), got "
                      f"{protocol[:40]!r}")


class RequestTrace:
    """One client request's spans: its own, and the current span of each leg."""

    def __init__(self, tracing: ProxyTracing, span: Any, tracestate: str | None) -> None:
        self._t = tracing
        self.span = span
        self._state = tracestate
        self._legs: dict[str, Any] = {}

    def begin_leg(self, role: str, url: str, tid: str, mode: str) -> None:
        """A leg to the ``role`` engine at ``url`` starts now (a leg of that role still open,
        from an earlier attempt, ends first)."""
        from opentelemetry import trace

        self.end_leg(role)
        ctx = trace.set_span_in_context(self.span)
        self._legs[role] = self._t.tracer.start_span(
            f"kvbridge.{role}", context=ctx, kind=self._t._kind.CLIENT,
            attributes={"kvbridge.engine": url, "kvbridge.transfer_id": tid,
                        "kvbridge.mode": mode})

    def headers(self, role: str, base: dict[str, str]) -> dict[str, str]:
        """``base`` plus the ``traceparent`` (and client's ``tracestate``) of ``role``'s leg."""
        span = self._legs.get(role, self.span)
        sc = span.get_span_context()
        out = dict(base)
        out["traceparent"] = TraceParent(sc.trace_id, sc.span_id, int(sc.trace_flags)).header()
        if self._state:
            out["tracestate"] = self._state
        return out

    def end_leg(self, role: str, error: str | None = None) -> None:
        """``role``'s leg ended (``error``: how it failed); no-op when none is open."""
        span = self._legs.pop(role, None)
        if span is None:
            return
        if error:
            span.set_status(self._t._status(self._t._code.ERROR, error[:200]))
        span.end()

    def finish(self, mode: str, outcome: str, tid: str, retries: int) -> None:
        """The request ended: its span ends with what became of it (legs still open, such as
        a push's P draining after D answered, end on their own)."""
        self.span.set_attributes({"kvbridge.mode": mode, "kvbridge.outcome": outcome,
                                  "kvbridge.transfer_id": tid,
                                  "kvbridge.retries": max(0, retries)})
        if outcome not in ("ok", "cancelled"):
            self.span.set_status(self._t._status(self._t._code.ERROR, outcome))
        self.span.end()

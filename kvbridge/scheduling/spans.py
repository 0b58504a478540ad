"""Hand-off spans of one engine rank: a transfer's flight record as one OpenTelemetry span.

When vLLM traces (``--otlp-traces-endpoint``), it hands each request's ``traceparent`` (the
proxy's leg span, or the client's) to its engine core, and it sets up OpenTelemetry's tracer
provider in every engine process with its own exporter. The scheduler side of the connector then
passes each hand-off's ``traceparent`` to the ranks (:attr:`StepPlan.traces`); this module makes,
once the rank's part of the hand-off is over, one ``kvbridge.handoff`` span under it, through the
global tracer provider vLLM configured (same endpoint, protocol and resource as vLLM's own spans).
The span runs from the record's first event to its last; each flight-recorder event
(:mod:`kvbridge.scheduling.recorder`) is a span event at its own time, and each phase the rank
timed is an attribute ``kvbridge.phase.<phase>_ms``. So a hand-off is one trace from the client
through the proxy's legs into P's and D's vLLM request spans and kvbridge's hand-off spans.

When a rank's part is over:

- P: when the transfer's outcome is recorded (the WRITE done, D's DONE for a pull, a failure).
- D: at ``first_step`` (vLLM scheduled the request on the received KV); a receive that failed
  ends at its outcome.

Contract:

- :meth:`HandoffSpans.want`, :meth:`HandoffSpans.mark` and :meth:`HandoffSpans.ended` may be
  called from any thread (one lock). The thread that ends a part (the transfer loop, or the
  model-runner thread at ``first_step``) only copies the record and queues it; the span (tens
  of microseconds) is built on one background thread of its own, started with the first span,
  and exported by vLLM's batch processor. :meth:`HandoffSpans.flush` waits for what is queued.
  Export failures are OpenTelemetry's to log; they never touch a transfer.
- Bounded: at most ``capacity`` transfers wait for their end (the oldest is forgotten, without a
  span): a request vLLM aborted after its receive never gets a ``first_step``.
- Only transfers the scheduler named are traced; a malformed ``traceparent`` is ignored.
- Without the flight recorder (``flight_recorder`` off) there is no record: no span is made.
- No OpenTelemetry import at module import; the tracer is asked for when the first span is made.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbridge.scheduling.recorder import Recorder, local_phases
from kvbridge.tracing import parse_traceparent

__all__ = ["HandoffSpans", "SPAN_NAME"]

log = logging.getLogger("kvbridge.spans")

SPAN_NAME = "kvbridge.handoff"


class HandoffSpans:
    """See the module docstring. ``tracer``: an OpenTelemetry tracer to use instead of the global
    provider's (tests)."""

    def __init__(self, recorder: Recorder, engine_id: str, rank: int, tracer: Any = None,
                 capacity: int = 4096) -> None:
        self.recorder = recorder
        self.engine_id = engine_id
        self.rank = rank
        self.capacity = capacity
        self.made = 0
        self._tracer = tracer
        self._lock = threading.Lock()
        self._wanted: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._builder: ThreadPoolExecutor | None = None

    def want(self, transfer_id: str, traceparent: str) -> None:
        """Trace ``transfer_id`` under ``traceparent`` (ignored when malformed)."""
        if parse_traceparent(traceparent) is None:
            return
        with self._lock:
            self._wanted[transfer_id] = traceparent.strip(" \t")
            self._wanted.move_to_end(transfer_id)
            while len(self._wanted) > self.capacity:
                self._wanted.popitem(last=False)

    def mark(self, transfer_id: str, event: str) -> None:
        """A flight-recorder event was marked: ``first_step`` ends D's part."""
        if event == "first_step":
            self._finish(transfer_id, "done")

    def ended(self, transfer_id: str, outcome: str) -> None:
        """The transfer's outcome on this rank (``done`` or why not): P's part is over; D's is
        over if it failed (a received one waits for ``first_step``)."""
        if outcome == "done" and self._receiving(transfer_id):
            return
        self._finish(transfer_id, outcome)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every span queued so far is built and handed to the exporter."""
        with self._lock:
            builder = self._builder
        if builder is not None:
            builder.submit(lambda: None).result(timeout)

    def _receiving(self, transfer_id: str) -> bool:
        events = self.recorder.get(transfer_id)
        return events is not None and _side(events) == "decode"

    def _finish(self, transfer_id: str, outcome: str) -> None:
        with self._lock:
            parent = self._wanted.pop(transfer_id, None)
            if parent is not None and self._builder is None:
                self._builder = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-spans")
            builder = self._builder
        if parent is None or builder is None:
            return
        events = self.recorder.get(transfer_id)  # a copy, as of now
        if events:
            builder.submit(self._build, transfer_id, parent, events, outcome)

    def _build(self, tid: str, parent: str, events: dict[str, float], outcome: str) -> None:
        try:
            self._emit(tid, parent, events, outcome)
            self.made += 1
        except Exception:  # noqa: BLE001 - tracing never fails a transfer
            log.warning("kvbridge: could not make the span of transfer %s", tid[:64],
                        exc_info=True)

    def _emit(self, tid: str, parent: str, events: dict[str, float], outcome: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if self._tracer is None:
            self._tracer = trace.get_tracer("kvbridge.engine")
        ctx = TraceContextTextMapPropagator().extract({"traceparent": parent})
        ordered = sorted(events.items(), key=lambda kv: kv[1])
        attrs: dict[str, Any] = {"kvbridge.transfer_id": tid, "kvbridge.engine_id": self.engine_id,
                                 "kvbridge.rank": self.rank, "kvbridge.side": _side(events),
                                 "kvbridge.outcome": outcome[:200]}
        for phase, seconds in local_phases(events).items():
            attrs[f"kvbridge.phase.{phase}_ms"] = round(seconds * 1e3, 3)
        span = self._tracer.start_span(SPAN_NAME, context=ctx, kind=trace.SpanKind.INTERNAL,
                                       attributes=attrs, start_time=_ns(ordered[0][1]))
        for name, when in ordered:
            span.add_event(name, timestamp=_ns(when))
        if outcome != "done":
            span.set_status(trace.Status(trace.StatusCode.ERROR, outcome[:200]))
        span.end(end_time=_ns(ordered[-1][1]))


def _side(events: dict[str, float]) -> str:
    """Which side of the hand-off a rank's record is: only P marks ``kv_ready``."""
    return "prefill" if "kv_ready" in events else "decode"


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))

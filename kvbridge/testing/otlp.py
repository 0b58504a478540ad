"""A small OTLP/HTTP trace receiver on 127.0.0.1, for tests. NOT a collector.

It answers ``POST /v1/traces`` the way an OpenTelemetry collector does (protobuf
``ExportTraceServiceRequest`` in, an empty ``ExportTraceServiceResponse`` out), decodes each
span into a plain dict (:meth:`Receiver.spans`) and keeps it, so a test can start real processes
(the proxy, vLLM engines) with ``--otlp-traces-endpoint`` :attr:`Receiver.endpoint` and
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` and look at what they exported.

Needs ``opentelemetry-proto``. Serves from a thread; :meth:`Receiver.close` stops it. Bounded:
at most :data:`MAX_SPANS` spans are kept (later ones are dropped) and a body larger than
:data:`MAX_BODY` is refused (413), so a chatty process cannot fill a test's memory.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Receiver", "MAX_SPANS", "MAX_BODY"]

MAX_SPANS = 100_000
MAX_BODY = 64 << 20


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return None if kind is None else getattr(v, kind)


class Receiver:
    """See the module docstring. Each span: ``service``, ``name``, ``trace_id``, ``span_id``,
    ``parent`` (hex; ``""`` for a root), ``start_ns``, ``end_ns``, ``attributes`` (dict),
    ``events`` (``[(name, time_ns)]``), ``status`` (the status code's number: 2 is an error)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        self._lock = threading.Lock()
        self._spans: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                size = int(self.headers.get("Content-Length") or 0)
                if size > MAX_BODY:
                    self.send_error(413)
                    return
                req = pb.ExportTraceServiceRequest.FromString(self.rfile.read(size))
                receiver._add(req)
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="otlp-receiver")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The URL to give ``--otlp-traces-endpoint`` (OTLP/HTTP)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def _add(self, req: Any) -> None:
        got = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append({"service": service, "name": s.name,
                                "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "start_ns": s.start_time_unix_nano,
                                "end_ns": s.end_time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "events": [(e.name, e.time_unix_nano) for e in s.events],
                                "status": int(s.status.code)})
        with self._lock:
            self._spans.extend(got[:max(0, MAX_SPANS - len(self._spans))])

    def spans(self) -> list[dict[str, Any]]:
        """Every span received so far (a copy)."""
        with self._lock:
            return list(self._spans)

    def wait(self, cond: Callable[[list[dict[str, Any]]], bool],
             timeout: float = 15.0) -> list[dict[str, Any]]:
        """The spans, once ``cond(spans)`` holds or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if cond(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

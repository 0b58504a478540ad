"""kvbridge.proxy.tracing without a proxy: ``traceparent`` parsing (hostile input included),
the pass-through when tracing is off, the settings' check, and spans into the SDK's in-memory
exporter. No process is started (the proxy importing no OpenTelemetry without an endpoint:
test_proxy_layout.py)."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.settings import ProxySettings
from kvbridge.proxy.tracing import TRACEPARENT_MAX, TraceParent, parse_traceparent, pass_on

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_parses_and_round_trips() -> None:
    tp = parse_traceparent(GOOD)
    assert tp == TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
    assert tp.header() == GOOD
    assert parse_traceparent(" " + GOOD + "\t") == tp  # optional whitespace around a value
    # a later version may append fields; 00 may not
    assert parse_traceparent("01" + GOOD[2:] + "-extra") == TraceParent(tp.trace_id,
                                                                         tp.span_id, 1)


@pytest.mark.parametrize("value", [
    None, "", "garbage", GOOD.upper(), GOOD + "-extra", GOOD[:-1], GOOD + "0",
    "ff" + GOOD[2:],                                                   # version ff is invalid
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",          # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",          # all-zero span id
    "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",          # not hex
    "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
    "00-４bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",          # non-ASCII digit
    "01" + GOOD[2:] + "-" + "x" * TRACEPARENT_MAX,                      # oversized
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
    GOOD + "\x00",
])
def test_invalid_traceparents_are_none_never_a_raise(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_oversized_input_is_refused_without_scanning_it() -> None:
    assert parse_traceparent(GOOD + "-" + "0" * 10_000_000) is None


def test_pass_on_copies_only_a_valid_context() -> None:
    out: dict[str, str] = {}
    pass_on({"traceparent": GOOD, "tracestate": "vendor=abc"}, out)
    assert out == {"traceparent": GOOD, "tracestate": "vendor=abc"}
    for bad in ({"traceparent": "nope", "tracestate": "vendor=abc"},
                {"traceparent": GOOD, "tracestate": "x" * 10_000} | {"traceparent": "ff"},
                {"tracestate": "vendor=abc"}, {}):
        out = {}
        pass_on(bad, out)
        assert out == {}
    out = {}
    pass_on({"traceparent": GOOD, "tracestate": "a=1\x01" + "b" * 600}, out)
    assert out == {"traceparent": GOOD}  # an unusable tracestate is dropped alone


@pytest.mark.parametrize("endpoint", ["", "  ", "http://a b:4317", "http://x\n:1",
                                      "http://" + "a" * 3000])
def test_a_bad_endpoint_is_a_config_error(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint"):
        ProxySettings(["http://a:1"], ["http://b:2"], otlp_traces_endpoint=endpoint).check()


def test_spans_into_the_in_memory_exporter() -> None:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    from kvbridge.proxy.tracing import ProxyTracing

    exporter = memory.InMemorySpanExporter()
    tracing = ProxyTracing("http://unused:4317", exporter)
    trace = tracing.start({"traceparent": GOOD, "tracestate": "v=1"}, "rid-1", "/v1/completions")
    trace.begin_leg("prefill", "http://p:1", "xfer-1", "pull")
    headers = trace.headers("prefill", {"Authorization": "Bearer t"})
    trace.end_leg("prefill", "prefill_error")
    trace.end_leg("prefill")  # twice: a no-op
    trace.finish("pull", "upstream_error", "xfer-1", 0)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, leg = spans["kvbridge.request"], spans["kvbridge.prefill"]
    assert root.context.trace_id == leg.context.trace_id == parse_traceparent(GOOD).trace_id
    assert root.parent.span_id == parse_traceparent(GOOD).span_id
    assert leg.parent.span_id == root.context.span_id
    sent = parse_traceparent(headers["traceparent"])
    assert (sent.trace_id, sent.span_id) == (leg.context.trace_id, leg.context.span_id)
    assert headers["tracestate"] == "v=1" and headers["Authorization"] == "Bearer t"
    assert not leg.status.is_ok and not root.status.is_ok
    assert root.attributes["kvbridge.request_id"] == "rid-1"
    assert root.attributes["kvbridge.transfer_id"] == "xfer-1"
    assert root.resource.attributes["service.name"] == "kvbridge-proxy"



def test_a_request_span_starts_when_its_bytes_reached_the_proxy() -> None:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    from kvbridge.proxy.flight import Flight
    from kvbridge.proxy.tracing import ProxyTracing

    exporter = memory.InMemorySpanExporter()
    tracing = ProxyTracing("http://unused:4317", exporter)
    flight = Flight("rid-2")
    flight.waited(25_000_000)  # 25 ms in the proxy's socket
    assert flight.began_ns() == flight.wall0 - 25_000_000
    tracing.start({}, "rid-2", "/v1/completions", flight.began_ns()).finish("pull", "ok", "", 0)
    tracing.shutdown()
    (root,) = exporter.get_finished_spans()
    assert root.start_time == flight.wall0 - 25_000_000

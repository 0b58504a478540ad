"""kvbridge.scheduling.spans: a transfer's flight record as one OpenTelemetry span per rank, under
the traceparent vLLM kept for the request; and the flight recorder's off switch.

Spans go to the OpenTelemetry SDK's in-memory exporter (the engines use vLLM's provider)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvbridge.config import Config
from kvbridge.scheduling.handoff import StepPlan
from kvbridge.scheduling.rank import RankSide
from kvbridge.scheduling.recorder import Recorder
from kvbridge.scheduling.spans import SPAN_NAME, HandoffSpans
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import send

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID, PARENT_SPAN = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
P_EVENTS = ("arrived", "scheduled", "kv_ready", "ready_seen", "write_posted", "write_done")
D_EVENTS = ("arrived", "scheduled", "recv_start", "recv_done")


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def _spans(exporter: InMemorySpanExporter, rec: Recorder, engine: str = "e",
           **kw: Any) -> HandoffSpans:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return HandoffSpans(rec, engine, 0, tracer=provider.get_tracer("test"), **kw)


def _marked(rec: Recorder, tid: str, events: tuple[str, ...]) -> None:
    for e in events:
        rec.mark(tid, e)
        time.sleep(0.001)


def test_a_prefill_record_becomes_one_span_under_the_requests_traceparent(
        exporter: InMemorySpanExporter) -> None:
    rec = Recorder()
    spans = _spans(exporter, rec, "P-1")
    spans.want("t1", PARENT)
    _marked(rec, "t1", P_EVENTS)
    assert exporter.get_finished_spans() == ()
    spans.ended("t1", "done")
    spans.flush()
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_NAME
    assert span.context.trace_id == TRACE_ID and span.parent.span_id == PARENT_SPAN
    assert [e.name for e in span.events] == list(P_EVENTS)
    wall = rec.get("t1") or {}
    assert span.start_time == round(wall["arrived"] * 1e9)
    assert span.end_time == round(wall["write_done"] * 1e9)
    attrs = dict(span.attributes or {})
    assert attrs["kvbridge.side"] == "prefill" and attrs["kvbridge.engine_id"] == "P-1"
    assert attrs["kvbridge.transfer_id"] == "t1" and attrs["kvbridge.outcome"] == "done"
    for phase in ("queue", "prefill", "post", "wire"):
        assert attrs[f"kvbridge.phase.{phase}_ms"] >= 0.5  # 1 ms between marks
    assert span.status.status_code != StatusCode.ERROR
    spans.ended("t1", "done")
    spans.flush()
    assert len(exporter.get_finished_spans()) == 1  # once


def test_a_decode_span_ends_at_the_first_step_not_at_the_receive(
        exporter: InMemorySpanExporter) -> None:
    rec = Recorder()
    spans = _spans(exporter, rec)
    spans.want("t2", PARENT)
    _marked(rec, "t2", D_EVENTS)
    spans.ended("t2", "done")  # the KV landed; vLLM has not scheduled the request yet
    spans.flush()
    assert exporter.get_finished_spans() == ()
    _marked(rec, "t2", ("recv_seen",))
    rec.mark("t2", "first_step")
    spans.mark("t2", "first_step")
    spans.flush()
    (span,) = exporter.get_finished_spans()
    assert [e.name for e in span.events] == [*D_EVENTS, "recv_seen", "first_step"]
    assert dict(span.attributes or {})["kvbridge.side"] == "decode"
    assert "kvbridge.phase.first_step_ms" in dict(span.attributes or {})


def test_a_failed_receive_ends_its_span_with_an_error(exporter: InMemorySpanExporter) -> None:
    rec = Recorder()
    spans = _spans(exporter, rec)
    spans.want("t3", PARENT)
    _marked(rec, "t3", ("arrived", "scheduled", "recv_start"))
    spans.ended("t3", "failed: checksum mismatch in part 0")
    spans.flush()
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert "checksum" in (span.status.description or "")


@pytest.mark.parametrize("parent", ["", "00-zz", "ff-" + PARENT[3:], "x" * 10_000,
                                    "00-00000000000000000000000000000000-00f067aa0ba902b7-01"])
def test_untraced_or_malformed_transfers_make_no_span(exporter: InMemorySpanExporter,
                                                     parent: str) -> None:
    rec = Recorder()
    spans = _spans(exporter, rec)
    spans.want("bad", parent)
    for tid in ("bad", "never-wanted"):
        _marked(rec, tid, P_EVENTS)
        spans.ended(tid, "done")
    spans.flush()
    assert exporter.get_finished_spans() == ()


def test_waiting_transfers_are_bounded(exporter: InMemorySpanExporter) -> None:
    rec = Recorder()
    spans = _spans(exporter, rec, capacity=4)
    for i in range(10):
        spans.want(f"t{i}", PARENT)
        rec.mark(f"t{i}", "kv_ready")
    for i in range(10):
        spans.ended(f"t{i}", "done")
    spans.flush()
    assert [dict(s.attributes or {})["kvbridge.transfer_id"]
            for s in exporter.get_finished_spans()] == ["t6", "t7", "t8", "t9"]


def test_a_recorder_turned_off_records_nothing_and_makes_no_span(
        exporter: InMemorySpanExporter) -> None:
    phases: list[str] = []
    rec = Recorder(on_phase=lambda p, s: phases.append(p), enabled=False)
    spans = _spans(exporter, rec)
    spans.want("t", PARENT)
    _marked(rec, "t", P_EVENTS)
    spans.ended("t", "done")
    assert rec.get("t") is None and len(rec) == 0 and phases == []
    spans.flush()
    assert exporter.get_finished_spans() == ()


def test_the_setting_reaches_the_loops_recorder(local_pd: tuple[LocalAgent, LocalAgent]) -> None:
    assert Config().flight_recorder is True
    assert Config.load(env={"KVBRIDGE_FLIGHT_RECORDER": "0"}).flight_recorder is False
    p, _ = local_pd
    assert p.loop.recorder.enabled


def test_a_traced_push_makes_a_span_on_each_side(local_pd: tuple[LocalAgent, LocalAgent],
                                                 exporter: InMemorySpanExporter) -> None:
    """Through real transfer loops: D registers, P's step plan names the traceparent, the WRITE
    lands; P's span ends with the outcome, D's once vLLM's scheduler saw the first step."""
    from test_rank import _registered, _Results

    p, d = local_pd
    for agent in (p, d):
        agent.loop.trace_spans(_spans(exporter, agent.loop.recorder, agent.loop.engine_id))
    p_side, d_side = RankSide(p.loop), RankSide(d.loop)
    d_side.apply(StepPlan(traces=[("t", PARENT)]))
    _registered(d_side, p, [5, 6])
    p_side.apply(StepPlan(push_ready=[send("p", "t", [1, 2])], prefill_done=["t"],
                          traces=[("t", PARENT)], marks=[("t", "scheduled", time.time())]))
    p_side.after_forward()
    d_res = _Results(d_side)
    assert d_res.until(lambda: "d" in d_res.recving)
    deadline = time.monotonic() + 5
    while not exporter.get_finished_spans() and time.monotonic() < deadline:
        time.sleep(0.01)
    (p_span,) = exporter.get_finished_spans()
    assert dict(p_span.attributes or {})["kvbridge.side"] == "prefill"
    assert {"kv_ready", "write_posted", "write_done"} <= {e.name for e in p_span.events}
    d_side.apply(StepPlan(marks=[("t", "recv_seen", time.time()),
                                 ("t", "first_step", time.time())]))
    d.loop.spans.flush()  # type: ignore[union-attr]
    spans = exporter.get_finished_spans()
    assert len(spans) == 2 and {s.context.trace_id for s in spans} == {TRACE_ID}
    d_span = spans[1]
    assert dict(d_span.attributes or {})["kvbridge.side"] == "decode"
    assert d_span.events[-1].name == "first_step"


class _Req:
    def __init__(self, headers: Any) -> None:
        self.trace_headers = headers


class _Cfg:
    def __init__(self, endpoint: str | None) -> None:
        self.observability_config = type("O", (), {"otlp_traces_endpoint": endpoint})()


@pytest.mark.parametrize(("headers", "want"), [
    ({"traceparent": PARENT}, PARENT),
    ({"traceparent": PARENT, "tracestate": "a=b"}, PARENT),
    (None, None), ({}, None), ({"traceparent": None}, None), ({"traceparent": 7}, None),
    ({"traceparent": PARENT.upper()}, None), ({"traceparent": PARENT + "-" + "x" * 100_000}, None),
    ("not a mapping", None), ([("traceparent", PARENT)], None),
])
def test_the_scheduler_passes_on_only_a_valid_traceparent(headers: Any, want: str | None) -> None:
    """What vLLM kept from the request's headers is the client's (or the proxy's): only a
    valid W3C traceparent goes into the step plan, whatever its size or type."""
    from kvbridge.integrations.vllm_meta import trace_parent, traces_enabled

    assert trace_parent(_Req(headers)) == want
    assert traces_enabled(_Cfg("http://127.0.0.1:4317"))
    assert not traces_enabled(_Cfg(None)) and not traces_enabled(object())

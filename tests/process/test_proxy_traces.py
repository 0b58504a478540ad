"""The proxy's OpenTelemetry spans over real HTTP, against stand-in engines that trace like vLLM.

Each stand-in engine answers just enough of vLLM's API and of the connector's
``kv_transfer_params`` contract for a pull or a push, records the headers it got, and — like a
vLLM started with ``--otlp-traces-endpoint`` — makes its own ``llm_request`` span under the
``traceparent`` it was sent (OpenTelemetry's W3C propagator, as vLLM uses). The stand-ins are NOT
vLLM. Spans go to the SDK's in-memory exporter (a proxy in this process), or, for the real
``kvbridge proxy`` process, over OTLP/HTTP to a small receiver on 127.0.0.1 that decodes the
protobuf export requests (opentelemetry-proto) the way a collector does
(:mod:`kvbridge.testing.otlp`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvbridge.proxy.app import ProxyServer
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings
from kvbridge.proxy.tracing import parse_traceparent
from kvbridge.testing.otlp import Receiver

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import (  # noqa: E402
    TraceContextTextMapPropagator,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
CLIENT_TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
BODY = {"model": "m", "prompt": "The capital of France is", "max_tokens": 4}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Engine:
    """A stand-in engine of ``role`` that traces like vLLM into ``exporter``."""

    def __init__(self, role: str, exporter: SpanExporter) -> None:
        self.role = role
        self.headers: list[dict[str, str]] = []  # of generation requests (not probes)
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("vllm.standin")
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Engine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self.provider.shutdown()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "m", "max_model_len": 1024}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kvp = body.get("kv_transfer_params") or {}
        address = {"remote_engine_id": "P-standin", "remote_host": "127.0.0.1",
                   "remote_port": 5601, "tp_size": 1}
        if kvp.get("kvbridge_probe"):
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
                **address, "kvbridge_version": "0.1.0"}})
        self.headers.append(dict(request.headers))
        ctx = TraceContextTextMapPropagator().extract(carrier=dict(request.headers))
        with self.tracer.start_as_current_span("llm_request", context=ctx):  # vLLM's name
            if self.role == "prefill":
                return web.json_response({"choices": [{"index": 0, "text": "A"}],
                                          "kv_transfer_params": {
                    **address, "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_block_ids": [3, 4, 5], "transfer_id": kvp.get("transfer_id"),
                    "transfer_mode": kvp.get("transfer_mode", "pull")}})
            return web.json_response({"choices": [{"index": 0, "text": "t0t1"}]})


@pytest.fixture
async def standins() -> AsyncIterator[Callable[..., Any]]:
    started: list[Engine] = []

    async def make(exporter: SpanExporter) -> tuple[Engine, Engine]:
        p, d = await Engine("prefill", exporter).start(), await Engine("decode", exporter).start()
        started.extend((p, d))
        return p, d

    yield make
    for e in started:
        await e.stop()


async def _traced(standins: Any, mode: ProxyMode) -> tuple[Any, Engine, Engine, ProxyServer]:
    memory = InMemorySpanExporter()
    p, d = await standins(memory)
    proxy = ProxyServer(ProxySettings([p.url], [d.url], mode=mode, port=0, timeout_s=20.0,
                                      otlp_traces_endpoint="http://unused:4317"),
                        span_exporter=memory)
    await proxy.start()
    return memory, p, d, proxy


async def _post(proxy: ProxyServer, headers: dict[str, str]) -> str:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + "/v1/completions", json=BODY,
                                                     headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Request-Id"]


def _check_one_trace(spans: list[Any], p: Engine, d: Engine, trace_id: int | None) -> Any:
    """The proxy's request span, its two legs under it, each engine's span under its leg, and
    each engine sent the ``traceparent`` of its leg: one trace. Returns the request span."""
    by = {}
    for s in spans:
        by.setdefault(s.name, []).append(s)
    (root,) = by["kvbridge.request"]
    (pleg,), (dleg,) = by["kvbridge.prefill"], by["kvbridge.decode"]
    engine_spans = {s.parent.span_id: s for s in by["llm_request"]}
    tid = root.context.trace_id
    if trace_id is not None:
        assert tid == trace_id
    assert {s.context.trace_id for s in spans} == {tid}
    assert pleg.parent.span_id == dleg.parent.span_id == root.context.span_id
    for leg, engine in ((pleg, p), (dleg, d)):
        (sent,) = engine.headers
        tp = parse_traceparent(sent["traceparent"])
        assert tp is not None and (tp.trace_id, tp.span_id) == (tid, leg.context.span_id)
        assert leg.context.span_id in engine_spans  # vLLM's span joined under the leg
        assert leg.attributes["kvbridge.engine"] == engine.url
        assert leg.attributes["kvbridge.transfer_id"] == root.attributes["kvbridge.transfer_id"]
    assert re.fullmatch(r"xfer-[0-9a-f]{32}", root.attributes["kvbridge.transfer_id"])
    assert root.attributes["kvbridge.outcome"] == "ok"
    return root


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_one_trace_from_proxy_to_both_engines(standins: Any, mode: ProxyMode) -> None:
    memory, p, d, proxy = await _traced(standins, mode)
    try:
        rid = await _post(proxy, {})
    finally:
        await proxy.stop()
    root = _check_one_trace(list(memory.get_finished_spans()), p, d, None)
    assert root.parent is None  # no client context: a new trace
    assert root.attributes["kvbridge.request_id"] == rid
    assert root.attributes["kvbridge.mode"] == mode.value


async def test_a_clients_traceparent_is_continued(standins: Any) -> None:
    memory, p, d, proxy = await _traced(standins, ProxyMode.PUSH)
    try:
        await _post(proxy, {"traceparent": CLIENT_TP, "tracestate": "vendor=abc"})
    finally:
        await proxy.stop()
    root = _check_one_trace(list(memory.get_finished_spans()), p, d, CLIENT_TRACE)
    assert root.parent.span_id == 0x00F067AA0BA902B7
    assert p.headers[0]["tracestate"] == d.headers[0]["tracestate"] == "vendor=abc"


@pytest.mark.parametrize("bad", [
    "garbage", CLIENT_TP.upper(), "ff" + CLIENT_TP[2:], "01" + CLIENT_TP[2:] + "-" + "a" * 4000,
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
])
async def test_a_malformed_traceparent_starts_a_new_trace(standins: Any, bad: str) -> None:
    memory, p, d, proxy = await _traced(standins, ProxyMode.PULL)
    try:
        await _post(proxy, {"traceparent": bad, "tracestate": "vendor=abc"})
    finally:
        await proxy.stop()
    root = _check_one_trace(list(memory.get_finished_spans()), p, d, None)
    assert root.parent is None and root.context.trace_id != CLIENT_TRACE
    assert "tracestate" not in p.headers[0]  # it belonged to the refused context


async def test_without_tracing_a_valid_client_context_passes_on_as_it_came(
        standins: Any) -> None:
    memory = InMemorySpanExporter()
    p, d = await standins(memory)
    proxy = ProxyServer(ProxySettings([p.url], [d.url], mode=ProxyMode.PULL, port=0))
    await proxy.start()
    try:
        assert proxy.tracing is None
        await _post(proxy, {"traceparent": CLIENT_TP})
        await _post(proxy, {"traceparent": "nonsense"})
    finally:
        await proxy.stop()
    assert [h.get("traceparent") for h in p.headers] == [CLIENT_TP, None]
    assert [h.get("traceparent") for h in d.headers] == [CLIENT_TP, None]
    assert {s.name for s in memory.get_finished_spans()} == {"llm_request"}  # the engines' only


# ------------------------------------------------------------------ a real process, over OTLP


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    r = Receiver()
    yield r
    r.close()


async def test_a_proxy_process_exports_over_otlp_into_the_requests_trace(
        standins: Any, receiver: Receiver) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    p, d = await standins(OTLPSpanExporter(endpoint=receiver.endpoint))  # "vLLM" exports too
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL":
           "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    env.pop("OTEL_SERVICE_NAME", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbridge.proxy", "--log-level", "WARNING", "--prefill", p.url,
        "--decode", d.url, "--mode", "push", "--port", "0", "--otlp-traces-endpoint",
        receiver.endpoint, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        async with aiohttp.ClientSession() as s, s.post(
                m.group(1) + "/v1/completions", json=BODY,
                headers={"traceparent": CLIENT_TP}) as r:
            assert r.status == 200, await r.text()
        proc.terminate()  # shutting down flushes what is pending
        assert await asyncio.wait_for(proc.wait(), 15.0) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    spans = receiver.spans()
    ours = {s["name"]: s for s in spans if s["service"] == "kvbridge-proxy"}
    assert set(ours) == {"kvbridge.request", "kvbridge.prefill", "kvbridge.decode"}, spans
    engines = [s for s in spans if s["name"] == "llm_request"]
    assert len(engines) == 2
    assert {s["trace_id"] for s in spans} == {f"{CLIENT_TRACE:032x}"}  # one trace id
    assert ours["kvbridge.request"]["parent"] == "00f067aa0ba902b7"
    legs = {ours["kvbridge.prefill"]["span_id"], ours["kvbridge.decode"]["span_id"]}
    assert {s["parent"] for s in engines} == legs
    assert json.dumps(spans)  # plain data

"""The kvbridge proxy over real HTTP against *stand-in* engines.

The stand-in engines below are small aiohttp servers on 127.0.0.1 (port 0) that implement just
enough of vLLM's OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health) and of
KVBridgeConnector's ``kv_transfer_params`` contract (probe answer, P's returned params) to check
what the proxy sends, when, and what it does with the answers. They are NOT vLLM: real engines
are covered by the end-to-end tests. Each stand-in records every request it got with its start
and end times and whether the proxy went away mid-request (so vLLM would have aborted it).

:class:`FakeControl` stands in for an engine rank's control channel: a real
:class:`~kvbridge.control.ControlServer` answered by a small thread, which tells the proxy what
happened to a transfer (``TransferQuery`` → ``TransferReply``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
from aiohttp import web

from kvbridge import trust
from kvbridge.control import ControlServer
from kvbridge.errors import ConfigError
from kvbridge.messages import Ack, Codec, DrainNotice, TransferQuery, TransferReply
from kvbridge.proxy.app import ProxyServer
from kvbridge.proxy.credit import KvAdmission
from kvbridge.proxy.discovery import DnsSource
from kvbridge.proxy.relay import stream_error
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings
from kvbridge.testing.clients import engine_codec
from kvbridge.tools import prom

P = "kvbridge_proxy_"
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------------------ stand-in engines


@dataclass
class Seen:
    """One request a stand-in engine received."""

    path: str
    body: dict[str, Any]
    headers: Any  # case-insensitive multidict
    t_start: float
    t_end: float = 0.0
    cancelled: bool = False


@dataclass
class StandIn:
    """A stand-in engine (see the module docstring). Knobs are read per request."""

    role: str  # "prefill" | "decode"
    prefill_delay: float = 0.0
    first_delay: float = 0.0  # decode: before the first chunk / the answer
    chunk_delay: float = 0.0
    chunks: int = 3
    fail_status: int | None = None
    no_params: bool = False  # prefill: answer like an engine without the connector
    headers_first: bool = False  # decode stream: send headers before first_delay (like vLLM)
    break_after: int | None = None  # decode stream: drop the connection after N chunks
    health_status: int = 200
    engine_id: str = "P-standin"
    generation: str | None = None  # kvbridge_generation in probe and prefill answers
    identity: str | None = None  # kvbridge_identity in probe and prefill answers
    control_port: int = 5601  # the control address it reports (a FakeControl's port)
    answers_probe: bool | None = None  # default: prefill yes, decode no (like old stand-ins)
    error_answer: str | None = None  # prefill: answer kvbridge_error (nothing handed off)
    bad_params: dict[str, Any] | None = None  # prefill: merged into its answer's params
    fail_first: int = 0  # with fail_status: fail only the first N generation requests
    kv_blocks: int | None = None  # /metrics: vLLM's cache_config_info with this many blocks
    local_per_token: float = 0.0  # decode: seconds per prompt token of a request it prefills
    # itself (no kv_transfer_params: D alone), before its first chunk
    handoff_delay: float = 0.0  # decode: seconds a hand-off's KV takes to arrive (a request
    # with kv_transfer_params), before its first chunk
    error_event: bool = False  # decode stream: 200, then an in-band error event (vLLM's way
    # of failing a streamed request after its headers, e.g. a KV load); fail_first applies
    seen: list[Seen] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, probe: bool = False) -> list[Seen]:
        """Generation requests seen (probes excluded unless ``probe``)."""
        return [
            s
            for s in self.seen
            if bool((s.body.get("kv_transfer_params") or {}).get("kvbridge_probe")) == probe
        ]

    async def start(self) -> StandIn:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)  # 0: a free port
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": f"standin-{self.role}", "max_model_len": 1024}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
        if self.kv_blocks is not None:
            text += ("# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="
                     f'"32",engine="0",num_gpu_blocks="{self.kv_blocks}"}} 1.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    def _address(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.control_port,
            "tp_size": 1,
        }
        if self.generation is not None:
            out["kvbridge_generation"] = self.generation
        if self.identity is not None:
            out["kvbridge_identity"] = self.identity
        return out

    def _failing(self) -> bool:
        if self.fail_status is None:
            return False
        return not self.fail_first or len(self.requests()) <= self.fail_first

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen = Seen(request.path, body, request.headers.copy(), time.monotonic())
        self.seen.append(seen)
        kvp = body.get("kv_transfer_params") or {}
        answers_probe = self.role == "prefill" if self.answers_probe is None else self.answers_probe
        try:
            if kvp.get("kvbridge_probe") and answers_probe and not self.no_params:
                params = {**self._address(), "kvbridge_version": "0.1.0", **(self.bad_params or {})}
                return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})
            if self.role == "prefill":
                return await self._prefill(body)
            return await self._decode(request, body)
        except asyncio.CancelledError:
            seen.cancelled = True
            self.cancelled.set()
            raise
        finally:
            seen.t_end = time.monotonic()

    async def _prefill(self, body: dict[str, Any]) -> web.Response:
        kvp = body.get("kv_transfer_params") or {}
        await asyncio.sleep(self.prefill_delay)
        if self._failing():
            assert self.fail_status is not None
            err = {"error": {"message": "stand-in prefill failure", "code": self.fail_status}}
            return web.json_response(err, status=self.fail_status)
        answer: dict[str, Any] = {"id": "cmpl-p", "choices": [{"index": 0, "text": "A"}]}
        if self.error_answer is not None:
            answer["kv_transfer_params"] = {"kvbridge_error": self.error_answer}
        elif not self.no_params:
            answer["kv_transfer_params"] = {
                **self._address(),
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [3, 4, 5],
                "transfer_id": kvp.get("transfer_id"),
                "transfer_mode": kvp.get("transfer_mode", "pull"),
                **(self.bad_params or {}),
            }
        return web.json_response(answer)

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if (self.error_event and body.get("stream")
                and (not self.fail_first or len(self.requests()) <= self.fail_first)):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await asyncio.sleep(self.first_delay)
            err = {"error": {"message": "stand-in KV load failed", "type": "InternalServerError",
                             "code": 500}}
            await out.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            await out.write_eof()
            return out
        if self.headers_first and body.get("stream") and not self._failing():
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await asyncio.sleep(self.first_delay)
            for chunk in sse_chunks(self.chunks):
                await out.write(chunk)
                await asyncio.sleep(self.chunk_delay)
            await out.write_eof()
            return out
        await asyncio.sleep(self.first_delay)
        if body.get("kv_transfer_params"):
            await asyncio.sleep(self.handoff_delay)
        elif self.local_per_token:
            prompt = body.get("prompt")
            await asyncio.sleep(self.local_per_token * len(prompt if isinstance(prompt, list)
                                                          else str(prompt)))
        if self._failing():
            assert self.fail_status is not None
            err = {"error": {"message": "stand-in decode failure", "code": self.fail_status}}
            return web.json_response(err, status=self.fail_status)
        if not body.get("stream"):
            text = "".join(f"t{i}" for i in range(self.chunks))
            return web.json_response({"id": "cmpl-d", "choices": [{"index": 0, "text": text}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, chunk in enumerate(sse_chunks(self.chunks)):
            if i == self.break_after:
                assert request.transport is not None
                request.transport.close()  # the engine dies mid-stream
                return out
            await out.write(chunk)
            await asyncio.sleep(self.chunk_delay)
        await out.write_eof()
        return out


def sse_chunks(n: int) -> list[bytes]:
    events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(n)]
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def dead_url() -> str:
    """A 127.0.0.1 URL nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakeControl:
    """An engine rank's control channel: a real ControlServer, answered by a thread.

    ``outcomes`` maps transfer ids to what the rank says happened (``"failed: …"``); ``default``
    is said of any other id (None: the rank does not know it). Every TransferQuery is recorded,
    and every DrainNotice counted (``notices``). ``secret``: the fleet secret it authenticates
    with (default: the per-user one local engines use).
    """

    def __init__(self, default: str | None = None, *, refuse: bool = False,
                 secret: str | None = None) -> None:
        codec = Codec(secret.encode()) if secret else engine_codec()  # as a local engine
        self.server = ControlServer(codec, "127.0.0.1", 0)
        self.port = self.server.port
        self.default = default
        self.refuse = refuse
        self.outcomes: dict[str, str] = {}
        #: transfer id -> flight record ({step: wall time}) answered to a query with timings
        self.records: dict[str, dict[str, float]] = {}
        self.queries: list[list[str]] = []
        self.notices = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-control", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.server.socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            for ctx, msg in self.server.receive():
                if isinstance(msg, DrainNotice) and not self.refuse:
                    self.notices += 1
                    self.server.reply(ctx, Ack(ok=True))
                    continue
                if not isinstance(msg, TransferQuery) or self.refuse:
                    self.server.reply(ctx, Ack(ok=False, error="not answering"))
                    continue
                self.queries.append(list(msg.transfer_ids))
                said = {t: o for t in msg.transfer_ids
                        if (o := self.outcomes.get(t, self.default)) is not None}
                timings = {t: r for t in msg.transfer_ids
                           if msg.timings and (r := self.records.get(t)) is not None}
                self.server.reply(ctx, TransferReply(outcomes=said, timings=timings))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.server.close()


@pytest.fixture
def controls() -> Iterator[Callable[..., FakeControl]]:
    started: list[FakeControl] = []

    def make(default: str | None = None, **kw: Any) -> FakeControl:
        c = FakeControl(default, **kw)
        started.append(c)
        return c

    yield make
    for c in started:
        c.close()


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started stand-ins; all are stopped at teardown, even on failure."""
    started: list[StandIn] = []

    async def make(role: str, **knobs: Any) -> StandIn:
        e = await StandIn(role, **knobs).start()
        started.append(e)
        return e

    yield make
    for e in started:
        await e.stop()


@pytest.fixture
async def proxies() -> AsyncIterator[Callable[..., Any]]:
    started: list[ProxyServer] = []

    async def make(prefill: list[str], decode: list[str], **kw: Any) -> ProxyServer:
        kw.setdefault("mode", ProxyMode.PULL)
        kw.setdefault("timeout_s", 20.0)
        kw.setdefault("connect_timeout_s", 1.0)
        kw.setdefault("control_timeout_s", 0.5)
        server = ProxyServer(ProxySettings(prefill, decode, port=0, **kw))
        await server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


COMPLETION = {
    "model": "m",
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "min_tokens": 2,
    "temperature": 0.0,
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
}
XFER = re.compile(r"xfer-[0-9a-f]{32}")


async def post(client: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with client.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


# ------------------------------------------------------------------------------ pull


async def test_pull_sequencing(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill", prefill_delay=0.1)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)

    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == "t0t1t2"  # D's answer, not P's

    [ps] = p.requests()
    [ds] = d.requests()
    assert p.requests(probe=True) == []  # pull never probes
    assert ps.body["max_tokens"] == 1 and ps.body["stream"] is False
    assert "min_tokens" not in ps.body and ps.body["prompt"] == COMPLETION["prompt"]
    kvp = dict(ps.body["kv_transfer_params"])
    tid = kvp.pop("transfer_id")
    assert XFER.fullmatch(tid)
    assert kvp == {"do_remote_decode": True, "transfer_mode": "pull"}
    # D: the original request, with P's returned params unchanged, sent after P answered
    assert ds.t_start >= ps.t_end
    expected = {**COMPLETION, "kv_transfer_params": ds.body["kv_transfer_params"]}
    assert ds.body == expected
    assert ds.body["kv_transfer_params"]["remote_block_ids"] == [3, 4, 5]
    assert ds.body["kv_transfer_params"]["transfer_id"] == tid
    assert ps.headers["X-Request-Id"] == ds.headers["X-Request-Id"]


async def test_pull_chat_streaming_passthrough(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode", chunks=4, chunk_delay=0.3)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)

    arrivals: list[float] = []
    received = b""
    async with client.post(proxy.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in r.content.iter_any():
            arrivals.append(time.monotonic())
            received += chunk
    assert received == b"".join(sse_chunks(4))
    [ps], [ds] = p.requests(), d.requests()
    assert ps.path == ds.path == "/v1/chat/completions"
    assert ps.body["max_completion_tokens"] == 1 and ps.body["max_tokens"] == 1
    assert "stream_options" not in ps.body and ps.body["stream"] is False
    assert ds.body["stream"] is True and ds.body["stream_options"] == {"include_usage": True}
    # passthrough, not buffering: the first bytes arrived while D was still generating
    assert arrivals[0] < ds.t_end - 0.5


async def test_pull_picks_least_loaded_decode_after_prefill(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill")
    busy = await engines("decode", chunks=2, chunk_delay=0.4)
    idle = await engines("decode")
    proxy = await proxies([p.url], [busy.url, idle.url], mode=ProxyMode.PULL)
    # occupy `busy` with a slow stream, then the next request must go to `idle`
    slow = asyncio.ensure_future(post_stream(client, proxy.url, {**COMPLETION, "stream": True}))
    while not busy.requests():
        await asyncio.sleep(0.01)
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    assert len(idle.requests()) == 1 and len(busy.requests()) == 1
    await slow


async def post_stream(client: aiohttp.ClientSession, base: str, body: Any) -> bytes:
    async with client.post(base + "/v1/completions", json=body) as r:
        return await r.read()


# ------------------------------------------------------------------------------ push


async def test_push_dispatches_prefill_and_decode_concurrently(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", prefill_delay=0.5, engine_id="P-42")
    d = await engines("decode", first_delay=0.6)  # D "waits for the pushed KV"
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)

    for _ in range(2):
        status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == "t0t1t2"
    assert len(p.requests(probe=True)) == 1  # discovered once, then cached
    probe = p.requests(probe=True)[0].body
    assert probe == {
        "model": "standin-prefill",
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": {"kvbridge_probe": True},
    }
    ps, ds = p.requests()[0], d.requests()[0]
    # concurrency: D's request started before P's prefill finished, and vice versa
    assert ds.t_start < ps.t_end and ps.t_start < ds.t_end
    assert abs(ds.t_start - ps.t_start) < 0.4
    tid = ps.body["kv_transfer_params"]["transfer_id"]
    assert XFER.fullmatch(tid)
    assert ps.body["kv_transfer_params"]["transfer_mode"] == "push"
    assert ps.body["max_tokens"] == 1 and ps.body["kv_transfer_params"]["do_remote_decode"]
    assert ds.body["max_tokens"] == 16 and ds.body["min_tokens"] == 2
    assert ds.body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": tid,
        "remote_engine_id": "P-42",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
    }
    # a fresh transfer id per dispatch
    assert p.requests()[1].body["kv_transfer_params"]["transfer_id"] != tid


async def test_push_streaming_passthrough(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill", prefill_delay=0.2)
    d = await engines("decode", chunks=5)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    assert await post_stream(client, proxy.url, {**COMPLETION, "stream": True}) == b"".join(
        sse_chunks(5)
    )
    [ps] = p.requests()
    assert ps.body["stream"] is False and not ps.cancelled


@pytest.mark.parametrize(("stream", "headers_first"), [(False, False), (True, False), (True, True)])
async def test_push_prefill_failure_aborts_decode_with_502(
    engines: Any, proxies: Any, client: Any, stream: bool, headers_first: bool
) -> None:
    p = await engines("prefill", prefill_delay=0.2, fail_status=500)
    d = await engines("decode", first_delay=10.0, headers_first=headers_first)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    await proxy.discover()
    t0 = time.monotonic()
    body = {**COMPLETION, "stream": stream}
    status, answer = await post(client, proxy.url + "/v1/completions", body)
    assert status == 502 and "prefill" in answer["error"]["message"]
    assert time.monotonic() - t0 < 3.0
    await asyncio.wait_for(d.cancelled.wait(), 5.0)  # the D leg's connection was closed
    assert d.requests()[0].cancelled
    assert proxy.prefills.engines[0].probe is None  # re-discovered on the next push


async def test_push_decode_failure_returns_its_error(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", prefill_delay=5.0)
    d = await engines("decode", fail_status=503)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    t0 = time.monotonic()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 503 and answer["error"]["message"] == "stand-in decode failure"
    assert time.monotonic() - t0 < 3.0
    await asyncio.wait_for(p.cancelled.wait(), 5.0)  # P leg closed too


async def test_push_mode_with_dead_prefill_is_502(engines: Any, proxies: Any, client: Any) -> None:
    d = await engines("decode")
    proxy = await proxies([dead_url()], [d.url], mode=ProxyMode.PUSH)
    t0 = time.monotonic()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502 and "control address" in answer["error"]["message"]
    assert time.monotonic() - t0 < 3.0
    assert d.requests() == []
    assert proxy.decodes.engines[0].in_flight == 0


# -------------------------------------------------------------------------- headroom


async def test_headroom_switches_push_to_pull_under_load(
    engines: Any, proxies: Any, client: Any
) -> None:
    """headroom: the rule auto was before the planner, unchanged."""
    p = await engines("prefill")
    d = await engines("decode", chunks=3, chunk_delay=0.5)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.HEADROOM, push_headroom=1)
    await proxy.discover()

    first = asyncio.ensure_future(post_stream(client, proxy.url, {**COMPLETION, "stream": True}))
    while not d.requests():
        await asyncio.sleep(0.01)
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)  # D is busy
    assert status == 200
    await first
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)  # D idle again
    assert status == 200

    modes = [s.body["kv_transfer_params"]["transfer_mode"] for s in p.requests()]
    assert modes == ["push", "pull", "push"]
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "mode_decisions_total", configured="headroom", chosen="push",
                      reason="headroom") == 2
    assert prom.value(text, P + "mode_decisions_total", configured="headroom", chosen="pull",
                      reason="busy") == 1


async def test_headroom_falls_back_to_pull_without_probe(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", no_params=True)  # a P without the connector: probe fails
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.HEADROOM)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    # the fallback pull then finds no kv_transfer_params in P's answer: a named 502
    assert status == 502 and "KVBridgeConnector" in answer["error"]["message"]
    assert d.requests() == []
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "mode_decisions_total", configured="headroom", chosen="pull",
                      reason="no_probe") == 1
    # a failed probe is not repeated for every request (back-off of cooldown_s)
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502 and len(p.requests(probe=True)) == 1


# ------------------------------------------------------------------------------ failures


async def test_dead_prefill_gives_502_quickly(engines: Any, proxies: Any, client: Any) -> None:
    d = await engines("decode")
    proxy = await proxies([dead_url()], [d.url], mode=ProxyMode.PULL)
    for _ in range(2):
        t0 = time.monotonic()
        status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
        assert status == 502 and "unreachable" in answer["error"]["message"]
        assert time.monotonic() - t0 < 2.0
    assert d.requests() == []


async def test_dead_decode_gives_502_quickly(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    proxy = await proxies([p.url], [dead_url()], mode=ProxyMode.PULL)
    t0 = time.monotonic()
    status, answer = await post(client, proxy.url + "/v1/completions", {**COMPLETION})
    assert status == 502 and "decode engine" in answer["error"]["message"]
    assert time.monotonic() - t0 < 2.0
    assert proxy.decodes.engines[0].in_flight == 0 and proxy.prefills.engines[0].in_flight == 0


async def test_decode_dying_mid_stream_ends_with_an_error_event(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill")
    d = await engines("decode", chunks=5, chunk_delay=0.05, break_after=2)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    received = await post_stream(client, proxy.url, {**COMPLETION, "stream": True})
    assert received.startswith(b"".join(sse_chunks(5)[:2]))
    last = json.loads(received.rstrip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "decode_error" and d.url in last["error"]["message"]
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "requests_total", mode="pull", outcome="upstream_error") == 1


async def test_prefill_client_error_keeps_its_status(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", fail_status=400)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 400 and "stand-in prefill failure" in answer["error"]["message"]
    assert d.requests() == []


async def test_timeout_gives_504(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode", first_delay=5.0)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL, timeout_s=0.5)
    t0 = time.monotonic()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 504, answer
    assert time.monotonic() - t0 < 3.0


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", json.dumps({"model": "m"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "m", "prompt": "x"}).encode()),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "many"}).encode()),
    ],
)
async def test_bad_request_is_400_without_touching_engines(
    engines: Any, proxies: Any, client: Any, path: str, raw: bytes
) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.AUTO)
    async with client.post(proxy.url + path, data=raw) as r:
        assert r.status == 400
        answer = await r.json()
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert p.requests() == [] and d.requests() == []


# ------------------------------------------------------------------------------ one hand-off each


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ["The capital of France is", "The capital of Spain is"]}, "prompt"),
        ({"prompt": [[1, 2, 3], [4, 5]]}, "prompt"),
        ({"n": 2}, "n"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ],
)
@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_batches_n_and_client_params_are_400(
    engines: Any, proxies: Any, client: Any, extra: dict[str, Any], param: str, mode: ProxyMode
) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=mode)
    status, answer = await post(client, proxy.url + "/v1/completions", {**COMPLETION, **extra})
    assert status == 400, answer
    assert answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["param"] == param and answer["error"]["code"] == 400
    assert param in answer["error"]["message"]
    assert p.requests() == [] and d.requests() == []


async def test_chat_with_n_is_400(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url])
    status, answer = await post(client, proxy.url + "/v1/chat/completions", {**CHAT, "n": 3})
    assert status == 400 and answer["error"]["param"] == "n"


@pytest.mark.parametrize("prompt", [[464, 3139, 286, 4881, 318], ["The capital of France is"],
                                    [[464, 3139, 286]]])
async def test_single_prompt_lists_still_work(
    engines: Any, proxies: Any, client: Any, prompt: Any
) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url])
    status, answer = await post(client, proxy.url + "/v1/completions", {**COMPLETION,
                                                                        "prompt": prompt})
    assert status == 200, answer
    assert p.requests()[0].body["prompt"] == d.requests()[0].body["prompt"] == prompt


# ------------------------------------------------------------------------------ parsed answers


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"remote_block_ids": "abc"}, "kv_transfer_params.remote_block_ids"),
        ({"remote_port": "port"}, "kv_transfer_params.remote_port"),
        ({"remote_engine_id": 5}, "kv_transfer_params.remote_engine_id"),
        ({"transfer_mode": "sideways"}, "kv_transfer_params.transfer_mode"),
        ({"transfer_id": "xfer-somebody-else"}, "kv_transfer_params.transfer_id"),
    ],
)
async def test_malformed_prefill_answer_is_502_naming_the_key(
    engines: Any, proxies: Any, client: Any, bad: dict[str, Any], field: str
) -> None:
    p = await engines("prefill", bad_params=bad)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502 and field in answer["error"]["message"], answer
    assert d.requests() == []


async def test_malformed_probe_answer_is_502_naming_the_key(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", bad_params={"remote_port": "port"})
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502, answer
    assert "control address" in answer["error"]["message"]
    assert "kv_transfer_params.remote_port" in answer["error"]["message"]
    assert p.requests() == [] and d.requests() == []


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ("prompt: a hand-off needs token-id prompts", 400),
        ("kv_transfer_params.transfer_id: xfer-1 is already used by request 3", 400),
        ("cannot stage the blocks: lookup buffer full", 502),
    ],
)
@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_prefill_kvbridge_error_reaches_the_client(
    engines: Any, proxies: Any, client: Any, error: str, status: int, mode: ProxyMode
) -> None:
    p = await engines("prefill")
    p.error_answer = error  # probes are still answered
    d = await engines("decode", first_delay=10.0)
    proxy = await proxies([p.url], [d.url], mode=mode)
    t0 = time.monotonic()
    got, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert got == status and error in answer["error"]["message"], answer
    assert answer["error"]["type"] == "prefill_refused"
    assert time.monotonic() - t0 < 3.0
    if status == 400:
        assert answer["error"]["param"] == error.split(":", 1)[0]
    if mode is ProxyMode.PUSH:
        await asyncio.wait_for(d.cancelled.wait(), 5.0)  # the waiting D leg was closed
        assert proxy.prefills.engines[0].probe is not None  # not a restart: probe kept
    else:
        assert d.requests() == []


# ------------------------------------------------------------------------------ restarted prefill


async def test_new_generation_in_a_prefill_answer_drops_the_probe(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", generation="gen-1")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    assert proxy.prefills.engines[0].probe is not None
    assert proxy.prefills.engines[0].probe.generation == "gen-1"
    assert d.requests()[0].body["kv_transfer_params"]["kvbridge_generation"] == "gen-1"
    p.generation = "gen-2"  # P restarts between two requests
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    for _ in range(100):  # the P leg may finish just after D answered
        if proxy.prefills.engines[0].probe is None:
            break
        await asyncio.sleep(0.02)
    assert proxy.prefills.engines[0].probe is None
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    assert len(p.requests(probe=True)) == 2  # re-probed for the third request
    assert d.requests()[2].body["kv_transfer_params"]["kvbridge_generation"] == "gen-2"
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "probes_dropped_total", reason="generation_changed") == 1


async def test_new_model_identity_in_a_prefill_answer_drops_the_probe(
    engines: Any, proxies: Any, client: Any
) -> None:
    """P's weights were reloaded (its identity moved on): push D legs must name the new one,
    or D refuses them."""
    p = await engines("prefill", identity="1111111111111111")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert d.requests()[0].body["kv_transfer_params"]["kvbridge_identity"] == "1111111111111111"
    p.identity = "2222222222222222"  # reloaded between two requests
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    for _ in range(100):  # the P leg may finish just after D answered
        if proxy.prefills.engines[0].probe is None:
            break
        await asyncio.sleep(0.02)
    assert proxy.prefills.engines[0].probe is None
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert d.requests()[2].body["kv_transfer_params"]["kvbridge_identity"] == "2222222222222222"
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "probes_dropped_total", reason="identity_changed") == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("p_answers_first", [True, False])
async def test_push_failing_after_a_prefill_restart_is_retried_once_as_pull(
    engines: Any, proxies: Any, client: Any, stream: bool, p_answers_first: bool
) -> None:
    # P answers before D fails (its answer shows the restart), or after (a re-probe shows it)
    p = await engines("prefill", generation="gen-1", prefill_delay=0.0 if p_answers_first else 2.0)
    d = await engines("decode", fail_status=503, fail_first=1,
                      first_delay=0.3 if p_answers_first else 0.0)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    await proxy.discover()
    p.generation = "gen-2"  # P restarted after the probe: D is told the old generation
    body = {**COMPLETION, "stream": stream}
    async with client.post(proxy.url + "/v1/completions", json=body) as r:
        raw = await r.read()
        assert r.status == 200, raw
    expected = b"".join(sse_chunks(3)) if stream else None
    if expected is not None:
        assert raw == expected
    else:
        assert json.loads(raw)["choices"][0]["text"] == "t0t1t2"
    modes = [s.body["kv_transfer_params"]["transfer_mode"] for s in p.requests()]
    assert modes == ["push", "pull"]
    first, second = d.requests()
    assert first.body["kv_transfer_params"]["transfer_mode"] == "push"
    assert second.body["kv_transfer_params"]["remote_block_ids"] == [3, 4, 5]
    assert second.body["kv_transfer_params"]["transfer_id"] != (
        first.body["kv_transfer_params"]["transfer_id"]  # a fresh transfer id for the retry
    )
    if not p_answers_first:
        assert len(p.requests(probe=True)) == 2 and p.requests()[0].cancelled
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "retries_total", mode="push", reason="prefill_restarted") == 1
    assert any(name == P + "mode_decisions_total" and ("chosen", "pull") in labels
               and ("reason", "prefill_restarted") in labels for name, labels in prom.samples(text))
    assert prom.value(text, P + "requests_total", mode="pull", outcome="ok") == 1


async def test_push_failing_without_a_restart_is_not_retried(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", generation="gen-1", prefill_delay=0.0)
    d = await engines("decode", fail_status=503, first_delay=0.3)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 503 and answer["error"]["message"] == "stand-in decode failure"
    assert len(p.requests()) == 1 and len(d.requests()) == 1
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.total(text, P + "retries_total") == 0  # published at zero, never moved


# ------------------------------------------------------------------------------ failure reasons


async def test_decode_failure_reason_from_the_control_channel(
    engines: Any, proxies: Any, client: Any, controls: Any
) -> None:
    p_ctl = controls("in progress: staged, waiting for the READ")
    d_ctl = controls("failed: READ from P-standin timed out")
    p = await engines("prefill", control_port=p_ctl.port)
    d = await engines("decode", fail_status=500, control_port=d_ctl.port, answers_probe=True)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    tid = p.requests()[0].body["kv_transfer_params"]["transfer_id"]
    assert status == 502, answer
    assert answer["error"]["message"] == (
        f"decode failed: transfer {tid}: READ from P-standin timed out"
    )
    assert d_ctl.queries == [[tid]] and p_ctl.queries == [[tid]]
    assert len(d.requests(probe=True)) == 1  # D's control address: probed lazily...
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502 and len(d.requests(probe=True)) == 1  # ...and cached
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "reason_queries_total", outcome="answered") == 4


async def test_push_prefill_failure_reason(
    engines: Any, proxies: Any, client: Any, controls: Any
) -> None:
    p_ctl = controls("failed: the WRITE to decode failed: connection reset")
    p = await engines("prefill", prefill_delay=0.1, fail_status=500, control_port=p_ctl.port)
    d = await engines("decode", first_delay=10.0)  # answers no probe: only P can tell
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    tid = p.requests()[0].body["kv_transfer_params"]["transfer_id"]
    assert status == 502, answer
    assert answer["error"]["message"] == (
        f"prefill failed: transfer {tid}: the WRITE to decode failed: connection reset"
    )
    await asyncio.wait_for(d.cancelled.wait(), 5.0)


async def test_timeout_reason_is_504(
    engines: Any, proxies: Any, client: Any, controls: Any
) -> None:
    d_ctl = controls("in progress: waiting for the pushed KV")
    p = await engines("prefill")
    d = await engines("decode", first_delay=5.0, control_port=d_ctl.port, answers_probe=True)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL, timeout_s=0.5)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 504, answer
    assert answer["error"]["message"].endswith(": in progress: waiting for the pushed KV")
    assert answer["error"]["message"].startswith("decode failed: transfer xfer-")


@pytest.mark.parametrize("how", ["unknown", "refused", "silent"])
async def test_no_reason_keeps_the_generic_error(
    engines: Any, proxies: Any, client: Any, controls: Any, how: str
) -> None:
    if how == "silent":
        silent = FakeControl()
        silent.close()  # nobody answers on its port: the query times out
        port = silent.port
    else:
        ctl = controls(None, refuse=how == "refused")
        port = ctl.port
    p = await engines("prefill", control_port=port)
    d = await engines("decode", fail_status=503)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    t0 = time.monotonic()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 503 and answer["error"]["message"] == "stand-in decode failure"
    assert time.monotonic() - t0 < 3.0


async def test_reason_queries_do_not_block_the_event_loop(
    engines: Any, proxies: Any, client: Any
) -> None:
    silent = FakeControl()
    silent.close()  # a control address nobody answers on: each query waits its timeout
    p = await engines("prefill", control_port=silent.port)
    bad = await engines("decode", fail_status=503)
    good = await engines("prefill")
    ok_d = await engines("decode")
    failing = await proxies([p.url], [bad.url], mode=ProxyMode.PULL, control_timeout_s=1.0)
    working = await proxies([good.url], [ok_d.url], mode=ProxyMode.PULL)
    slow = asyncio.ensure_future(post(client, failing.url + "/v1/completions", COMPLETION))
    while not bad.requests():
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    status, _ = await post(client, working.url + "/v1/completions", COMPLETION)
    assert status == 200 and time.monotonic() - t0 < 0.5  # served while the query waits
    assert (await slow)[0] == 503


# ------------------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_client_disconnect_mid_stream_cancels_decode(
    engines: Any, proxies: Any, client: Any, mode: ProxyMode
) -> None:
    p = await engines("prefill")
    d = await engines("decode", chunks=50, chunk_delay=0.2)
    proxy = await proxies([p.url], [d.url], mode=mode)
    r = await client.post(proxy.url + "/v1/completions", json={**COMPLETION, "stream": True})
    assert r.status == 200
    assert (await r.content.readany()).startswith(b"data: ")
    r.close()  # the client goes away mid-stream
    await asyncio.wait_for(d.cancelled.wait(), 5.0)
    [ds] = d.requests()
    assert ds.cancelled and ds.t_end - ds.t_start < 5.0
    for _ in range(100):
        if proxy.decodes.engines[0].in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert proxy.decodes.engines[0].in_flight == 0
    text = (await (await client.get(proxy.url + "/metrics")).read()).decode()
    assert prom.value(text, P + "requests_total", mode=mode.value, outcome="cancelled") == 1


async def test_client_disconnect_during_push_prefill_cancels_both_legs(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill", prefill_delay=10.0)
    d = await engines("decode", first_delay=10.0)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    await proxy.discover()
    task = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", COMPLETION))
    while not (p.requests() and d.requests()):
        await asyncio.sleep(0.01)
    task.cancel()  # closes the client's connection
    await asyncio.wait_for(asyncio.gather(p.cancelled.wait(), d.cancelled.wait()), 5.0)
    assert p.requests()[0].cancelled and d.requests()[0].cancelled


# ------------------------------------------------------------------------------ other endpoints


async def test_models_health_and_metrics(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill", engine_id="P-7")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    await proxy.discover()

    async with client.get(proxy.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "standin-decode"

    async with client.get(proxy.url + "/health") as r:
        health = await r.json()
        assert r.status == 200, health
    assert health["status"] == "ok" and health["mode"] == "push"
    assert health["prefill"][0]["ok"] and health["prefill"][0]["engine_id"] == "P-7"
    assert health["decode"][0]["url"] == d.url

    assert await post_stream(client, proxy.url, {**COMPLETION, "stream": True})
    async with client.get(proxy.url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    samples = prom.samples(text)

    def value(name: str, **labels: str) -> float | None:
        return prom.value(text, name, **labels)

    assert value("kvbridge_proxy_requests_total", mode="push", outcome="ok") == 1
    assert value("kvbridge_proxy_in_flight", engine=d.url, role="decode") == 0
    assert value("kvbridge_proxy_engine_requests_total", engine=p.url, role="prefill") == 1
    assert value("kvbridge_proxy_ttft_seconds_count", mode="push") == 1
    assert value("kvbridge_proxy_ttft_seconds_bucket", mode="push", le="+Inf") == 1
    assert "# TYPE kvbridge_proxy_ttft_seconds histogram" in text
    assert value("kvbridge_proxy_request_duration_seconds_count", mode="push") == 1
    assert value("kvbridge_proxy_upstream_seconds_count", role="prefill") == 1
    assert value("kvbridge_proxy_upstream_seconds_count", role="decode") == 1
    assert value("kvbridge_proxy_prefill_leg_seconds_count", mode="push") == 1
    assert value("kvbridge_proxy_socket_wait_seconds_count") == 1  # known for every request
    assert any(name == "kvbridge_proxy_mode_decisions_total" and ("chosen", "push") in labels
               for name, labels in samples)

    d.health_status = 503  # no healthy D: 503 with details
    async with client.get(proxy.url + "/health") as r:
        assert r.status == 503
        health = await r.json()
    assert health["status"] == "unavailable" and health["decode"][0]["status"] == 503


async def test_health_with_dead_engine_is_503(engines: Any, proxies: Any, client: Any) -> None:
    d = await engines("decode")
    dead = dead_url()
    proxy = await proxies([dead], [d.url])
    t0 = time.monotonic()
    async with client.get(proxy.url + "/health") as r:
        assert r.status == 503
        health = await r.json()
    assert time.monotonic() - t0 < 3.0
    assert health["prefill"][0]["url"] == dead and health["prefill"][0]["error"]
    async with client.get(proxy.url + "/metrics") as r:
        assert r.status == 200


async def test_both_modes_against_the_same_engines(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill", prefill_delay=0.05)
    d = await engines("decode", chunks=2, chunk_delay=0.05)
    push = await proxies([p.url], [d.url], mode=ProxyMode.PUSH)
    pull = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    bodies = [{**COMPLETION, "stream": bool(i % 2)} for i in range(8)]
    results = await asyncio.gather(
        *(post_stream(client, (push if i % 3 else pull).url, b) for i, b in enumerate(bodies))
    )
    assert all(results)
    modes = sorted(s.body["kv_transfer_params"]["transfer_mode"] for s in p.requests())
    assert modes == ["pull"] * 3 + ["push"] * 5
    ids = {s.body["kv_transfer_params"]["transfer_id"] for s in p.requests()}
    assert len(ids) == 8


# ------------------------------------------------------------------------------ fleets (xPyD)


def tid_of(seen: Seen) -> str:
    return str(seen.body["kv_transfer_params"]["transfer_id"])


async def metrics_text(client: aiohttp.ClientSession, proxy: ProxyServer) -> str:
    async with client.get(proxy.url + "/metrics") as r:
        return await r.text()


async def fleet(engines: Any, n_p: int = 2, n_d: int = 2, p: dict[str, Any] | None = None,
                d: dict[str, Any] | None = None) -> tuple[list[StandIn], list[StandIn]]:
    """``n_p`` prefill and ``n_d`` decode stand-ins; ``p`` / ``d`` knobs go to the first one."""
    ps = [await engines("prefill", engine_id=f"P{i}", **((p or {}) if i == 0 else {}))
          for i in range(n_p)]
    ds = [await engines("decode", **((d or {}) if i == 0 else {})) for i in range(n_d)]
    return ps, ds


# headroom, not auto: the planner may serve a request by D alone, and this needs every P used
@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH, ProxyMode.HEADROOM])
async def test_fleet_spreads_requests_over_every_engine(
    engines: Any, proxies: Any, client: Any, mode: ProxyMode
) -> None:
    ps, ds = await fleet(engines)
    for e in (*ps, *ds):
        e.prefill_delay, e.chunk_delay = 0.05, 0.05
    proxy = await proxies([e.url for e in ps], [e.url for e in ds], mode=mode)
    bodies = [{**COMPLETION, "stream": bool(i % 2)} for i in range(8)]
    results = await asyncio.gather(*(post_stream(client, proxy.url, b) for b in bodies))
    assert all(results)
    text = await metrics_text(client, proxy)
    for e in (*ps, *ds):
        assert e.requests(), e.url  # every engine served some
        assert prom.value(text, P + "engine_requests_total", engine=e.url,
                          role=e.role) == len(e.requests())
    assert sum(len(e.requests()) for e in ps) == sum(len(e.requests()) for e in ds) == 8
    assert prom.total(text, P + "retries_total") == 0  # published at zero, never moved


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_fleet_failed_prefill_is_retried_on_the_other_with_a_fresh_transfer_id(
    engines: Any, proxies: Any, client: Any, mode: ProxyMode
) -> None:
    ps, ds = await fleet(engines, p={"fail_status": 500, "prefill_delay": 0.2},
                         d={"first_delay": 0.5, "headers_first": True})
    ds[1].first_delay, ds[1].headers_first = 0.5, True
    proxy = await proxies([e.url for e in ps], [e.url for e in ds], mode=mode)
    await proxy.discover()
    for _ in range(3):  # P1 is busier (other clients): only the retry's choice sends it there
        proxy.prefills.engines[1].acquire()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200 and answer["choices"][0]["text"] == "t0t1t2", answer
    [first], [second] = ps[0].requests(), ps[1].requests()
    assert tid_of(first) != tid_of(second)
    d_legs = [s for e in ds for s in e.requests()]
    if mode is ProxyMode.PUSH:  # the first D leg was aborted with its P leg
        assert sorted(tid_of(s) for s in d_legs) == sorted([tid_of(first), tid_of(second)])
        assert [s.cancelled for s in d_legs if tid_of(s) == tid_of(first)] == [True]
    else:  # pull never got as far as D
        assert [tid_of(s) for s in d_legs] == [tid_of(second)]
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode=mode.value, reason="prefill_failed") == 1
    assert prom.value(text, P + "errors_total", kind="prefill_error") == 1
    assert prom.value(text, P + "requests_total", mode=mode.value, outcome="ok") == 1


async def test_fleet_unreachable_decode_gets_the_same_prefill_answer_on_another(
    engines: Any, proxies: Any, client: Any
) -> None:
    p = await engines("prefill")
    good = await engines("decode")
    proxy = await proxies([p.url], [dead_url(), good.url], mode=ProxyMode.PULL,
                          health_interval_s=0)  # the dead D is found by the request
    status, _ = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200
    [ps], [ds] = p.requests(), good.requests()  # one prefill only
    assert tid_of(ds) == tid_of(ps)  # the same hand-off: the dead D never claimed it
    assert not proxy.decodes.engines[0].is_up()
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode="pull", reason="decode_unreachable") == 1
    assert prom.value(text, P + "engine_up", engine=proxy.decodes.engines[0].url,
                      role="decode") == 0
    # the dead D stays out of rotation: the next request goes straight to the good one
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert len(good.requests()) == 2
    assert prom.value(await metrics_text(client, proxy), P + "retries_total", mode="pull",
                      reason="decode_unreachable") == 1


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_fleet_failed_decode_is_a_fresh_dispatch_on_untried_engines(
    engines: Any, proxies: Any, client: Any, mode: ProxyMode
) -> None:
    ps, ds = await fleet(engines, d={"fail_status": 500})
    if mode is ProxyMode.PUSH:
        ps[0].prefill_delay = 5.0  # P0 is still prefilling when D0 fails: its leg is aborted
    proxy = await proxies([e.url for e in ps], [e.url for e in ds], mode=mode)
    await proxy.discover()
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200, answer
    [p0], [p1], [d0], [d1] = (e.requests() for e in (*ps, *ds))  # both engines changed
    assert tid_of(d0) == tid_of(p0) != tid_of(p1) == tid_of(d1)
    if mode is ProxyMode.PUSH:
        await asyncio.wait_for(ps[0].cancelled.wait(), 5.0)
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode=mode.value, reason="decode_failed") == 1
    assert proxy.decodes.engines[0].is_up()  # a 5xx is no reason to take an engine out


async def test_fleet_stream_broken_before_its_first_byte_is_retried_after_it_is_not(
    engines: Any, proxies: Any, client: Any
) -> None:
    ps, ds = await fleet(engines, n_p=1, d={"break_after": 0})
    proxy = await proxies([ps[0].url], [e.url for e in ds], mode=ProxyMode.PULL)
    received = await post_stream(client, proxy.url, {**COMPLETION, "stream": True})
    assert received == b"".join(sse_chunks(3))
    assert len(ds[0].requests()) == len(ds[1].requests()) == 1
    # once bytes reached the client nothing can be re-routed: an in-band error ends the stream
    ds[0].break_after = ds[1].break_after = 2
    received = await post_stream(client, proxy.url, {**COMPLETION, "stream": True})
    last = json.loads(received.rstrip().rsplit(b"\n\n", 1)[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "decode_error"
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode="pull", reason="decode_failed") == 1
    assert prom.value(text, P + "requests_total", mode="pull", outcome="upstream_error") == 1


async def test_fleet_stream_that_starts_with_an_error_event_is_retried(
    engines: Any, proxies: Any, client: Any
) -> None:
    """vLLM fails a streamed request whose KV load failed with 200 + an error event before any
    token: nothing reached the client yet, so it is a D failure like a 500."""
    ps, ds = await fleet(engines, d={"error_event": True, "first_delay": 0.1})
    proxy = await proxies([e.url for e in ps], [e.url for e in ds], mode=ProxyMode.PULL)
    received = await post_stream(client, proxy.url, {**COMPLETION, "stream": True})
    assert received == b"".join(sse_chunks(3))
    assert len(ds[0].requests()) == len(ds[1].requests()) == 1
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode="pull", reason="decode_failed") == 1
    assert prom.value(text, P + "requests_total", mode="pull", outcome="ok") == 1


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_stream_error_event_before_any_token_is_an_explained_502(
    engines: Any, proxies: Any, client: Any, controls: Any, mode: ProxyMode
) -> None:
    d_ctl = controls("failed: READ from P-standin failed: connection refused")
    p = await engines("prefill", prefill_delay=0.0 if mode is ProxyMode.PULL else 3.0)
    d = await engines("decode", error_event=True, control_port=d_ctl.port, answers_probe=True)
    proxy = await proxies([p.url], [d.url], mode=mode)
    status, answer = await post(client, proxy.url + "/v1/completions",
                                {**COMPLETION, "stream": True})
    assert status == 502, answer
    assert answer["error"]["message"].endswith(": READ from P-standin failed: connection refused")
    if mode is ProxyMode.PUSH:  # the P leg is closed with the failed D leg
        await asyncio.wait_for(p.cancelled.wait(), 5.0)
    d_ctl.default = None  # no engine knows why: D's own message
    status, answer = await post(client, proxy.url + "/v1/completions",
                                {**COMPLETION, "stream": True})
    assert status == 502 and "failed the request: stand-in KV load failed" in (
        answer["error"]["message"])


@pytest.mark.parametrize(
    ("head", "error"),
    [
        (b'data: {"error": {"message": "boom", "code": 500}}\n\ndata: [DONE]\n\n', "boom"),
        (b'data:{"error": "flat"}\n\n', "flat"),
        (b'data: {"error": {}}\n\n', "an error event"),
        (b'data: {"error": {"message": "' + b"x" * 2000 + b'"}}\n\n', "x" * 500),
        (b'data: {"choices": [{"text": "t"}], "error": null}\n\n', None),  # a token
        (b'data: {"choices": [{"text": "t"}]}\n\ndata: {"error": "late"}\n\n', None),
        (b"data: [DONE]\n\n", None),
        (b"data: {not json\n\n", None),
        (b"data: [1, 2]\n\n", None),
        (b'data: "error"\n\n', None),
        (b"data: \xff\xfe\n\n", None),
        (b"data: " + b"[" * 5000 + b"\n\n", None),  # too deep for the JSON parser
        (b": keep-alive\n\n", None),
        (b"", None),
    ],
)
def test_a_streams_first_event_is_an_error_only_when_it_says_so(head: bytes,
                                                                 error: str | None) -> None:
    assert stream_error(head) == error


@pytest.mark.parametrize("max_retries", [0, 1, 3])
async def test_fleet_retries_are_bounded(
    engines: Any, proxies: Any, client: Any, max_retries: int
) -> None:
    ps = [await engines("prefill", fail_status=503) for _ in range(2)]
    d = await engines("decode")
    proxy = await proxies([e.url for e in ps], [d.url], max_retries=max_retries)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 502 and "stand-in prefill failure" in answer["error"]["message"]
    # one retry per other engine at most: a request never goes back to an engine it tried
    assert [len(e.requests()) for e in ps] == ([1, 0] if max_retries == 0 else [1, 1])
    assert d.requests() == []
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "retries_total", mode="pull",
                      reason="prefill_failed") == (0 if max_retries == 0 else 1)
    assert prom.value(text, P + "requests_total", mode="pull", outcome="upstream_error") == 1


@pytest.mark.parametrize(
    ("knobs", "mode", "status", "needle"),
    [
        ({"fail_status": 400}, ProxyMode.PULL, 400, "stand-in prefill failure"),
        ({"error_answer": "prompt: too long to hand off"}, ProxyMode.PULL, 400, "too long"),
        ({"error_answer": "no room to stage"}, ProxyMode.PUSH, 502, "no room"),
        ({"bad_params": {"remote_block_ids": "forged"}}, ProxyMode.PULL, 502,
         "kv_transfer_params.remote_block_ids"),
        ({"bad_params": {"transfer_id": "xfer-someone-elses"}}, ProxyMode.PULL, 502,
         "kv_transfer_params.transfer_id"),
        ({"bad_params": {"remote_port": "5600"}}, ProxyMode.PUSH, 502,
         "kv_transfer_params.remote_port"),  # the probe answer is malformed too
        ({"no_params": True}, ProxyMode.PULL, 502, "KVBridgeConnector"),
    ],
)
async def test_fleet_never_retries_bad_requests_refusals_or_forged_answers(
    engines: Any, proxies: Any, client: Any, knobs: dict[str, Any], mode: ProxyMode,
    status: int, needle: str
) -> None:
    """The request or the engine's answer is at fault, not the engine's health: retrying on
    another P would hide a misconfigured or hostile engine. The error names the field."""
    ps, ds = await fleet(engines, p=knobs)
    proxy = await proxies([e.url for e in ps], [e.url for e in ds], mode=mode)
    got, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert got == status and needle in answer["error"]["message"], answer
    assert ps[1].requests() == [] and all(not s.cancelled for s in ps[0].requests())
    text = await metrics_text(client, proxy)
    assert prom.total(text, P + "retries_total") == 0  # published at zero, never moved
    assert proxy.prefills.engines[0].is_up()  # it answered: its health is not in question


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_fleet_health_checks_take_an_engine_out_and_put_it_back(
    engines: Any, proxies: Any, client: Any
) -> None:
    ps, ds = await fleet(engines, n_p=1)
    proxy = await proxies([ps[0].url], [e.url for e in ds], health_interval_s=0.05,
                          health_failures=2)
    sick = proxy.decodes.engines[0]
    ds[0].health_status = 503  # alive, but vLLM says its engine core is not
    await wait_for(lambda: not sick.is_up())
    async with client.get(proxy.url + "/health") as r:
        health = await r.json()
    assert r.status == 200 and health["decode"][0]["in_rotation"] is False
    assert "503" in health["decode"][0]["out_because"] and health["decode"][1]["in_rotation"]
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "engine_up", engine=sick.url, role="decode") == 0
    for _ in range(4):
        assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert ds[0].requests() == [] and len(ds[1].requests()) == 4
    ds[0].health_status = 200  # it recovers: back in rotation at the next check
    await wait_for(sick.is_up)
    for _ in range(4):
        assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert ds[0].requests()
    assert prom.value(await metrics_text(client, proxy), P + "engine_up", engine=sick.url,
                      role="decode") == 1


async def test_fleet_dead_prefill_leaves_at_once_and_comes_back_restarted(
    engines: Any, proxies: Any, client: Any
) -> None:
    ps, ds = await fleet(engines, n_d=1, p={"generation": "gen-1"})
    proxy = await proxies([e.url for e in ps], [ds[0].url], mode=ProxyMode.PUSH,
                          health_interval_s=0.05)
    await proxy.discover()
    p0 = proxy.prefills.engines[0]
    port = ps[0].port
    await ps[0].stop()  # the process is gone: connections are refused
    await wait_for(lambda: not p0.is_up())
    assert p0.probe is None  # dropped: what comes back may be another process
    for _ in range(3):
        assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert len(ps[1].requests()) == 3
    restarted = await engines("prefill", engine_id="P0", generation="gen-2", port=port)
    await wait_for(p0.is_up)
    for _ in range(4):
        assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert restarted.requests()  # back in rotation, re-probed: D is told the new generation
    gens = {s.body["kv_transfer_params"].get("kvbridge_generation") for s in ds[0].requests()
            if tid_of(s) in {tid_of(r) for r in restarted.requests()}}
    assert gens == {"gen-2"}
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "probes_dropped_total", reason="engine_down") == 1
    # published at zero, never moved (the checker found it first)
    assert prom.total(text, P + "retries_total") == 0


def test_fleet_settings_are_checked() -> None:
    for bad in ({"max_retries": -1}, {"health_interval_s": -1.0},
                {"health_interval_s": float("nan")}, {"health_failures": 0}):
        with pytest.raises(ConfigError):
            ProxyServer(ProxySettings(["h:1"], ["h:2"], **bad))


# ------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("entry", ["python -m kvbridge.proxy", "kvbridge proxy"])
async def test_cli_serves_on_port_zero_and_stops_on_sigterm(
    engines: Any, client: Any, entry: str
) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    if entry == "kvbridge proxy":
        script = Path(sys.executable).parent / "kvbridge"
        if not script.exists():
            pytest.skip("the kvbridge console script is not installed")
        cmd = [str(script), "proxy"]
    else:
        cmd = [sys.executable, "-m", "kvbridge.proxy", "--log-level", "WARNING"]
    cmd += ["--prefill", p.url, "--decode", d.url, "--mode", "pull", "--port", "0"]
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        status, answer = await post(client, m.group(1) + "/v1/completions", COMPLETION)
        assert status == 200 and answer["choices"][0]["text"] == "t0t1t2"
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10.0) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ------------------------------------------------------------------------------ tenants


async def _salts(client: aiohttp.ClientSession, proxy: ProxyServer, p: StandIn, d: StandIn,
                 headers: dict[str, str], body: dict[str, Any]) -> tuple[Any, Any]:
    async with client.post(proxy.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
    return (p.requests()[-1].body.get("cache_salt"), d.requests()[-1].body.get("cache_salt"))


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_salt_from_header_sets_the_salt_of_both_legs_and_ignores_the_clients(
        engines: Any, proxies: Any, client: Any, mode: ProxyMode) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=mode, salt_header="X-Tenant",
                          control_secret="fleet-secret")
    forged = {**COMPLETION, "cache_salt": "someone-elses"}
    a1 = await _salts(client, proxy, p, d, {"X-Tenant": "acme"}, forged)
    a2 = await _salts(client, proxy, p, d, {"X-Tenant": "acme"}, COMPLETION)
    b = await _salts(client, proxy, p, d, {"X-Tenant": "globex"}, COMPLETION)
    none = await _salts(client, proxy, p, d, {}, forged)
    assert a1[0] == a1[1] == a2[0] == a2[1]  # one tenant, one salt, on P and D alike
    assert re.fullmatch(r"[0-9a-f]{64}", a1[0]) and a1[0] != "someone-elses"
    assert b[0] == b[1] and b[0] != a1[0]
    assert none == (None, None)  # no tenant: no salt, and never the client's own


async def test_salt_depends_on_the_secret(engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    one = await proxies([p.url], [d.url], salt_header="X-Tenant", control_secret="s1")
    two = await proxies([p.url], [d.url], salt_header="X-Tenant", control_secret="s2")
    h = {"X-Tenant": "acme"}
    assert (await _salts(client, one, p, d, h, COMPLETION)
            != await _salts(client, two, p, d, h, COMPLETION))


async def test_oversized_tenant_header_is_400_naming_it(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], salt_header="X-Tenant", control_secret="s")
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION,
                           headers={"X-Tenant": "x" * 5000}) as r:
        assert r.status == 400
        answer = await r.json()
    assert answer["error"]["param"] == "X-Tenant" and "X-Tenant" in answer["error"]["message"]
    assert p.requests() == [] and d.requests() == []


async def test_without_salt_from_header_the_clients_salt_passes(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url])
    got = await _salts(client, proxy, p, d, {"X-Tenant": "acme"},
                       {**COMPLETION, "cache_salt": "mine"})
    assert got == ("mine", "mine")


def test_salt_from_header_needs_a_secret_and_a_header_name() -> None:
    with pytest.raises(ConfigError, match="needs the fleet secret"):
        ProxySettings(["http://p"], ["http://d"], salt_header="X-Tenant").check()
    with pytest.raises(ConfigError, match="must name a header"):
        ProxySettings(["http://p"], ["http://d"], salt_header=" ", control_secret="s").check()


# ------------------------------------------------------------------------------ mixed fleets


async def test_pull_passes_a_stock_prefill_answer_through_as_it_came(
        engines: Any, proxies: Any, client: Any) -> None:
    """vLLM's NixlConnector answers per-group ``remote_block_ids`` (``[[...]]``) and keys
    kvbridge does not read; re-serialised, the nesting was flattened and vLLM's D died with
    ``'int' object is not iterable``. D gets P's answer as P gave it, plus the transfer id."""
    stock = {"remote_block_ids": [[3, 4, 5]], "dcp_size": 1, "remote_request_id": "cmpl-7-0",
             "remote_blocks_expiry_time": None}
    p = await engines("prefill", bad_params=stock)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    [seen] = d.requests()
    got = seen.body["kv_transfer_params"]
    for key, value in stock.items():
        assert got[key] == value, key
    assert got["transfer_id"] == tid_of(p.requests()[0])


# ------------------------------------------------------------------------------ /admin

SECRET = "admin-test-secret"
TOKEN = trust.admin_token(SECRET.encode())


async def admin(client: aiohttp.ClientSession, proxy: ProxyServer, method: str, path: str,
                token: str | None = TOKEN, **kw: Any) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with client.request(method, proxy.url + path, headers=headers, **kw) as r:
        return r.status, await r.json(content_type=None)


def rows(listing: Any) -> dict[str, dict[str, Any]]:
    return {row["url"]: row for row in listing["engines"]}


async def test_admin_needs_the_token_and_changes_nothing_without_it(
        engines: Any, proxies: Any, client: Any) -> None:
    ps, ds = await fleet(engines, 1, 2)
    proxy = await proxies([p.url for p in ps], [d.url for d in ds], control_secret=SECRET)
    for token in (None, "", "0" * 64, trust.admin_token(b"another fleet's secret")):
        status, answer = await admin(client, proxy, "POST", f"/admin/drain?engine={ds[0].url}",
                                     token=token)
        assert status == 401 and answer["error"]["param"] == "Authorization"
        assert (await admin(client, proxy, "GET", "/admin/engines", token=token))[0] == 401
    status, listing = await admin(client, proxy, "GET", "/admin/engines")
    assert status == 200
    assert {r["state"] for r in listing["engines"]} == {"active"}
    assert [r["role"] for r in listing["engines"]] == ["prefill", "decode", "decode"]


async def test_a_drain_tells_the_engines_ranks_once_to_write_their_kv_out(
        engines: Any, proxies: Any, client: Any, controls: Any) -> None:
    ctl, quiet = controls(secret=SECRET), controls(secret=SECRET)
    p = await engines("prefill", control_port=ctl.port)
    d = await engines("decode", control_port=quiet.port, answers_probe=True)
    proxy = await proxies([p.url], [d.url], control_secret=SECRET)
    for token in (None, trust.admin_token(b"another fleet's secret")):  # refused: no notice
        assert (await admin(client, proxy, "POST", f"/admin/drain?engine={p.url}",
                            token=token))[0] == 401
    status, row = await admin(client, proxy, "POST", f"/admin/drain?engine={p.url}")
    assert status == 200 and row["state"] in ("draining", "drained")
    await until(lambda: ctl.notices == 1)
    await admin(client, proxy, "POST", f"/admin/drain?engine={p.url}")  # already draining
    await asyncio.sleep(0.3)
    assert ctl.notices == 1 and quiet.notices == 0  # once, and only the drained engine's


async def test_a_drain_notice_without_the_fleet_secret_is_dropped(
        engines: Any, proxies: Any, client: Any, controls: Any) -> None:
    ctl = controls(secret="the engines' own fleet secret")  # the proxy signs with another one
    p = await engines("prefill", control_port=ctl.port)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], control_secret=SECRET)
    assert (await admin(client, proxy, "POST", f"/admin/drain?engine={p.url}"))[0] == 200
    await until(lambda: ctl.server.dropped_auth >= 1)
    assert ctl.notices == 0


async def test_admin_is_off_without_any_secret(
        engines: Any, proxies: Any, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trust, "for_tools", lambda secret=None: trust.Trust(None, "insecure"))
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url])
    status, answer = await admin(client, proxy, "GET", "/admin/engines")
    assert status == 403 and answer["error"]["type"] == "admin_disabled"


async def test_draining_a_decode_finishes_its_request_and_sends_it_no_new_one(
        engines: Any, proxies: Any, client: Any) -> None:
    ps, ds = await fleet(engines, 1, 2)
    for d in ds:
        d.first_delay = 0.6
    proxy = await proxies([ps[0].url], [d.url for d in ds], mode=ProxyMode.PUSH,
                          control_secret=SECRET)
    slow = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", COMPLETION))
    while not (ds[0].requests() or ds[1].requests()):
        await asyncio.sleep(0.01)
    busy = ds[0] if ds[0].requests() else ds[1]
    other = ds[1] if busy is ds[0] else ds[0]
    status, row = await admin(client, proxy, "POST", f"/admin/drain?engine={busy.url}")
    assert status == 200 and row["state"] == "draining" and row["in_flight"] == 1
    results = await asyncio.gather(
        *(post(client, proxy.url + "/v1/completions", COMPLETION) for _ in range(4)))
    assert [s for s, _ in results] == [200] * 4
    assert (await slow)[0] == 200  # what it served ran to its end
    assert len(busy.requests()) == 1 and len(other.requests()) == 4
    listing = rows((await admin(client, proxy, "GET", "/admin/engines"))[1])
    assert listing[busy.url]["state"] == "drained" and listing[other.url]["state"] == "active"
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "engine_state", engine=busy.url, role="decode",
                      state="drained") == 1
    assert prom.value(text, P + "engine_state", engine=busy.url, role="decode",
                      state="active") == 0
    # resume: it takes requests again
    assert (await admin(client, proxy, "POST", f"/admin/resume?engine={busy.url}"))[1][
        "state"] == "active"
    await asyncio.gather(*(post(client, proxy.url + "/v1/completions", COMPLETION)
                           for _ in range(2)))
    assert len(busy.requests()) == 2


async def test_a_draining_prefill_is_drained_only_once_its_pulls_decode_leg_ended(
        engines: Any, proxies: Any, client: Any) -> None:
    ps, ds = await fleet(engines, 2, 1)
    ds[0].first_delay = 0.8
    proxy = await proxies([p.url for p in ps], [ds[0].url], mode=ProxyMode.PULL,
                          control_secret=SECRET)
    req = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", COMPLETION))
    while not ds[0].requests():  # P answered; D claims the hand-off
        await asyncio.sleep(0.01)
    p = ps[0] if ps[0].requests() else ps[1]
    status, row = await admin(client, proxy, "POST", f"/admin/drain?engine={p.url}")
    assert row["in_flight"] == 0 and row["handoffs"] == 1 and row["state"] == "draining"
    # removing it now would lose the lease D is pulling: refused
    status, answer = await admin(client, proxy, "DELETE", f"/admin/engines?engine={p.url}")
    assert status == 409 and "drain" in answer["error"]["message"]
    assert (await req)[0] == 200
    assert rows((await admin(client, proxy, "GET", "/admin/engines"))[1])[p.url][
        "state"] == "drained"
    status, row = await admin(client, proxy, "DELETE", f"/admin/engines?engine={p.url}")
    assert status == 200 and row["state"] == "removed"
    assert [e.url for e in proxy.prefills.engines] == [q.url for q in ps if q is not p]


async def test_every_decode_draining_is_503_with_retry_after_and_touches_no_engine(
        engines: Any, proxies: Any, client: Any) -> None:
    ps, ds = await fleet(engines, 1, 2)
    proxy = await proxies([ps[0].url], [d.url for d in ds], mode=ProxyMode.AUTO,
                          control_secret=SECRET)
    for d in ds:
        assert (await admin(client, proxy, "POST", f"/admin/drain?engine={d.url}"))[0] == 200
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        answer = await r.json()
    assert answer["error"]["type"] == "no_engine"
    assert "no decode engine takes new requests (2 draining)" in answer["error"]["message"]
    assert ps[0].requests() == [] and all(d.requests() == [] for d in ds)


async def test_an_added_engine_joins_once_healthy_and_then_serves(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    late = await engines("decode", health_status=503)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL, control_secret=SECRET)
    status, row = await admin(client, proxy, "POST", "/admin/engines",
                              json={"role": "decode", "url": late.url + "/"})
    assert status == 202 and row["state"] == "joining" and row["url"] == late.url
    await asyncio.sleep(1.5)  # its /health still fails: it gets nothing
    await asyncio.gather(*(post(client, proxy.url + "/v1/completions", COMPLETION)
                           for _ in range(3)))
    assert late.requests() == []
    assert rows((await admin(client, proxy, "GET", "/admin/engines"))[1])[late.url][
        "state"] == "joining"
    late.health_status = 200
    deadline = time.monotonic() + 10
    while proxy.decodes.by_url(late.url).state.value != "active":  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the added engine never joined"
        await asyncio.sleep(0.1)
    d.first_delay = 0.3  # the old one is busy: the new one takes the next request
    await asyncio.gather(*(post(client, proxy.url + "/v1/completions", COMPLETION)
                           for _ in range(2)))
    assert late.requests()
    # the same URL again, or as the other role, is a conflict
    for role in ("decode", "prefill"):
        status, answer = await admin(client, proxy, "POST", "/admin/engines",
                                     json={"role": role, "url": late.url})
        assert status == 409 and answer["error"]["param"] == "url"


async def test_a_prefill_added_to_a_pushing_proxy_joins_after_its_probe(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    new = await engines("prefill", engine_id="P-new")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PUSH, control_secret=SECRET)
    assert (await admin(client, proxy, "POST", "/admin/engines",
                        json={"role": "prefill", "url": new.url}))[0] == 202
    deadline = time.monotonic() + 10
    while proxy.prefills.by_url(new.url).state.value != "active":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert new.requests(probe=True)  # the handshake happened before it joined
    assert proxy.prefills.by_url(new.url).probe is not None  # type: ignore[union-attr]


@pytest.mark.parametrize(("method", "path", "kw", "status", "param"), [
    ("POST", "/admin/drain", {}, 400, "engine"),
    ("POST", "/admin/drain?engine=http://127.0.0.1:1", {}, 404, "engine"),
    ("POST", "/admin/drain?engine=ftp://h:1", {}, 400, "engine"),
    ("POST", "/admin/drain?engine=http://h:1/v1", {}, 400, "engine"),
    ("POST", "/admin/drain?engine=http://u:p@h:1", {}, 400, "engine"),
    ("POST", "/admin/resume?engine=http://h", {}, 400, "engine"),
    ("DELETE", "/admin/engines", {}, 400, "engine"),
    ("POST", "/admin/engines", {"data": b"{not json"}, 400, None),
    ("POST", "/admin/engines", {"json": ["decode"]}, 400, None),
    ("POST", "/admin/engines", {"json": {"role": "decode"}}, 400, "url"),
    ("POST", "/admin/engines", {"json": {"role": "both", "url": "http://h:1"}}, 400, "role"),
    ("POST", "/admin/engines", {"json": {"role": "decode", "url": "h:1", "x": 1}}, 400, "x"),
    ("POST", "/admin/engines", {"json": {"role": "decode", "url": 7}}, 400, "url"),
    ("POST", "/admin/engines", {"json": {"role": "decode", "url": "http://" + "h" * 400}},
     400, "url"),
    ("POST", "/admin/engines", {"data": b"{" + b" " * (70 << 10) + b"}"}, 413, None),
])
async def test_admin_refuses_bad_input_naming_the_field(
        engines: Any, proxies: Any, client: Any, method: str, path: str, kw: dict[str, Any],
        status: int, param: str | None) -> None:
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url], control_secret=SECRET)
    got, answer = await admin(client, proxy, method, path, **kw)
    assert got == status, answer
    assert answer["error"]["param"] == param
    assert len(proxy.fleet.engines) == 2 and all(e.accepting for e in proxy.fleet.engines)
    # the proxy keeps serving
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200


async def test_the_last_engine_of_a_role_cannot_be_removed(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url], control_secret=SECRET)
    await admin(client, proxy, "POST", f"/admin/drain?engine={d.url}")
    status, answer = await admin(client, proxy, "DELETE", f"/admin/engines?engine={d.url}")
    assert status == 409 and "last decode engine" in answer["error"]["message"]


async def test_kvbridge_engines_and_drain_commands(
        engines: Any, proxies: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from kvbridge.tools import cli

    ps, ds = await fleet(engines, 1, 2)
    ds[0].first_delay = ds[1].first_delay = 0.5
    proxy = await proxies([ps[0].url], [d.url for d in ds], mode=ProxyMode.PULL,
                          control_secret=SECRET)

    async def run(*argv: str, secret: str = SECRET) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(cli.main, [*argv[:1], "--proxy", proxy.url,
                                                  "--control-secret", secret, *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await run("engines", "--json")
    assert code == 0 and [r["state"] for r in json.loads(out)] == ["active"] * 3
    req = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", COMPLETION))
    while not (ds[0].requests() or ds[1].requests()):
        await asyncio.sleep(0.01)
    busy = ds[0] if ds[0].requests() else ds[1]
    # `kvbridge drain` returns once what the engine serves has ended
    code, out, _ = await run("drain", busy.url, "--json", "--wait", "20")
    assert req.done() and (await req)[0] == 200
    assert code == 0 and json.loads(out)[0]["state"] == "drained"
    code, out, _ = await run("engines", "remove", busy.url)
    assert code == 0 and "removed" in out
    code, _, err = await run("engines", "resume", busy.url)
    assert code == 1 and "HTTP 404" in err
    code, _, err = await run("engines", "list", secret="not the fleet's secret")
    assert code == 1 and "HTTP 401" in err
    code, out, _ = await run("engines", "add", "decode", busy.url)
    assert code == 0 and "joining" in out


# ------------------------------------------------------------------------------ KV credit

def tokens(n: int, max_tokens: int = 16) -> dict[str, Any]:
    """A completion whose KV may reach ``n + max_tokens`` tokens."""
    return {"model": "m", "prompt": list(range(1, n + 1)), "max_tokens": max_tokens}


@pytest.mark.parametrize("mode", [ProxyMode.PULL, ProxyMode.PUSH])
async def test_kv_credit_reject_answers_503_before_touching_prefill(
        engines: Any, proxies: Any, client: Any, mode: ProxyMode) -> None:
    p = await engines("prefill")
    d = await engines("decode", kv_blocks=10, first_delay=0.5)  # 320 tokens of KV
    proxy = await proxies([p.url], [d.url], mode=mode, kv_admission=KvAdmission.REJECT)
    first = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", tokens(200)))
    while not d.requests():
        await asyncio.sleep(0.01)
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "kv_capacity_blocks", engine=d.url) == 10
    assert prom.value(text, P + "kv_credit_blocks", engine=d.url) == 3  # 7 blocks claimed
    async with client.post(proxy.url + "/v1/completions", json=tokens(200)) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        answer = await r.json()
    assert answer["error"]["type"] == "no_kv_credit"
    assert "it may hold 216 tokens; the most any engine has free is 3 blocks" in answer[
        "error"]["message"]
    assert len(p.requests()) == 1  # the refused request never reached P
    assert (await first)[0] == 200
    # the first one's end freed its credit: the same request is admitted now
    assert (await post(client, proxy.url + "/v1/completions", tokens(200)))[0] == 200
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "kv_credit_blocks", engine=d.url) == 10
    assert prom.value(text, P + "errors_total", kind="no_kv_credit") == 1


async def test_kv_credit_queue_waits_for_room_then_serves(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode", kv_blocks=10, first_delay=0.4)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL,
                          kv_admission=KvAdmission.QUEUE, kv_queue_s=10.0)
    t0 = time.monotonic()
    results = await asyncio.gather(*(post(client, proxy.url + "/v1/completions", tokens(200))
                                     for _ in range(3)))
    assert [s for s, _ in results] == [200] * 3
    assert time.monotonic() - t0 >= 1.2  # one at a time: each waited for the one before
    starts = sorted(s.t_start for s in d.requests())
    ends = sorted(s.t_end for s in d.requests())
    assert all(start >= end - 0.01 for start, end in zip(starts[1:], ends, strict=False))


async def test_kv_credit_spreads_over_decodes_with_room_and_follows_late_placement(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    small = await engines("decode", kv_blocks=8, first_delay=0.3)
    big = await engines("decode", kv_blocks=16, first_delay=0.3)
    proxy = await proxies([p.url], [small.url, big.url], mode=ProxyMode.PULL,
                          kv_admission=KvAdmission.REJECT)
    # 7 blocks each: big takes two, small one; a fourth finds no room anywhere
    results = await asyncio.gather(*(post(client, proxy.url + "/v1/completions", tokens(200))
                                     for _ in range(4)))
    assert sorted(s for s, _ in results) == [200, 200, 200, 503]
    assert len(big.requests()) == 2 and len(small.requests()) == 1
    assert proxy.fleet.admission.reserved == {}  # every claim released


async def test_kv_credit_with_engines_that_report_none_limits_nothing(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d = await engines("decode", first_delay=0.2)  # no cache_config_info: not vLLM
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL, kv_admission=KvAdmission.REJECT)
    results = await asyncio.gather(*(post(client, proxy.url + "/v1/completions", tokens(900))
                                     for _ in range(3)))
    assert [s for s, _ in results] == [200] * 3


# ------------------------------------------------------------------------------ discovery


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def write_engines(path: Path, doc: Any) -> None:
    """Replace the file at once, as a ConfigMap update does (a new inode every time)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    os.replace(tmp, path)


def admission(proxy: ProxyServer, url: str) -> str | None:
    e = proxy.decodes.by_url(url) or proxy.prefills.by_url(url)
    return None if e is None else e.admission.value


@pytest.fixture
async def discovering() -> AsyncIterator[Callable[..., Any]]:
    """Factory of started proxies with discovery (and an optional injected resolver)."""
    started: list[ProxyServer] = []

    async def make(prefill: list[str], decode: list[str], resolver: Any = None,
                   **kw: Any) -> ProxyServer:
        kw.setdefault("mode", ProxyMode.PULL)
        kw.setdefault("connect_timeout_s", 1.0)
        kw.setdefault("health_interval_s", 0.2)
        kw.setdefault("discovery_interval_s", 0.1)
        server = ProxyServer(ProxySettings(prefill, decode, port=0, **kw), resolver=resolver)
        await server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


async def test_discovery_file_adds_engines_that_serve_and_drains_one_that_left(
        engines: Any, discovering: Any, client: Any, tmp_path: Path) -> None:
    p, d1, d2 = await engines("prefill"), await engines("decode"), await engines("decode")
    path = tmp_path / "engines.json"  # not written yet: the decode pool starts empty
    proxy = await discovering([p.url], [], engines_file=str(path))
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["type"] == "no_engine"
    async with client.get(proxy.url + "/health") as r:
        assert r.status == 503
    for _ in range(500):  # a discovery round has found the file absent (before it exists)
        if (prom.value(await metrics_text(client, proxy), P + "discovery_errors_total",
                       source="file") or 0) >= 1:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the absent engines file was never counted as an error")
    write_engines(path, {"decode": [d1.url]})
    await until(lambda: admission(proxy, d1.url) == "active")
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    write_engines(path, {"decode": [d1.url, d2.url]})
    await until(lambda: admission(proxy, d2.url) == "active")
    for d in (d1, d2):
        d.first_delay = 2.0  # long enough to see it draining on a loaded host
    slow = asyncio.ensure_future(post(client, proxy.url + "/v1/completions", COMPLETION))
    await until(lambda: len(d1.requests()) + len(d2.requests()) == 2)
    busy = d1 if len(d1.requests()) == 2 else d2
    other = d2 if busy is d1 else d1
    write_engines(path, {"decode": [other.url]})
    await until(lambda: admission(proxy, busy.url) == "draining")
    assert proxy.decodes.by_url(busy.url) is not None  # never removed while it serves
    assert (await slow)[0] == 200  # its in-flight request ran to its end
    await until(lambda: admission(proxy, busy.url) is None)  # then removed
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    text = await metrics_text(client, proxy)
    for change, n in (("added", 2), ("drained", 1), ("removed", 1), ("resumed", 0)):
        assert prom.value(text, P + "discovery_changes_total", role="decode",
                          change=change) == n, change


@pytest.mark.parametrize("content", [
    b"{not json",
    {"decode": ["http://127.0.0.1:1/v1"]},
    {"decode": "http://127.0.0.1:1"},
    {"decode": [1, 2]},
    {"decode": []},
    {"decodes": ["http://127.0.0.1:1"]},
    {"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:1"]},
    b" " * ((1 << 20) + 1),
])
async def test_discovery_a_malformed_oversized_or_forged_file_changes_nothing(
        engines: Any, discovering: Any, client: Any, tmp_path: Path, content: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    path = tmp_path / "engines.json"
    write_engines(path, {"prefill": [p.url], "decode": [d.url]})
    proxy = await discovering([], [], engines_file=str(path))
    await until(lambda: admission(proxy, d.url) == "active" == admission(proxy, p.url))
    write_engines(path, content)
    before = prom.value(await metrics_text(client, proxy), P + "discovery_errors_total",
                        source="file") or 0
    await asyncio.sleep(0.5)  # five rounds
    assert [(e.url, e.admission.value) for e in proxy.fleet.engines] == [
        (p.url, "active"), (d.url, "active")]
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    after = prom.value(await metrics_text(client, proxy), P + "discovery_errors_total",
                       source="file") or 0.0
    assert after > before or content == {"decode": []}  # an empty list is no error


async def test_discovery_dns_finds_an_engine_by_the_system_resolver(
        engines: Any, discovering: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    proxy = await discovering([p.url], [], decode_dns=f"localhost:{d.port}")
    await until(lambda: admission(proxy, d.url) == "active")  # ::1, if answered, never joins
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    assert len(d.requests()) == 1


async def test_discovery_dns_answers_that_change_between_rounds(
        engines: Any, discovering: Any, client: Any) -> None:
    p, d0, d1 = await engines("prefill"), await engines("decode"), await engines("decode")
    box: list[Any] = [["127.0.0.1"]]  # what the resolver answers next

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == ("engines.test", d1.port)
        answer = box[0]
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":
            await asyncio.sleep(3600)
        return list(answer)

    # one round at start, then the test steps the rounds itself
    proxy = await discovering([p.url], [d0.url], resolver=resolver,
                              decode_dns=f"engines.test:{d1.port}", discovery_interval_s=3600)
    assert proxy.discovery is not None
    step = proxy.discovery.round
    await until(lambda: admission(proxy, d1.url) == "active")
    gone = f"http://[::1]:{d1.port}"  # nothing listens there: it stays joining
    box[0] = ["::1"]
    await step()
    assert admission(proxy, d1.url) == "draining" and admission(proxy, gone) == "joining"
    box[0] = ["127.0.0.1"]  # back before it was removed: resumed; ::1 left
    await step()
    assert admission(proxy, d1.url) == "active" and admission(proxy, gone) == "draining"
    await step()
    assert admission(proxy, gone) is None
    source = proxy.discovery.sources[0]
    assert isinstance(source, DnsSource)
    source.timeout_s = 0.2
    for box[0] in ([], OSError("Temporary failure in name resolution"), "hang", ["not-an-ip"]):
        t0 = time.monotonic()
        await step()  # an empty answer, a failure, a hang, a forged answer: nothing changes
        assert time.monotonic() - t0 < 2.0  # a hanging resolver is bounded
        assert admission(proxy, d1.url) == "active" and admission(proxy, d0.url) == "active"
    # the static engine is never removed, even when DNS names neither
    box[0] = ["::1"]
    await step()
    await step()
    assert admission(proxy, d1.url) is None and admission(proxy, d0.url) == "active"
    assert (await post(client, proxy.url + "/v1/completions", COMPLETION))[0] == 200
    text = await metrics_text(client, proxy)
    assert prom.value(text, P + "discovery_changes_total", role="decode", change="resumed") == 1
    assert prom.value(text, P + "discovery_errors_total", source="dns") == 3


# ------------------------------------------------------------------------------ /admin/why

LOCAL_TOKEN = trust.admin_token(trust.for_tools(None).secret or b"")


async def test_why_of_a_request_sent_with_record_0_names_it_and_asks_no_engine(
        engines: Any, proxies: Any, client: Any, controls: Any) -> None:
    p_ctl = controls()
    p = await engines("prefill", control_port=p_ctl.port)
    d = await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION,
                           headers={"X-Request-Id": "quiet-1", "X-KVBridge-Record": "0"}) as r:
        assert r.status == 200
        await r.read()
    p_ctl.records[tid_of(p.requests()[0])] = {"arrived": 1.0}  # even if an engine had one
    status, row = await admin(client, proxy, "GET", "/admin/why/quiet-1", token=LOCAL_TOKEN)
    assert status == 200 and row["P"] is None and row["D"] is None
    assert "not recorded (the request said X-KVBridge-Record: 0)" in row["engines"]["P"]
    assert row["proxy"]["first_token"] > row["proxy"]["receive"]  # the proxy's own steps stay
    assert sum(x["seconds"] for x in row["phases"]) == pytest.approx(
        row["proxy"]["first_token"] - row["proxy"]["receive"])


async def test_a_request_left_in_the_proxys_socket_is_in_its_record(
        engines: Any, proxies: Any, client: Any) -> None:
    """The proxy's event loop is held (here by this test, which shares it; in production by
    other requests or by the host) while a request's bytes sit in the proxy's socket: the
    kernel's TCP_INFO puts that wait into the record as its first phase."""
    from kvbridge.proxy.arrival import TICK_NS

    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(COMPLETION).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: held-1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        sent = time.monotonic()
        time.sleep(0.08)  # the loop (the proxy's too) does nothing while the bytes wait
        answer = await asyncio.wait_for(reader.read(), 20)
        elapsed = time.monotonic() - sent
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    status, row = await admin(client, proxy, "GET", "/admin/why/held-1", token=LOCAL_TOKEN)
    assert status == 200, row
    first = row["phases"][0]
    assert first["phase"] == "in the proxy's socket (before its handler ran)", row["phases"]
    assert 0.08 - 2 * TICK_NS / 1e9 - 0.002 <= first["seconds"] <= elapsed
    steps = row["proxy"]
    assert steps["receive"] - steps["arrived"] == pytest.approx(first["seconds"])
    assert row["ttft_s"] == pytest.approx(steps["first_token"] - steps["arrived"])
    # the next request, not held, records no wait (or only what the host took, far less)
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION,
                           headers={"X-Request-Id": "free-1"}) as r:
        assert r.status == 200
        await r.read()
    status, row = await admin(client, proxy, "GET", "/admin/why/free-1", token=LOCAL_TOKEN)
    assert status == 200
    assert row["phases"][0]["from"] == "proxy.receive" or row["phases"][0]["seconds"] < 0.04


@pytest.mark.parametrize("mode", [ProxyMode.PUSH, ProxyMode.PULL])
async def test_why_joins_the_proxy_record_with_the_engines_records(
        engines: Any, proxies: Any, client: Any, controls: Any, mode: ProxyMode) -> None:
    p_ctl, d_ctl = controls(), controls()
    p = await engines("prefill", control_port=p_ctl.port, prefill_delay=0.05)
    d = await engines("decode", control_port=d_ctl.port, first_delay=0.2, answers_probe=True)
    proxy = await proxies([p.url], [d.url], mode=mode)
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION,
                           headers={"X-Request-Id": "client-req.1"}) as r:
        assert r.status == 200 and r.headers["X-Request-Id"] == "client-req.1"
        await r.read()
    status, row = await admin(client, proxy, "GET", "/admin/why/client-req.1",
                              token=LOCAL_TOKEN)
    assert status == 200, row
    tid = tid_of(p.requests()[0])
    assert row["transfer_id"] == tid and row["mode"] == mode.value
    assert row["P"] is None and row["D"] is None  # the stand-ins recorded nothing yet
    steps = row["proxy"]
    t0, t1 = steps["receive"], steps["first_token"]
    assert sum(x["seconds"] for x in row["phases"]) == pytest.approx(t1 - t0)
    # now the engines remember the transfer: steps on their own clocks, D's 3 s behind
    span = t1 - t0
    p_ctl.records[tid] = {"arrived": t0 + 0.1 * span, "scheduled": t0 + 0.15 * span,
                          "kv_ready": t0 + 0.2 * span, "write_posted": t0 + 0.21 * span,
                          "write_done": t0 + 0.25 * span}
    d_ctl.records[tid] = {k: v - 3.0 for k, v in {
        "arrived": t0 + 0.3 * span, "scheduled": t0 + 0.31 * span,
        "recv_start": t0 + 0.32 * span, "read_posted": t0 + 0.33 * span,
        "recv_done": t0 + 0.4 * span, "recv_seen": t0 + 0.41 * span,
        "first_step": t0 + 0.42 * span}.items()}
    status, row = await admin(client, proxy, "GET", "/admin/why/client-req.1",
                              token=LOCAL_TOKEN)
    assert status == 200 and row["P"] and row["D"], row["engines"]
    phases = {x["phase"]: x for x in row["phases"]}
    assert sum(x["seconds"] for x in row["phases"]) == pytest.approx(t1 - t0)
    assert row["ttft_s"] == pytest.approx(t1 - t0)
    assert phases["P prefill"]["seconds"] == pytest.approx(0.05 * span, abs=1e-6)
    assert not phases["P prefill"]["hop"] and phases["D first step → first token out"]["hop"]
    if mode is ProxyMode.PULL:
        assert phases["wire (READ)"]["seconds"] == pytest.approx(0.07 * span, abs=1e-6)
    else:
        assert phases["wire (WRITE)"]["seconds"] == pytest.approx(0.04 * span, abs=1e-6)


async def test_why_refuses_without_the_token_and_hostile_ids(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url])
    async with client.post(proxy.url + "/v1/completions", json=COMPLETION,
                           headers={"X-Request-Id": "y" * 500}) as r:
        rid = r.headers["X-Request-Id"]  # an unsafe client id is replaced, not echoed
        assert r.status == 200 and rid.startswith("kvb-") and len(rid) < 64
    for token in (None, "", "0" * 64):
        status, answer = await admin(client, proxy, "GET", f"/admin/why/{rid}", token=token)
        assert status == 401 and "P" not in answer
    assert (await admin(client, proxy, "GET", f"/admin/why/{rid}", token=LOCAL_TOKEN))[0] == 200
    for bad in ("y" * 500, "bad%20id", "%00", "-x", "a%0Ab"):
        status, answer = await admin(client, proxy, "GET", f"/admin/why/{bad}",
                                     token=LOCAL_TOKEN)
        assert status == 400 and answer["error"]["param"] == "rid", (bad, answer)
    status, answer = await admin(client, proxy, "GET", "/admin/why/kvb-unknown",
                                 token=LOCAL_TOKEN)
    assert status == 404 and answer["error"]["param"] == "rid"
    async with client.get(proxy.url + "/admin/why/" + "z" * 20000,
                          headers={"Authorization": f"Bearer {LOCAL_TOKEN}"}) as r:
        assert 400 <= r.status < 500  # an oversized path is refused before any handler


# ------------------------------------------------------------------------------ local and plan


async def test_local_mode_sends_the_request_to_d_alone(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.LOCAL)
    status, answer = await post(client, proxy.url + "/v1/completions", COMPLETION)
    assert status == 200 and answer["choices"][0]["text"] == "t0t1t2"
    assert p.requests() == []  # no prefill, no hand-off
    [ds] = d.requests()
    assert ds.body == COMPLETION  # as the client sent it: no kv_transfer_params
    text = await (await client.get(proxy.url + "/metrics")).text()
    assert prom.value(text, P + "requests_total", mode="local", outcome="ok") == 1
    assert prom.value(text, P + "mode_decisions_total", configured="local", chosen="local",
                      reason="configured") == 1


async def test_the_mode_header_overrides_the_proxy_mode_and_bad_headers_are_refused(
        engines: Any, proxies: Any, client: Any) -> None:
    p, d = await engines("prefill"), await engines("decode", answers_probe=False)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.PULL)
    url = proxy.url + "/v1/completions"
    async with client.post(url, json=COMPLETION, headers={"X-KVBridge-Mode": "LOCAL"}) as r:
        assert r.status == 200
    assert p.requests() == [] and "kv_transfer_params" not in d.requests()[-1].body
    async with client.post(url, json=COMPLETION, headers={"X-KVBridge-Mode": "push"}) as r:
        assert r.status == 200
    assert p.requests()[-1].body["kv_transfer_params"]["transfer_mode"] == "push"
    for header, value in (("X-KVBridge-Mode", "nixl"), ("X-KVBridge-Mode", "x" * 5000),
                          ("X-KVBridge-TTFT-SLO-Ms", "-3"), ("X-KVBridge-TTFT-SLO-Ms", "nan"),
                          ("X-KVBridge-TTFT-SLO-Ms", "soon")):
        async with client.post(url, json=COMPLETION, headers={header: value}) as r:
            answer = await r.json()
            assert r.status == 400 and answer["error"]["param"] == header, answer
    assert len(d.requests()) == 2  # the refused ones reached no engine
    status, _ = await post(client, url, COMPLETION)  # the proxy keeps serving
    assert status == 200


async def test_the_record_header_asks_both_legs_for_no_flight_record(
        engines: Any, proxies: Any, client: Any) -> None:
    """X-KVBridge-Record: 0 puts kvbridge_record false in P's and D's params (push and pull);
    without it the params say nothing; a value that is not a boolean is refused, naming it."""
    p = await engines("prefill", engine_id="P-rec")
    d = await engines("decode")
    for mode in (ProxyMode.PULL, ProxyMode.PUSH):
        proxy = await proxies([p.url], [d.url], mode=mode)
        url = proxy.url + "/v1/completions"
        for value, recorded in (("0", False), ("Off", False), ("true", True), (None, True)):
            headers = {} if value is None else {"X-KVBridge-Record": value}
            async with client.post(url, json=COMPLETION, headers=headers) as r:
                assert r.status == 200, await r.text()
            for leg in (p.requests()[-1], d.requests()[-1]):
                kvp = leg.body["kv_transfer_params"]
                assert kvp.get("kvbridge_record", True) is recorded, (mode, value, kvp)
                assert "kvbridge_record" not in kvp or recorded is False
        sent = len(d.requests())
        for bad in ("maybe", "2", "", "x" * 5000):
            async with client.post(url, json=COMPLETION, headers={"X-KVBridge-Record": bad}) as r:
                answer = await r.json()
                assert r.status == 400 and answer["error"]["param"] == "X-KVBridge-Record"
        assert len(d.requests()) == sent  # the refused ones reached no engine
        status, _ = await post(client, url, COMPLETION)  # the proxy keeps serving
        assert status == 200


async def test_auto_is_the_planner_plan_its_other_name_and_headroom_the_old_rule(
        engines: Any, proxies: Any, client: Any) -> None:
    """auto is the planner: its answers carry X-KVBridge-Plan. A request asking for plan or auto
    is the planner's, counted as configured="auto" either way; one asking for headroom gets the
    load rule (D idle: push), counted as configured="headroom"."""
    p, d = await engines("prefill"), await engines("decode")
    proxy = await proxies([p.url], [d.url], mode=ProxySettings([], []).mode)  # the default
    url = proxy.url + "/v1/completions"
    planned = []
    for mode in (None, "plan", "Auto"):
        headers = {} if mode is None else {"X-KVBridge-Mode": mode}
        async with client.post(url, json={**COMPLETION, "stream": True}, headers=headers) as r:
            assert r.status == 200
            await r.read()
            planned.append(plan_of(r.headers))
    assert all(x["path"] in ("local", "push", "pull") and x["why"] != "requested"
               for x in planned), planned
    async with client.post(url, json=COMPLETION, headers={"X-KVBridge-Mode": "headroom"}) as r:
        assert r.status == 200
        assert plan_of(r.headers)["why"] == "requested"  # the planner watched, did not choose
    assert p.requests()[-1].body["kv_transfer_params"]["transfer_mode"] == "push"
    text = await (await client.get(proxy.url + "/metrics")).text()
    assert prom.value(text, P + "mode_decisions_total", configured="headroom", chosen="push",
                      reason="headroom") == 1
    assert prom.total(text, P + "mode_decisions_total", configured="auto") == 3
    assert "configured=\"plan\"" not in text


def plan_of(headers: Any) -> dict[str, str]:
    return dict(part.split("=", 1) for part in headers["X-KVBridge-Plan"].split("; "))


async def ask_plan(client: Any, url: str, tokens: int, seed: int, max_tokens: int = 16,
                   mode: str | None = None) -> dict[str, str]:
    """Stream a completion of ``tokens`` copies of ``seed`` through the proxy at ``url`` (with
    ``X-KVBridge-Mode: mode`` when given); assert it was answered whole; its plan header."""
    body = {**COMPLETION, "prompt": [seed] * tokens, "stream": True, "max_tokens": max_tokens}
    headers = {"X-KVBridge-Mode": mode} if mode else {}
    async with client.post(url, json=body, headers=headers) as r:
        assert r.status == 200
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
        return plan_of(r.headers)


async def test_plan_keeps_short_prompts_on_d_and_hands_long_ones_off(
        engines: Any, proxies: Any, client: Any) -> None:
    """D alone costs 0.5 ms per prompt token here, a hand-off a flat 30 ms or more: once each
    path was measured, a 10-token prompt stays on D and a 400-token one is handed off."""
    p = await engines("prefill", prefill_delay=0.01)
    d = await engines("decode", local_per_token=0.0005, handoff_delay=0.03)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.AUTO)
    url = proxy.url + "/v1/completions"

    async def ask(tokens: int, seed: int) -> dict[str, str]:
        return await ask_plan(client, url, tokens, seed)

    plans = [await ask(tokens, seed) for seed, tokens in enumerate([10, 400] * 6)]
    assert {x["why"] for x in plans[:9]} >= {"warmup"}  # every path measured first
    assert {x["path"] for x in plans} == {"local", "push", "pull"}
    short, long = await ask(10, 100), await ask(400, 101)
    assert short["path"] == "local" and float(short["local"]) < float(short["push"]), short
    assert long["path"] in ("push", "pull"), long
    assert float(long["local"]) > float(long[long["path"]]), long
    text = await (await client.get(proxy.url + "/metrics")).text()
    assert prom.value(text, P + "mode_decisions_total", configured="auto", chosen="local",
                      reason="fastest") >= 1
    status, snap = await admin(client, proxy, "GET", "/admin/plan", token=LOCAL_TOKEN)
    assert status == 200 and snap["paths"]["local"]["observations"] >= 3, snap
    assert snap["paths"]["local"]["ms_per_1k_compute"] > 100  # 0.5 ms per token, measured
    assert snap["prefix_units"][d.url] > 0 and set(snap["prefix_units"]) == {p.url, d.url}
    assert (await admin(client, proxy, "GET", "/admin/plan", token=None))[0] == 401


async def test_plan_places_a_prompt_on_the_d_that_holds_it_and_never_by_another_tenant(
        engines: Any, proxies: Any, client: Any) -> None:
    p = await engines("prefill")
    d1, d2 = await engines("decode"), await engines("decode")
    proxy = await proxies([p.url], [d1.url, d2.url], mode=ProxyMode.AUTO)
    url = proxy.url + "/v1/completions"
    history = list(range(1, 200))

    async def ask(prompt: list[int], salt: str) -> str:
        body = {**COMPLETION, "prompt": prompt, "stream": True, "cache_salt": salt}
        async with client.post(url, json=body, headers={"X-KVBridge-Mode": "local"}) as r:
            assert r.status == 200
            await r.read()
        return "d1" if d1.requests() and d1.requests()[-1].body["prompt"] == prompt \
            and d1.requests()[-1].body["cache_salt"] == salt else "d2"

    first = await ask(history, "tenant-a")
    # the conversation grows: every turn goes where its history is, though both Ds are idle
    for turn in range(4):
        history = history + [500 + turn] * 20
        assert await ask(history, "tenant-a") == first
    # the same tokens from another tenant are not placed by tenant-a's history: they alternate
    other = [await ask(history, f"tenant-b{i}") for i in range(4)]
    assert set(other) == {"d1", "d2"}


async def test_plan_sends_a_prompt_to_the_p_that_computed_its_prefix(
        engines: Any, proxies: Any, client: Any) -> None:
    p1, p2 = await engines("prefill"), await engines("prefill")
    d = await engines("decode")
    proxy = await proxies([p1.url, p2.url], [d.url], mode=ProxyMode.AUTO)
    prompt = list(range(1, 300))

    async def push(tokens: list[int]) -> str:
        body = {**COMPLETION, "prompt": tokens, "stream": True}
        async with client.post(proxy.url + "/v1/completions", json=body,
                               headers={"X-KVBridge-Mode": "push"}) as r:
            assert r.status == 200
            await r.read()
        return "p1" if p1.requests() and p1.requests()[-1].body["prompt"] == tokens else "p2"

    first = await push(prompt)
    for turn in range(3):
        prompt = prompt + [900 + turn] * 30
        assert await push(prompt) == first
    assert {await push([7000 + i] * 50) for i in range(4)} == {"p1", "p2"}  # cold: by load


async def test_plan_keeps_long_prefills_off_a_d_whose_decodes_are_at_their_tpot_slo(
        engines: Any, proxies: Any, client: Any) -> None:
    """D streams a token every 50 ms, over a 40 ms TPOT SLO: once the proxy has measured that,
    a prompt whose prefill would take D more than half the SLO is handed off (guard=tpot),
    while a short one still goes to D alone; the prefill work the planner counts per engine
    is back to nothing when the requests are done."""
    from kvbridge.proxy.planner import PlannerSettings
    p = await engines("prefill", prefill_delay=0.01)
    d = await engines("decode", local_per_token=0.0005, handoff_delay=0.03, chunk_delay=0.05)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode("plan"),  # auto's other name
                          plan=PlannerSettings(tpot_slo_ms=40.0, explore_every=0))
    url = proxy.url + "/v1/completions"

    async def ask(tokens: int, seed: int) -> dict[str, str]:
        return await ask_plan(client, url, tokens, seed)

    for seed in range(9):  # every path measured (warm-up), D's TPOT too
        await ask(10 if seed % 2 else 400, seed)
    planning = proxy.dispatcher.planning
    assert planning.tpot[d.url] > 40.0
    long, short = await ask(400, 100), await ask(10, 101)
    assert long["path"] in ("push", "pull") and long.get("guard") == "tpot", long
    assert short["path"] == "local" and "guard" not in short, short
    assert planning.pending == {} and planning.placed == {}


async def test_plan_keeps_a_prefill_off_a_d_where_it_would_push_a_stream_past_its_tpot_slo(
        engines: Any, proxies: Any, client: Any) -> None:
    """D's streams are fast (20 ms a token, under 75 % of a 60 ms SLO even on a loaded host)
    and a 1000-token prompt is cheapest on D alone (100 ms, a hand-off 300 ms). While a 2-token
    stream is placed on D, that 100 ms stall would add 100 ms to its TPOT: the prompt is handed
    off (guard=tpot); with nothing on D it stays there. Nothing is left placed when the
    requests are done. (Margins of 2 x both ways: D's TPOT measured 34 ms on a busy host.)"""
    from kvbridge.proxy.planner import PlannerSettings
    p = await engines("prefill", prefill_delay=0.01)
    d = await engines("decode", local_per_token=0.0001, handoff_delay=0.3, chunk_delay=0.02)
    proxy = await proxies([p.url], [d.url], mode=ProxyMode.AUTO,
                          plan=PlannerSettings(tpot_slo_ms=60.0, explore_every=0))
    url = proxy.url + "/v1/completions"

    async def ask(tokens: int, seed: int, max_tokens: int = 16,
                  mode: str | None = None) -> dict[str, str]:
        return await ask_plan(client, url, tokens, seed, max_tokens, mode)

    for seed in range(9):  # every path measured (warm-up), D's TPOT too
        await ask(10 if seed % 2 else 1000, seed)
    planning = proxy.dispatcher.planning
    assert planning.tpot[d.url] < 45.0
    alone = await ask(1000, 100)
    assert alone["path"] == "local" and "guard" not in alone, alone
    # a 2-token stream on D, prefilling 8000 tokens there (0.8 s) while the next one is planned
    other = asyncio.ensure_future(ask(8000, 200, max_tokens=2, mode="local"))
    for _ in range(200):
        if planning.placed.get(d.url):
            break
        await asyncio.sleep(0.005)
    assert planning.placed.get(d.url)
    guarded = await ask(1000, 101)
    assert guarded["path"] in ("push", "pull") and guarded.get("guard") == "tpot", guarded
    await other
    assert planning.placed == {} and planning.pending == {}

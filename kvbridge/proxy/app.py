"""HTTP side of the disaggregation proxy: an aiohttp server in front of vLLM P and D engines.

The proxy knows HTTP and routing (:mod:`kvbridge.proxy.routing`), never transports: all it moves
between engines is ``kv_transfer_params`` inside the OpenAI request bodies (docs/proxy.md).
:class:`ProxyServer` wires the parts and serves the endpoints; the work is theirs:

- :mod:`~kvbridge.proxy.pool` — the engines, the upstream session, probes, health and rotation;
- :mod:`~kvbridge.proxy.dispatch` — push or pull per request, retries, explained failures;
- :mod:`~kvbridge.proxy.relay` — the legs: P's prefill, D's answer and stream to the client;
- :mod:`~kvbridge.proxy.tenants` — ``cache_salt`` from the operator's tenant header;
- :mod:`~kvbridge.proxy.admin` — ``/admin``: list, add, drain, resume and remove engines;
- :mod:`~kvbridge.proxy.discovery` — engines found by DNS or in a watched file (a pool found
  only by discovery starts empty: requests get 503 ``no_engine`` with ``Retry-After`` and
  ``/health`` 503 until an engine joined);
- :mod:`~kvbridge.proxy.metrics`, :mod:`~kvbridge.proxy.reasons`.

Contract:

- Runs on one asyncio event loop; :class:`ProxyServer` is not thread-safe.
- Every upstream call is bounded: ``connect_timeout_s`` to open a connection, ``timeout_s`` for
  the whole exchange. A dead engine gives a 502 JSON error at once (refused) or after the connect
  timeout (black-holed), never a hang; the engine is then avoided (health checks or a cool-down).
- A client that goes away cancels its handler (``handler_cancellation``); every upstream
  connection the request opened is then closed, so vLLM aborts the request and frees its blocks.
  A P leg still draining after D answered runs to its end in the background; when the request
  failed or was cancelled, it is cancelled too.
- Every failure of a request ends at the handler: a body that is not JSON is a 400, one that
  :func:`~kvbridge.proxy.routing.validate_request` refuses a 400 naming the field (so is a
  tenant header :mod:`~kvbridge.proxy.tenants` cannot use); a failed
  dispatch is a JSON error with the status and type of its
  :class:`~kvbridge.proxy.failures.LegFailed` (or D's own answer). Every request, whatever its
  end, is counted once in ``requests_total`` (and, once routed, in
  ``request_duration_seconds``).
- Health: ``/health`` checks every engine now (200 while some P and some D answer, else 503);
  the background check every ``health_interval_s`` moves engines in and out of rotation.
- :meth:`ProxyServer.stop` cancels background work, stops serving and closes every upstream
  connection and control-channel client; it is safe after a failed :meth:`ProxyServer.start`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvbridge.proxy.admin import AdminApi
from kvbridge.proxy.arrival import socket_wait_ns
from kvbridge.proxy.credit import KvAdmission
from kvbridge.proxy.discovery import Resolver, from_settings
from kvbridge.proxy.dispatch import Dispatcher
from kvbridge.proxy.failures import LegFailed
from kvbridge.proxy.flight import Flight, FlightLog, safe_request_id
from kvbridge.proxy.kvfeed import EnginePrefixes
from kvbridge.proxy.members import NoEngine
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.planning import SLO_HEADER, requested_slo
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.relay import Call, Relay
from kvbridge.proxy.routing import (
    MODE_HEADER,
    RECORD_HEADER,
    Engine,
    ProbeInfo,
    ProxyMode,
    Role,
    requested_mode,
    requested_record,
    validate_request,
)
from kvbridge.proxy.settings import ProxySettings
from kvbridge.proxy.tenants import SaltError, TenantSalt
from kvbridge.proxy.tracing import ProxyTracing, pass_on

__all__ = ["ProxySettings", "ProxyServer", "serve"]

log = logging.getLogger("kvbridge.proxy")
T = TypeVar("T")
_FORWARDED_HEADERS = ("Authorization",)


def _log_leg_failure(task: asyncio.Future[Any]) -> None:
    """Done-callback of a background P leg: log (and so retrieve) its failure, if any."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("background prefill leg ended with: %s", task.exception())


def _error(
    status: int, message: str, kind: str = "proxy_error", param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class ProxyServer:
    """The proxy as an object: ``await start()`` binds (port 0 → see :attr:`port`), ``stop()``."""

    def __init__(self, settings: ProxySettings, resolver: Resolver | None = None,
                 span_exporter: Any = None) -> None:
        """``resolver``: what ``--prefill-dns``/``--decode-dns`` resolve with (default: the
        system's, :func:`kvbridge.proxy.discovery.system_resolver`); ``span_exporter``: an
        OpenTelemetry SDK exporter that replaces OTLP when ``otlp_traces_endpoint`` is set
        (tests)."""
        settings.check()
        #: OpenTelemetry spans (kvbridge.proxy.tracing); None without --otlp-traces-endpoint
        self.tracing = (ProxyTracing(settings.otlp_traces_endpoint, span_exporter)
                        if settings.otlp_traces_endpoint else None)
        self.settings = settings
        self.metrics = ProxyMetrics()
        self.fleet = Fleet(settings, self.metrics)
        self.prefills = self.fleet.prefills
        self.decodes = self.fleet.decodes
        self.dispatcher = Dispatcher(settings, self.metrics, self.fleet,
                                     Relay(settings, self.metrics, self.fleet))
        #: the last requests' flight records (kvbridge.proxy.flight; GET /admin/why/<id>)
        self.flights = FlightLog()
        self.admin = AdminApi(self.fleet, settings.control_secret, self.flights,
                              settings.control_timeout_s, self.dispatcher.planning)
        self.discovery = from_settings(settings, self.fleet, self.metrics, resolver)
        self._salt = (TenantSalt(settings.salt_header, settings.control_secret or "")
                      if settings.salt_header else None)
        #: the engines' KV events (kvbridge.proxy.kvfeed), with --kv-events: the planner's
        #: prefix index answers from them where an engine publishes
        self.prefixes: EnginePrefixes | None = None
        if settings.kv_events:
            self.prefixes = EnginePrefixes(self.fleet)
            self.dispatcher.planning.index = self.prefixes
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---------------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.admin.add_routes(app)
        return app

    async def start(self) -> None:
        """Bind and serve; probes P engines for their control address in the background."""
        s = self.settings
        self.fleet.open()
        self._runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        log.info(
            "proxy listening on %s mode=%s prefill=%s decode=%s push_headroom=%d",
            self.url,
            s.mode.value,
            [e.url for e in self.prefills.engines],
            [e.url for e in self.decodes.engines],
            s.push_headroom,
        )
        if s.mode is not ProxyMode.PULL:
            self._spawn(self.discover())
        if s.health_interval_s > 0:
            self._spawn(self.fleet.health_loop())
        if s.kv_admission is not KvAdmission.OFF:
            await self.fleet.learn_capacities()  # before the first request is admitted
        if self.discovery is not None:
            self._spawn(self.discovery.run())
        if self.prefixes is not None:
            self._spawn(self.prefixes.run())

    async def stop(self) -> None:
        """Stop serving, cancel background work and close every upstream connection."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.prefixes is not None:
            await self.prefixes.close()  # its sockets, before the loop goes
        await self.admin.close()  # its notices probe through the fleet's session
        await self.fleet.close()
        await self.dispatcher.close()
        if self.tracing is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream session (:attr:`Fleet.session <kvbridge.proxy.pool.Fleet.session>`)."""
        return self.fleet.session

    async def discover(self) -> dict[str, ProbeInfo | str]:
        """Probe every P engine; returns url → ProbeInfo, or the error text."""
        return await self.fleet.discover()

    async def probe(self, e: Engine, timeout_s: float | None = None) -> ProbeInfo:
        """An engine's control addresses (see :meth:`Fleet.probe`)."""
        return await self.fleet.probe(e, timeout_s)

    # ---------------------------------------------------------------- OpenAI endpoints

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        flight = Flight("")  # its steps start now: "receive"
        if request.transport is not None:  # and the bytes were there this long before
            waited = socket_wait_ns(request.transport.get_extra_info("socket"))
            if waited is not None:
                flight.waited(waited)
                self.metrics.observe_socket_wait(waited / 1e9)
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            self.metrics.error("bad_request")
            self.metrics.request_done("none", "client_error")
            return _error(400, f"request body is not valid JSON: {exc}", "invalid_request_error")
        problem = validate_request(body, chat)
        if problem is not None:
            self.metrics.error("bad_request")
            self.metrics.request_done("none", "client_error")
            return _error(400, problem.message, "invalid_request_error", problem.param)
        if self._salt is not None:
            try:
                self._salt.apply(body, request.headers)
            except SaltError as exc:
                self.metrics.error("bad_request")
                self.metrics.request_done("none", "client_error")
                return _error(400, str(exc), "invalid_request_error", self._salt.header)

        try:
            requested = requested_mode(request.headers)
        except ValueError as exc:
            return self._bad_header(exc, MODE_HEADER)
        try:
            slo_ms = requested_slo(request.headers)
        except ValueError as exc:
            return self._bad_header(exc, SLO_HEADER)
        try:
            record = requested_record(request.headers)
        except ValueError as exc:
            return self._bad_header(exc, RECORD_HEADER)

        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        # the client's id when it is safe to key a record and echo, else the proxy's own
        rid = safe_request_id(request.headers.get("X-Request-Id")) or "kvb-" + uuid.uuid4().hex
        headers["X-Request-Id"] = flight.rid = rid
        flight.engines_record = record
        self.flights.add(flight)
        call = Call(t0=t0, rid=rid, stream=bool(body.get("stream")), headers=headers,
                    flight=flight, requested=requested, slo_ms=slo_ms)
        if self.tracing is not None:
            call.trace = self.tracing.start(request.headers, rid, path, flight.began_ns())
        else:  # no spans of ours: vLLM's still join the client's trace
            pass_on(request.headers, headers)
        try:
            resp = await self.dispatcher.route(request, path, body, call)
            if call.outcome == "ok" and resp.status >= 400:
                call.outcome = "client_error" if resp.status < 500 else "upstream_error"
            if not resp.prepared:
                resp.headers["X-Request-Id"] = rid
            return resp
        except LegFailed as exc:
            log.warning("%s %s failed (%s): %s", call.rid, call.mode, exc.kind, exc.message)
            call.outcome = (
                "timeout"
                if exc.status == 504
                else ("client_error" if exc.status < 500 else "upstream_error")
            )
            if exc.response is not None:  # D's own answer, unless an engine says why
                if not exc.response.prepared:
                    exc.response.headers["X-Request-Id"] = rid
                return exc.response
            resp = _error(exc.status, exc.message, exc.kind, exc.param)
            resp.headers.update(call.reply_headers)
            resp.headers["X-Request-Id"] = rid
            if exc.kind in ("no_engine", "no_kv_credit"):  # a moment later it may fit
                resp.headers["Retry-After"] = "1"
            return resp
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            log.info("%s client went away; upstream requests closed", call.rid)
            raise
        finally:
            for task in call.background:
                task.add_done_callback(_log_leg_failure)
                if call.outcome != "ok":
                    task.cancel()  # abort the P leg with the request (no-op when it is done)
                elif not task.done():
                    self._spawn(task)  # P still draining after D answered: let it finish
            call.release_held()
            flight.outcome = call.outcome
            self.dispatcher.planning.learn(call)
            if call.trace is not None:
                call.trace.finish(call.mode, call.outcome, flight.tid, flight.retries)
            self.metrics.request_done(call.mode, call.outcome)
            self.metrics.observe_duration(call.mode, time.monotonic() - t0)

    def _bad_header(self, exc: ValueError, header: str) -> web.Response:
        """A request header the proxy reads holds no valid value: 400 naming it."""
        self.metrics.error("bad_request")
        self.metrics.request_done("none", "client_error")
        return _error(400, str(exc), "invalid_request_error", header)

    # ---------------------------------------------------------------- other endpoints

    async def _models(self, request: web.Request) -> web.StreamResponse:
        last = "no decode engine"
        try:
            first = [self.decodes.pick()]
        except NoEngine:  # every D is leaving or joining: any that answers will do
            first = []
        # the least-loaded D first, then the others (a snapshot: membership may change)
        for d in first + [e for e in self.decodes.engines if e not in first]:
            try:
                async with self.fleet.session.get(d.url + "/v1/models") as r:
                    raw = await r.read()
                    ctype = r.headers.get("Content-Type", "application/json")
                    return web.Response(body=raw, status=r.status, headers={"Content-Type": ctype})
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, aiohttp.ClientConnectionError):
                    self.fleet.take_out(d, str(exc) or type(exc).__name__)
                last = f"{d.url}: {exc or type(exc).__name__}"
        return _error(502, f"no decode engine answered /v1/models ({last})", "decode_unreachable")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        engines = self.fleet.engines  # a snapshot: membership may change while they answer
        checks = [info for info, _ in await asyncio.gather(
            *(self.fleet.check(e) for e in engines)
        )]
        n = sum(1 for e in engines if e.role is Role.PREFILL)
        prefill, decode = checks[:n], checks[n:]
        ok = any(c["ok"] for c in prefill) and any(c["ok"] for c in decode)
        body = {
            "status": "ok" if ok else "unavailable",
            "mode": self.settings.mode.value,
            "prefill": prefill,
            "decode": decode,
        }
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        text = self.metrics.render(self.fleet.engines)
        return web.Response(
            text=text,
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type": "text/plain; version=0.0.4"},
        )


async def serve(settings: ProxySettings, ready: asyncio.Event | None = None) -> None:
    """Run a proxy until cancelled (or SIGINT/SIGTERM when run from :func:`cli.main`)."""
    server = ProxyServer(settings)
    await server.start()
    print(f"kvbridge proxy listening on {server.url} (mode {settings.mode.value})", flush=True)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()

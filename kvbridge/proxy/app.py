"""HTTP side of the disaggregation proxy: an aiohttp server in front of vLLM P and D engines.

The proxy knows HTTP and routing (:mod:`kvbridge.proxy.routing`), never transports: all it moves
between engines is ``kv_transfer_params`` inside the OpenAI request bodies (docs/proxy.md).

Contract:

- Runs on one asyncio event loop; :class:`ProxyServer` is not thread-safe.
- Every upstream call is bounded: ``connect_timeout_s`` to open a connection, ``timeout_s`` for
  the whole exchange. A dead engine gives a 502 JSON error at once (refused) or after the connect
  timeout (black-holed), never a hang; the engine is then avoided for a short cool-down.
- A client that goes away cancels its handler (``handler_cancellation``); every upstream
  connection the request opened is then closed, so vLLM aborts the request and frees its blocks.
- push: if the P leg fails before D's first byte reached the client, the D leg is closed at once
  and the client gets a 502 (a P 4xx keeps its status: the request itself was bad). If D fails,
  the client gets D's error and the P leg is closed.
- Every ``kv_transfer_params`` sent is built by :mod:`kvbridge.params`, every one received (probe
  and P answers) parsed by it: a malformed answer is a 502 naming the key. A P answer with
  ``kvbridge_error`` (P prefilled without handing off) is a 400 when the error names a request
  field, else a 502, with P's message.
- A P answer whose ``kvbridge_generation`` differs from the cached probe's drops that probe (P
  restarted; the next push re-probes). A push whose D leg fails before any byte reached the
  client, when P's answer or a re-probe shows a new generation, is retried once as a pull.
- Fleets (xPyD): a dispatch that fails before any byte reached the client, because of an
  engine (unreachable, broken connection, 5xx), is retried up to ``max_retries`` times on
  engines the request has not tried (:func:`routing.plan_retry`), with a fresh ``transfer_id``
  (except a pull whose D was unreachable: P's answer goes to another D). A stream that broke
  after its first byte cannot be retried: the client gets an in-band error event.
- Health: an engine that refuses a connection is taken out of rotation at once; a background
  check of every engine's ``/health`` every ``health_interval_s`` takes out engines that fail
  it and puts them back when it answers 200 again (a P's cached probe is dropped, so a
  restarted P is re-probed).
- A leg that fails with a 5xx, a broken answer or a timeout is explained by asking the engines'
  control channels (:mod:`kvbridge.proxy.reasons`, bounded by ``control_timeout_s``): the client
  gets ``"<leg> failed: transfer <id>: <reason>"`` (502, 504 for a timeout), or the generic error
  when no engine can say.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvbridge.errors import ConfigError, ParamsError
from kvbridge.params import TransferParams
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.reasons import QueryOutcome, ReasonFinder, pick_reason
from kvbridge.proxy.routing import (
    Cause,
    Decision,
    Engine,
    Pool,
    PrefillRefused,
    ProbeInfo,
    ProxyMode,
    Retry,
    Role,
    control_addresses,
    decide,
    decode_body,
    new_transfer_id,
    parse_probe,
    plan_retry,
    prefill_body,
    probe_body,
    pull_decode_params,
    push_decode_params,
    read_prefill_answer,
    validate_request,
)

__all__ = ["ProxySettings", "ProxyServer", "serve", "add_arguments", "main", "cli_main"]

log = logging.getLogger("kvbridge.proxy")
T = TypeVar("T")
_FORWARDED_HEADERS = ("Authorization",)


@dataclass(frozen=True)
class ProxySettings:
    """Everything a proxy needs; the CLI flags map one to one (``--push-headroom`` …)."""

    prefill: Sequence[str]
    decode: Sequence[str]
    mode: ProxyMode = ProxyMode.AUTO
    host: str = "127.0.0.1"
    port: int = 8000
    push_headroom: int = 4
    timeout_s: float = 600.0
    connect_timeout_s: float = 3.0
    cooldown_s: float = 2.0
    probe_timeout_s: float = 30.0
    control_timeout_s: float = 1.0
    """Upper bound on one control-channel query (and on the probe that finds the address) made
    to explain a failed leg."""
    control_secret: str | None = None
    """The fleet's control-channel secret (``KVBRIDGE_SECRET``), to query engines that use one;
    None: the per-user secret engines on this host use (kvbridge.trust)."""
    max_retries: int = 1
    """How many times one client request may be dispatched again after an engine failed it
    before any byte reached the client (``--retries``; 0: never)."""
    health_interval_s: float = 2.0
    """Period of the background ``/health`` check of every engine (``--health-interval``; 0:
    none, and an engine that refused a connection is avoided for ``cooldown_s`` only)."""
    health_failures: int = 2
    """Failed checks in a row (timeouts, non-200) that take an engine out of rotation; a refused
    connection takes it out at once."""


#: Leg failures that no control channel can explain (nothing reached an engine, or the engine
#: already said why).
_UNEXPLAINED_KINDS = ("prefill_unreachable", "decode_unreachable", "probe_failed",
                      "prefill_refused")


class _LegFailed(Exception):
    """An upstream leg failed; becomes a JSON error at the HTTP boundary, never escapes it.

    ``cause`` is what the retry policy reads. :meth:`within` records the dispatch the leg
    belonged to (its transfer id and the engines to ask why); ``response`` is D's own unsent
    error answer, passed on when no engine can say more.
    """

    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 cause: Cause = Cause.SERVER_ERROR,
                 response: web.StreamResponse | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.cause = cause
        self.response = response
        self.tid: str | None = None
        self.legs: Sequence[tuple[Engine, TransferParams | None]] = ()

    @property
    def role(self) -> Role:
        """The role of the leg that failed (a probe is P's)."""
        return Role.DECODE if self.kind.startswith("decode") else Role.PREFILL

    def within(self, tid: str, legs: Sequence[tuple[Engine, TransferParams | None]]
               ) -> _LegFailed:
        self.tid = tid
        self.legs = legs
        return self


@dataclass
class _Attempt:
    """One dispatch of a client request (the first, or a retry): what a retry needs to know."""

    mode: ProxyMode = ProxyMode.PULL
    tid: str = ""
    p: Engine | None = None
    d: Engine | None = None
    probe: ProbeInfo | None = None
    answer: TransferParams | None = None
    """pull: P's checked answer, once P's leg finished."""
    p_leg: asyncio.Future[TransferParams] | None = None
    """push: P's leg."""


@dataclass
class _Call:
    """Book-keeping of one client request."""

    t0: float
    rid: str
    stream: bool
    headers: dict[str, str]
    mode: str = "none"
    outcome: str = "ok"
    background: list[asyncio.Future[Any]] = field(default_factory=list)
    attempt: _Attempt = field(default_factory=_Attempt)
    tried: dict[Role, set[str]] = field(
        default_factory=lambda: {Role.PREFILL: set(), Role.DECODE: set()})
    retries: int = 0

    def abandon(self) -> None:
        """Cancel the P legs of a failed dispatch (vLLM aborts them and frees their blocks)."""
        for task in self.background:
            task.cancel()
        self.background.clear()


def _log_leg_failure(task: asyncio.Future[Any]) -> None:
    """Done-callback of a background P leg: log (and so retrieve) its failure, if any."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("background prefill leg ended with: %s", task.exception())


def _error(
    status: int, message: str, kind: str = "proxy_error", param: str | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _unsent_failure(resp: web.StreamResponse) -> bool:
    """True for a 5xx answer of D that nothing of has reached the client yet."""
    return resp.status >= 500 and not resp.prepared


def _decode_answered(d: Engine, resp: web.StreamResponse) -> _LegFailed:
    """D's unsent 5xx answer as a failure (passed on as it is when nobody knows more)."""
    body = resp.body if isinstance(resp, web.Response) and isinstance(resp.body, bytes) else b""
    return _LegFailed(
        502,
        f"decode engine {d.url} answered {resp.status}: " + body[:300].decode("utf-8", "replace"),
        "decode_error",
        cause=Cause.SERVER_ERROR,
        response=resp,
    )


_FIRST_EVENT_MAX = 64 << 10


def _stream_error(head: bytes) -> str | None:
    """The message of the error event an SSE stream starts with, else None.

    vLLM answers a streamed request that fails after its headers went out (a KV load that
    failed: ``GenerationError``) with HTTP 200 and ``data: {"error": {...}}`` before any token;
    the proxy reads that first event before it commits anything to the client. Anything else,
    malformed data included, is not an error event (it is relayed as it came).
    """
    event = head.split(b"\n\n", 1)[0].strip()
    if not event.startswith(b"data:"):
        return None
    try:
        data = json.loads(event[5:])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or "error" not in data or data.get("choices"):
        return None
    err = data["error"]
    message = err.get("message") if isinstance(err, dict) else err
    return str(message or "an error event")[:500]


def _cause_of(exc: BaseException) -> Cause:
    """How a request to an engine failed, from the exception aiohttp (or a parser) raised."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        return Cause.UNREACHABLE  # no connection: nothing was sent
    if isinstance(exc, TimeoutError):
        return Cause.TIMEOUT
    if isinstance(exc, aiohttp.ClientResponseError):
        return Cause.SERVER_ERROR if exc.status >= 500 else Cause.REFUSED
    if isinstance(exc, aiohttp.ClientError):
        return Cause.BROKEN
    return Cause.MALFORMED


class ProxyServer:
    """The proxy as an object: ``await start()`` binds (port 0 → see :attr:`port`), ``stop()``."""

    def __init__(self, settings: ProxySettings) -> None:
        if settings.push_headroom < 0:
            raise ConfigError(f"--push-headroom must be >= 0, got {settings.push_headroom}")
        if settings.max_retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {settings.max_retries}")
        if settings.health_interval_s < 0 or not math.isfinite(settings.health_interval_s):
            raise ConfigError("--health-interval must be >= 0 (0: no health checks), got "
                              f"{settings.health_interval_s}")
        if settings.health_failures < 1:
            raise ConfigError(f"--health-failures must be >= 1, got {settings.health_failures}")
        for name in ("timeout_s", "connect_timeout_s", "probe_timeout_s", "control_timeout_s"):
            if getattr(settings, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(settings, name)}")
        self.settings = settings
        self.prefills = Pool(Role.PREFILL, settings.prefill)
        self.decodes = Pool(Role.DECODE, settings.decode)
        self.metrics = ProxyMetrics()
        self.port = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probe_locks: dict[str, asyncio.Lock] = {}
        self._probe_backoff: dict[str, tuple[float, str, Cause]] = {}
        self._reasons = ReasonFinder(settings.control_secret, settings.control_timeout_s)

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
        return app

    async def start(self) -> None:
        """Bind and serve; probes P engines for their control address in the background."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(total=s.timeout_s, sock_connect=s.connect_timeout_s)
        # keep-alive below uvicorn's 5 s so a pooled connection is never one the engine closed
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
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
            self._spawn(self._health_loop())

    async def stop(self) -> None:
        """Stop serving, cancel background work and close every upstream connection."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._reasons.close()

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
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    # ---------------------------------------------------------------- discovery

    async def discover(self) -> dict[str, ProbeInfo | str]:
        """Probe every P engine; returns url → ProbeInfo, or the error text."""
        results = await asyncio.gather(
            *(self.probe(p) for p in self.prefills.engines), return_exceptions=True
        )
        out: dict[str, ProbeInfo | str] = {}
        for p, r in zip(self.prefills.engines, results, strict=True):
            out[p.url] = r if isinstance(r, ProbeInfo) else str(r)
            if not isinstance(r, ProbeInfo):
                log.warning("%s (push will be retried on first use)", r)
        return out

    async def probe(self, e: Engine, timeout_s: float | None = None) -> ProbeInfo:
        """An engine's control addresses: cached, else asked of its connector
        (:func:`routing.probe_body`). A failure is remembered for ``cooldown_s``."""
        if e.probe is not None:
            return e.probe
        lock = self._probe_locks.setdefault(e.url, asyncio.Lock())
        async with lock:
            if e.probe is not None:
                return e.probe
            until, why, cause = self._probe_backoff.get(e.url, (0.0, "", Cause.UNREACHABLE))
            if time.monotonic() < until:  # failed a moment ago: don't re-probe per request
                raise _LegFailed(502, why, "probe_failed", cause=cause)
            timeout = aiohttp.ClientTimeout(
                total=timeout_s or self.settings.probe_timeout_s,
                sock_connect=self.settings.connect_timeout_s,
            )
            try:
                async with self.session.get(e.url + "/v1/models", timeout=timeout) as r:
                    r.raise_for_status()
                    model = str((await r.json(content_type=None))["data"][0]["id"])
                body = probe_body(model)
                async with self.session.post(
                    e.url + "/v1/completions", json=body, timeout=timeout
                ) as r:
                    r.raise_for_status()
                    data = await r.json(content_type=None)
                raw = data.get("kv_transfer_params") if isinstance(data, dict) else None
                info = parse_probe(raw)
            except (
                aiohttp.ClientError,
                TimeoutError,
                ValueError,  # ParamsError (a malformed answer, naming the key) included
                KeyError,
                IndexError,
                TypeError,
            ) as exc:
                self.metrics.error("probe")
                why = (
                    f"cannot learn the control address of {e.role.value} engine {e.url}: "
                    f"{exc or type(exc).__name__}"
                )
                cause = _cause_of(exc)
                if cause is Cause.UNREACHABLE:
                    self._take_out(e, str(exc) or type(exc).__name__)
                self._probe_backoff[e.url] = (time.monotonic() + self.settings.cooldown_s, why,
                                              cause)
                raise _LegFailed(502, why, "probe_failed", cause=cause) from exc
            self._probe_backoff.pop(e.url, None)
            e.probe = info
            log.info(
                "%s %s: engine_id=%s control=%s:%d tp=%d generation=%s kvbridge=%s",
                e.role.value,
                e.url,
                info.engine_id,
                info.host,
                info.port,
                info.tp_size,
                info.generation or "?",
                info.version,
            )
            return info

    def _take_out(self, e: Engine, reason: str) -> None:
        """Take ``e`` out of rotation after a connection-level failure: until a health check
        passes (or for ``cooldown_s`` without health checks). Its probe is dropped: an engine
        that comes back may be a restarted one."""
        was_up = e.is_up()
        cooldown = math.inf if self.settings.health_interval_s > 0 else self.settings.cooldown_s
        e.mark_down(reason, cooldown)
        if was_up:
            log.warning("%s engine %s taken out of rotation: %s", e.role.value, e.url, reason)
            self._drop_probe(e, "engine_down")

    def _drop_probe(self, e: Engine, reason: str) -> None:
        """Forget ``e``'s cached probe (the next push re-probes)."""
        if e.probe is not None:
            e.probe = None
            self.metrics.probe_dropped(reason)

    def _note_generation(self, e: Engine, answer: TransferParams) -> None:
        """Drop ``e``'s cached probe when ``answer`` shows that the engine restarted."""
        new = answer.kvbridge_generation
        old = e.probe.generation if e.probe is not None else None
        if new is not None and old is not None and new != old:
            log.info(
                "%s engine %s restarted (generation %s -> %s); its probe is dropped",
                e.role.value,
                e.url,
                old,
                new,
            )
            self._drop_probe(e, "generation_changed")

    # ---------------------------------------------------------------- OpenAI endpoints

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
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

        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        rid = request.headers.get("X-Request-Id") or "kvb-" + uuid.uuid4().hex
        headers["X-Request-Id"] = rid
        call = _Call(t0=t0, rid=rid, stream=bool(body.get("stream")), headers=headers)
        try:
            resp = await self._route(request, path, body, call)
            if call.outcome == "ok" and resp.status >= 400:
                call.outcome = "client_error" if resp.status < 500 else "upstream_error"
            return resp
        except _LegFailed as exc:
            log.warning("%s %s failed (%s): %s", call.rid, call.mode, exc.kind, exc.message)
            call.outcome = (
                "timeout"
                if exc.status == 504
                else ("client_error" if exc.status < 500 else "upstream_error")
            )
            if exc.response is not None:  # D's own answer, unless an engine says why
                return exc.response
            return _error(exc.status, exc.message, exc.kind, exc.param)
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
            self.metrics.request_done(call.mode, call.outcome)
            self.metrics.observe_duration(call.mode, time.monotonic() - t0)

    async def _route(
        self, request: web.Request, path: str, body: dict[str, Any], call: _Call
    ) -> web.StreamResponse:
        """Dispatch until one attempt answers or the failure is final; raises _LegFailed with
        the engines' reason for the last attempt's failure (``response``: D's own answer)."""
        forced: Decision | None = None
        reuse: _Attempt | None = None
        while True:
            call.attempt = _Attempt()
            try:
                if reuse is not None:
                    resp = await self._pull(request, path, body, call, reuse)
                else:
                    decision = forced or decide(
                        self.settings.mode, self.decodes, self.settings.push_headroom
                    )
                    if decision.mode is ProxyMode.PUSH:
                        resp = await self._push(request, path, body, call, decision)
                    else:
                        self._record(decision, call)
                        resp = await self._pull(request, path, body, call)
            except _LegFailed as exc:
                self.metrics.error(exc.kind)
                call.abandon()
                plan = await self._plan_retry(exc, call)
                if plan is None:
                    raise await self._explained(exc) from None
                failed = call.attempt
                log.warning(
                    "%s %s %s failed (%s: %s); retrying (%s, %d/%d)",
                    call.rid, failed.mode.value, exc.role.value, exc.kind, exc.message,
                    plan.reason, call.retries + 1, self.settings.max_retries,
                )  # fmt: skip
                self.metrics.retry(failed.mode.value, plan.reason)
                call.retries += 1
                reuse = failed if plan.reuse_prefill else None
                forced = (
                    Decision(ProxyMode.PULL, "prefill_restarted")
                    if plan.reason == "prefill_restarted"
                    else None
                )
                continue
            return resp

    async def _plan_retry(self, exc: _LegFailed, call: _Call) -> Retry | None:
        """How to retry the failed attempt (see :func:`routing.plan_retry`), or None."""
        att = call.attempt
        s = self.settings
        tried = call.tried
        for e in (att.p, att.d) if exc.role is Role.DECODE else (att.p,):
            if e is not None:  # a D failure may be P's fault: avoid both on the retry
                tried[e.role].add(e.url)
        plan = plan_retry(
            att.mode, exc.role, exc.cause, retries=call.retries, max_retries=s.max_retries,
            other_prefill=self.prefills.has_untried(tried[Role.PREFILL]),
            other_decode=self.decodes.has_untried(tried[Role.DECODE]),
        )  # fmt: skip
        if plan is not None:
            return plan
        # no other engine to go to: a push whose P restarted under it is retried once as a pull
        # on the same engines (the restarted P is a new process)
        if (
            att.mode is ProxyMode.PUSH
            and exc.role is Role.DECODE
            and exc.cause not in (Cause.REFUSED, Cause.MALFORMED)
            and call.retries < s.max_retries
            and att.p is not None
            and att.probe is not None
            and att.p_leg is not None
            and await self._prefill_restarted(att.p, att.probe, att.p_leg)
        ):
            return Retry("prefill_restarted")
        return None

    def _record(self, decision: Decision, call: _Call) -> None:
        call.mode = decision.mode.value
        self.metrics.decision(self.settings.mode.value, decision.mode.value, decision.reason)
        log.debug("%s mode=%s (%s)", call.rid, decision.mode.value, decision.reason)

    async def _pull(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        call: _Call,
        reuse: _Attempt | None = None,
    ) -> web.StreamResponse:
        """One pull dispatch; ``reuse``: a failed pull whose D never got P's answer (the same
        P, answer and transfer_id go to another D)."""
        att = call.attempt
        att.mode = ProxyMode.PULL
        call.mode = ProxyMode.PULL.value
        if reuse is not None and reuse.p is not None and reuse.answer is not None:
            p, answer, tid = reuse.p, reuse.answer, reuse.tid
        else:
            p = self.prefills.pick(avoid=call.tried[Role.PREFILL])
            tid = new_transfer_id()
            att.p, att.tid = p, tid
            try:
                answer = await self._prefill_leg(
                    p, path, prefill_body(body, tid, ProxyMode.PULL), call, tid, ProxyMode.PULL
                )
            except _LegFailed as exc:
                raise exc.within(tid, [(p, None)]) from None
        att.p, att.tid, att.answer = p, tid, answer
        # late placement: the least-loaded D now that prefill is done
        d = att.d = self.decodes.pick(avoid=call.tried[Role.DECODE])
        d.acquire()
        d_body = decode_body(body, pull_decode_params(answer))
        d_open = asyncio.ensure_future(self._open(d, path, d_body, call))
        legs: list[tuple[Engine, TransferParams | None]] = [(d, None), (p, answer)]
        try:
            resp = await self._relay(request, d, d_open, None, call)
        except _LegFailed as exc:
            raise exc.within(tid, legs) from None
        if _unsent_failure(resp):
            raise _decode_answered(d, resp).within(tid, legs)
        return resp

    async def _push(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        call: _Call,
        decision: Decision,
    ) -> web.StreamResponse:
        att = call.attempt
        att.mode = ProxyMode.PUSH
        call.mode = ProxyMode.PUSH.value
        # early placement: D is committed before prefill starts
        d = att.d = self.decodes.pick(avoid=call.tried[Role.DECODE])
        d.acquire()
        p = att.p = self.prefills.pick(avoid=call.tried[Role.PREFILL])
        try:
            info = await self.probe(p)
        except _LegFailed as exc:
            d.release()
            if self.settings.mode is not ProxyMode.AUTO:
                raise exc.within("", []) from None
            call.tried[Role.PREFILL].add(p.url)  # the fallback pull goes to another P if any
            self._record(Decision(ProxyMode.PULL, "no_probe"), call)
            return await self._pull(request, path, body, call)
        except BaseException:
            d.release()
            raise
        self._record(decision, call)
        tid = att.tid = new_transfer_id()
        att.probe = info
        p_leg = att.p_leg = asyncio.ensure_future(
            self._prefill_leg(
                p, path, prefill_body(body, tid, ProxyMode.PUSH), call, tid, ProxyMode.PUSH
            )
        )
        call.background.append(p_leg)
        d_body = decode_body(body, push_decode_params(info, tid))
        d_open = asyncio.ensure_future(self._open(d, path, d_body, call))
        try:
            resp = await self._relay(request, d, d_open, p_leg, call)
        except _LegFailed as exc:
            if exc.role is Role.PREFILL:
                if exc.kind != "prefill_refused":  # P may have restarted: re-discover
                    self._drop_probe(p, "prefill_failed")
                # ask P where D was told it listens
                raise exc.within(tid, [(p, info.params), (d, None)]) from None
            # D failed and nothing reached the client: _relay only raises before the first byte
            raise exc.within(tid, [(d, None), (p, _answer_of(p_leg) or info.params)]) from None
        if _unsent_failure(resp):
            self._drop_probe(p, "decode_failed")  # D may have failed to reach P at that address
            legs = [(d, None), (p, _answer_of(p_leg) or info.params)]
            raise _decode_answered(d, resp).within(tid, legs)
        return resp

    async def _prefill_restarted(
        self, p: Engine, used: ProbeInfo, p_leg: asyncio.Future[TransferParams]
    ) -> bool:
        """Whether P's generation moved past ``used`` (the probe D was given): from P's answer
        when the P leg finished, else from a fresh probe (the P leg is then abandoned)."""
        if used.generation is None:
            return False  # an engine that reports no generation: a restart cannot be told
        answer = _answer_of(p_leg)
        if answer is not None and answer.kvbridge_generation is not None:
            return answer.kvbridge_generation != used.generation
        p_leg.cancel()
        self._drop_probe(p, "decode_failed")
        try:
            fresh = await self.probe(p)
        except _LegFailed:
            return False
        return fresh.generation is not None and fresh.generation != used.generation

    # ---------------------------------------------------------------- failure reasons

    async def _reason(
        self, tid: str, legs: Sequence[tuple[Engine, TransferParams | None]]
    ) -> str | None:
        """What the engines of ``legs`` (in priority order) say happened to ``tid``, or None.

        Each engine's control addresses come from its answer, its cached probe, or a probe made
        now (bounded by ``control_timeout_s``); every rank is asked at once.
        """
        budget = self.settings.control_timeout_s

        async def ask(e: Engine, answer: TransferParams | None) -> list[str]:
            addresses = control_addresses(answer) if answer is not None else []
            if not addresses:
                try:
                    addresses = (await self.probe(e, budget)).addresses()
                except _LegFailed:
                    return []
            replies = await asyncio.gather(*(self._reasons.query(a, tid) for a in addresses))
            for outcome, _ in replies:
                self.metrics.reason_query(outcome.value)
            return [text for outcome, text in replies
                    if outcome is QueryOutcome.ANSWERED and text]

        tasks = [asyncio.ensure_future(ask(e, a)) for e, a in legs]
        if not tasks:
            return None
        try:
            await asyncio.wait(tasks, timeout=2 * budget + 1.0)
        finally:
            for task in tasks:
                task.cancel()
        found: list[str] = []
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                found += task.result()
        return pick_reason(found)

    async def _explained(self, exc: _LegFailed) -> _LegFailed:
        """``exc`` with the engines' reason for its transfer as its message, when they know
        one (D's own answer is then dropped)."""
        if exc.status < 500 or exc.kind in _UNEXPLAINED_KINDS or not exc.tid:
            return exc
        reason = await self._reason(exc.tid, exc.legs)
        if reason is None:
            return exc
        log.info("transfer %s: %s (%s)", exc.tid, reason, exc.message)
        status = 504 if exc.status == 504 else 502
        return _LegFailed(status, f"{exc.role.value} failed: transfer {exc.tid}: {reason}",
                          exc.kind, cause=exc.cause)

    # ---------------------------------------------------------------- legs

    async def _open(
        self, e: Engine, path: str, body: dict[str, Any], call: _Call
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its headers arrived; errors → _LegFailed."""
        role = e.role.value
        t0 = time.monotonic()
        try:
            resp = await self.session.post(e.url + path, json=body, headers=call.headers)
        except aiohttp.ConnectionTimeoutError as exc:
            self._take_out(e, "connect timeout")
            raise _LegFailed(
                502,
                f"{role} engine {e.url} did not accept a connection within "
                f"{self.settings.connect_timeout_s:.1f}s",
                role + "_unreachable",
                cause=Cause.UNREACHABLE,
            ) from exc
        except aiohttp.ClientConnectionError as exc:
            # refused: the engine is gone; reset or closed: it died with our request
            self._take_out(e, str(exc) or type(exc).__name__)
            cause = _cause_of(exc)
            kind = role + ("_unreachable" if cause is Cause.UNREACHABLE else "_error")
            what = "unreachable" if cause is Cause.UNREACHABLE else "dropped the connection"
            raise _LegFailed(502, f"{role} engine {e.url} {what}: {exc}", kind,
                             cause=cause) from exc
        except TimeoutError as exc:
            raise _LegFailed(
                504,
                f"{role} engine {e.url} did not answer within {self.settings.timeout_s:.0f}s",
                role + "_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise _LegFailed(
                502, f"{role} engine {e.url}: {exc}", role + "_error", cause=Cause.BROKEN
            ) from exc
        if self.settings.health_interval_s <= 0:
            e.mark_up()  # without health checks, an answer is what puts an engine back
        self.metrics.observe_upstream(role, time.monotonic() - t0)
        return resp

    async def _prefill_leg(
        self,
        p: Engine,
        path: str,
        body: dict[str, Any],
        call: _Call,
        tid: str,
        mode: ProxyMode,
    ) -> TransferParams:
        """Run P's one-token prefill; returns P's parsed and checked ``kv_transfer_params``."""
        p.acquire()
        t0 = time.monotonic()
        try:
            resp = await self._open(p, path, body, call)
            try:
                raw = await self._read(p, resp)
            finally:
                resp.close()
            if resp.status >= 400:
                status = resp.status if 400 <= resp.status < 500 else 502
                raise _LegFailed(
                    status,
                    f"prefill engine {p.url} answered {resp.status}: "
                    + raw[:500].decode("utf-8", "replace"),
                    "prefill_error",
                    cause=Cause.REFUSED if resp.status < 500 else Cause.SERVER_ERROR,
                )
            try:
                data = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                data = None
            kvp = data.get("kv_transfer_params") if isinstance(data, dict) else None
            try:
                answer = read_prefill_answer(kvp, tid, mode)
            except PrefillRefused as exc:
                raise _LegFailed(
                    400 if exc.malformed else 502,
                    f"prefill engine {p.url} did not hand off: {exc.message}",
                    "prefill_refused",
                    exc.param,
                    cause=Cause.REFUSED,
                ) from None
            except ParamsError as exc:
                raise _LegFailed(
                    502, f"prefill engine {p.url}: {exc}", "prefill_error", cause=Cause.MALFORMED
                ) from None
            self._note_generation(p, answer)
            self.metrics.observe_prefill_leg(mode.value, time.monotonic() - t0)
            return answer
        finally:
            p.release()

    async def _read(self, e: Engine, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except TimeoutError as exc:
            raise _LegFailed(
                504,
                f"{e.role.value} engine {e.url} did not finish within "
                f"{self.settings.timeout_s:.0f}s",
                e.role.value + "_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise _LegFailed(
                502,
                f"{e.role.value} engine {e.url} broke off its answer: {exc}",
                e.role.value + "_error",
                cause=Cause.BROKEN,
            ) from exc

    async def _gate(self, task: asyncio.Future[T], p_leg: asyncio.Future[Any] | None) -> T:
        """Await ``task``; if the P leg fails first, cancel ``task`` and raise P's failure."""
        try:
            while p_leg is not None and not p_leg.done():
                await asyncio.wait({task, p_leg}, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    break
            if p_leg is not None and p_leg.done() and not p_leg.cancelled():
                exc = p_leg.exception()
                if exc is not None:
                    task.cancel()
                    if isinstance(exc, _LegFailed):
                        raise _LegFailed(
                            exc.status if exc.status < 500 else 502,
                            "prefill leg failed, decode leg aborted: " + exc.message,
                            exc.kind,
                            exc.param,
                            cause=exc.cause,
                        )
                    raise exc
            return await task
        except BaseException:
            task.cancel()
            raise

    async def _relay(
        self,
        request: web.Request,
        d: Engine,
        d_open: asyncio.Future[aiohttp.ClientResponse],
        p_leg: asyncio.Future[Any] | None,
        call: _Call,
    ) -> web.StreamResponse:
        """Return D's answer to the client (streamed as it comes when the client asked so)."""
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await self._gate(d_open, p_leg)
            finally:
                if (
                    resp is None
                    and d_open.done()
                    and not d_open.cancelled()
                    and d_open.exception() is None
                ):
                    d_open.result().close()  # P failed just as D's headers arrived
            if resp.status >= 400 or not call.stream:
                raw = await self._gate(asyncio.ensure_future(self._read(d, resp)), p_leg)
                if resp.status >= 400:
                    log.warning("%s decode %s answered %d", call.rid, d.url, resp.status)
                    if resp.status < 500:  # a 5xx is raised and counted by the caller
                        self.metrics.error("decode_error")
                    if p_leg is not None:
                        p_leg.cancel()
                ctype = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=raw, status=resp.status, headers={"Content-Type": ctype})
            first = await self._gate(asyncio.ensure_future(self._first_event(d, resp)), p_leg)
            problem = _stream_error(first)
            if problem is not None:  # D failed the request (e.g. its KV load) before a token
                if p_leg is not None:
                    p_leg.cancel()
                raise _LegFailed(502, f"decode engine {d.url} failed the request: {problem}",
                                 "decode_error", cause=Cause.SERVER_ERROR)
            out = web.StreamResponse(
                status=resp.status,
                headers={
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                },
            )
            await out.prepare(request)
            chunk = first
            while chunk:
                try:
                    await out.write(chunk)
                except ConnectionError:  # the client went away between two chunks
                    call.outcome = "cancelled"
                    log.info("%s client went away; closing the decode stream", call.rid)
                    return out
                if chunk is first:
                    self.metrics.observe_ttft(call.mode, time.monotonic() - call.t0)
                try:
                    chunk = await self._next_chunk(d, resp)
                except _LegFailed as exc:  # headers are gone: report in-band, like vLLM does
                    log.warning("%s stream from %s broke: %s", call.rid, d.url, exc.message)
                    self.metrics.error(exc.kind)
                    call.outcome = "timeout" if exc.status == 504 else "upstream_error"
                    event = {
                        "error": {"message": exc.message, "type": exc.kind, "code": exc.status}
                    }
                    with contextlib.suppress(ConnectionError):
                        await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    break
            try:
                await out.write_eof()
            except ConnectionError:  # the client hung up right after the last chunk: harmless
                log.debug("%s client closed before the end of the stream", call.rid)
            return out
        finally:
            if resp is not None:
                resp.close()  # closing mid-stream aborts the request inside vLLM
            d.release()

    async def _first_event(self, d: Engine, resp: aiohttp.ClientResponse) -> bytes:
        """D's stream up to the end of its first SSE event (or its end, or 64 KiB)."""
        buf = b""
        while True:
            chunk = await self._next_chunk(d, resp)
            buf += chunk
            if not chunk or b"\n\n" in buf or len(buf) >= _FIRST_EVENT_MAX:
                return buf

    async def _next_chunk(self, d: Engine, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.content.readany()
        except TimeoutError as exc:
            raise _LegFailed(
                504,
                f"decode engine {d.url} stalled past {self.settings.timeout_s:.0f}s",
                "decode_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise _LegFailed(
                502,
                f"decode engine {d.url} broke off its stream: {exc}",
                "decode_error",
                cause=Cause.BROKEN,
            ) from exc

    # ---------------------------------------------------------------- other endpoints

    async def _models(self, request: web.Request) -> web.StreamResponse:
        last = "no decode engine"
        tried: set[str] = set()
        for _ in self.decodes.engines:
            d = self.decodes.pick()
            if d.url in tried:
                d = next(e for e in self.decodes.engines if e.url not in tried)
            tried.add(d.url)
            try:
                async with self.session.get(d.url + "/v1/models") as r:
                    raw = await r.read()
                    ctype = r.headers.get("Content-Type", "application/json")
                    return web.Response(body=raw, status=r.status, headers={"Content-Type": ctype})
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, aiohttp.ClientConnectionError):
                    self._take_out(d, str(exc) or type(exc).__name__)
                last = f"{d.url}: {exc or type(exc).__name__}"
        return _error(502, f"no decode engine answered /v1/models ({last})", "decode_unreachable")

    async def _check(self, e: Engine) -> tuple[dict[str, Any], bool]:
        """One ``GET /health`` of ``e``: (what ``/health`` shows of it, whether the connection
        was refused). Bounded by ``max(2, connect_timeout_s)``."""
        timeout = aiohttp.ClientTimeout(
            total=max(2.0, self.settings.connect_timeout_s),
            sock_connect=self.settings.connect_timeout_s,
        )
        info: dict[str, Any] = {"url": e.url, "in_flight": e.in_flight}
        refused = False
        try:
            async with self.session.get(e.url + "/health", timeout=timeout) as r:
                info["ok"] = r.status == 200
                info["status"] = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            info["ok"] = False
            info["error"] = str(exc) or type(exc).__name__
            refused = isinstance(exc, aiohttp.ClientConnectorError)  # nothing listens
        info["in_rotation"] = e.is_up()
        if not e.is_up() and e.last_error:
            info["out_because"] = e.last_error
        if e.probe is not None:
            info["engine_id"] = e.probe.engine_id
            info["control"] = f"{e.probe.host}:{e.probe.port}"
            if e.probe.generation is not None:
                info["generation"] = e.probe.generation
        return info, refused

    async def _health_loop(self) -> None:
        """Every ``health_interval_s``, check every engine at once and move it in or out of
        rotation (:meth:`Engine.check_passed`, :meth:`Engine.check_failed`). Runs until
        cancelled by :meth:`stop`."""
        engines = (*self.prefills.engines, *self.decodes.engines)
        while True:
            started = time.monotonic()
            results = await asyncio.gather(*(self._check(e) for e in engines))
            for e, (info, refused) in zip(engines, results, strict=True):
                if info["ok"]:
                    if e.check_passed(started):
                        log.warning("%s engine %s is back in rotation", e.role.value, e.url)
                        self._drop_probe(e, "engine_down")  # it may be a restarted process
                    continue
                why = info.get("error") or f"/health answered {info.get('status')}"
                if e.check_failed(f"health check: {why}", refused, self.settings.health_failures):
                    log.warning("%s engine %s taken out of rotation: health check: %s",
                                e.role.value, e.url, why)
                    self._drop_probe(e, "engine_down")
            await asyncio.sleep(max(0.0, self.settings.health_interval_s
                                    - (time.monotonic() - started)))

    async def _health(self, request: web.Request) -> web.StreamResponse:
        checks = [info for info, _ in await asyncio.gather(
            *(self._check(e) for e in (*self.prefills.engines, *self.decodes.engines))
        )]
        n = len(self.prefills.engines)
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
        text = self.metrics.render((*self.prefills.engines, *self.decodes.engines))
        return web.Response(
            text=text,
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type": "text/plain; version=0.0.4"},
        )


def _answer_of(p_leg: asyncio.Future[TransferParams]) -> TransferParams | None:
    """The P leg's answer if it finished successfully, else None."""
    if p_leg.done() and not p_leg.cancelled() and p_leg.exception() is None:
        return p_leg.result()
    return None


# -------------------------------------------------------------------- running it


async def serve(settings: ProxySettings, ready: asyncio.Event | None = None) -> None:
    """Run a proxy until cancelled (or SIGINT/SIGTERM when run from :func:`main`)."""
    server = ProxyServer(settings)
    await server.start()
    print(f"kvbridge proxy listening on {server.url} (mode {settings.mode.value})", flush=True)
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvbridge proxy`` flags."""
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill engine URLs (http://host:port)",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode engine URLs (http://host:port)",
    )
    parser.add_argument(
        "--mode",
        choices=[m.value for m in ProxyMode],
        default="auto",
        help="push, pull, or auto per request from live load (default auto)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--push-headroom",
        type=int,
        default=4,
        metavar="N",
        help="auto: push while some D has fewer than N requests in flight",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="upper bound on one upstream exchange, seconds (default 600)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="upper bound on opening an upstream connection (default 3)",
    )
    parser.add_argument(
        "--control-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="upper bound on asking an engine's control channel why a transfer failed "
        "(default 1)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        metavar="N",
        help="dispatch a request again, on engines it has not tried, at most N times when an "
        "engine failed it before any byte reached the client (default 1; 0: never)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="check every engine's /health every S seconds; failing engines leave the "
        "rotation until they pass again (default 2; 0: no checks)",
    )
    parser.add_argument(
        "--health-failures",
        type=int,
        default=2,
        metavar="N",
        help="failed health checks in a row that take an engine out (a refused connection: "
        "at once; default 2)",
    )
    parser.add_argument(
        "--control-secret",
        default=os.environ.get("KVBRIDGE_SECRET") or None,
        metavar="SECRET",
        help="the engines' control-channel secret (default: $KVBRIDGE_SECRET)",
    )


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        mode=ProxyMode(args.mode),
        host=args.host,
        port=args.port,
        push_headroom=args.push_headroom,
        timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout,
        control_timeout_s=args.control_timeout,
        control_secret=args.control_secret,
        max_retries=args.retries,
        health_interval_s=args.health_interval,
        health_failures=args.health_failures,
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of ``kvbridge proxy``: serve until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "log_level", None):
        logging.getLogger("kvbridge").setLevel(str(args.log_level).upper())
    settings = settings_from_args(args)

    async def run() -> None:
        task = asyncio.ensure_future(serve(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    except OSError as exc:
        log.error("cannot serve on %s:%d: %s", settings.host, settings.port, exc)
        return 1
    return 0


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvbridge proxy", description="kvbridge disaggregation proxy"
    )
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help="kvbridge log level (default INFO)")
    return main(parser.parse_args(argv))


cli_main = main  # the name kvbridge.tools.cli's lazy subcommands look for

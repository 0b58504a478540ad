"""The legs of one dispatch: P's prefill, D's answer, and D's stream relayed to the client.

:class:`Relay` makes the upstream exchanges of one dispatch and nothing else: which engines, which
mode, and whether to try again is :mod:`~kvbridge.proxy.dispatch`'s. Every failure of an exchange
is raised as :class:`~kvbridge.proxy.failures.LegFailed` with its cause; D's own unsent error
answer is returned as it came (:func:`unsent_failure` tells it apart). :class:`Call` is the
client request's record that the handler, the dispatcher and the relay share.

Contract:

- Runs on the proxy's one asyncio event loop; not thread-safe.
- Every upstream call is bounded: ``connect_timeout_s`` to open a connection, ``timeout_s`` for
  the whole exchange. A connection that is refused, reset or times out on connect takes the
  engine out of rotation (:meth:`~kvbridge.proxy.pool.Fleet.take_out`).
- Every ``kv_transfer_params`` sent is built by :mod:`kvbridge.params`, every one P answers is
  parsed by it (:func:`~kvbridge.proxy.routing.read_prefill_answer`): a malformed answer is a 502
  naming the key. A P answer with ``kvbridge_error`` (P prefilled without handing off) is a 400
  when the error names a request field, else a 502, with P's message.
- push: while P's leg runs, D's leg is *gated* on it: if P fails before D's first byte reached
  the client, D's leg is closed at once and P's failure is raised (a P 4xx keeps its status).
- D's stream is read up to the end of its first SSE event before anything is sent to the client:
  an error event there (vLLM's failed KV load) is a failure that can still be retried. Once a
  byte went out, a broken stream ends with an in-band error event, never a raise.
- Whatever happens, every upstream response is closed (closing mid-stream aborts the request
  inside vLLM and frees its blocks) and D's in-flight count is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvbridge.errors import ParamsError
from kvbridge.params import TransferParams
from kvbridge.proxy.credit import Reservation
from kvbridge.proxy.failures import LegFailed, cause_of
from kvbridge.proxy.flight import Flight
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.planner import Plan
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.prefixes import Prompt
from kvbridge.proxy.routing import (
    Cause,
    Engine,
    PrefillRefused,
    ProbeInfo,
    ProxyMode,
    Role,
    read_prefill_answer,
)
from kvbridge.proxy.settings import ProxySettings
from kvbridge.proxy.tracing import RequestTrace

__all__ = ["Attempt", "Call", "Relay", "decode_answered", "stream_error", "unsent_failure"]

log = logging.getLogger("kvbridge.proxy")
T = TypeVar("T")

_FIRST_EVENT_MAX = 64 << 10


@dataclass
class Attempt:
    """One dispatch of a client request (the first, or a retry): what a retry needs to know."""

    mode: ProxyMode = ProxyMode.PULL
    tid: str = ""
    p: Engine | None = None
    d: Engine | None = None
    probe: ProbeInfo | None = None
    answer: TransferParams | None = None
    """pull: P's checked answer, once P's leg finished."""
    wire: dict[str, Any] | None = None
    """P's answer ``kv_transfer_params`` as it came (what a pull's D gets)."""
    p_leg: asyncio.Future[TransferParams] | None = None
    """push: P's leg."""


@dataclass
class Call:
    """Book-keeping of one client request."""

    t0: float
    rid: str
    stream: bool
    headers: dict[str, str]
    mode: str = "none"
    outcome: str = "ok"
    background: list[asyncio.Future[Any]] = field(default_factory=list)
    attempt: Attempt = field(default_factory=Attempt)
    tried: dict[Role, set[str]] = field(
        default_factory=lambda: {Role.PREFILL: set(), Role.DECODE: set()})
    retries: int = 0
    flight: Flight = field(default_factory=lambda: Flight(""))
    """Its flight record (:mod:`kvbridge.proxy.flight`): the proxy's steps, timestamps only."""
    reservation: Reservation | None = None
    """Its claim on a D's KV credit (:mod:`kvbridge.proxy.credit`), released with
    :meth:`release_held`."""
    held: list[Engine] = field(default_factory=list)
    """Engines that serve a hand-off of this request beyond their open legs (a pull's P until
    D's answer ended): :meth:`Engine.hold` until :meth:`release_held`."""
    trace: RequestTrace | None = None
    """Its OpenTelemetry spans (:mod:`kvbridge.proxy.tracing`); None without tracing."""
    requested: ProxyMode | None = None
    """The mode the client asked for (``X-KVBridge-Mode``); None: the proxy's ``--mode``."""
    slo_ms: float | None = None
    """The client's TTFT SLO (``X-KVBridge-TTFT-SLO-Ms``); None: the planner's default."""
    prompt: Prompt | None = None
    """The prompt as the planner sees it (:mod:`kvbridge.proxy.prefixes`); None when no planner
    looks at this request."""
    plan: Plan | None = None
    """The planner's plan for the request (:mod:`kvbridge.proxy.planner`), once made."""
    max_tokens: int | None = None
    """The output tokens the client allows (``max_tokens``), for the planner's TPOT guard;
    None when the body does not say or no planner looks at the request."""
    reply_headers: dict[str, str] = field(default_factory=dict)
    """Headers the client's answer carries besides D's (``X-KVBridge-Plan``)."""
    events: int = 0
    """SSE data events relayed to the client (about one per token), ``[DONE]`` left out."""
    first_at: float = 0.0
    last_at: float = 0.0
    """When (monotonic) the first and the last of them went out."""
    on_first_token: list[Callable[[], None]] = field(default_factory=list)
    """Called once, when the first token goes out or the request ends without one (the
    planner's count of prefill work in flight on an engine)."""

    def first_token(self) -> None:
        """The first token (or, not streamed, the whole answer) is going out now."""
        self.flight.mark("first_token")
        self.first_at = self.last_at = time.monotonic()
        self._fire()

    def _fire(self) -> None:
        hooks, self.on_first_token = self.on_first_token, []
        for hook in hooks:
            hook()

    def hold(self, e: Engine) -> None:
        """Count a hand-off on ``e`` until the request ends (once per engine)."""
        if not any(h is e for h in self.held):
            e.hold()
            self.held.append(e)

    def release_held(self) -> None:
        """The request ended: nothing it handed off is served any more, and its KV credit is
        free again."""
        self._fire()
        for e in self.held:
            e.unhold()
        self.held.clear()
        if self.reservation is not None:
            self.reservation.release()

    def place(self, d: Engine) -> None:
        """The request's D is ``d``: its KV credit claim follows it."""
        if self.reservation is not None:
            self.reservation.move(d)

    def abandon(self) -> None:
        """Cancel the P legs of a failed dispatch (vLLM aborts them and frees their blocks)."""
        for task in self.background:
            task.cancel()
        self.background.clear()


def unsent_failure(resp: web.StreamResponse) -> bool:
    """True for a 5xx answer of D that nothing of has reached the client yet."""
    return resp.status >= 500 and not resp.prepared


def decode_answered(d: Engine, resp: web.StreamResponse) -> LegFailed:
    """D's unsent 5xx answer as a failure (passed on as it is when nobody knows more)."""
    body = resp.body if isinstance(resp, web.Response) and isinstance(resp.body, bytes) else b""
    return LegFailed(
        502,
        f"decode engine {d.url} answered {resp.status}: " + body[:300].decode("utf-8", "replace"),
        "decode_error",
        cause=Cause.SERVER_ERROR,
        response=resp,
    )


def stream_error(head: bytes) -> str | None:
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


class Relay:
    """The upstream exchanges of a proxy (see the module docstring)."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics, fleet: Fleet) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fleet = fleet

    async def open(
        self, e: Engine, path: str, body: dict[str, Any], call: Call
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its headers arrived; errors → LegFailed."""
        role = e.role.value
        t0 = time.monotonic()
        headers = call.headers
        if role == "decode":
            call.flight.mark("decode_sent")
        if call.trace is not None:  # the leg's span is the parent of the engine's own
            if role == "decode":  # (P's leg began in prefill_leg); ends in to_client
                call.trace.begin_leg(role, e.url, call.attempt.tid, call.attempt.mode.value)
            headers = call.trace.headers(role, headers)
        try:
            resp = await self.fleet.session.post(e.url + path, json=body, headers=headers)
        except aiohttp.ConnectionTimeoutError as exc:
            self.fleet.take_out(e, "connect timeout")
            raise LegFailed(
                502,
                f"{role} engine {e.url} did not accept a connection within "
                f"{self.settings.connect_timeout_s:.1f}s",
                role + "_unreachable",
                cause=Cause.UNREACHABLE,
            ) from exc
        except aiohttp.ClientConnectionError as exc:
            # refused: the engine is gone; reset or closed: it died with our request
            self.fleet.take_out(e, str(exc) or type(exc).__name__)
            cause = cause_of(exc)
            kind = role + ("_unreachable" if cause is Cause.UNREACHABLE else "_error")
            what = "unreachable" if cause is Cause.UNREACHABLE else "dropped the connection"
            raise LegFailed(502, f"{role} engine {e.url} {what}: {exc}", kind,
                            cause=cause) from exc
        except TimeoutError as exc:
            raise LegFailed(
                504,
                f"{role} engine {e.url} did not answer within {self.settings.timeout_s:.0f}s",
                role + "_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise LegFailed(
                502, f"{role} engine {e.url}: {exc}", role + "_error", cause=Cause.BROKEN
            ) from exc
        if self.settings.health_interval_s <= 0:
            e.mark_up()  # without health checks, an answer is what puts an engine back
        self.metrics.observe_upstream(role, time.monotonic() - t0)
        return resp

    async def prefill_leg(
        self,
        p: Engine,
        path: str,
        body: dict[str, Any],
        call: Call,
        tid: str,
        mode: ProxyMode,
    ) -> TransferParams:
        """Run P's one-token prefill; returns P's parsed and checked ``kv_transfer_params``."""
        p.acquire()
        t0 = time.monotonic()
        call.flight.mark("prefill_sent")
        trace = call.trace
        if trace is not None:
            trace.begin_leg("prefill", p.url, tid, mode.value)
        error: str | None = "cancelled"
        try:
            resp = await self.open(p, path, body, call)
            try:
                raw = await self._read(p, resp)
            finally:
                resp.close()
            if resp.status >= 400:
                status = resp.status if 400 <= resp.status < 500 else 502
                raise LegFailed(
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
                raise LegFailed(
                    400 if exc.malformed else 502,
                    f"prefill engine {p.url} did not hand off: {exc.message}",
                    "prefill_refused",
                    exc.param,
                    cause=Cause.REFUSED,
                ) from None
            except ParamsError as exc:
                raise LegFailed(
                    502, f"prefill engine {p.url}: {exc}", "prefill_error", cause=Cause.MALFORMED
                ) from None
            call.flight.mark("prefill_answer")
            self.fleet.note_generation(p, answer)
            if isinstance(kvp, dict):
                call.attempt.wire = kvp
            self.metrics.observe_prefill_leg(mode.value, time.monotonic() - t0)
            error = None
            return answer
        except LegFailed as exc:
            error = exc.kind
            raise
        finally:
            p.release()
            if trace is not None:
                trace.end_leg("prefill", error)

    async def _read(self, e: Engine, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except TimeoutError as exc:
            raise LegFailed(
                504,
                f"{e.role.value} engine {e.url} did not finish within "
                f"{self.settings.timeout_s:.0f}s",
                e.role.value + "_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise LegFailed(
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
                    if isinstance(exc, LegFailed):
                        raise LegFailed(
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

    async def to_client(
        self,
        request: web.Request,
        d: Engine,
        d_open: asyncio.Future[aiohttp.ClientResponse],
        p_leg: asyncio.Future[Any] | None,
        call: Call,
    ) -> web.StreamResponse:
        """Return D's answer to the client (streamed as it comes when the client asked so)."""
        resp: aiohttp.ClientResponse | None = None
        error: str | None = "cancelled"
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
                if resp.status < 400:
                    call.first_token()  # the whole answer: its first token too
                error = None if resp.status < 400 else f"decode answered {resp.status}"
                return web.Response(body=raw, status=resp.status,
                                    headers={**call.reply_headers, "Content-Type": ctype,
                                             "X-Request-Id": call.rid})
            first = await self._gate(asyncio.ensure_future(self._first_event(d, resp)), p_leg)
            problem = stream_error(first)
            if problem is not None:  # D failed the request (e.g. its KV load) before a token
                if p_leg is not None:
                    p_leg.cancel()
                raise LegFailed(502, f"decode engine {d.url} failed the request: {problem}",
                                "decode_error", cause=Cause.SERVER_ERROR)
            out = web.StreamResponse(
                status=resp.status,
                headers={
                    **call.reply_headers,
                    "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    "X-Request-Id": call.rid,
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
                    call.first_token()
                    self.metrics.observe_ttft(call.mode, time.monotonic() - call.t0)
                n = chunk.count(b"data:") - chunk.count(b"data: [DONE]")
                if n > 0:
                    call.events += n
                    call.last_at = time.monotonic()
                try:
                    chunk = await self._next_chunk(d, resp)
                except LegFailed as exc:  # headers are gone: report in-band, like vLLM does
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
            error = None if call.outcome == "ok" else call.outcome
            return out
        except LegFailed as exc:
            error = exc.kind
            raise
        finally:
            if resp is not None:
                resp.close()  # closing mid-stream aborts the request inside vLLM
            d.release()
            if call.trace is not None:
                call.trace.end_leg("decode", error)

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
            raise LegFailed(
                504,
                f"decode engine {d.url} stalled past {self.settings.timeout_s:.0f}s",
                "decode_timeout",
                cause=Cause.TIMEOUT,
            ) from exc
        except aiohttp.ClientError as exc:
            raise LegFailed(
                502,
                f"decode engine {d.url} broke off its stream: {exc}",
                "decode_error",
                cause=Cause.BROKEN,
            ) from exc

"""The proxy's ``/admin`` endpoints: see and change the engines it routes to, while it serves.

========  =====================================  ===============================================
method    path                                   does
========  =====================================  ===============================================
GET       ``/admin/engines``                     every engine: state, load, hand-offs (200)
POST      ``/admin/engines``                     add ``{"role": "prefill"|"decode", "url": …}``;
                                                 it joins in the background (202)
POST      ``/admin/drain?engine=URL``            no new requests to it; what it serves runs on;
                                                 its ranks are told to write their hot KV out
POST      ``/admin/resume?engine=URL``           undo a drain
DELETE    ``/admin/engines?engine=URL[&force=1]``  forget it (409 while it serves something)
GET       ``/admin/why/<request-id>``            the request's flight record joined with its
                                                 engines' (:mod:`kvbridge.proxy.flight`): the
                                                 critical path, phase by phase (200; 404 when
                                                 the proxy no longer remembers it)
GET       ``/admin/plan``                        the planner's cost model per path and the
                                                 prefix index's size per engine (200)
========  =====================================  ===============================================

States and admissions are :mod:`kvbridge.proxy.members`'; the changes are
:class:`~kvbridge.proxy.pool.Fleet`'s. Every answer is JSON: the engine's row (or ``engines``, a
list of rows), or ``{"error": {"message", "type", "param"}}`` naming the bad field.

Trust: every request needs ``Authorization: Bearer <token>``, the token being
:func:`kvbridge.trust.admin_token` of the fleet secret (``--control-secret`` /
``KVBRIDGE_SECRET``), else of the per-user secret of this host — whoever may talk to the
engines may run the fleet, and nobody else: a wrong or missing token is a 401 and changes
nothing; a proxy that runs without any secret (``allow_insecure_control``) answers 403.
``kvbridge engines`` and ``kvbridge drain`` compute the same token. Bodies over 64 KiB are
refused (413) before they are parsed.

Contract: handlers run on the proxy's event loop and never block; a change is made at once and
is visible to the next pick. A drain's notices (:mod:`kvbridge.proxy.notices`: the engine's
ranks write their offload tiers' hot chunks into the lasting tiers, for the engine that
replaces it) go out in the background, once per drain, after a probe for the engine's control
addresses if none is cached; the answer does not wait for them. ``/admin/why`` asks the
request's engines' control channels (bounded by ``control_timeout_s`` each, all at once); an
engine that does not answer, or no longer remembers the transfer, only leaves its steps out of
the answer (``engines`` says so).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvbridge import trust
from kvbridge.errors import ConfigError, KVBridgeError
from kvbridge.proxy.failures import LegFailed
from kvbridge.proxy.flight import FlightLog, critical_path, safe_request_id
from kvbridge.proxy.members import Admission, Engine, Role, parse_engine_url
from kvbridge.proxy.notices import DrainNotices, NoticeOutcome
from kvbridge.proxy.planning import Planning
from kvbridge.proxy.pool import Fleet, read_capped
from kvbridge.proxy.reasons import ReasonFinder

__all__ = ["AdminApi", "engine_row", "MAX_BODY"]

log = logging.getLogger("kvbridge.proxy.admin")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = 64 << 10


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


class _Bad(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def engine_row(e: Engine, now: float | None = None) -> dict[str, Any]:
    """What ``GET /admin/engines`` shows of one engine."""
    now = time.monotonic() if now is None else now
    row: dict[str, Any] = {
        "url": e.url,
        "role": e.role.value,
        "state": e.state.value,
        "admission": e.admission.value,
        "in_rotation": e.is_up(now),
        "in_flight": e.in_flight,
        "handoffs": e.handoffs,
        "requests": e.total,
        "errors": e.errors,
    }
    if e.since:
        row["state_for_s"] = round(now - e.since, 3)
    if e.last_error:
        row["last_error"] = e.last_error
    if e.probe is not None:
        row["engine_id"] = e.probe.engine_id
        if e.probe.generation is not None:
            row["generation"] = e.probe.generation
    return row


def check_engine_url(value: Any, param: str = "url") -> str:
    """An engine base URL (:func:`~kvbridge.proxy.members.parse_engine_url`), or a 400 naming
    ``param``."""
    try:
        return parse_engine_url(value, param)
    except ConfigError as exc:
        raise _Bad(400, str(exc), param) from None


class AdminApi:
    """The ``/admin`` routes of one proxy (see the module docstring)."""

    def __init__(self, fleet: Fleet, secret: str | None, flights: FlightLog | None = None,
                 control_timeout_s: float = 2.0, planning: Planning | None = None) -> None:
        self.fleet = fleet
        self.planning = planning
        self.flights = flights if flights is not None else FlightLog()
        self._finder = ReasonFinder(secret, control_timeout_s)
        self._budget = control_timeout_s
        self.notices = DrainNotices(self._finder.client, control_timeout_s)  # one client
        self._tasks: set[asyncio.Task[dict[str, NoticeOutcome]]] = set()
        self._token: str | None = None
        self._disabled = ""
        try:
            key = trust.for_tools(secret).secret
        except KVBridgeError as exc:
            key = None
            self._disabled = f"the proxy cannot read its secret: {exc}"
        if key is None:
            self._disabled = self._disabled or (
                "the proxy runs without a secret (allow_insecure_control): its admin endpoints "
                "are off; give it --control-secret or KVBRIDGE_SECRET")
        else:
            self._token = trust.admin_token(key)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/engines", self._guard(self._list))
        app.router.add_post("/admin/engines", self._guard(self._add))
        app.router.add_delete("/admin/engines", self._guard(self._remove))
        app.router.add_post("/admin/drain", self._guard(self._drain))
        app.router.add_post("/admin/resume", self._guard(self._resume))
        app.router.add_get("/admin/why/{rid}", self._guard(self._why))
        app.router.add_get("/admin/plan", self._guard(self._plan))

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            if self._token is None:
                return _error(403, self._disabled, "admin_disabled")
            auth = request.headers.get("Authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self._token.encode()):
                log.warning("admin %s %s refused: %s bearer token", request.method,
                            request.path, "wrong" if given else "no")
                return _error(401, "the admin endpoints need 'Authorization: Bearer <token>' "
                                   "(kvbridge engines / kvbridge drain compute it from the "
                                   "fleet secret)", "unauthorized", "Authorization")
            try:
                return await handler(request)
            except _Bad as exc:
                return _error(exc.status, str(exc), "invalid_request_error", exc.param)
        return guarded

    def _engine(self, request: web.Request) -> Engine:
        raw = request.query.get("engine")
        if raw is None:
            raise _Bad(400, "name the engine: ?engine=http://host:port", "engine")
        url = check_engine_url(raw, "engine")
        try:
            return self.fleet.find(url)
        except ConfigError as exc:
            raise _Bad(404, str(exc), "engine") from None

    async def _list(self, request: web.Request) -> web.StreamResponse:
        now = time.monotonic()
        return web.json_response({"engines": [engine_row(e, now) for e in self.fleet.engines]})

    async def _add(self, request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > MAX_BODY:
            raise _Bad(413, f"the body is over {MAX_BODY} bytes")
        raw = await read_capped(request.content, MAX_BODY)
        if len(raw) > MAX_BODY:
            raise _Bad(413, f"the body is over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _Bad(400, "the body must be a JSON object such as "
                            '{"role": "decode", "url": "http://10.0.0.7:8100"}') from None
        if not isinstance(body, dict):
            raise _Bad(400, "the body must be a JSON object")
        unknown = sorted(set(body) - {"role", "url"})
        if unknown:
            raise _Bad(400, f"unknown field {unknown[0]!r}; the fields are role and url",
                       unknown[0][:64])
        role_text = body.get("role")
        if role_text not in ("prefill", "decode"):
            raise _Bad(400, "'role' must be 'prefill' or 'decode'", "role")
        url = check_engine_url(body.get("url"))
        try:
            e = self.fleet.add(Role(role_text), url)
        except ConfigError as exc:
            raise _Bad(409, str(exc), "url") from None
        return web.json_response(engine_row(e), status=202)

    async def _drain(self, request: web.Request) -> web.StreamResponse:
        e = self._engine(request)
        first = e.admission is not Admission.DRAINING
        row = engine_row(self.fleet.drain(e.url))
        if first:
            task = asyncio.ensure_future(self.write_out(e))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return web.json_response(row)

    async def write_out(self, e: Engine) -> dict[str, NoticeOutcome]:
        """Tell ``e``'s ranks to write their hot KV out; what each answered (never raises)."""
        try:
            addresses = (await self.fleet.probe(e, self._budget)).addresses()
        except LegFailed as exc:
            log.warning("%s drains without writing its KV out: no control address (%s)",
                        e.url, exc.message)
            return {}
        return await self.notices.tell(addresses)

    async def close(self) -> None:
        """Cancel drain notices still in flight; close the control-channel client
        the notices and ``/admin/why`` share."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._finder.close()

    async def _resume(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(engine_row(self.fleet.resume(self._engine(request).url)))

    async def _remove(self, request: web.Request) -> web.StreamResponse:
        e = self._engine(request)
        force = request.query.get("force", "0") not in ("0", "false", "")
        try:
            removed = self.fleet.remove(e.url, force=force)
        except ConfigError as exc:
            raise _Bad(409, str(exc), "engine") from None
        if self.planning is not None:
            self.planning.forget(removed.url)  # a URL used again is a new engine
        row = engine_row(removed)
        row["state"] = "removed"
        return web.json_response(row)

    async def _plan(self, request: web.Request) -> web.StreamResponse:
        if self.planning is None:
            raise _Bad(404, "this proxy has no planner", "plan")
        index = self.planning.index
        return web.json_response({
            "paths": self.planning.planner.snapshot(),
            "prefix_units": {e.url: index.size(e.url) for e in self.fleet.engines},
        })

    async def _why(self, request: web.Request) -> web.StreamResponse:
        rid = safe_request_id(request.match_info.get("rid"))
        if rid is None:
            raise _Bad(400, "a request id is 1-128 characters of [A-Za-z0-9._:@-]", "rid")
        flight = self.flights.get(rid)
        if flight is None:
            raise _Bad(404, f"this proxy does not remember request {rid} (it keeps the last "
                            f"{self.flights.capacity})", "rid")
        row = flight.row()
        records: dict[str, dict[str, float] | None] = {"P": None, "D": None}
        engines: dict[str, str] = {}
        if flight.tid and not flight.engines_record:
            engines = {side: f"{url}: not recorded (the request said X-KVBridge-Record: 0)"
                       for side, url in (("P", flight.prefill), ("D", flight.decode)) if url}
        elif flight.tid:
            asks = [(side, url) for side, url in (("P", flight.prefill), ("D", flight.decode))
                    if url]
            found = await asyncio.gather(*(self._record(url, flight.tid) for _, url in asks))
            for (side, url), (record, note) in zip(asks, found, strict=True):
                records[side] = record
                engines[side] = f"{url}: {note}"
        row["engines"] = engines
        row["P"], row["D"] = records["P"], records["D"]
        row["phases"] = critical_path(flight.mode, row["proxy"], records["P"], records["D"])
        row["ttft_s"] = sum(p["seconds"] for p in row["phases"]) if row["phases"] else None
        return web.json_response(row)

    async def _record(self, url: str, tid: str) -> tuple[dict[str, float] | None, str]:
        """The flight record engine ``url`` kept of ``tid`` (the first of its ranks that has
        one), and what happened asking."""
        try:
            e = self.fleet.find(url)
        except ConfigError:
            return None, "no longer an engine of this proxy"
        try:
            addresses = (await self.fleet.probe(e, self._budget)).addresses()
        except Exception as exc:  # noqa: BLE001 - a dead engine only loses its steps
            return None, f"not reachable ({exc})"
        for found in await asyncio.gather(*(self._finder.record(a, tid) for a in addresses)):
            if found:
                return found, "recorded"
        return None, "no record (evicted, or never reached it)"

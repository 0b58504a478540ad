"""The engines a proxy routes to: both pools, the connections to them, their probes and health.

:class:`Fleet` holds the P and D :class:`~kvbridge.proxy.routing.Pool` (which engine is picked is
:mod:`~kvbridge.proxy.routing`'s policy), the one ``aiohttp`` client session every upstream
request uses, each P's *probe* (its control addresses, learnt by
:func:`~kvbridge.proxy.routing.probe_body`), and rotation membership:

- :meth:`Fleet.probe` asks an engine once and caches the answer; one probe per engine runs at a
  time (a lock per URL), and a failure is remembered for ``cooldown_s`` so that a dead P is not
  re-probed per request. A failed probe raises :class:`~kvbridge.proxy.failures.LegFailed`
  (``probe_failed``) and leaves no cached answer.
- :meth:`Fleet.take_out` removes an engine after a connection-level failure: until a health check
  passes, or for ``cooldown_s`` when health checks are off. A probe is dropped whenever the engine
  may have restarted (it left the rotation, came back, or answered with a new generation).
- :meth:`Fleet.add`, :meth:`Fleet.drain`, :meth:`Fleet.resume` and :meth:`Fleet.remove` change
  membership while requests run (:mod:`kvbridge.proxy.members` says what each admission means;
  :mod:`kvbridge.proxy.admin` serves them). An added engine joins in the background: it becomes
  ``active`` once its ``/health`` answers 200 and, for a P of a proxy that pushes, its probe
  answered (an engine whose answer shows it is no kvbridge engine joins for pull only).
- :meth:`Fleet.health_loop` checks every engine's ``/health`` every ``health_interval_s``; an
  engine leaves after ``health_failures`` failed checks in a row (a refused connection: at once)
  and comes back when a check begun after it was taken out passes. One failing engine never
  delays the others: all are checked at once, each bounded by ``max(2, connect_timeout_s)``.

Contract: used from the proxy's one asyncio event loop and not thread-safe. :meth:`open` must run
on that loop before any request; :meth:`close` closes every pooled upstream connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from kvbridge.errors import ConfigError
from kvbridge.params import TransferParams
from kvbridge.proxy.credit import Capacity, KvAdmission, KvCredit, read_capacity
from kvbridge.proxy.failures import LegFailed, cause_of
from kvbridge.proxy.members import Admission
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.routing import (
    Cause,
    Engine,
    Pool,
    ProbeInfo,
    ProxyMode,
    Role,
    parse_probe,
    probe_body,
)
from kvbridge.proxy.settings import ProxySettings

__all__ = ["Fleet", "read_capped"]

log = logging.getLogger("kvbridge.proxy")

_MAX_METRICS = 8 << 20
"""Most bytes of an engine's /metrics read to learn its KV capacity."""


async def read_capped(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The whole body of ``stream``, or its first ``limit + 1`` bytes when it is longer (so the
    caller can tell it is over ``limit``). ``StreamReader.read(n)`` alone returns what has
    arrived so far, which for a body sent in several pieces is only its start."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await stream.read(limit + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


class Fleet:
    """P and D engines of one proxy, with their upstream session, probes and health."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.prefills = Pool(Role.PREFILL, settings.prefill,
                             empty_ok=settings.discovers(Role.PREFILL.value))
        self.decodes = Pool(Role.DECODE, settings.decode,
                            empty_ok=settings.discovers(Role.DECODE.value))
        self._session: aiohttp.ClientSession | None = None
        self._probe_locks: dict[str, asyncio.Lock] = {}
        self._probe_backoff: dict[str, tuple[float, str, Cause]] = {}
        self._joins: dict[str, asyncio.Task[None]] = {}
        self._learning: set[asyncio.Task[Capacity | None]] = set()
        self.admission = KvCredit(self.decodes, settings.kv_admission,
                                   settings.kv_credit_fraction, settings.kv_queue,
                                   settings.kv_queue_s)
        metrics.watch_credit(self.admission)
        #: called (on the event loop) with an engine whose probe was learnt or dropped, or that
        #: was removed: the KV-events feeds (kvbridge.proxy.kvfeed) follow probes through it
        self.probe_listener: Callable[[Engine], None] | None = None

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine, P first."""
        return (*self.prefills.engines, *self.decodes.engines)

    # ---------------------------------------------------------------- upstream session

    def open(self) -> None:
        """Create the upstream session (on the running event loop)."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(total=s.timeout_s, sock_connect=s.connect_timeout_s)
        # keep-alive below uvicorn's 5 s so a pooled connection is never one the engine closed
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)

    async def close(self) -> None:
        """Close every upstream connection and stop every join; idempotent."""
        tasks = [*self._joins.values(), *self._learning]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._joins.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    # ---------------------------------------------------------------- discovery

    async def discover(self) -> dict[str, ProbeInfo | str]:
        """Probe every P engine; returns url → ProbeInfo, or the error text."""
        prefills = list(self.prefills.engines)  # membership may change while they answer
        results = await asyncio.gather(*(self.probe(p) for p in prefills), return_exceptions=True)
        out: dict[str, ProbeInfo | str] = {}
        for p, r in zip(prefills, results, strict=True):
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
                raise LegFailed(502, why, "probe_failed", cause=cause)
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
                cause = cause_of(exc)
                if cause is Cause.UNREACHABLE:
                    self.take_out(e, str(exc) or type(exc).__name__)
                self._probe_backoff[e.url] = (time.monotonic() + self.settings.cooldown_s, why,
                                              cause)
                raise LegFailed(502, why, "probe_failed", cause=cause) from exc
            self._probe_backoff.pop(e.url, None)
            e.probe = info
            self._probe_changed(e)
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

    # ---------------------------------------------------------------- KV capacity

    async def learn_capacity(self, e: Engine) -> Capacity | None:
        """Read D ``e``'s KV capacity (vLLM's ``cache_config_info`` and ``max_model_len``) into
        the admission book (:mod:`kvbridge.proxy.credit`); None, and no limit on ``e``, when it
        has none or does not answer. Only with admission on; never raises."""
        if self.admission.mode is KvAdmission.OFF or e.role is not Role.DECODE:
            return None
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.settings.connect_timeout_s))
        cap: Capacity | None = None
        try:
            async with self.session.get(e.url + "/metrics", timeout=timeout) as r:
                r.raise_for_status()
                text = (await read_capped(r.content, _MAX_METRICS)).decode("utf-8", "replace")
            async with self.session.get(e.url + "/v1/models", timeout=timeout) as r:
                r.raise_for_status()
                models = await r.json(content_type=None)
            cap = read_capacity(text, models)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("cannot read the KV capacity of %s (%s); it is not limited",
                        e.url, exc or type(exc).__name__)
        if cap is None:
            log.warning("decode engine %s reports no KV capacity (no vllm:cache_config_info); "
                        "it is not limited", e.url)
        else:
            log.info("decode engine %s: %d KV blocks of %d tokens, max_model_len %d", e.url,
                     cap.blocks, cap.block_size, cap.max_model_len)
        self.admission.set_capacity(e.url, cap)
        return cap

    async def learn_capacities(self) -> None:
        """:meth:`learn_capacity` of every D, at once."""
        await asyncio.gather(*(self.learn_capacity(e) for e in list(self.decodes.engines)))

    # ---------------------------------------------------------------- membership

    def take_out(self, e: Engine, reason: str) -> None:
        """Take ``e`` out of rotation after a connection-level failure: until a health check
        passes (or for ``cooldown_s`` without health checks). Its probe is dropped: an engine
        that comes back may be a restarted one."""
        was_up = e.is_up()
        cooldown = math.inf if self.settings.health_interval_s > 0 else self.settings.cooldown_s
        e.mark_down(reason, cooldown)
        if was_up:
            log.warning("%s engine %s taken out of rotation: %s", e.role.value, e.url, reason)
            self.drop_probe(e, "engine_down")

    def drop_probe(self, e: Engine, reason: str) -> None:
        """Forget ``e``'s cached probe (the next push re-probes)."""
        if e.probe is not None:
            e.probe = None
            self.metrics.probe_dropped(reason)
            self._probe_changed(e)

    def _probe_changed(self, e: Engine) -> None:
        if self.probe_listener is not None:
            self.probe_listener(e)

    def note_generation(self, e: Engine, answer: TransferParams) -> None:
        """Drop ``e``'s cached probe when ``answer`` shows that the engine restarted, or that
        its model identity changed (a weight reload: push D legs must name the new one)."""
        if (e.probe is not None and answer.kvbridge_identity is not None
                and answer.kvbridge_identity != e.probe.params.kvbridge_identity):
            log.info("%s engine %s has a new model identity (%s -> %s); its probe is dropped",
                     e.role.value, e.url, e.probe.params.kvbridge_identity,
                     answer.kvbridge_identity)
            self.drop_probe(e, "identity_changed")
            return
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
            self.drop_probe(e, "generation_changed")

    def _spawn_learn(self, e: Engine) -> None:
        if self.admission.mode is not KvAdmission.OFF and e.role is Role.DECODE:
            task = asyncio.ensure_future(self.learn_capacity(e))
            self._learning.add(task)
            task.add_done_callback(self._learning.discard)

    def pool(self, role: Role) -> Pool:
        return self.prefills if role is Role.PREFILL else self.decodes

    def find(self, url: str) -> Engine:
        """The engine at ``url`` (any role); :class:`~kvbridge.errors.ConfigError` if none."""
        e = self.prefills.by_url(url) or self.decodes.by_url(url)
        if e is None:
            raise ConfigError(f"{url} is not an engine of this proxy")
        return e

    def add(self, role: Role, url: str) -> Engine:
        """Add an engine to a running proxy; it joins in the background (:meth:`_join`) and
        gets requests once it is ``active``. ConfigError if the URL is already an engine."""
        e = self.pool(role).add(url)
        for other in self.pool(Role.DECODE if role is Role.PREFILL else Role.PREFILL).engines:
            if other.url == e.url:
                self.pool(role).remove(e.url)
                raise ConfigError(f"{e.url} is already a {other.role.value} engine of this proxy")
        log.info("%s engine %s added; joining", role.value, e.url)
        self._joins[e.url] = asyncio.ensure_future(self._join(e))
        return e

    async def _join(self, e: Engine) -> None:
        """Make ``e`` active once ``/health`` passes (and, for a P of a proxy that pushes, the
        probe answered); retries every second until then. Never raises."""
        try:
            while e.admission is Admission.JOINING:
                info, _ = await self.check(e)
                if info["ok"] and await self._handshake(e):
                    await self.learn_capacity(e)
                    e.mark_up()
                    e.admit(Admission.ACTIVE)
                    log.warning("%s engine %s joined", e.role.value, e.url)
                    return
                await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a join must never kill the proxy
            log.exception("joining %s engine %s failed", e.role.value, e.url)
        finally:
            self._joins.pop(e.url, None)

    async def _handshake(self, e: Engine) -> bool:
        """Whether ``e`` may take requests: always for a D and for a pull-only proxy; a P of a
        proxy that pushes needs its probe (a P that answers without kvbridge's parameters is no
        kvbridge engine: it joins, and auto and headroom modes pull from it)."""
        if e.role is Role.DECODE or self.settings.mode is ProxyMode.PULL:
            return True
        self._probe_backoff.pop(e.url, None)
        try:
            await self.probe(e)
        except LegFailed as exc:
            if exc.cause in (Cause.MALFORMED, Cause.REFUSED):
                log.warning("%s joins without a probe (pull only): %s", e.url, exc.message)
                return True
            e.last_error = exc.message
            return False
        return True

    def drain(self, url: str) -> Engine:
        """Stop sending new requests to the engine at ``url``; what it serves runs to its end.
        Idempotent; draining a joining engine cancels its join."""
        e = self.find(url)
        if e.admission is not Admission.DRAINING:
            join = self._joins.pop(e.url, None)
            if join is not None:
                join.cancel()
            e.admit(Admission.DRAINING)
            log.warning("%s engine %s draining (%d open requests, %d hand-offs)",
                        e.role.value, e.url, e.in_flight, e.handoffs)
        return e

    def resume(self, url: str) -> Engine:
        """Undo :meth:`drain`: the engine takes new requests again (a joining one: once it has
        joined). Idempotent."""
        e = self.find(url)
        if e.admission is Admission.DRAINING:
            e.admit(Admission.ACTIVE)
            log.warning("%s engine %s active again", e.role.value, e.url)
        return e

    def remove(self, url: str, force: bool = False) -> Engine:
        """Forget the engine at ``url``. Refused (ConfigError) while it still serves something
        unless ``force``, or when it is its role's last engine."""
        e = self.find(url)
        if not force and (e.in_flight or e.handoffs):
            raise ConfigError(f"{e.url} still serves {e.in_flight} requests and {e.handoffs} "
                              "hand-offs: drain it and wait until it is drained, or force")
        self.pool(e.role).remove(e.url)
        join = self._joins.pop(e.url, None)
        if join is not None:
            join.cancel()
        self._probe_locks.pop(e.url, None)
        self._probe_backoff.pop(e.url, None)
        self.admission.set_capacity(e.url, None)
        self._probe_changed(e)
        log.warning("%s engine %s removed", e.role.value, e.url)
        return e

    # ---------------------------------------------------------------- health

    async def check(self, e: Engine) -> tuple[dict[str, Any], bool]:
        """One ``GET /health`` of ``e``: (what ``/health`` shows of it, whether the connection
        was refused). Bounded by ``max(2, connect_timeout_s)``."""
        timeout = aiohttp.ClientTimeout(
            total=max(2.0, self.settings.connect_timeout_s),
            sock_connect=self.settings.connect_timeout_s,
        )
        info: dict[str, Any] = {"url": e.url, "in_flight": e.in_flight, "state": e.state.value}
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

    async def health_loop(self) -> None:
        """Every ``health_interval_s``, check every engine at once and move it in or out of
        rotation (:meth:`Engine.check_passed`, :meth:`Engine.check_failed`). Runs until
        cancelled."""
        while True:
            engines = self.engines  # membership may have changed since the last round
            started = time.monotonic()
            results = await asyncio.gather(*(self.check(e) for e in engines))
            for e, (info, refused) in zip(engines, results, strict=True):
                if info["ok"]:
                    if e.check_passed(started):
                        log.warning("%s engine %s is back in rotation", e.role.value, e.url)
                        self.drop_probe(e, "engine_down")  # it may be a restarted process
                        self._spawn_learn(e)  # … with another KV cache, maybe
                    continue
                why = info.get("error") or f"/health answered {info.get('status')}"
                if e.check_failed(f"health check: {why}", refused, self.settings.health_failures):
                    log.warning("%s engine %s taken out of rotation: health check: %s",
                                e.role.value, e.url, why)
                    self.drop_probe(e, "engine_down")
            await asyncio.sleep(max(0.0, self.settings.health_interval_s
                                    - (time.monotonic() - started)))

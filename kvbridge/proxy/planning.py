"""The planner in a running proxy: features from the live fleet, placement, and learning.

:class:`Planning` joins the pure parts — the cost models (:mod:`kvbridge.proxy.planner`) and the
prefix index (:mod:`kvbridge.proxy.prefixes`) — to the fleet the dispatcher routes over:

- :meth:`Planning.plan` builds each path's :class:`~kvbridge.proxy.planner.Features` for a
  request from the engines' in-flight counts and what the index says they hold, and asks the
  planner for a path (``X-KVBridge-Plan`` goes on the answer);
- :meth:`Planning.requested` records the features of a request whose path was fixed (by
  ``--mode`` or ``X-KVBridge-Mode``), so every request served teaches the planner, not only the
  planned ones;
- :meth:`Planning.decode_rank` orders the decode engines for a path: most of the prompt held,
  balanced against load (prefix-aware placement; the tenant's ``cache_salt`` keys the index);
- :meth:`Planning.decoding` keeps, per decode engine, the requests placed there until they end:
  the streams the planner's TPOT guard weighs a prefill on that engine against;
- :meth:`Planning.learn` feeds back the request's TTFT (proxy receive → first token out, streamed
  answers of a first dispatch only: a retry or a whole non-streamed answer would teach the wrong
  cost). What the engines hold is recorded in the prefix index as soon as the request's first
  token is out (its KV is on its D, and on its P, from then on, and stays while it decodes), and
  again when it ends: a prompt that repeats one still decoding (a shared system prompt, the next
  turn of a conversation) is then counted as held, not as a cold prompt whose prefill would stall
  D's streams.

Runs on the proxy's event loop; not thread-safe. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kvbridge.proxy.kvfeed import EnginePrefixes
from kvbridge.proxy.members import Engine, NoEngine, Role
from kvbridge.proxy.planner import (
    COMPUTE,
    DECODES,
    QUEUE,
    Features,
    Path,
    Plan,
    Planner,
    PlannerSettings,
    Stream,
    smoothed_tpot,
)
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.prefixes import PrefixIndex, Prompt, prompt_of
from kvbridge.proxy.relay import Call
from kvbridge.proxy.routing import ProxyMode

__all__ = ["SLO_HEADER", "Planning", "requested_slo"]

SLO_HEADER = "X-KVBridge-TTFT-SLO-Ms"
"""A request's own TTFT SLO in ms (0: none), overriding ``--plan-ttft-slo-ms``."""


def requested_slo(headers: Mapping[str, str]) -> float | None:
    """The SLO a request names in :data:`SLO_HEADER` (None: the proxy's default); a value that
    is not a number in [0, 3 600 000] raises :class:`ValueError` naming the header."""
    raw = headers.get(SLO_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3_600_000:  # also refuses nan and inf
        raise ValueError(f"{SLO_HEADER} must be a number of milliseconds in [0, 3600000], got "
                         f"{raw[:40]!r}")
    return value


def _best(engines: Sequence[Engine], avoid: Collection[str],
          rank: Callable[[Engine], float]) -> Engine | None:
    """The best-ranked engine that takes requests, is in rotation and not in ``avoid`` (those
    that take requests when none is left; None when none takes requests). Unlike
    :meth:`Pool.pick` it moves no round-robin cursor: the dispatch's own pick follows."""
    accepting = [e for e in engines if e.accepting]
    up = [e for e in accepting if e.is_up()]
    candidates = [e for e in up if e.url not in avoid] or up or accepting
    return min(candidates, key=rank, default=None)


class Planning:
    """The planner and prefix index of one proxy (module docstring)."""

    def __init__(self, fleet: Fleet, settings: PlannerSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.planner = Planner(settings)
        self.index = PrefixIndex()
        #: per engine URL: prompt tokens sent to it to prefill and not yet past their first token
        self.pending: dict[str, float] = {}
        #: per decode engine URL: its streams' recent TPOT (ms, an EWMA of finished requests)
        self.tpot: dict[str, float] = {}
        #: per decode engine URL: the requests placed there and not ended (the TPOT guard's
        #: streams), by ``id(call)``; and where each of them is
        self.placed: dict[str, dict[int, Call]] = {}
        self._where: dict[int, str] = {}

    def prefilling(self, call: Call, e: Engine) -> None:
        """``e`` is to prefill ``call``'s prompt (less what it holds): counted in its queue
        until the request's first token or its end."""
        if call.prompt is None:
            return
        tokens = max(0.0, call.prompt.tokens - sum(self._held(e.url, call.prompt)))
        self.pending[e.url] = self.pending.get(e.url, 0.0) + tokens

        def done() -> None:
            left = self.pending.get(e.url, 0.0) - tokens
            if left > 0.5:
                self.pending[e.url] = left
            else:
                self.pending.pop(e.url, None)

        call.on_first_token.append(done)

    def prompt(self, call: Call, body: Mapping[str, Any], chat: bool) -> Prompt:
        """The request's prompt, computed once per request (and its ``max_tokens``)."""
        if call.prompt is None:
            call.prompt = prompt_of(body, chat)
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                call.max_tokens = limit
            call.on_first_token.append(lambda: self._holding(call))
        return call.prompt

    def _holding(self, call: Call) -> None:
        """``call``'s first token is out (or it ended without one: nothing then): its engines
        hold its prompt's KV from now on, not only once it ends."""
        if call.prompt is None or not call.first_at:
            return
        for url in (call.flight.decode, call.flight.prefill):
            if url:
                self.index.record(url, call.prompt)

    def decoding(self, call: Call, d: Engine) -> None:
        """``call`` is placed on decode engine ``d`` (a retry may move it): one of the streams
        the TPOT guard weighs for ``d`` until :meth:`learn` sees it end."""
        self._leave(call)
        self.placed.setdefault(d.url, {})[id(call)] = call
        self._where[id(call)] = d.url

    def _leave(self, call: Call) -> None:
        url = self._where.pop(id(call), None)
        if url is not None:
            calls = self.placed.get(url, {})
            calls.pop(id(call), None)
            if not calls:
                self.placed.pop(url, None)

    def streams(self, url: str) -> list[Stream]:
        """The streams decoding (or about to) on decode engine ``url``, for the TPOT guard: each
        request's ``max_tokens`` (those without one are left out: vLLM runs them to the model's
        length, over which a stall spreads thin) and its TPOT so far once it sent 4 tokens."""
        out = []
        for call in self.placed.get(url, {}).values():
            if call.max_tokens is None:
                continue
            tpot = (1000.0 * (call.last_at - call.first_at) / (call.events - 1)
                    if call.events >= 4 and call.last_at > call.first_at else None)
            out.append(Stream(call.max_tokens, tpot, started=call.events > 0))
        return out

    def _held(self, url: str, prompt: Prompt) -> tuple[float, float, float]:
        """Tokens of ``prompt`` the engine holds: (prefix cache or unknown where, host-memory
        tier, disk or remote tier) — by medium when its KV events say (``--kv-events``)."""
        if isinstance(self.index, EnginePrefixes):
            m = self.index.held_by_medium(url, prompt)
            return (m.get("GPU", 0.0) + m.get("unknown", 0.0), m.get("CPU", 0.0),
                    m.get("STORAGE", 0.0))
        return self.index.held(url, prompt), 0.0, 0.0

    def _features(self, prompt: Prompt, p: Engine | None, d: Engine
                  ) -> dict[Path, Features]:
        cached, cpu, storage = self._held(d.url, prompt)
        held_d = cached + cpu + storage
        out = {Path.LOCAL: Features(prompt.tokens - held_d, 0.0, cached,
                                    self.pending.get(d.url, 0.0), cpu=cpu, storage=storage,
                                    decodes=d.in_flight)}
        if p is not None:
            held_p = sum(self._held(p.url, prompt))
            f = Features(prompt.tokens - held_p, prompt.tokens - held_d, cached,
                         self.pending.get(p.url, 0.0), cpu=cpu, storage=storage)
            out[Path.PUSH] = out[Path.PULL] = f
        return out

    def decode_rank(self, path: Path, prompt: Prompt, p: Engine | None = None
                    ) -> Callable[[Engine], float]:
        """The order of decode engines for ``path`` (lower is better): the path's estimate
        with that D, plus, for a hand-off, D's own load at D alone's cost of the requests
        decoding there and the prefill work queued there (for ``local`` both are in the
        estimate already)."""
        model = self.planner.models

        def rank(d: Engine) -> float:
            f = self._features(prompt, p, d)
            est = self.planner.estimate(path, f.get(path, f[Path.LOCAL]))
            if path is not Path.LOCAL:
                coef = model[Path.LOCAL].coef
                queued = float(coef[COMPUTE]) + float(coef[QUEUE])  # per 1000 queued tokens
                est += (max(0.0, float(coef[DECODES])) * d.in_flight
                        + max(0.0, queued) * self.pending.get(d.url, 0.0) / 1000)
            return est

        return rank

    def prefill_rank(self, path: Path, prompt: Prompt) -> Callable[[Engine], float]:
        """The order of prefill engines for a hand-off on ``path`` (lower is better): the
        path's estimate with that P's own prefix hit and queue."""
        def rank(p: Engine) -> float:
            held_p = sum(self._held(p.url, prompt))
            return self.planner.estimate(
                path, Features(prompt.tokens - held_p, prompt.tokens, 0.0,
                               self.pending.get(p.url, 0.0)))

        return rank

    def plan(self, call: Call, prompt: Prompt) -> Plan:
        """Choose the request's path; its plan goes on the call and into ``X-KVBridge-Plan``.

        The candidates: ``local`` on the D ranked best for it, and, when a P is in rotation,
        ``push`` and ``pull`` with the P ranked best (:meth:`prefill_rank`: its own prefix hit
        against its queue); the dispatch then places each by the same ranks."""
        d = _best(self.fleet.decodes.engines, call.tried[Role.DECODE],
                  self.decode_rank(Path.LOCAL, prompt))
        if d is None:
            raise NoEngine(Role.DECODE, self.fleet.decodes.engines)
        p = _best(self.fleet.prefills.engines, call.tried[Role.PREFILL],
                  self.prefill_rank(Path.PUSH, prompt))
        features = self._features(prompt, p, d)
        # the TPOT guard (Planner.stalls): D alone left out while D's streams are slow
        plan = self.planner.choose(features, call.slo_ms, d_tpot_ms=self.tpot.get(d.url),
                                   streams=self.streams(d.url))
        call.plan = plan
        call.reply_headers["X-KVBridge-Plan"] = plan.header()
        return plan

    def requested(self, call: Call, prompt: Prompt, mode: ProxyMode) -> None:
        """A request whose path is fixed: its features, so its TTFT teaches the planner too."""
        if mode not in (ProxyMode.LOCAL, ProxyMode.PUSH, ProxyMode.PULL):
            return
        path = Path(mode.value)
        p = (None if path is Path.LOCAL
             else _best(self.fleet.prefills.engines, (), self.prefill_rank(path, prompt)))
        d = _best(self.fleet.decodes.engines, (), self.decode_rank(path, prompt, p))
        if d is None or (p is None and path is not Path.LOCAL):
            return  # no engine: the dispatch says so
        features = self._features(prompt, p, d)
        est = {q: self.planner.estimate(q, f) for q, f in features.items()}
        call.plan = Plan(path, "requested", est, features)
        call.reply_headers["X-KVBridge-Plan"] = call.plan.header()

    def learn(self, call: Call) -> None:
        """The request ended: teach the planner its TTFT and the index where its KV now is."""
        flight, prompt = call.flight, call.prompt
        self._leave(call)
        if call.outcome != "ok" or prompt is None:
            return
        if flight.decode:
            self.index.record(flight.decode, prompt)
            if call.stream and call.events >= 3 and call.last_at > call.first_at:
                tpot = 1000.0 * (call.last_at - call.first_at) / (call.events - 1)
                self.tpot[flight.decode] = smoothed_tpot(self.tpot.get(flight.decode), tpot)
        if flight.prefill:
            self.index.record(flight.prefill, prompt)
        plan = call.plan
        steps = flight.steps
        if (plan is None or not call.stream or call.retries or "first_token" not in steps
                or call.mode not in {p.value for p in Path}):
            return
        ttft_ms = (steps["first_token"] - steps["receive"]) / 1e6
        self.planner.observe(plan, Path(call.mode), ttft_ms)

    def forget(self, url: str) -> None:
        """An engine left or restarted: the index no longer counts on what it held."""
        self.index.forget(url)

"""Dispatch of one client request: push or pull, retries on other engines, explained failures.

:meth:`Dispatcher.route` asks :func:`~kvbridge.proxy.routing.decide` for a mode, picks the engines
(:mod:`~kvbridge.proxy.routing`'s :class:`~kvbridge.proxy.routing.Pool`), runs the legs through
:class:`~kvbridge.proxy.relay.Relay`, and on a failure either dispatches again
(:func:`~kvbridge.proxy.routing.plan_retry`) or raises the failure, explained by the engines'
control channels (:mod:`~kvbridge.proxy.reasons`).

Contract:

- Runs on the proxy's one asyncio event loop; not thread-safe. A D is acquired
  (:meth:`~kvbridge.proxy.routing.Engine.acquire`) as soon as it is picked, with no await
  between, and released by the relay when its answer ends (or here, when a push falls back to a
  pull before D was sent anything); a P is acquired while its leg runs.
- push: if the P leg fails before D's first byte reached the client, the D leg is closed at once
  and the client gets a 502 (a P 4xx keeps its status: the request itself was bad). If D fails,
  the client gets D's error and the P leg is closed. In ``auto`` (the planner) and ``headroom``, a
  P that cannot be probed makes the request a pull (to another P when there is one).
- A P answer whose ``kvbridge_generation`` differs from the cached probe's drops that probe (P
  restarted; the next push re-probes). A push whose D leg fails before any byte reached the
  client, when P's answer or a re-probe shows a new generation, is retried once as a pull.
- Fleets (xPyD): a dispatch that fails before any byte reached the client, because of an
  engine (unreachable, broken connection, 5xx), is retried up to ``max_retries`` times on
  engines the request has not tried, with a fresh ``transfer_id`` (except a pull whose D was
  unreachable: P's answer goes to another D). The P legs of a failed dispatch are cancelled
  before the next one starts (:meth:`~kvbridge.proxy.relay.Call.abandon`).
- A leg that fails with a 5xx, a broken answer or a timeout is explained by asking the engines'
  control channels (bounded by ``control_timeout_s``): the client gets ``"<leg> failed:
  transfer <id>: <reason>"`` (502, 504 for a timeout), or the generic error when no engine can
  say. A control channel that does not answer only costs that deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvbridge.params import TransferParams
from kvbridge.proxy.credit import NoCredit
from kvbridge.proxy.failures import LegFailed
from kvbridge.proxy.members import NoEngine
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.proxy.planner import Path
from kvbridge.proxy.planning import Planning
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.reasons import QueryOutcome, ReasonFinder, pick_reason
from kvbridge.proxy.relay import Attempt, Call, Relay, decode_answered, unsent_failure
from kvbridge.proxy.routing import (
    Cause,
    Decision,
    Engine,
    ProbeInfo,
    ProxyMode,
    Retry,
    Role,
    control_addresses,
    decide,
    decode_body,
    new_transfer_id,
    plan_retry,
    prefill_body,
    pull_decode_params,
    push_decode_params,
)
from kvbridge.proxy.settings import ProxySettings

__all__ = ["Dispatcher"]

log = logging.getLogger("kvbridge.proxy")

#: Leg failures that no control channel can explain (nothing reached an engine, or the engine
#: already said why).
_UNEXPLAINED_KINDS = ("prefill_unreachable", "decode_unreachable", "probe_failed",
                      "prefill_refused")


def _answer_of(p_leg: asyncio.Future[TransferParams]) -> TransferParams | None:
    """The P leg's answer if it finished successfully, else None."""
    if p_leg.done() and not p_leg.cancelled() and p_leg.exception() is None:
        return p_leg.result()
    return None


def _leg(body: dict[str, Any], call: Call) -> dict[str, Any]:
    """A leg's body as sent: ``kvbridge_record: false`` added when the client asked that the
    engines keep no flight record of the hand-off (``X-KVBridge-Record: 0``)."""
    if not call.flight.engines_record:
        body["kv_transfer_params"] = {**body["kv_transfer_params"], "kvbridge_record": False}
    return body


def _d_tiers(call: Call) -> bool:
    """Whether D's offload tiers serve the request's hand-off (the planner may leave them out)."""
    return call.plan is None or call.plan.d_tiers


class Dispatcher:
    """Routes client requests over a :class:`~kvbridge.proxy.pool.Fleet` (module docstring)."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics, fleet: Fleet,
                 relay: Relay) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fleet = fleet
        self.relay = relay
        self.planning = Planning(fleet, settings.plan)
        self._reasons = ReasonFinder(settings.control_secret, settings.control_timeout_s)

    async def close(self) -> None:
        """Close the control-channel clients used to explain failures."""
        await self._reasons.close()

    async def route(
        self, request: web.Request, path: str, body: dict[str, Any], call: Call
    ) -> web.StreamResponse:
        """Dispatch until one attempt answers or the failure is final; raises LegFailed with
        the engines' reason for the last attempt's failure (``response``: D's own answer)."""
        forced: Decision | None = None
        reuse: Attempt | None = None
        mode = call.requested or self.settings.mode
        if ProxyMode.AUTO in (mode, self.settings.mode):  # the planner sees every request
            self.planning.prompt(call, body, chat=path.endswith("/chat/completions"))
        while True:
            call.attempt = Attempt()
            try:
                if reuse is None:  # nothing sent yet: no engine to take it is a 503 now
                    self.fleet.prefills.require()
                self.fleet.decodes.require()
                if call.reservation is None:  # once, before any leg: KV credit on some D
                    call.reservation = await self.fleet.admission.admit(body)
                if reuse is not None:
                    resp = await self._pull(request, path, body, call, reuse)
                else:
                    decision = forced or self._decide(mode, call)
                    if decision.mode is ProxyMode.PUSH:
                        resp = await self._push(request, path, body, call, decision)
                    elif decision.mode is ProxyMode.LOCAL:
                        self._record(decision, call)
                        resp = await self._local(request, path, body, call)
                    else:
                        self._record(decision, call)
                        resp = await self._pull(request, path, body, call)
            except NoEngine as exc:
                self.metrics.error("no_engine")
                call.abandon()
                raise LegFailed(503, str(exc), "no_engine", cause=Cause.REFUSED) from None
            except NoCredit as exc:  # waited or refused per --kv-admission
                self.metrics.error("no_kv_credit")
                raise LegFailed(503, str(exc), "no_kv_credit", cause=Cause.REFUSED) from None
            except LegFailed as exc:
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

    def _decide(self, mode: ProxyMode, call: Call) -> Decision:
        """The concrete mode of the next dispatch: the planner's in ``auto`` mode, else
        :func:`decide`'s (whose path the planner then records, to learn from it)."""
        if mode is ProxyMode.AUTO:
            assert call.prompt is not None
            plan = self.planning.plan(call, call.prompt)
            return Decision(ProxyMode(plan.path.value), plan.why)
        decision = decide(mode, self.fleet.decodes, self.settings.push_headroom)
        if call.prompt is not None:
            self.planning.requested(call, call.prompt, decision.mode)
        return decision

    def _pick_prefill(self, call: Call, mode: ProxyMode) -> Engine:
        """The P for the request's attempt: the one the planner ranks best when it looks at
        the request (its prefix hit, its queue), else the least loaded."""
        prompt = call.prompt
        return self.fleet.prefills.pick(
            avoid=call.tried[Role.PREFILL],
            rank=None if prompt is None else self.planning.prefill_rank(Path(mode.value), prompt))

    def _pick_decode(self, call: Call, p: Engine | None = None) -> Engine:
        """The D for the request's attempt: with KV credit for it, then the one the planner
        ranks best when the request has a prompt it looks at (prefix held, load), else the
        least loaded; its credit claim follows it."""
        r = call.reservation
        prompt = call.prompt
        d = self.fleet.decodes.pick(
            avoid=call.tried[Role.DECODE],
            only=None if r is None or r.engine is None
            else (lambda e: self.fleet.admission.fits(e, r)),
            rank=None if prompt is None
            else self.planning.decode_rank(Path(call.attempt.mode.value), prompt, p))
        call.place(d)
        self.planning.decoding(call, d)
        return d

    async def _plan_retry(self, exc: LegFailed, call: Call) -> Retry | None:
        """How to retry the failed attempt (see :func:`routing.plan_retry`), or None."""
        att = call.attempt
        s = self.settings
        tried = call.tried
        for e in (att.p, att.d) if exc.role is Role.DECODE else (att.p,):
            if e is not None:  # a D failure may be P's fault: avoid both on the retry
                tried[e.role].add(e.url)
        plan = plan_retry(
            att.mode, exc.role, exc.cause, retries=call.retries, max_retries=s.max_retries,
            other_prefill=self.fleet.prefills.has_untried(tried[Role.PREFILL]),
            other_decode=self.fleet.decodes.has_untried(tried[Role.DECODE]),
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

    def _record(self, decision: Decision, call: Call) -> None:
        call.mode = decision.mode.value
        configured = (call.requested or self.settings.mode).value
        self.metrics.decision(configured, decision.mode.value, decision.reason)
        log.debug("%s mode=%s (%s)", call.rid, decision.mode.value, decision.reason)

    async def _pull(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        call: Call,
        reuse: Attempt | None = None,
    ) -> web.StreamResponse:
        """One pull dispatch; ``reuse``: a failed pull whose D never got P's answer (the same
        P, answer and transfer_id go to another D)."""
        att = call.attempt
        att.mode = ProxyMode.PULL
        call.mode = ProxyMode.PULL.value
        if reuse is not None and reuse.p is not None and reuse.answer is not None:
            p, answer, tid = reuse.p, reuse.answer, reuse.tid
            att.wire = reuse.wire
            call.flight.steps.pop("decode_sent", None)  # P's steps stand; a new D follows
        else:
            p = self._pick_prefill(call, ProxyMode.PULL)
            tid = new_transfer_id()
            att.p, att.tid = p, tid
            call.flight.attempt(ProxyMode.PULL.value, tid, p.url)
            self.planning.prefilling(call, p)
            try:
                answer = await self.relay.prefill_leg(
                    p, path, _leg(prefill_body(body, tid, ProxyMode.PULL), call), call, tid,
                    ProxyMode.PULL
                )
            except LegFailed as exc:
                raise exc.within(tid, [(p, None)]) from None
        att.p, att.tid, att.answer = p, tid, answer
        call.hold(p)  # P serves the pull until D's answer ends (drain waits for it)
        # late placement: the best D now that prefill is done
        d = att.d = self._pick_decode(call, p)
        d.acquire()
        call.flight.decode = d.url
        d_body = _leg(decode_body(body, pull_decode_params(answer, att.wire, _d_tiers(call))),
                      call)
        d_open = asyncio.ensure_future(self.relay.open(d, path, d_body, call))
        legs: list[tuple[Engine, TransferParams | None]] = [(d, None), (p, answer)]
        try:
            resp = await self.relay.to_client(request, d, d_open, None, call)
        except LegFailed as exc:
            raise exc.within(tid, legs) from None
        if unsent_failure(resp):
            raise decode_answered(d, resp).within(tid, legs)
        return resp

    async def _push(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        call: Call,
        decision: Decision,
    ) -> web.StreamResponse:
        att = call.attempt
        att.mode = ProxyMode.PUSH
        call.mode = ProxyMode.PUSH.value
        # early placement: D is committed before prefill starts
        p = att.p = self._pick_prefill(call, ProxyMode.PUSH)
        d = att.d = self._pick_decode(call, p)
        d.acquire()
        try:
            info = await self.fleet.probe(p)
        except LegFailed as exc:
            d.release()
            if (call.requested or self.settings.mode) not in (ProxyMode.AUTO, ProxyMode.HEADROOM):
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
        self.planning.prefilling(call, p)
        call.flight.attempt(ProxyMode.PUSH.value, tid, p.url, d.url)
        p_leg = att.p_leg = asyncio.ensure_future(
            self.relay.prefill_leg(
                p, path, _leg(prefill_body(body, tid, ProxyMode.PUSH), call), call, tid,
                ProxyMode.PUSH
            )
        )
        call.background.append(p_leg)
        d_body = _leg(decode_body(body, push_decode_params(info, tid, _d_tiers(call))), call)
        d_open = asyncio.ensure_future(self.relay.open(d, path, d_body, call))
        try:
            resp = await self.relay.to_client(request, d, d_open, p_leg, call)
        except LegFailed as exc:
            if exc.role is Role.PREFILL:
                if exc.kind != "prefill_refused":  # P may have restarted: re-discover
                    self.fleet.drop_probe(p, "prefill_failed")
                # ask P where D was told it listens
                raise exc.within(tid, [(p, info.params), (d, None)]) from None
            # D failed and nothing reached the client: to_client only raises before the first
            # byte
            raise exc.within(tid, [(d, None), (p, _answer_of(p_leg) or info.params)]) from None
        if unsent_failure(resp):
            self.fleet.drop_probe(p, "decode_failed")  # D may have failed to reach P there
            legs = [(d, None), (p, _answer_of(p_leg) or info.params)]
            raise decode_answered(d, resp).within(tid, legs)
        return resp

    async def _local(
        self, request: web.Request, path: str, body: dict[str, Any], call: Call
    ) -> web.StreamResponse:
        """One dispatch to D alone: the client's request as it came (no ``kv_transfer_params``),
        so D prefills it with its own prefix cache and tiers; no P, no hand-off."""
        att = call.attempt
        att.mode = ProxyMode.LOCAL
        call.mode = ProxyMode.LOCAL.value
        d = att.d = self._pick_decode(call)
        d.acquire()
        call.flight.attempt(ProxyMode.LOCAL.value, "", "", d.url)
        self.planning.prefilling(call, d)
        d_open = asyncio.ensure_future(self.relay.open(d, path, body, call))
        legs: list[tuple[Engine, TransferParams | None]] = [(d, None)]
        try:
            resp = await self.relay.to_client(request, d, d_open, None, call)
        except LegFailed as exc:
            raise exc.within("", legs) from None
        if unsent_failure(resp):
            raise decode_answered(d, resp).within("", legs)
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
        self.fleet.drop_probe(p, "decode_failed")
        try:
            fresh = await self.fleet.probe(p)
        except LegFailed:
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
                    addresses = (await self.fleet.probe(e, budget)).addresses()
                except LegFailed:
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

    async def _explained(self, exc: LegFailed) -> LegFailed:
        """``exc`` with the engines' reason for its transfer as its message, when they know
        one (D's own answer is then dropped)."""
        if exc.status < 500 or exc.kind in _UNEXPLAINED_KINDS or not exc.tid:
            return exc
        reason = await self._reason(exc.tid, exc.legs)
        if reason is None:
            return exc
        log.info("transfer %s: %s (%s)", exc.tid, reason, exc.message)
        status = 504 if exc.status == 504 else 502
        return LegFailed(status, f"{exc.role.value} failed: transfer {exc.tid}: {reason}",
                         exc.kind, cause=exc.cause)

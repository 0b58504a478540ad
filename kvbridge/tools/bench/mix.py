"""``kvbridge bench mix``'s replay: one :class:`~kvbridge.tools.bench.mix_workload.MixTrace`
sent through a proxy once per hand-off policy, measured and compared.

Contract:

- :func:`replay` sends every request of a trace to ``URL/v1/completions`` at its arrival offset
  (open loop: a slow answer never delays the next send), streamed, greedy, ``ignore_eos``,
  ``return_token_ids``, with header ``X-KVBridge-Mode: <policy>`` and body ``cache_salt``
  :func:`cache_salt` (one salt per policy, seed and rate, so one run's prefix-cache and tier
  entries never serve another's prompts). Per request (:class:`Outcome`): TTFT (send → first SSE
  ``data:`` chunk carrying text or token ids), end to end, TPOT ((e2e − TTFT) / (tokens − 1)), the
  output token ids and text, and ``path`` from the answer's ``X-KVBridge-Plan`` header
  (:func:`parse_plan_header`; None when absent). A non-200 answer, an ``error`` chunk, a stream
  without a token, a network error or ``timeout`` makes the request failed, never the replay.
- :func:`mark_mismatches` compares each answered request's token ids (text when the server sent
  none) with a reference: the ``local`` policy's (D alone, one engine serving the request).
- :func:`summarize` reduces outcomes to rows per class plus ``all``: count, failures, TTFT p50 /
  p99, TPOT p50 (ms, :func:`kvbridge.tools.report.percentile`), goodput (answered requests with
  TTFT <= the TTFT SLO and TPOT <= the TPOT SLO, per second of the run's wall time), mismatches
  and the chosen paths; :func:`format_rate` and :func:`format_goodput` print them with
  :func:`kvbridge.tools.report.table`, and :func:`write_plot` draws goodput, TTFT p99 and TPOT
  p50 of the whole mix against the rate, a line per policy (matplotlib).
- :func:`run_rate` runs the policies of one rate (``local`` first: it is the reference) and
  calls ``before(policy)`` / ``after(policy)`` around each, for the caller's resets and engine
  counters.

aiohttp is imported when a replay runs, so importing this module stays light. Not thread-safe;
one replay at a time per event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError
from kvbridge.tools.bench.mix_workload import CLASSES, MixRequest, MixTrace
from kvbridge.tools.report import percentile, table

if TYPE_CHECKING:
    import aiohttp

__all__ = ["MODE_HEADER", "PLAN_HEADER", "PLOT_PANELS", "POLICIES", "Outcome", "cache_salt",
           "format_goodput", "format_rate", "mark_mismatches", "parse_plan_header",
           "parse_policies", "plot_rows", "replay", "request_body", "run_rate", "summarize",
           "write_plot"]

POLICIES: tuple[str, ...] = ("push", "pull", "local", "headroom", "auto")
"""The proxy's modes as policies: ``auto`` is the planner, ``headroom`` push or pull by D's load
(auto before the planner); ``plan``, auto's other name, is taken as ``auto``."""
REFERENCE = "local"
MODE_HEADER = "X-KVBridge-Mode"
PLAN_HEADER = "X-KVBridge-Plan"


def parse_policies(text: str) -> tuple[str, ...]:
    """``"push,local"`` → the policies, duplicates removed, ``local`` first when present (it is
    the reference of the others), ``plan`` read as ``auto`` (one policy, one run); ConfigError
    naming ``--policies`` for an unknown one."""
    names = ["auto" if w.strip() == "plan" else w.strip() for w in text.split(",") if w.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise ConfigError(f"--policies: {', '.join(bad) or 'none given'}; choose from "
                          f"{','.join(POLICIES)}")
    out = list(dict.fromkeys(names))
    if REFERENCE in out:
        out.remove(REFERENCE)
        out.insert(0, REFERENCE)
    return tuple(out)


def parse_plan_header(value: str | None) -> dict[str, str]:
    """``path=local; est_ms=12.3; why=fastest`` → ``{"path": "local", ...}``. Lenient: parts
    without ``=`` and empty keys are skipped, keys are lower-cased, blanks trimmed."""
    out: dict[str, str] = {}
    for part in (value or "").split(";"):
        key, sep, val = part.partition("=")
        if sep and key.strip():
            out[key.strip().lower()] = val.strip()
    return out


def cache_salt(policy: str, seed: int, rate: float) -> str:
    """The ``cache_salt`` of every request of one (policy, seed, rate) run."""
    return f"mix-{policy}-{seed}-r{rate:g}"


def request_body(req: MixRequest, salt: str, model: str = "tiny") -> dict[str, Any]:
    """The ``/v1/completions`` body of ``req``: streamed, greedy, exactly ``max_tokens``."""
    return {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True, "return_token_ids": True,
            "cache_salt": salt}


@dataclass
class Outcome:
    """What one request of one policy run did (times in seconds from its send)."""

    index: int
    klass: str
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    path: str | None = None
    """``path`` of the ``X-KVBridge-Plan`` answer header, when there was one."""
    plan: str | None = None
    """The whole ``X-KVBridge-Plan`` header (estimates, why), when there was one."""
    mismatch: bool | None = None
    """Output differs from the reference's (None: no reference, or either side failed)."""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)

    def record(self) -> dict[str, Any]:
        """JSON-ready, with TPOT."""
        return {**asdict(self), "tpot_s": self.tpot_s}


# -- the replay ----------------------------------------------------------------------------------


def _chunk(out: Outcome, payload: bytes, elapsed: float) -> None:
    chunk = json.loads(payload)
    if isinstance(chunk, dict) and "error" in chunk:
        raise ValueError(f"error chunk: {json.dumps(chunk['error'])[:300]}")
    for choice in (chunk.get("choices") if isinstance(chunk, dict) else None) or []:
        ids = choice.get("token_ids") or []
        text = choice.get("text") or ""
        if (ids or text) and out.ttft_s is None:
            out.ttft_s = elapsed
        out.token_ids.extend(int(i) for i in ids)
        out.text += text
        out.tokens += len(ids) if ids else (1 if text else 0)


async def send_one(session: aiohttp.ClientSession, url: str, req: MixRequest, policy: str,
                   salt: str, *, model: str = "tiny", timeout: float = 120.0) -> Outcome:
    """One streamed request (module docstring); never raises for the server's failures."""
    import aiohttp

    out = Outcome(req.index, req.klass)
    t0 = time.perf_counter()
    try:
        async with session.post(url.rstrip("/") + "/v1/completions",
                                json=request_body(req, salt, model),
                                headers={MODE_HEADER: policy},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            out.plan = resp.headers.get(PLAN_HEADER)
            out.path = parse_plan_header(out.plan).get("path") or None
            if resp.status != 200:
                body = (await resp.read())[:300].decode("utf-8", "replace")
                raise ValueError(f"HTTP {resp.status}: {body}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                _chunk(out, payload, time.perf_counter() - t0)
        out.e2e_s = time.perf_counter() - t0
        if out.ttft_s is None:
            raise ValueError("no token streamed")
        out.ok = True
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        out.ok = False
        out.error = f"{type(exc).__name__}: {exc}"[:400]
    return out


async def replay(url: str, trace: MixTrace, policy: str, salt: str, *, model: str = "tiny",
                 timeout: float = 120.0, on_send: Callable[[int], None] | None = None
                 ) -> tuple[list[Outcome], float]:
    """Every request of ``trace`` at its arrival offset; (outcomes in trace order, wall seconds
    from the first send to the last answer). ``on_send(index)`` runs just before each request
    is sent, in the order they are sent (e.g. to slow a tier from request N on)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def at_offset(req: MixRequest) -> Outcome:
            await asyncio.sleep(max(0.0, start + req.arrival_s - loop.time()))
            if on_send is not None:
                on_send(req.index)
            return await send_one(session, url, req, policy, salt, model=model, timeout=timeout)

        outcomes = await asyncio.gather(*(at_offset(r) for r in trace.requests))
        return list(outcomes), loop.time() - start


def mark_mismatches(outcomes: Sequence[Outcome], reference: Mapping[int, Outcome]) -> None:
    """Set each outcome's ``mismatch`` against the reference outcome of the same request."""
    for o in outcomes:
        ref = reference.get(o.index)
        if ref is None or not (ref.ok and o.ok):
            o.mismatch = None
        elif ref.token_ids and o.token_ids:
            o.mismatch = ref.token_ids != o.token_ids
        else:
            o.mismatch = ref.text != o.text


# -- the summary ---------------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def summarize(outcomes: Sequence[Outcome], wall_s: float, ttft_slo_ms: float,
              tpot_slo_ms: float) -> list[dict[str, Any]]:
    """Rows per class (in :data:`CLASSES` order, classes without requests left out) then
    ``all`` (module docstring). ``mismatches`` is None when no request had a reference."""
    groups = [(k, [o for o in outcomes if o.klass == k]) for k in CLASSES]
    rows = []
    for name, group in [*(g for g in groups if g[1]), ("all", list(outcomes))]:
        ok = [o for o in group if o.ok]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
        good = [o for o in ok if o.ttft_s is not None and o.ttft_s * 1000 <= ttft_slo_ms
                and (o.tpot_s is None or o.tpot_s * 1000 <= tpot_slo_ms)]
        compared = [o for o in group if o.mismatch is not None]
        paths = Counter(o.path for o in group if o.path)
        rows.append({
            "class": name, "count": len(group), "failures": len(group) - len(ok),
            "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
            "tpot_p50_ms": _ms(percentile(tpot, 50)), "slo_met": len(good),
            "goodput_rps": round(len(good) / wall_s, 3) if wall_s > 0 else None,
            "mismatches": sum(bool(o.mismatch) for o in compared) if compared else None,
            "paths": dict(sorted(paths.items())),
        })  # fmt: skip
    return rows


def _paths(paths: Mapping[str, int], count: int) -> str:
    if not paths or not count:
        return "-"
    return " ".join(f"{p} {100 * n / count:.0f}%" for p, n in paths.items())


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_rate(entry: Mapping[str, Any]) -> str:
    """The table of one rate: a row per (policy, class)."""
    head = ["policy", "class", "n", "fail", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "goodput/s", "mismatch", "paths", "P reqs"]
    rows = []
    for run in entry.get("policies") or []:
        policy = run["policy"]
        if run.get("error"):
            rows.append([policy, "all", "-", "-", "-", "-", "-", "-", "-", "-",
                         f"error: {run['error'][:60]}"])
            continue
        for r in run.get("rows") or []:
            mism = ("ref" if policy == REFERENCE else "-") if r["mismatches"] is None \
                else str(r["mismatches"])
            p_reqs = run.get("p_requests") if r["class"] == "all" else None
            rows.append([policy, r["class"], r["count"], r["failures"],
                         _num(r["ttft_p50_ms"]), _num(r["ttft_p99_ms"]), _num(r["tpot_p50_ms"]),
                         _num(r["goodput_rps"], 2), mism, _paths(r["paths"], r["count"]),
                         "-" if p_reqs is None else f"{p_reqs:g}"])
    return "\n".join(table(head, rows, align=list("llrrrrrrrlr")))


def format_goodput(report: Mapping[str, Any]) -> str:
    """Goodput (whole mix, req/s) per policy against the rate: one row per policy."""
    rates = [e["rate"] for e in report.get("rates") or []]
    policies: list[str] = []
    values: dict[tuple[str, float], Any] = {}
    for e in report.get("rates") or []:
        for run in e.get("policies") or []:
            if run["policy"] not in policies:
                policies.append(run["policy"])
            whole = [r for r in run.get("rows") or [] if r["class"] == "all"]
            values[(run["policy"], e["rate"])] = whole[0]["goodput_rps"] if whole else None
    head = ["policy", *(f"{r:g} req/s" for r in rates)]
    rows = [[p, *(_num(values.get((p, r)), 2) for r in rates)] for p in policies]
    return "\n".join(table(head, rows, align=["l", *("r" * len(rates))]))


#: (row key, name, unit) of the figure's panels (:func:`write_plot`)
PLOT_PANELS: tuple[tuple[str, str, str], ...] = (
    ("goodput_rps", "goodput", "req/s"), ("ttft_p99_ms", "TTFT p99", "ms"),
    ("tpot_p50_ms", "TPOT p50", "ms"))


def plot_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The whole mix's row (class ``all``) of every policy and rate, with its ``policy`` and
    ``rate``: what :func:`write_plot` draws."""
    out = []
    for e in report.get("rates") or []:
        for run in e.get("policies") or []:
            whole = [r for r in run.get("rows") or [] if r["class"] == "all"]
            if whole:
                out.append({**whole[0], "policy": run["policy"], "rate": e["rate"]})
    return out


def write_plot(report: Mapping[str, Any], path: Path) -> Path:
    """Draw goodput, TTFT p99 and TPOT p50 of the whole mix against the rate into ``path``, a
    line per policy in the report's order. Needs matplotlib
    (:func:`~kvbridge.tools.bench.serve_plots.matplotlib_available`)."""
    from kvbridge.tools.bench.serve_plots import draw_rate_panels

    s = report.get("settings") or {}
    policies = list(s.get("policies") or [])
    title = (f"kvbridge bench mix ({s.get('fleet', '?')}, {s.get('backend', '?')}): "
             f"{s.get('num_requests', '?')} requests, seed {s.get('seed', '?')}, SLO TTFT "
             f"{_num(s.get('ttft_slo_ms'), 0)} ms / TPOT {_num(s.get('tpot_slo_ms'), 0)} ms, "
             f"{report.get('date', '')}")
    return draw_rate_panels(
        plot_rows(report), PLOT_PANELS, title, path, group="policy",
        order=lambda p: (policies.index(p) if p in policies else len(policies), p))


# -- one rate ------------------------------------------------------------------------------------

Hook = Callable[[str], "Mapping[str, Any] | None"]


def run_rate(url: str, trace: MixTrace, policies: Sequence[str], *, ttft_slo_ms: float,
             tpot_slo_ms: float, model: str = "tiny", timeout: float = 120.0,
             before: Hook | None = None, after: Hook | None = None,
             on_send: Callable[[int], None] | None = None,
             say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Replay ``trace`` once per policy (``local`` first, when asked); the rate's report entry.

    ``before(policy)`` runs before a policy's replay, ``after(policy)`` after it; what either
    returns is merged into that policy's entry (e.g. ``{"p_requests": 0}``). A policy whose
    hook raises is reported with its ``error`` and the next policy runs. ``on_send``: see
    :func:`replay` (every policy's replay).
    """
    order = parse_policies(",".join(policies))
    reference: dict[int, Outcome] = {}
    runs: list[dict[str, Any]] = []
    for policy in order:
        salt = cache_salt(policy, trace.seed, trace.rate)
        run: dict[str, Any] = {"policy": policy, "cache_salt": salt}
        try:
            if before is not None:
                run.update(before(policy) or {})
            say(f"{policy} at {trace.rate:g} req/s: {len(trace.requests)} requests -> {url}")
            outcomes, wall = asyncio.run(replay(url, trace, policy, salt, model=model,
                                                timeout=timeout, on_send=on_send))
            if after is not None:
                run.update(after(policy) or {})
        except Exception as exc:  # noqa: BLE001 - report this policy failed, run the next
            run["error"] = f"{type(exc).__name__}: {exc}"[:500]
            runs.append(run)
            say(f"{policy}: FAILED: {run['error'][:200]}")
            continue
        if policy == REFERENCE:
            reference = {o.index: o for o in outcomes}
        else:
            mark_mismatches(outcomes, reference)
        run.update(wall_s=round(wall, 3), rows=summarize(outcomes, wall, ttft_slo_ms,
                                                         tpot_slo_ms),
                   requests=[o.record() for o in outcomes])
        runs.append(run)
        whole = run["rows"][-1]
        say(f"{policy}: {whole['count'] - whole['failures']}/{whole['count']} answered, "
            f"mismatches {whole['mismatches']}, {wall:.1f} s")
    return {"rate": trace.rate, "counts": trace.counts(), "policies": runs}

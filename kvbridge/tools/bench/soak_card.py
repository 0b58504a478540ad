"""The pure parts of the chaos soak (``benchmarks/soak.py``): its fault schedule and report card.

Contract: :func:`schedule` turns a seed into the faults a soak injects, one at a time, at random
moments, and :func:`rolling` is the plan of a rolling upgrade (a drain and replacement of every
engine, one after the other); :func:`reason` folds a failed request's error into a short,
countable cause; :func:`card` aggregates what every request did (:class:`Outcome`) and when
faults were open (:class:`Window`) into the report card, and :func:`card_rows` lays it out for
:func:`kvbridge.tools.report.print_table`. Nothing here starts a process or touches the network.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvbridge.tools.report import percentile

__all__ = ["CONNECTORS", "DEFAULT_FAULTS", "ENGINES", "FAULTS", "PROXY_MODES", "ROLLING_ORDER",
           "SCHEDULED", "TIERS", "Fault", "Outcome", "Window", "applicable", "card", "card_rows",
           "code_rows", "code_version", "proxy_mode", "reason", "repeat_of", "rolling",
           "rolling_order", "schedule"]

ENGINES = ("P0", "P1", "D0", "D1")
SCHEDULED = ("kill", "stop", "drain", "proxy", "slow_disk")
"""Faults injected at a moment: SIGKILL of an engine (restarted at its port), SIGSTOP of an
engine for a few seconds then SIGCONT, drain + remove + restart + add of an engine through the
proxy's admin API, SIGKILL of the proxy (restarted at its port), and ``slow_disk``: every
engine's ``slow_disk`` offload tier reads slowly (``delay_ms`` per read) for ``hold_s``, then
fast again (target ``tiers``: the delay file every engine's tier reads)."""
FAULTS = (*SCHEDULED, "transfer_error")
"""``transfer_error`` is not a moment: P1 and D1 run the fault-injecting transport wrapper for
the whole soak, failing a seeded share of their transfers."""
DEFAULT_FAULTS = ("kill", "stop", "drain", "proxy", "transfer_error")
"""The faults of a soak that names none: all but ``slow_disk``, which changes the engines (an
offload tier, a small vLLM KV cache) and the load (repeated prompts), so it is asked for."""
TIERS = "tiers"
"""The target of a ``slow_disk`` fault: the tiers of every engine at once."""
CONNECTORS: dict[str, tuple[str, ...]] = {
    "kvbridge": FAULTS,
    "vllm-nixl": ("kill", "stop", "drain", "proxy"),
}
"""The faults that apply to each connector the soak can run: vLLM's own ``NixlConnector`` has
no kvbridge transport to wrap (``transfer_error``) and no kvbridge offload tier (``slow_disk``)."""
ROLLING_ORDER = ("P0", "P1", "D0", "D1")
"""A rolling upgrade replaces the prefill engines first, then the decode engines (unless told
another order: :func:`rolling_order`)."""
PROXY_MODES = ("pull", "push", "headroom", "auto")
"""The proxy modes a soak can run (``--proxy-mode``): ``pull`` and ``push`` hand off every request
that way, ``headroom`` hands off every request (push or pull by D's load), ``auto`` is the
planner (it may also serve a request by D alone); ``local`` is not one: nothing to fault."""


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: ``at_s`` after the load started, of ``kind`` on ``target`` (an
    engine name, ``proxy`` or :data:`TIERS`); ``hold_s`` is how long a SIGSTOP or a slow disk
    lasts (0 otherwise), ``delay_ms`` the slow disk's delay per read (0 otherwise)."""

    at_s: float
    kind: str
    target: str
    hold_s: float = 0.0
    delay_ms: float = 0.0


def applicable(connector: str, kinds: Sequence[str]) -> list[str]:
    """``kinds`` checked against what applies to ``connector`` (:data:`CONNECTORS`); ValueError
    naming the connector and the faults that do not apply."""
    if connector not in CONNECTORS:
        raise ValueError(f"unknown connector {connector!r}; known: {', '.join(CONNECTORS)}")
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    refused = [k for k in kinds if k not in CONNECTORS[connector]]
    if refused:
        raise ValueError(f"faults {', '.join(refused)} do not apply to --connector {connector} "
                         f"(it takes {', '.join(CONNECTORS[connector])})")
    return list(kinds)


def repeat_of(seed: int, i: int, share: float) -> int | None:
    """Whether request ``i`` of the load re-sends an earlier request's prompt, and whose: with
    probability ``share`` (from ``seed`` and ``i`` alone, so the rest of the load is drawn as
    without repeats) one of requests ``0 … i-1`` uniformly, else None. A repeat of a repeat is
    resolved by the caller (the prompt is the first one's)."""
    if share <= 0 or i <= 0:
        return None
    rng = random.Random(f"{seed}-repeat-{i}")
    return rng.randrange(i) if rng.random() < share else None


def schedule(seed: int, duration_s: float, kinds: Sequence[str], *, warmup_s: float = 20.0,
             gap_s: tuple[float, float] = (25.0, 50.0), stop_s: tuple[float, float] = (2.0, 12.0),
             slow_s: tuple[float, float] = (10.0, 40.0),
             slow_ms: tuple[float, float] = (300.0, 1500.0),
             quiet_tail_s: float = 30.0) -> list[Fault]:
    """The faults of a soak of ``duration_s`` seconds, from ``seed``: the first after
    ``warmup_s``, then one every ``gap_s`` (uniform), none in the last ``quiet_tail_s``; each of
    a kind drawn from ``kinds`` (those of :data:`SCHEDULED`; others are ignored) on a target
    drawn among those it applies to (a ``slow_disk`` lasts ``slow_s`` with a delay of ``slow_ms``
    per read, both uniform). The same arguments give the same list, and a set of kinds without
    ``slow_disk`` gives the list it gave before that fault existed. The injector runs
    them in order, one at a time: one whose moment came while the previous one was still
    recovering starts late (the card records when each really ran)."""
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if not 0 < gap_s[0] <= gap_s[1] or not 0 <= stop_s[0] <= stop_s[1] \
            or not 0 <= slow_s[0] <= slow_s[1] or not 0 <= slow_ms[0] <= slow_ms[1]:
        raise ValueError(f"bad ranges: gap_s {gap_s}, stop_s {stop_s}, slow_s {slow_s}, "
                         f"slow_ms {slow_ms}")
    usable = [k for k in SCHEDULED if k in kinds]
    rng = random.Random(seed)
    out: list[Fault] = []
    at = warmup_s
    while usable and at <= duration_s - quiet_tail_s:
        kind = rng.choice(usable)
        if kind == "slow_disk":  # its own draws: the other kinds' schedules stay as they were
            out.append(Fault(round(at, 1), kind, TIERS, round(rng.uniform(*slow_s), 1),
                             float(round(rng.uniform(*slow_ms)))))
        else:
            target = "proxy" if kind == "proxy" else rng.choice(ENGINES)
            hold = round(rng.uniform(*stop_s), 1) if kind == "stop" else 0.0
            out.append(Fault(round(at, 1), kind, target, hold))
        at += rng.uniform(*gap_s)
    return out


def rolling(warmup_s: float, order: Sequence[str] = ROLLING_ORDER) -> list[Fault]:
    """A rolling upgrade: a ``drain`` (drain, remove, stop, start the successor, add) of each
    engine of ``order``, once, all due at ``warmup_s``. The injector runs them one at a time and
    each ends only when the fleet is whole again, so every step starts once the previous one's
    engine is back in rotation."""
    if warmup_s < 0 or len(set(order)) != len(order) or not set(order) <= set(ENGINES):
        raise ValueError(f"bad rolling upgrade: warmup_s {warmup_s}, order {list(order)}")
    return [Fault(round(warmup_s, 1), "drain", name) for name in order]


def rolling_order(text: str) -> tuple[str, ...]:
    """The engines of a rolling upgrade, in the order written (``"D0,D1,P0,P1"``, blanks
    allowed): each of :data:`ENGINES` exactly once; ValueError saying what is wrong otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    twice = sorted({n for n in names if names.count(n) > 1})
    missing = [n for n in ENGINES if n not in names]
    if unknown or twice or missing:
        why = "; ".join(w for w in (f"unknown {', '.join(unknown)}" if unknown else "",
                                    f"twice {', '.join(twice)}" if twice else "",
                                    f"missing {', '.join(missing)}" if missing else "") if w)
        raise ValueError(f"{text!r}: name each of {', '.join(ENGINES)} exactly once ({why})")
    return tuple(names)


def proxy_mode(connector: str, mode: str | None) -> str:
    """The soak's proxy mode: ``mode`` if given (one of :data:`PROXY_MODES`), else ``headroom``
    for kvbridge's engines (push or pull by D's load, every request a hand-off) and ``pull`` for
    vLLM's NixlConnector, the only mode it serves; ValueError for any other."""
    default = "pull" if connector == "vllm-nixl" else "headroom"
    if mode is None:
        return default
    if mode not in PROXY_MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(PROXY_MODES)}")
    if connector == "vllm-nixl" and mode != "pull":
        raise ValueError(f"--connector vllm-nixl runs in pull mode only, not {mode}")
    return mode


def code_version(start: int, old: str | None, new: str) -> str:
    """Which kvbridge the ``start``-th process of an engine runs (1: the initial fleet's, 2 and
    up: its successors'): with a rolling upgrade from an older checkout (``old``, the soak's
    ``--from-code``) the initial fleet runs ``old`` and every successor ``new``, the tree the
    soak and its proxy run; without one, ``new`` throughout."""
    if start < 1:
        raise ValueError(f"an engine's starts count from 1, got {start}")
    return old if old is not None and start == 1 else new


def code_rows(code: Mapping[str, Any]) -> list[list[str]]:
    """The card's rows on the code that ran: ``code`` is ``{"from": {...} | None, "to": {...},
    "engines": {name: [label, ...]}, "mapped": {name: [[dir, ...], ...]}}``, each version
    ``{"label", "commit", "subject", "path", "dirty"}``, each engine's labels those of its
    processes in order and ``mapped`` the checkouts each process was seen running (optional);
    no rows without a ``from`` (every engine ran the soak's own tree)."""
    old, new = code.get("from"), code["to"]
    if not old:
        return []

    def version(v: Mapping[str, Any]) -> str:
        dirty = " + uncommitted changes" if v.get("dirty") else ""
        return f"{v['commit'][:10]}{dirty} ({v.get('subject', '')[:60]}) at {v['path']}"

    commits = {v["label"]: v["commit"][:10] for v in (old, new)}
    rows = [["code before (initial fleet)", version(old)],
            ["code after (successors, proxy)", version(new)]]
    mapped = code.get("mapped") or {}
    for name, labels in code.get("engines", {}).items():
        ran = " -> ".join(commits.get(label, label) for label in labels)
        seen = " -> ".join(", ".join(dirs) or "?" for dirs in mapped.get(name, []))
        rows.append([f"  {name} ran", ran + (f" (mapped: {seen})" if seen else "")])
    return rows


@dataclass(frozen=True)
class Window:
    """A fault from the moment it was injected (``start``) until the fleet was whole again
    (``end``: the engine or proxy back in rotation), seconds on the soak's clock."""

    kind: str
    target: str
    start: float
    end: float
    note: str = ""


@dataclass
class Outcome:
    """One request: when it was sent and answered (soak clock, s), HTTP status (200, the
    error's status, or 0 when none came), ``why`` it failed (``""`` when it did not), TTFT of a
    stream (s), whether its output equals the single-engine reference (None: unchecked), and
    the request whose prompt it re-sent (``repeat_of``; None: a prompt never sent before)."""

    i: int
    stream: bool
    prompt_len: int
    max_tokens: int
    start: float
    end: float
    status: int
    why: str = ""
    ttft: float | None = None
    correct: bool | None = None
    repeat_of: int | None = None
    tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.why


_REASONS = (
    ("Connection refused", "connection refused (nothing listening)"),
    ("reported an error", "stream ended with an in-band error event"),
    ("Connection reset", "connection reset"),
    ("Remote end closed", "connection closed without a response"),
    ("timed out", "client timeout"),
    ("exceeded", "client timeout"),
    ("IncompleteRead", "response cut short"),
)


def reason(status: int, text: str) -> str:
    """A short cause for a failed request, the same for failures of one kind (numbers, ids and
    addresses are dropped) so that they can be counted."""
    for needle, short in _REASONS:
        if needle in text:
            if needle == "reported an error":
                kind = re.search(r"'type': '([^']+)'", text)
                return short + (f" ({kind.group(1)})" if kind else "")
            return short
    msg = text
    found = re.search(r'"message":\s*"([^"]{0,160})', text)
    if found:
        msg = found.group(1)
    msg = re.sub(r"https?://\S+|tcp://\S+|[0-9a-f]{8,}|\d+(\.\d+)?", "#", msg)
    msg = re.sub(r"\s+", " ", msg).strip()[:90]
    return f"HTTP {status}: {msg}" if status else msg or "unknown"


def _in_window(o: Outcome, windows: Iterable[Window], settle_s: float) -> bool:
    return any(w.start <= o.end and o.start <= w.end + settle_s for w in windows)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def card(outcomes: Sequence[Outcome], windows: Sequence[Window],
         pending: Mapping[str, int | None], *, settle_s: float = 5.0,
         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The report card: requests sent (and how many re-sent an earlier prompt), ok, failed (by
    reason, and how many while a fault was open), wrong outputs (ok but not the reference: must
    be 0), unchecked outputs, transfers still held per engine after the run (``pending``: must
    be 0; None where the engine cannot say, e.g. vLLM's own connector: listed in
    ``leaked_unmeasured``, never counted as 0 nor as a leak), the longest a failed request
    took to fail, TTFT p50/p99 of streams that overlapped a fault window (its end plus
    ``settle_s``) vs the others with the ratio of their p99s (``ttft_p99_ratio``, faults over
    quiet: the rolling upgrade's bar is 2), and the faults by kind. ``extra`` is merged in as is."""
    failed = [o for o in outcomes if not o.ok]
    ok = [o for o in outcomes if o.ok]
    faulted = [o for o in outcomes if _in_window(o, windows, settle_s)]
    quiet = [o for o in outcomes if not _in_window(o, windows, settle_s)]
    ttft_f = [o.ttft for o in faulted if o.ok and o.ttft is not None]
    ttft_q = [o.ttft for o in quiet if o.ok and o.ttft is not None]
    p99_f, p99_q = percentile(ttft_f, 99), percentile(ttft_q, 99)
    out: dict[str, Any] = {
        "sent": len(outcomes),
        "repeats": sum(1 for o in outcomes if o.repeat_of is not None),
        "ok": len(ok),
        "failed": len(failed),
        "failed_during_faults": sum(1 for o in failed if _in_window(o, windows, settle_s)),
        "failed_by_reason": dict(Counter(o.why for o in failed).most_common()),
        "wrong": sum(1 for o in ok if o.correct is False),
        "wrong_requests": [o.i for o in ok if o.correct is False],
        "unchecked": sum(1 for o in ok if o.correct is None),
        "leaked": dict(pending),
        "leaked_total": sum(v for v in pending.values() if v is not None),
        "leaked_unmeasured": [k for k, v in pending.items() if v is None],
        "longest_failure_s": round(max((o.end - o.start for o in failed), default=0.0), 2),
        "ttft_faults_ms": {"n": len(ttft_f), "p50": _ms(percentile(ttft_f, 50)),
                           "p99": _ms(p99_f)},
        "ttft_quiet_ms": {"n": len(ttft_q), "p50": _ms(percentile(ttft_q, 50)),
                          "p99": _ms(p99_q)},
        "ttft_p99_ratio": _ratio(p99_f, p99_q),
        "faults": dict(Counter(w.kind for w in windows)),
        "windows": [asdict(w) for w in windows],
    }
    out.update(extra or {})
    return out


def card_rows(c: Mapping[str, Any]) -> list[list[str]]:
    """The card as (item, value) rows for :func:`kvbridge.tools.report.print_table`."""
    def ttft(d: Mapping[str, Any]) -> str:
        return f"p50 {d['p50']} / p99 {d['p99']} ms (n={d['n']})"

    sent = str(c["sent"]) + (f" ({c['repeats']} re-sent an earlier prompt)"
                             if c.get("repeats") else "")
    rows = [["requests sent", sent], ["ok", str(c["ok"])],
            ["failed", f"{c['failed']} ({c['failed_during_faults']} while a fault was open)"]]
    rows += [[f"  failed: {why}", str(n)] for why, n in c["failed_by_reason"].items()]
    rows += [["wrong outputs (must be 0)", str(c["wrong"])],
             ["unchecked outputs", str(c["unchecked"])],
             ["blocks leaked (must be 0)", ", ".join(
                 f"{k} {'not measurable' if v is None else v}" for k, v in c["leaked"].items())],
             ["longest time to fail", f"{c['longest_failure_s']} s"],
             ["TTFT during faults", ttft(c["ttft_faults_ms"])],
             ["TTFT quiet", ttft(c["ttft_quiet_ms"])],
             ["TTFT p99 faults / quiet", str(c.get("ttft_p99_ratio"))],
             ["faults injected", ", ".join(f"{k} {v}" for k, v in c["faults"].items()) or "none"]]
    if c.get("proxy_mode"):
        rows.append(["proxy mode", str(c["proxy_mode"])])
    if c.get("order"):
        rows.append(["rolling order", ", ".join(c["order"])])
    if c.get("code"):
        rows += code_rows(c["code"])
    return rows

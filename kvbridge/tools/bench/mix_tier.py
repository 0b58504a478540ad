"""``kvbridge bench mix --disk-tier``: a slow tier injected mid-run, and how the planner followed.

Contract (pure: no I/O, no clock):

- :class:`SlowTier` is the schedule of ``--slow-tier-at N --slow-tier-ms MS --slow-tier-for M``:
  before request ``N`` of the trace is sent the tier's read delay becomes ``MS``, before request
  ``N + M`` it is 0 again (:meth:`SlowTier.delay_before`: the value to write before a request,
  None when nothing changes); :meth:`SlowTier.slow` says whether a request was sent while the
  delay was on. Bad values raise :class:`~kvbridge.errors.ConfigError` naming the flag.
- :func:`choice_of` reduces an ``X-KVBridge-Plan`` header to the path a request took and
  whether D's tiers were left out (``push tiers-off``); :func:`reads_tier` says whether that
  choice reads D's tier (D alone, or a hand-off with D's tiers on).
- :func:`flips` reads one policy's request records (``index``, ``klass``, ``plan``, ``ok``,
  ``ttft_s``) for the tier's class: each such request's choice around the injection, the
  requests (of the class, and of the whole trace) from ``N`` to the first one of the class that
  no longer reads the tier (``flip_after``), and from ``N + M`` to the first one that reads it
  again (``back_after``); None where it never happened. :func:`format_flips` prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError

__all__ = ["SlowTier", "choice_of", "disk_tier_offload", "flips", "format_flips",
           "kv_events_config", "reads_tier"]

MAX_SLOW_MS = 60_000.0
"""The largest delay the ``slow_disk`` tier accepts (its ``MAX_DELAY_MS``)."""


@dataclass(frozen=True)
class SlowTier:
    """The read delay ``ms`` is on for requests ``at`` .. ``at + count - 1`` of the trace."""

    at: int
    ms: float
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.at, bool) or not isinstance(self.at, int) or self.at < 0:
            raise ConfigError(f"--slow-tier-at must be a request index >= 0, got {self.at!r}")
        if not 0 < self.ms <= MAX_SLOW_MS:  # also refuses nan
            raise ConfigError(f"--slow-tier-ms must be in (0, {MAX_SLOW_MS:g}], got {self.ms!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ConfigError(f"--slow-tier-for must be a number of requests >= 1, got "
                              f"{self.count!r}")

    @property
    def end(self) -> int:
        """The first request sent after the delay is off again."""
        return self.at + self.count

    def delay_before(self, index: int) -> float | None:
        """The delay (ms) to put in force before request ``index`` is sent; None: no change."""
        if index == self.at:
            return self.ms
        if index == self.end:
            return 0.0
        return None

    def slow(self, index: int) -> bool:
        return self.at <= index < self.end


def choice_of(plan: str | None) -> str | None:
    """``path=push; ...; tiers=off; why=fastest`` → ``"push tiers-off"``; ``path=local`` →
    ``"local"``; None without a path."""
    parts: dict[str, str] = {}
    for part in (plan or "").split(";"):
        key, sep, val = part.partition("=")
        if sep:
            parts[key.strip().lower()] = val.strip()
    path = parts.get("path")
    if not path:
        return None
    return f"{path} tiers-off" if parts.get("tiers") == "off" else path


def reads_tier(choice: str | None) -> bool | None:
    """Whether a request so served reads D's tier: D alone or a hand-off with D's tiers on
    (True), a hand-off with them off (False); None when not known."""
    if choice is None:
        return None
    return not choice.endswith("tiers-off")


def flips(records: Iterable[Mapping[str, Any]], slow: SlowTier, klass: str = "disk"
          ) -> dict[str, Any]:
    """How the tier class's choices followed the injection (module docstring)."""
    ordered = sorted(records, key=lambda r: int(r["index"]))
    rows: list[dict[str, Any]] = []
    for r in ordered:
        if r.get("klass") != klass:
            continue
        choice = choice_of(r.get("plan"))
        rows.append({"index": int(r["index"]), "slow": slow.slow(int(r["index"])),
                     "choice": choice, "reads_tier": reads_tier(choice),
                     "why": _why(r.get("plan")), "ok": bool(r.get("ok")),
                     "ttft_ms": None if r.get("ttft_s") is None
                     else round(float(r["ttft_s"]) * 1000.0, 1)})

    def first(start: int, reading: bool) -> dict[str, int] | None:
        seen = 0
        for row in rows:
            if row["index"] < start:
                continue
            seen += 1
            if row["reads_tier"] is reading:
                return {"class_requests": seen, "requests": row["index"] - start + 1,
                        "index": row["index"]}
        return None

    before = [r["reads_tier"] for r in rows if r["index"] < slow.at]
    during = [r["reads_tier"] for r in rows if r["slow"]]
    after = [r["reads_tier"] for r in rows if r["index"] >= slow.end]
    return {"class": klass, "at": slow.at, "ms": slow.ms, "for": slow.count,
            "reads_tier_before": _share(before), "reads_tier_during": _share(during),
            "reads_tier_after": _share(after),
            "flip_after": first(slow.at, False), "back_after": first(slow.end, True),
            "requests": rows}


def _why(plan: str | None) -> str | None:
    for part in (plan or "").split(";"):
        key, sep, val = part.partition("=")
        if sep and key.strip().lower() == "why":
            return val.strip()
    return None


def _share(values: list[bool | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{sum(known)}/{len(known)}" if known else "-"


def format_flips(summary: Mapping[str, Any], policy: str = "auto", window: int = 0) -> str:
    """A few lines: the flip counts, then the class's requests (index, slow or not, choice,
    why, TTFT); ``window`` > 0 keeps only those within that many trace requests of the
    injection's start and end."""
    at, end = summary["at"], summary["at"] + summary["for"]

    def said(key: str, what: str) -> str:
        v = summary[key]
        if v is None:
            return f"never {what}"
        return (f"{what} at request {v['index']}: {v['class_requests']} {summary['class']} "
                f"request(s), {v['requests']} request(s) of the trace")

    lines = [f"{policy}: {summary['class']} tier slowed by {summary['ms']:g} ms for requests "
             f"{at}..{end - 1}; reads the tier before {summary['reads_tier_before']}, during "
             f"{summary['reads_tier_during']}, after {summary['reads_tier_after']}",
             "  " + said("flip_after", "flipped off the tier"),
             "  " + said("back_after", "back on the tier")]
    for r in summary["requests"]:
        if window and not (at - window <= r["index"] < at + window
                           or end - window <= r["index"] < end + window):
            continue
        ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.0f} ms"
        lines.append(f"  #{r['index']:<4} {'SLOW' if r['slow'] else 'fast'}  "
                     f"{r['choice'] or '-':<16} {r['why'] or '-':<10} TTFT {ttft}"
                     f"{'' if r['ok'] else '  FAILED'}")
    return "\n".join(lines)


def disk_tier_offload(path: str, delay_file: str, capacity: str = "256MiB") -> dict[str, Any]:
    """D's ``offload`` setting under ``--disk-tier``: one ``slow_disk`` tier (a disk tier whose
    reads sleep for the delay in ``delay_file``), so every block D stores lands on the disk
    and a prefix dropped from vLLM's own cache can only come back from there."""
    return {"tiers": [{"name": "slow_disk", "path": path, "capacity_bytes": capacity,
                       "delay_file": delay_file}]}


def kv_events_config(port: int) -> dict[str, Any]:
    """An engine's ``--kv-events-config`` under ``--disk-tier``: vLLM's ZeroMQ publisher on a
    port of its own, so the proxy (``--kv-events``) learns which blocks D holds on disk."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{port}", "topic": "kv"}

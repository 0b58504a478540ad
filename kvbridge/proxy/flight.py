"""The proxy's flight recorder, and the join of one request's records into its critical path.

:class:`FlightLog` keeps one :class:`Flight` per client request, keyed by the proxy's request id
(the client's ``X-Request-Id`` when it is a safe one, see :func:`safe_request_id`, else
``kvb-<uuid>``; the proxy returns it in its answer's ``X-Request-Id`` header). A flight holds
the request's mode, its last attempt's ``transfer_id`` and engines, and the proxy's own steps:
``receive``, ``prefill_sent``, ``prefill_answer``, ``decode_sent``, ``first_token`` — each one
``time.monotonic_ns()`` (plus one ``time.time_ns()`` anchor per flight). A retry starts the
attempt's steps again (``retries`` counts them). Where the kernel says the request's bytes
waited in the proxy's socket before its handler ran (:mod:`kvbridge.proxy.arrival`, a lower
bound), the flight also holds ``arrived`` (``receive`` less that wait), and the request's path
starts there.

:func:`critical_path` joins a flight with the engines' records of its ``transfer_id``
(:mod:`kvbridge.scheduling.recorder`, wall-clock seconds from each engine's own anchor) into a
chain of phases. A phase between two steps of one process is a difference on that process's
monotonic clock; a phase from one process to the next (``hop``: HTTP, tokenization, a
notification) is a difference of two wall clocks and carries their disagreement. The chain
telescopes: the phases always sum to the proxy's own ``arrived`` (else ``receive``) →
``first_token``, whatever the clocks say; only how that time is split between the hops and
their neighbours depends on the hosts' clocks agreeing (on one host they do).

Bounded: :data:`CAPACITY` flights (the oldest is evicted). Not thread-safe: the proxy's one event
loop owns the log. Pure Python, no aiohttp.
"""

from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CAPACITY", "Flight", "FlightLog", "critical_path", "safe_request_id", "PROXY_STEPS"]

CAPACITY = 4096
PROXY_STEPS = ("arrived", "receive", "prefill_sent", "prefill_answer", "decode_sent", "first_token")
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def safe_request_id(value: str | None) -> str | None:
    """``value`` if it can key a flight and be echoed in a header (1–128 characters of
    ``[A-Za-z0-9._:@-]``, starting alphanumeric), else None."""
    if isinstance(value, str) and _SAFE_ID.fullmatch(value):
        return value
    return None


@dataclass
class Flight:
    """One client request as the proxy saw it (see the module docstring)."""

    rid: str
    wall0: int = field(default_factory=time.time_ns)
    mono0: int = field(default_factory=time.monotonic_ns)
    mode: str = "none"
    tid: str = ""
    prefill: str = ""
    decode: str = ""
    retries: int = -1
    outcome: str = ""
    steps: dict[str, int] = field(default_factory=dict)
    #: False: the request asked the engines to keep no record (``X-KVBridge-Record: 0``; the
    #: proxy still keeps these steps, which the planner learns from)
    engines_record: bool = True

    def __post_init__(self) -> None:
        self.steps["receive"] = self.mono0

    def waited(self, ns: int | None) -> None:
        """The request's bytes had been in the proxy's socket at least ``ns`` when its handler
        ran (``receive``): record ``arrived`` that much earlier (nothing for None or 0)."""
        if ns is not None and ns > 0:
            self.steps["arrived"] = self.steps["receive"] - ns

    def began_ns(self) -> int:
        """Wall-clock ns of the request's first point: ``arrived``, else ``receive``."""
        return self.wall0 + self.steps.get("arrived", self.mono0) - self.mono0

    def attempt(self, mode: str, tid: str, prefill: str, decode: str = "") -> None:
        """A dispatch starts (the first or a retry): its steps replace the last one's."""
        self.mode, self.tid, self.prefill, self.decode = mode, tid, prefill, decode
        self.retries += 1
        self.steps = {s: t for s, t in self.steps.items() if s in ("arrived", "receive")}

    def mark(self, step: str) -> None:
        """The proxy did ``step`` now (the first mark of a step in an attempt wins)."""
        self.steps.setdefault(step, time.monotonic_ns())

    def wall(self) -> dict[str, float]:
        """The steps as wall-clock seconds (the anchor plus the monotonic offset)."""
        return {s: (self.wall0 + t - self.mono0) / 1e9 for s, t in self.steps.items()}

    def row(self) -> dict[str, Any]:
        return {"request_id": self.rid, "mode": self.mode, "transfer_id": self.tid,
                "prefill": self.prefill, "decode": self.decode, "retries": max(0, self.retries),
                "outcome": self.outcome, "proxy": self.wall()}


class FlightLog:
    """The last :data:`CAPACITY` flights by request id (a request id used again replaces the
    older flight)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._flights: collections.OrderedDict[str, Flight] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._flights)

    def add(self, flight: Flight) -> None:
        self._flights.pop(flight.rid, None)
        self._flights[flight.rid] = flight
        while len(self._flights) > self.capacity:
            self._flights.popitem(last=False)

    def get(self, rid: str) -> Flight | None:
        return self._flights.get(rid)


# (process, step) points of each mode's critical path, in order; the phase between two
# consecutive points present is named after its end point (and, for a hop, both).
_PUSH = (("proxy", "arrived"), ("proxy", "receive"), ("proxy", "prefill_sent"),
         ("P", "arrived"), ("P", "scheduled"),
         ("P", "kv_ready"), ("P", "write_posted"), ("P", "write_done"), ("D", "recv_done"),
         ("D", "recv_seen"), ("D", "first_step"), ("proxy", "first_token"))
_PULL = (("proxy", "arrived"), ("proxy", "receive"), ("proxy", "prefill_sent"),
         ("P", "arrived"), ("P", "scheduled"),
         ("P", "kv_ready"), ("proxy", "prefill_answer"), ("proxy", "decode_sent"),
         ("D", "arrived"), ("D", "scheduled"), ("D", "recv_start"), ("D", "read_posted"),
         ("D", "recv_done"), ("D", "recv_seen"), ("D", "first_step"), ("proxy", "first_token"))
_NAMES = {
    ("proxy", "receive"): "in the proxy's socket (before its handler ran)",
    ("proxy", "prefill_sent"): "proxy: receive → prefill leg sent",
    ("P", "arrived"): "proxy → P (HTTP, tokenize)",
    ("P", "scheduled"): "P queue wait",
    ("P", "kv_ready"): "P prefill",
    ("P", "write_posted"): "KV ready → WRITE posted",
    ("P", "write_done"): "wire (WRITE)",
    ("D", "recv_done"): "P → D (DONE notification)",
    ("proxy", "prefill_answer"): "P → proxy (prefill answer)",
    ("proxy", "decode_sent"): "proxy: pick D, decode leg sent",
    ("D", "arrived"): "proxy → D (HTTP, tokenize)",
    ("D", "scheduled"): "D admission wait (queue, KV allocation)",
    ("D", "recv_start"): "D receive planned",
    ("D", "read_posted"): "claim, READ posted",
    ("D", "recv_seen"): "D notified",
    ("D", "first_step"): "D scheduler → first step",
    ("proxy", "first_token"): "D first step → first token out",
}


def critical_path(mode: str, proxy: dict[str, float], p: dict[str, float] | None,
                  d: dict[str, float] | None) -> list[dict[str, Any]]:
    """The phases of one request: ``[{"phase", "from", "to", "seconds", "hop"}, …]`` from the
    proxy's, P's and D's wall-clock steps (see the module docstring). Points a process did not
    record are skipped (the phase spans to the next one present); without ``receive`` and
    ``first_token`` of the proxy the path is empty. It starts at the proxy's ``arrived``
    where the flight has one (the request waited in the proxy's socket)."""
    if "receive" not in proxy or "first_token" not in proxy:
        return []
    sides = {"proxy": proxy, "P": p or {}, "D": d or {}}
    chain = _PUSH if mode == "push" else _PULL
    points = [(i, side, step, sides[side][step]) for i, (side, step) in enumerate(chain)
              if step in sides[side]]
    out: list[dict[str, Any]] = []
    for (i0, s0, e0, t0), (i1, s1, e1, t1) in zip(points, points[1:], strict=False):
        if i1 != i0 + 1:  # a step in between was not recorded
            name = f"{s0}.{e0} → {s1}.{e1}"
        elif (s1, e1) == ("D", "recv_done") and s0 == "D":
            name = "wire (READ)"
        else:
            name = _NAMES[(s1, e1)]
        out.append({"phase": name, "from": f"{s0}.{e0}", "to": f"{s1}.{e1}",
                    "seconds": t1 - t0, "hop": s0 != s1})
    return out

"""Hand-off numbers from the engines' per-transfer timings (``StatsReply.timings``).

A KVBridgeConnector rank records, per transfer id, the wall-clock time of each step it saw
(P: ``kv_ready``, ``ready_seen``, ``write_posted``, ``write_done``; D: ``recv_done``,
``recv_seen``, ``first_step``). Contract: pure functions of those two mappings (P's and D's,
same host, so one clock) and a list of transfer ids; a transfer missing a step is left out of
what needs that step, never an error. Shared by ``kvbridge bench e2e``, ``handoff`` and
``serve``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

__all__ = ["HANDOFF_BAR_MS", "Timings", "beyond_wire", "handoff_breakdown", "handoff_times",
           "prefill_time", "request_steps"]

Timings = Mapping[str, Mapping[str, float]]


def handoff_times(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str]) -> list[
        float]:
    """``D.first_step - P.kv_ready`` (seconds) for every transfer id both sides recorded."""
    out: list[float] = []
    for tid in transfer_ids:
        p = p_timings.get(tid) or {}
        d = d_timings.get(tid) or {}
        if "kv_ready" in p and "first_step" in d:
            out.append(d["first_step"] - p["kv_ready"])
    return out


def prefill_time(p_timings: Timings, transfer_id: str) -> float | None:
    """P's prefill of one transfer, ``P.kv_ready - P.scheduled`` (seconds), or None where P
    did not record both: the part of the TTFT that is the prefill engine's own speed."""
    p = p_timings.get(transfer_id) or {}
    if "scheduled" in p and "kv_ready" in p:
        return p["kv_ready"] - p["scheduled"]
    return None


#: Consecutive steps of a request, in the order they happen, with who records each (C: the
#: benchmark's client: dispatch, and the first token's arrival).
_STEPS: tuple[tuple[str, str], ...] = (
    ("C", "dispatch"), ("P", "kv_ready"), ("P", "ready_seen"), ("P", "write_posted"),
    ("P", "write_done"), ("D", "recv_done"), ("D", "recv_seen"), ("D", "first_step"),
    ("C", "first_token"),
)
"""P: ``kv_ready`` the forward wrote the KV, ``ready_seen`` the transfer loop took it,
``write_posted`` / ``write_done`` the WRITE (push); D: ``recv_done`` the transfer loop has the
KV, ``recv_seen`` vLLM's scheduler learned it, ``first_step`` the request was scheduled."""

HANDOFF_BAR_MS = 2.0
"""The hand-off issue's bar: push hand-off minus wire time, p50, sequential."""


def beyond_wire(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str]) -> list[
        float]:
    """Push hand-off minus its wire time, per transfer: ``(D.first_step - P.kv_ready) -
    (P.write_done - P.write_posted)`` (seconds), for transfers that recorded all four: the
    part of the hand-off that is waiting and bookkeeping, not moving bytes."""
    out: list[float] = []
    for tid in transfer_ids:
        p = p_timings.get(tid) or {}
        d = d_timings.get(tid) or {}
        if all(k in p for k in ("kv_ready", "write_posted", "write_done")) and "first_step" in d:
            out.append((d["first_step"] - p["kv_ready"]) - (p["write_done"] - p["write_posted"]))
    return out


def handoff_breakdown(p_timings: Timings, d_timings: Timings, transfer_ids: Sequence[str],
                      client: Timings | None = None) -> dict[str, float]:
    """Median seconds between consecutive recorded steps, e.g. ``kv_ready->recv_done``.

    Steps a transfer did not record (pull has no write_*) are skipped, so a pull gives
    ``kv_ready->recv_done`` and ``recv_done->first_step``; a push also splits the WRITE.
    *client* adds the client's ``dispatch`` and ``first_token`` (wall clock) per transfer id,
    so the steps add up to the TTFT.
    """
    gaps: dict[str, list[float]] = {}
    for tid in transfer_ids:
        sides = {"P": p_timings.get(tid) or {}, "D": d_timings.get(tid) or {},
                 "C": (client or {}).get(tid) or {}}
        seen = [(ev, sides[side][ev]) for side, ev in _STEPS if ev in sides[side]]
        for (a, ta), (b, tb) in zip(seen, seen[1:], strict=False):
            gaps.setdefault(f"{a}->{b}", []).append(tb - ta)
    return {k: statistics.median(v) for k, v in gaps.items()}


def request_steps(p_timings: Timings, d_timings: Timings, transfer_id: str,
                  t0_wall: float) -> dict[str, float]:
    """One transfer's engine events as seconds after dispatch, keyed ``P.kv_ready`` etc."""
    out: dict[str, float] = {}
    for side, timings in (("P", p_timings), ("D", d_timings)):
        for event, t in (timings.get(transfer_id) or {}).items():
            out[f"{side}.{event}"] = t - t0_wall
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


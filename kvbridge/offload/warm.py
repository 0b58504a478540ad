"""Warm successors: on drain, an engine writes its hot chunks where its successor finds them.

What a draining engine holds that outlives it: the chunks already in its *lasting* tiers (the
blocking ones: ``disk``, a remote store — a shared disk or Mooncake Store is what a successor
reads). What dies with it: its *local* tiers (the non-blocking ones: ``dram``), the write-behind
backlog not yet written, and every store that skipped a lasting tier because the backlog was
full (``offload_backlog_full_<tier>``) or because the tier is ``drain_only``. All of those are in
a local tier (a store puts a request's chunks into every non-blocking tier first), so "write its
hot prefixes out" means here: :func:`write_out` copies the local tiers' chunks, most recently
used first, into each lasting tier that lacks them. A prompt's chain is held head-last
(:func:`kvbridge.offload.index.hold`), so most-recent-first writes a chain's head before its
tail: a budget that runs out leaves whole usable prefixes, not tails without heads.

What it does not write: vLLM's own prefix cache (blocks of finished requests were already copied
into the local tiers by the store; the rest are running requests' blocks, which finish — and are
stored — before the engine exits), and chunks a local tier evicted.

Bounds: at most ``budget_bytes`` per lasting tier, at most ``budget_s`` in all (checked between
batches of :data:`BATCH` chunks), and never past a managed tier's free room: the write-out does
not evict (a chunk hot in ``dram`` may be cold in the tier's own LRU order, its copy there never
touched by a ``dram`` hit, so evicting by that order could drop what is being written out;
and on a shared disk the oldest chunks may be another engine's). A tier that evicts on its own
(unmanaged: a remote store) is written up to the budget.

Partial failure: a lasting tier that raises or stores fewer chunks than asked is counted
(``offload_drain_failed_<tier>``), logged, and not written again by this write-out; the others
go on and the write-out completes. Counters: ``offload_drain_written_blocks_<tier>`` (chunks
written; their sum, without the suffix, is the series
``vllm:kvbridge_offload_drain_written_blocks_total``), ``offload_drain_present_blocks_<tier>``
(already there), ``offload_drain_failed_<tier>``, ``offload_drain_timeouts``.

Blocking: :func:`write_out` calls the lasting tiers (disk and network I/O) and returns when done
or out of budget; the manager runs it on its write-behind thread (a control-channel drain) or on
the closing thread (:meth:`~kvbridge.offload.manager.OffloadManager.close`). Thread safety: it
reads the manager's indexes under the manager's lock and calls tiers through the manager's
``_call`` (the per-tier lock), so it may run while the engine still serves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvbridge.offload.blocks import BlockIO
from kvbridge.offload.index import TierIndex
from kvbridge.offload.tier import Tier

__all__ = ["BATCH", "Owner", "WriteOutReport", "write_out", "hot_keys"]

log = logging.getLogger("kvbridge.offload")

#: chunks written per tier call (the time budget is checked between batches)
BATCH = 16


class Owner(Protocol):
    """What a write-out uses of :class:`kvbridge.offload.manager.OffloadManager` (its tiers,
    their indexes under its lock, its guarded tier calls and stores, its counters)."""

    tiers: list[Tier]
    io: BlockIO
    chunk_size: int  # one chunk as the tiers hold it (sealed or not)
    _lock: threading.Lock
    _index: dict[str, TierIndex]
    _known: dict[str, TierIndex]

    def _call(self, tier: Tier, method: str, arg: Any) -> Any: ...

    def _put(self, tier: Tier, items: list[tuple[str, bytes]],
             hashes: Sequence[bytes | None] | None = None) -> tuple[int, int]: ...

    def _count(self, key: str, n: int) -> None: ...


@dataclass
class WriteOutReport:
    """What one write-out did, per lasting tier."""

    written: dict[str, int] = field(default_factory=dict)
    present: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    timed_out: bool = False


def hot_keys(mgr: Owner) -> list[tuple[str, Tier, bytes | None]]:
    """``(key, local tier, block hash)`` of every chunk in the local tiers, most recently used
    first, each key once (the fastest tier that holds it)."""
    out: list[tuple[str, Tier, bytes | None]] = []
    seen: set[str] = set()
    with mgr._lock:
        for tier in mgr.tiers:
            index = mgr._index.get(tier.name)
            if tier.blocking or index is None:
                continue
            for key, block_hash in reversed(list(index.items())):
                if key not in seen:
                    seen.add(key)
                    out.append((key, tier, block_hash))
    return out


def write_out(mgr: Owner, budget_bytes: int, budget_s: float, *,
              clock: Callable[[], float] = time.monotonic) -> WriteOutReport:
    """Copy the local tiers' most recently used chunks into each lasting tier that lacks them,
    within the budgets (see the module docstring). Never raises on a tier's account."""
    report = WriteOutReport()
    deadline = clock() + budget_s
    targets = [t for t in mgr.tiers if t.blocking]
    if not targets or budget_bytes <= 0:
        return report
    hot = hot_keys(mgr)
    size = mgr.chunk_size
    for target in targets:
        room = budget_bytes // size
        index = mgr._index.get(target.name)
        if index is not None:
            with mgr._lock:
                room = min(room, index.free)
        for i in range(0, len(hot), BATCH):
            if room <= 0:
                break
            if clock() >= deadline:
                report.timed_out = True
                break
            batch = hot[i:i + BATCH]
            missing = _missing(mgr, target, [k for k, _, _ in batch])
            report.present[target.name] = (report.present.get(target.name, 0)
                                           + len(batch) - len(missing))
            items: list[tuple[str, bytes]] = []
            hashes: list[bytes | None] = []
            for key, source, block_hash in batch:
                if key not in missing or len(items) >= room:
                    continue
                chunk = mgr._call(source, "load", [key]) or []
                if chunk:  # gone from the local tier meanwhile: nothing to write
                    items.append((key, chunk[0]))
                    hashes.append(block_hash)
            if not items:
                continue
            todo, stored = mgr._put(target, items, hashes)
            room -= len(items)
            report.written[target.name] = report.written.get(target.name, 0) + stored
            if stored < todo:
                report.failed[target.name] = todo - stored
                log.warning("drain write-out: tier %s stored %d of %d chunk(s); not writing "
                            "to it any more", target.name, stored, todo)
                break
        if report.timed_out:
            break
    _count(mgr, report)
    log.info("drain write-out: %s%s", ", ".join(
        f"{n}: {report.written.get(n, 0)} written, {report.present.get(n, 0)} present"
        for n in (t.name for t in targets)) or "nothing", " (out of time)"
        if report.timed_out else "")
    return report


def _missing(mgr: Owner, target: Tier, keys: list[str]) -> set[str]:
    """Which of ``keys`` the manager does not know ``target`` to hold."""
    index = mgr._index.get(target.name)
    known = mgr._known.get(target.name)
    with mgr._lock:
        book = index if index is not None else known
        return {k for k in keys if book is None or k not in book}


def _count(mgr: Owner, report: WriteOutReport) -> None:
    for name, n in report.written.items():
        mgr._count(f"offload_drain_written_blocks_{name}", n)
        mgr._count("offload_drain_written_blocks", n)  # all tiers: a vllm:kvbridge_* series
    for name, n in report.present.items():
        mgr._count(f"offload_drain_present_blocks_{name}", n)
    for name, n in report.failed.items():
        mgr._count(f"offload_drain_failed_{name}", n)
    if report.timed_out:
        mgr._count("offload_drain_timeouts", 1)

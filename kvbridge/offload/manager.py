"""The worker side of offload: one engine rank's tiers, their capacities, staging, write-behind.

:class:`OffloadManager` owns the rank's tiers (in configured order, fastest first) and applies
the scheduler's :class:`~kvbridge.offload.orders.OffloadPlan`:

- **Lookup** — find the longest prefix of a request's block keys across the tiers (a prefix may
  come from several tiers: block 0–3 from DRAM, 4–9 from disk), *load and verify* it into host
  memory (staging), and answer how many blocks are staged. Non-blocking tiers (DRAM) are asked
  on the engine thread, so a DRAM hit is answered in the same step; anything slower runs on the
  manager's I/O thread and is answered in a later step (the engine is woken). A chunk a tier
  cannot return (corrupted, truncated, gone) ends the prefix there: the scheduler is told fewer
  blocks and vLLM computes the rest. So a failed tier load is *recomputed*, never served wrong,
  whatever vLLM's ``kv_load_failure_policy``; it is counted (``offload_load_failed``) and logged.
- **Load** — copy staged chunks into the request's blocks (before the step's forward; memory to
  memory, cannot fail on a tier's account).
- **Store** — copy a finished request's full prompt blocks out of the KV cache (on the I/O
  thread, off the critical path; the scheduler holds the blocks until then), put them in every
  non-blocking tier at once and send them down the write-behind FIFO pipe
  (:func:`~kvbridge.transports.pipe.memory_pipe`) to the blocking tiers, written by a second
  thread in order, the backlog bounded by ``max_backlog_bytes`` (past it a store skips that tier
  and is counted, ``offload_backlog_full_<tier>``; the engine never waits on a slow tier).
- **Capacity** — for tiers with ``managed = True`` an index per tier, a
  :class:`~kvbridge.lookup.LookupBuffer` of content keys (:func:`tier_index`: no leases, least
  recently used evicted when full); adding past ``capacity_bytes`` evicts least recently used
  chunks (a prompt's blocks are touched last to first, so a chain is evicted from its tail and
  its head — the useful part — lives longest).
  Persistent tiers' indexes are rebuilt from ``entries()`` at start. A hit in a lower tier is
  promoted into the non-blocking tiers above it.

Thread safety: public methods are called from the worker's model-runner thread; the two I/O
threads (each draining one FIFO pipe of jobs: lookups and copies out; write-behind) share the
indexes and staging under one lock, and a blocking tier is called by one thread at a time (a
lock per tier). Tier exceptions are caught, logged with the tier's name and counted; they never
reach vLLM. After :meth:`close`, a job is run on the caller's thread (nothing is dropped).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import PipeClosed
from kvbridge.lookup import BufferFull, LookupBuffer, LookupMiss
from kvbridge.offload import warm
from kvbridge.offload.blocks import BlockIO, Payload
from kvbridge.offload.build import build_tiers
from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.events import TierEvent, TierEvents
from kvbridge.offload.index import KNOWN_KEYS, TierIndex, hold, tier_index
from kvbridge.offload.keys import tier_key
from kvbridge.offload.layerwise import LayerFeed
from kvbridge.offload.orders import LoadOrder, LookupOrder, OffloadPlan, StoreOrder
from kvbridge.offload.seal import open_prefix, seal, sealed_size
from kvbridge.offload.tier import Tier
from kvbridge.transports.pipe import MemoryRecvHalf, MemorySendHalf, memory_pipe

__all__ = ["OffloadManager", "build_tiers", "staging_buffer"]

log = logging.getLogger("kvbridge.offload")


@dataclass(frozen=True)
class _Job:
    """One job down an I/O thread's pipe."""

    run: Callable[[], None]


#: staged chunks the scheduler never claimed are dropped after this long
STAGE_TTL_S = 120.0
#: lookups one rank holds at once; beyond, a lookup is answered "no hit" at once
MAX_LOOKUPS = 1 << 16


def staging_buffer(capacity: int = MAX_LOOKUPS, *,
                   clock: Callable[[], float] = time.monotonic) -> LookupBuffer[str, _Lookup]:
    """One rank's lookups: lookup id → the chunks staged for it, under a lease of
    :data:`STAGE_TTL_S` (given at insert); full is full (a lookup is answered "no hit")."""
    return LookupBuffer("offload lookups", capacity, clock=clock)


class _Lookup:
    def __init__(self, order: LookupOrder, tkeys: list[str]) -> None:
        self.order = order
        self.tkeys = tkeys
        self.chunks: list[Payload] = []
        self.done = False
        self.released = False


class OffloadManager:
    """See the module docstring."""

    def __init__(self, config: OffloadConfig, tiers: Sequence[Tier], io: BlockIO, *,
                 layout_fingerprint: str, rank: int = 0, tp_size: int = 1,
                 events: bool = False) -> None:
        self.config = config
        self.tiers = list(tiers)
        self.io = io
        self.chunk_size = sealed_size(io.chunk_bytes, config.sealed)  #: as the tiers hold one
        self.rank = rank
        self.tp_size = tp_size
        self._fp = layout_fingerprint
        self._lock = threading.Lock()
        self._tier_locks = {t.name: threading.Lock() for t in self.tiers}
        #: the tiers' KV-events stream (rank 0 only; kvbridge.offload.events)
        self.events = TierEvents(events and rank == 0, on_drop=functools.partial(
            self._count, "offload_kv_events_dropped"))
        self._index: dict[str, TierIndex] = {
            t.name: tier_index(t.name, t.capacity_bytes // self.chunk_size)
            for t in self.tiers if t.managed}
        #: keys stored into each unmanaged tier, remembered (boundedly) to skip re-storing
        self._known: dict[str, TierIndex] = {
            t.name: tier_index(f"{t.name} (stored)", KNOWN_KEYS)
            for t in self.tiers if not t.managed}
        #: lookup id → its staged chunks, for STAGE_TTL_S (a LookupBuffer home)
        self._lookups: LookupBuffer[str, _Lookup] = staging_buffer()
        self._answers: dict[str, int] = {}
        self._stored: set[str] = set()
        self._staged_bytes = 0
        self._backlog_bytes = 0
        self.counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        self._sink: Callable[[dict[str, int]], None] | None = None
        self._progress: Callable[[], None] = lambda: None
        self._closed = False
        self._draining = False  # a drain was announced: drain-only tiers are written too
        self._drain_only = {t.name for t in self.tiers if config.drain_only(t.name)}
        self._feed: LayerFeed | None = None  # this step's layer-wise load (model-runner thread)
        for t in self.tiers:
            if t.managed:
                self._rebuild(t)
        #: two FIFO pipes of jobs, each drained by its own thread: lookups and copies out
        #: (``io``), and the blocking tiers' write-behind (``writer``)
        self._fast, fast_rx = memory_pipe(sender="offload-io", kind=_Job)
        self._slow, slow_rx = memory_pipe(sender="write-behind", kind=_Job)
        self._threads = [threading.Thread(target=self._worker, args=(rx,), daemon=True,
                                          name=f"kvbridge-offload-{name}-{rank}")
                         for rx, name in ((fast_rx, "io"), (slow_rx, "writer"))]
        for th in self._threads:
            th.start()
        log.info("offload rank %d/%d: tiers %s; chunk %d bytes", rank, tp_size,
                 "; ".join(t.describe() for t in self.tiers), io.chunk_bytes)

    # -- set-up ------------------------------------------------------------------------------

    def count_into(self, sink: Callable[[dict[str, int]], None]) -> None:
        """Deliver counters to ``sink`` (thread-safe, e.g. the loop's ``add_counters``) after
        every job, so they are current even while the engine is idle."""
        self._sink = sink

    def _count(self, key: str, n: int) -> None:
        with self._counter_lock:
            self.counters[key] += n

    def _flush_counters(self) -> None:
        if self._sink is None:
            return
        counters = self.take_counters()
        if counters:
            self._sink(counters)

    def on_progress(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs (on an I/O thread) when an answer or a finished store is ready."""
        self._progress = callback

    def _rebuild(self, tier: Tier) -> None:
        try:
            entries = tier.entries()
        except Exception as exc:  # noqa: BLE001 - a tier bug must not stop the engine
            log.warning("offload tier %s: cannot list its chunks (%s); starting empty",
                        tier.name, exc)
            return
        if not entries:
            return
        index = self._index[tier.name]
        evicted: list[str] = []
        for key, _ in entries:  # oldest first: the newest end up most recently used
            evicted.extend(k for k, _ in hold(index, [key]))
        if evicted:
            self._call(tier, "evict", evicted)
        log.info("offload tier %s: %d chunk(s) from a previous run (%d evicted to fit)",
                 tier.name, len(index), len(evicted))

    def tkeys(self, keys: Sequence[str]) -> list[str]:
        return [tier_key(k, self._fp, self.rank, self.tp_size) for k in keys]

    # -- the plan (model-runner thread) -------------------------------------------------------

    def apply(self, plan: OffloadPlan) -> set[int]:
        """Apply one step's plan; return block ids whose load could not be done (load errors).

        Loads are copied into their blocks here, or, with ``layerwise_load``, by a
        :class:`~kvbridge.offload.layerwise.LayerFeed` while the forward runs (call
        :meth:`wait_layer` per layer and :meth:`finish_loads` after the forward)."""
        bad = self.finish_loads()  # a feed never outlives its step
        for lid in plan.releases:
            self.release(lid)
        for order in plan.lookups:
            self.lookup(order)
        feed: list[tuple[list[int], list[Payload]]] = []
        for load in plan.loads:
            chunks = self._claim(load)
            if chunks is None:
                bad.update(load.block_ids)
            elif self.config.layerwise_load:
                feed.append((self.io.check(load.block_ids, chunks), chunks))
            else:
                self.io.write(load.block_ids, chunks)
            if chunks is not None:
                self._count("offload_loaded_blocks", len(load.block_ids))
        if feed:
            self._feed = LayerFeed(self.io, feed)
            self._feed.start()
        for store in plan.stores:
            self.store(store)
        return bad

    def wait_layer(self, layer: str) -> None:
        """The forward is about to read ``layer``: wait until this step's loads put it in
        place (no-op without a layer-wise load in flight)."""
        if self._feed is not None:
            self._feed.wait(layer)

    def finish_loads(self) -> set[int]:
        """End this step's layer-wise load; the block ids it could not load."""
        feed, self._feed = self._feed, None
        if feed is None:
            return set()
        bad = feed.finish()
        self._count("offload_layerwise_steps", 1)
        self._count("offload_layerwise_layers_waited", feed.layers_waited)
        self._count("offload_layerwise_wait_us", int(feed.waited_s * 1e6))
        self._count("offload_layerwise_copy_us", int(feed.copy_s * 1e6))
        return bad

    def lookup(self, order: LookupOrder) -> None:
        tkeys = self.tkeys(order.keys)
        lk = _Lookup(order, tkeys)
        with self._lock:
            old = self._lookups.discard(order.lookup_id)
            if old is not None:
                self._drop(old)
            try:
                self._lookups.insert(order.lookup_id, lk, lease=STAGE_TTL_S)
            except BufferFull:
                self._answers[order.lookup_id] = 0  # a miss: vLLM computes the prompt
                full = True
            else:
                full = False
        if full:
            self._count("offload_lookups_full", 1)
            self._progress()
            return
        self._count("offload_lookups", 1)
        if not self._advance(lk, blocking_ok=False):
            self._submit(self._fast, functools.partial(self._finish_lookup, lk))

    def _finish_lookup(self, lk: _Lookup) -> None:
        self._advance(lk, blocking_ok=True)
        self._progress()

    def _advance(self, lk: _Lookup, *, blocking_ok: bool) -> bool:
        """Extend ``lk``'s staged prefix; False if a blocking tier must be asked (not here)."""
        n = len(lk.tkeys)
        while len(lk.chunks) < n and not lk.released:
            p = len(lk.chunks)
            with self._lock:
                room = (self.config.max_staged_bytes - self._staged_bytes) // self.io.chunk_bytes
            if room <= 0:
                self._count("offload_staging_full", 1)
                break
            got: list[Payload] = []
            for i, tier in enumerate(self.tiers):
                index = self._index.get(tier.name)
                listed = index.lookup(lk.tkeys, p) if index is not None else n - p
                if listed == 0:
                    continue
                if tier.blocking and not blocking_ok:
                    return False
                want = lk.tkeys[p:p + min(listed, room)]
                sealed, got = self._opened(tier, want, self._call(tier, "load", want) or [])
                if index is not None and len(got) < len(want):
                    self._lost(tier, want[len(got):], lk)
                if got:
                    self._count(f"offload_hit_blocks_{tier.name}", len(got))
                    hashes: list[bytes | None] = [None] * len(got)
                    if index is not None:
                        with self._lock:
                            hashes = [index.get(k) for k in want[:len(got)]]
                            hold(index, want[:len(got)])
                    if i > 0:
                        self._promote(i, want[:len(got)], sealed, hashes)
                    break
            if not got:
                break
            with self._lock:
                if lk.released:
                    break
                lk.chunks.extend(got)
                self._staged_bytes += len(got) * self.io.chunk_bytes
        with self._lock:
            lk.done = True
            if not lk.released:
                self._answers[lk.order.lookup_id] = len(lk.chunks)
            else:
                self._drop(lk)
        return True

    def _opened(self, tier: Tier, keys: Sequence[str], chunks: list[bytes]
                ) -> tuple[list[bytes], list[Payload]]:
        """The sealed chunks a tier returned for ``keys`` and their payloads, up to the first
        whose digest does not match (evicted, counted, logged: recomputed from there)."""
        sealed, payloads, bad = open_prefix(chunks[:len(keys)], self.io.chunk_bytes,
                                           self.config.sealed)
        if bad:
            key = keys[len(payloads)]
            self._count(f"offload_digest_mismatch_{tier.name}", 1)
            log.warning("offload tier %s: chunk %s does not match its digest; it is dropped and "
                        "the prompt recomputed from there", tier.name, key)
            self._call(tier, "evict", [key])
        return sealed, payloads

    def _lost(self, tier: Tier, keys: Sequence[str], lk: _Lookup) -> None:
        """A managed tier could not return chunks its index lists: forget them, count, log."""
        index = self._index[tier.name]
        with self._lock:
            first = keys[0] if keys else None
            gone = [index.discard(k) for k in keys]
        self.events.removed(tier.name, tier.medium, gone)
        self._count("offload_load_failed", 1)
        log.warning("offload lookup %s: tier %s could not return a chunk it held (%s); the "
                    "prompt is recomputed from block %d on", lk.order.lookup_id, tier.name,
                    first, len(lk.chunks))

    def _promote(self, upto: int, keys: Sequence[str], chunks: Sequence[bytes],
                 hashes: Sequence[bytes | None]) -> None:
        for tier in self.tiers[:upto]:
            if not tier.blocking:
                self._put(tier, list(zip(keys, chunks, strict=True)), hashes)
                self._count("offload_promoted_blocks", len(keys))

    def _claim(self, order: LoadOrder) -> list[Payload] | None:
        """Take the staged chunks ``order`` loads (the lookup ends); None (logged) if any is not."""
        with self._lock:
            try:  # a lookup whose staging expired does not serve (expire() drops it)
                lk: _Lookup | None = self._lookups.drop_select(order.lookup_id)
            except LookupMiss:
                lk = None
            ok = (lk is not None and lk.done and not lk.released
                  and order.first + len(order.block_ids) <= len(lk.chunks))
            chunks: list[Payload] = []
            if lk is not None:
                if ok:
                    chunks = lk.chunks[order.first:order.first + len(order.block_ids)]
                self._drop(lk)
        if not ok:
            self._count("offload_load_failed", 1)
            log.error("offload load %s: no staged chunks for %d block(s) (lookup %s); the "
                      "blocks are reported as load errors", order.lookup_id,
                      len(order.block_ids), "unknown" if lk is None else "short")
            return None
        return chunks

    def release(self, lookup_id: str) -> None:
        with self._lock:
            lk = self._lookups.discard(lookup_id)
            if lk is not None:
                lk.released = True
                self._drop(lk)
            self._answers.pop(lookup_id, None)

    def _drop(self, lk: _Lookup) -> None:  # under self._lock
        self._staged_bytes -= len(lk.chunks) * self.io.chunk_bytes
        lk.chunks = []
        lk.released = True

    def store(self, order: StoreOrder) -> None:
        """Queue the copy of a finished request's blocks; ``take_stored`` reports it done."""
        tkeys = self.tkeys(order.keys)
        if self._everywhere(tkeys):
            with self._lock:
                for index in self._index.values():
                    hold(index, tkeys)
                self._stored.add(order.req_id)
            self._count("offload_store_skipped_present", 1)
            return
        self._submit(self._fast, functools.partial(self._copy_out, order, tkeys))

    def _everywhere(self, tkeys: Sequence[str]) -> bool:
        with self._lock:
            for t in self.tiers:
                idx = self._index.get(t.name)
                known = self._known.get(t.name)
                if idx is not None and idx.lookup(tkeys) < len(tkeys):
                    return False
                if known is not None and known.lookup(tkeys) < len(tkeys):
                    return False
        return True

    def _copy_out(self, order: StoreOrder, tkeys: list[str]) -> None:
        try:
            chunks = self.io.read(order.block_ids)
        except Exception as exc:  # noqa: BLE001
            log.warning("offload store %s: cannot copy its blocks out: %s", order.req_id, exc)
            chunks = []
        finally:
            with self._lock:
                self._stored.add(order.req_id)
            self._progress()
        if not chunks:
            return
        items = list(zip(tkeys, (seal(c, self.config.sealed) for c in chunks), strict=True))
        hashes = list(order.hashes) if len(order.hashes) == len(items) else None
        for tier in self.tiers:
            if not tier.blocking:
                self._put(tier, items, hashes)
                continue
            if tier.name in self._drain_only and not self._draining:
                continue  # written by the drain's write-out (kvbridge.offload.warm)
            size = len(items) * self.chunk_size
            with self._lock:
                if self._backlog_bytes + size > self.config.max_backlog_bytes:
                    self._count(f"offload_backlog_full_{tier.name}", 1)
                    continue
                self._backlog_bytes += size
            self._submit(self._slow, functools.partial(self._write_behind, tier, items, size,
                                                       hashes))

    def _write_behind(self, tier: Tier, items: list[tuple[str, bytes]], size: int,
                      hashes: Sequence[bytes | None] | None) -> None:
        try:
            self._put(tier, items, hashes)
        finally:
            with self._lock:
                self._backlog_bytes -= size

    def _put(self, tier: Tier, items: list[tuple[str, bytes]],
             hashes: Sequence[bytes | None] | None = None) -> tuple[int, int]:
        """Store into one tier: skip what it holds, evict past capacity, remember the rest
        (under its block ``hashes``, which its KV events name); (chunks to store, stored)."""
        by_key = dict(zip((k for k, _ in items), hashes or (), strict=False))
        index = self._index.get(tier.name)
        known = self._known.get(tier.name)
        with self._lock:
            if index is not None:
                todo = [(k, c) for k, c in items if k not in index]
                hold(index, [k for k, _ in items if k in index])
            else:
                assert known is not None
                todo = [(k, c) for k, c in items if k not in known]
        if not todo:
            return 0, 0
        stored = self._call(tier, "store", todo) or []
        if len(stored) < len(todo):
            self._count(f"offload_store_failed_{tier.name}", len(todo) - len(stored))
        self._count(f"offload_stored_blocks_{tier.name}", len(stored))
        evicted: list[tuple[str, bytes | None]] = []
        kept = [by_key.get(k) for k in stored]
        with self._lock:
            if index is not None:
                evicted = hold(index, list(stored), kept)
            else:
                assert known is not None
                hold(known, list(stored))  # the oldest forgotten past KNOWN_KEYS
        self.events.stored(tier.name, tier.medium, kept)
        if evicted:
            self._count(f"offload_evicted_blocks_{tier.name}", len(evicted))
            self._call(tier, "evict", [k for k, _ in evicted])
            self.events.removed(tier.name, tier.medium, [h for _, h in evicted])
        return len(todo), len(stored)

    def _call(self, tier: Tier, method: str, arg: Any) -> Any:
        lock = self._tier_locks[tier.name] if tier.blocking else None
        try:
            if lock is None:
                return getattr(tier, method)(arg)
            with lock:
                return getattr(tier, method)(arg)
        except Exception as exc:  # noqa: BLE001 - a tier failure is a miss, not an engine crash
            self._count(f"offload_tier_errors_{tier.name}", 1)
            log.warning("offload tier %s: %s failed: %s: %s", tier.name, method,
                        type(exc).__name__, exc)
            return None

    # -- results (model-runner thread) ---------------------------------------------------------

    def take_answers(self) -> dict[str, int]:
        """Lookups answered since the last call: lookup id → blocks staged."""
        self._expire()
        with self._lock:
            out, self._answers = self._answers, {}
        return out

    def take_stored(self) -> set[str]:
        """Requests whose blocks have been copied out (their blocks may be freed)."""
        with self._lock:
            out, self._stored = self._stored, set()
        return out

    def take_events(self) -> list[TierEvent]:
        """The tiers' KV events since the last call, in order (rank 0; empty when off)."""
        return self.events.take()

    def take_counters(self) -> dict[str, int]:
        with self._counter_lock:
            out = dict(self.counters)
            self.counters.clear()
        return out

    def _expire(self) -> None:
        with self._lock:
            old = self._lookups.expire()
            for _, lk in old:
                self._drop(lk)  # a lookup still running sees it released and stops
        if old:
            self._count("offload_staging_expired", len(old))

    def snapshot(self) -> dict[str, Any]:
        """Occupancy per tier (for stats)."""
        with self._lock:
            return {"tiers": [{"name": t.name, "managed": t.managed,
                               "used_bytes": (len(self._index[t.name]) * self.chunk_size
                                              if t.name in self._index else None),
                               "capacity_bytes": t.capacity_bytes} for t in self.tiers],
                    "staged_bytes": self._staged_bytes, "backlog_bytes": self._backlog_bytes,
                    "lookups": len(self._lookups)}

    # -- threads ---------------------------------------------------------------------------------

    def _worker(self, rx: MemoryRecvHalf[_Job]) -> None:
        while True:
            try:
                _, job = rx.recv()
            except PipeClosed:  # the end of the stream: close() sent it after the last job
                return
            try:
                job.run()
            except Exception:  # noqa: BLE001
                log.exception("offload job failed")
            self._flush_counters()

    @staticmethod
    def _submit(pipe: MemorySendHalf[_Job], fn: Callable[[], None]) -> None:
        """Queue ``fn`` on one of the job pipes; once the manager closed, run it here (a late
        store still releases its blocks; a late lookup is still answered)."""
        try:
            pipe.send(_Job(fn))
        except PipeClosed:
            fn()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued job ran (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        for pipe in (self._fast, self._slow, self._fast):  # write-behind may queue I/O jobs
            done = threading.Event()
            self._submit(pipe, done.set)
            if not done.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def drain(self) -> None:
        """The engine drains: from now on stores write the drain-only tiers too, and a
        write-out (:mod:`kvbridge.offload.warm`) is queued behind the write-behind backlog.
        Non-blocking; idempotent (a second call queues nothing)."""
        if not self._draining:
            self._draining = True
            self._submit(self._slow, self._write_out)

    def _write_out(self) -> None:
        warm.write_out(self, self.config.drain_write_bytes, self.config.drain_write_s)
    def close(self, timeout: float = 10.0) -> None:
        """Finish queued writes, then the drain's write-out (both bounded), stop the threads,
        close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.finish_loads()
        drained, self._draining = self._draining, True
        self.flush(timeout)
        if not drained:  # once per engine: a drain already ran it (its budget spent)
            self._write_out()
        for pipe in (self._fast, self._slow):
            pipe.close()  # end of stream: each thread ends after the jobs queued before it
        for th in self._threads:
            th.join(timeout=1.0)
        self.events.close()
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("offload tier %s: close failed: %s", tier.name, exc)



"""What the transfer loop tells vLLM: finished sends and receives, failures, outcomes.

:class:`ResultBox` is written by the loop thread and drained by the connector (a lock guards
the hand-over). :class:`Outcomes` remembers how recent transfers ended, for refusals ("already
ended: …") and for :class:`~kvbridge.messages.TransferQuery` (why did my request fail?).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbridge.layout import KVLayout

__all__ = ["Results", "Outcomes", "ResultBox"]

log = logging.getLogger("kvbridge.loop")


@dataclass
class Results:
    """What finished since the last :meth:`TransferLoop.drain`.

    ``finished_recving`` lists receives whose blocks are safe to reuse (succeeded, or failed
    with nothing left in flight; the failed ones are also in ``failed_recving``).
    ``invalid_blocks`` are blocks of receives that failed while a transfer into them may still
    land: vLLM fails (or recomputes) those requests now, and their ids reach
    ``finished_recving`` only once the transfer has stopped.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.invalid_blocks)


class Outcomes:
    """How recent transfers ended (transfer_id → text), bounded; loop thread only.
    ``on_record(transfer_id, outcome)``, when set, is told each outcome (it must not raise)."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.on_record: Callable[[str, str], None] | None = None

    def record(self, tid: str, outcome: str) -> None:
        self._items[tid] = outcome[:4000]
        self._items.move_to_end(tid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        if self.on_record is not None:
            self.on_record(tid, outcome)

    def get(self, tid: str) -> str | None:
        return self._items.get(tid)


#: ``mark(transfer_id, event)``: record a timing event (the loop's :meth:`TransferLoop.mark`)
Mark = Callable[[str, str], None]
#: ``wake(arrival)``: tell the connector there is something to drain; ``arrival`` is
#: ``(req_id, transfer_id)`` of a receive that succeeded, else None
Wake = Callable[[tuple[str, str] | None], None]


class ResultBox:
    """Results under a lock, written by the loop thread, drained by the connector.

    ``layout`` maps failed receives' block ids to invalid blocks; ``stats`` and ``ended`` are
    the loop's counters and outcomes, ``mark`` and ``wake`` its timing and wake-up services."""

    def __init__(self, layout: KVLayout, stats: Counter[str], ended: Outcomes, mark: Mark,
                 wake: Wake) -> None:
        self._layout = layout
        self._stats = stats
        self._ended = ended
        self._mark = mark
        self._wake = wake
        self._lock = threading.Lock()
        self._results = Results()

    def sent(self, req_id: str) -> None:
        with self._lock:
            self._results.finished_sending.add(req_id)
        self._wake(None)

    def received(self, req_id: str, tid: str) -> None:
        self._stats["recv_ok"] += 1
        self._ended.record(tid, "done")
        self._mark(tid, "recv_done")
        with self._lock:
            self._results.finished_recving.add(req_id)
        self._wake((req_id, tid))

    def fail(self, req_id: str, local_ids: Sequence[int], why: str, *, safe: bool,
             transfer_id: str = "") -> None:
        self._stats["recv_failed"] += 1
        if transfer_id:
            self._ended.record(transfer_id, f"failed: {why}")
            self._mark(transfer_id, "recv_failed")
        log.warning("receive %s (%s) failed: %s%s", transfer_id, req_id, why,
                    "" if safe else " (blocks held until the transfer stops)")
        with self._lock:
            if safe:
                self._results.finished_recving.add(req_id)
                self._results.failed_recving.add(req_id)
            else:
                self._results.invalid_blocks.update(self._layout.block_ids(local_ids))
        self._wake(None)

    def release(self, req_id: str) -> None:
        """A receive that failed unsafely: its transfer has stopped now."""
        with self._lock:
            self._results.finished_recving.add(req_id)
            self._results.failed_recving.add(req_id)
        self._wake(None)

    def drain(self) -> Results:
        with self._lock:
            out, self._results = self._results, Results()
        return out


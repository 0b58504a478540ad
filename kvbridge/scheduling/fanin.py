"""One decode rank's receive made of parts, one per prefill rank it reads its heads from.

With heterogeneous TP a decode rank may receive from several prefill ranks (P TP 2 → D TP 1:
one part per prefill rank). Each part runs the ordinary pull or push state machine, but
reports to a :class:`FanIn` instead of the loop's :class:`~kvbridge.scheduling.results.
ResultBox`; the fan-in has the same three methods and reports the *whole* receive once:

* received — when every part was received;
* failed — at the first part's failure, which also gives every other part up (``cancel``), so
  a failure of any part fails the whole hand-off. The receive is reported *safe* (its blocks
  reusable) if no part's transfer can still land, else its blocks are reported invalid at once
  and the request is released when the last such transfer stopped.

A receive of one part uses the loop's result box directly (nothing changes for equal TP).
Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvbridge.scheduling.results import ResultBox

__all__ = ["Box", "FanIn"]


class Box(Protocol):
    """Where a part reports (a :class:`ResultBox`, or a :class:`FanIn`)."""

    def fail(self, req_id: str, local_ids: Sequence[int], why: str, *, safe: bool,
             transfer_id: str = "") -> None: ...

    def received(self, req_id: str, tid: str) -> None: ...

    def release(self, req_id: str) -> None: ...


class FanIn:
    """See the module docstring. ``cancel(why)`` gives up every part still running."""

    def __init__(self, results: ResultBox, req_id: str, tid: str, local_ids: Sequence[int],
                 parts: int, cancel: Callable[[str], object]) -> None:
        self._results = results
        self._req = req_id
        self._tid = tid
        self._ids = tuple(local_ids)
        self._cancel = cancel
        self.running = parts  # parts whose transfer may still change our blocks
        self.failure: str | None = None
        self._reported = False
        self._cancelling = False

    def received(self, req_id: str, tid: str) -> None:
        self.running -= 1
        self._settle()

    def fail(self, req_id: str, local_ids: Sequence[int], why: str, *, safe: bool,
             transfer_id: str = "") -> None:
        if safe:
            self.running -= 1
        if self.failure is None:
            self.failure = why
            self._cancelling = True
            try:
                self._cancel(why)
            finally:
                self._cancelling = False
        self._settle()

    def release(self, req_id: str) -> None:
        self.running -= 1
        self._settle()

    def _settle(self) -> None:
        if self._cancelling:
            return
        if self.failure is None:
            if self.running == 0:
                self._results.received(self._req, self._tid)
            return
        if not self._reported:
            self._reported = True
            self._results.fail(self._req, self._ids, self.failure, safe=self.running == 0,
                               transfer_id=self._tid)
        elif self.running == 0:
            self._results.release(self._req)

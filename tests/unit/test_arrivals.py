"""Direct arrival's bookkeeping (kvbridge.scheduling.arrivals): when a receive is ready to be
told to vLLM, which arrivals are refused, and which workers' reports are dropped afterwards."""

from __future__ import annotations

from kvbridge.scheduling.arrivals import DirectArrivals
from kvbridge.scheduling.wake import Arrival


def _book(tp: int, waiting: dict[str, str]) -> DirectArrivals:
    return DirectArrivals(tp, waiting.get)


def test_a_receive_is_ready_once_every_rank_arrived() -> None:
    waiting = {"a": "t1", "b": "t2"}
    book = _book(2, waiting)
    assert book.ready([Arrival(0, "a", "t1"), Arrival(1, "b", "t2")]) == (set(), 0)
    assert book.ready([Arrival(0, "a", "t1")]) == (set(), 0)  # the same rank twice
    assert book.ready([Arrival(1, "a", "t1")]) == ({"a"}, 0)
    assert len(book) == 1  # b's rank 1 only
    assert book.ready([Arrival(0, "b", "t2")]) == ({"b"}, 0)
    assert len(book) == 0


def test_stale_forged_and_out_of_range_arrivals_are_refused() -> None:
    book = _book(2, {"a": "t1"})
    ready, stale = book.ready([
        Arrival(0, "a", "t0"),  # another transfer of the same request (stale)
        Arrival(0, "nobody", "t1"),  # a request that waits for nothing
        Arrival(2, "a", "t1"),  # a rank this engine does not have
        Arrival(0, "a", "t1"),
    ])
    assert (ready, stale) == (set(), 3) and len(book) == 1


def test_a_new_transfer_of_a_request_starts_its_ranks_afresh() -> None:
    waiting = {"a": "t1"}
    book = _book(2, waiting)
    book.ready([Arrival(0, "a", "t1")])
    waiting["a"] = "t2"  # the request now waits for another transfer
    assert book.ready([Arrival(1, "a", "t2")]) == (set(), 0)
    assert book.ready([Arrival(0, "a", "t2")]) == ({"a"}, 0)


def test_the_workers_report_of_a_told_receive_is_dropped_exactly_once() -> None:
    book = _book(1, {"a": "t1", "b": "t2"})
    ready, _ = book.ready([Arrival(0, "a", "t1")])
    book.told(ready)
    assert book.reported({"a", "b"}) == {"a"}  # b was not told: vLLM learns it from the report
    assert book.reported({"a"}) == set()  # a report of it again is not ours to drop
    assert len(book) == 0


def test_a_report_before_all_arrivals_forgets_the_partial_ones() -> None:
    book = _book(2, {"a": "t1", "b": "t2"})
    book.ready([Arrival(0, "a", "t1"), Arrival(0, "b", "t2")])
    assert book.reported({"a"}) == set()  # the step output was first: nothing to drop
    book.forget("b")  # the request ended
    assert len(book) == 0

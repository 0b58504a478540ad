"""The flight recorder's ring (kvbridge.scheduling.recorder): bounds, eviction, clocks, phases."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.scheduling.recorder import MAX_EVENTS, MAX_ID, PHASES, Recorder, local_phases


def test_the_ring_keeps_the_newest_records_and_counts_evictions() -> None:
    r = Recorder(capacity=3)
    for i in range(5):
        r.mark(f"t{i}", "kv_ready")
    assert len(r) == 3 and r.evicted == 2
    assert r.get("t0") is None and r.get("t1") is None
    assert set(r.snapshot()) == {"t2", "t3", "t4"}


def test_a_mark_refreshes_its_record_so_a_live_transfer_is_not_evicted_first() -> None:
    r = Recorder(capacity=2)
    r.mark("old", "arrived")
    r.mark("new", "arrived")
    r.mark("old", "scheduled")  # still being worked on
    r.mark("third", "arrived")
    assert r.get("old") is not None and r.get("new") is None


def test_the_first_mark_of_an_event_wins_and_events_per_record_are_bounded() -> None:
    r = Recorder()
    r.mark("t", "kv_ready", when=100.0)
    r.mark("t", "kv_ready", when=200.0)
    for i in range(2 * MAX_EVENTS):
        r.mark("t", f"e{i}")
    got = r.get("t")
    assert got is not None and len(got) == MAX_EVENTS
    assert got["kv_ready"] == pytest.approx(100.0, abs=1e-6)


def test_hostile_ids_and_event_names_are_cut_not_stored_whole() -> None:
    r = Recorder(capacity=4)
    huge = "x" * (10 * MAX_ID)
    r.mark(huge, "y" * (10 * MAX_ID))
    (tid, events), = r.snapshot().items()
    assert len(tid) == MAX_ID and all(len(e) == MAX_ID for e in events)
    assert r.get(huge) is not None  # looked up the same way it was stored
    assert r.many([huge, "nope", ""]) == {huge: events}


def test_wall_times_come_from_one_anchor_plus_the_monotonic_clock() -> None:
    r = Recorder()
    before = time.time()
    r.mark("t", "a")
    time.sleep(0.02)
    r.mark("t", "b")
    after = time.time()
    got = r.get("t")
    assert got is not None
    assert before - 0.01 <= got["a"] <= got["b"] <= after + 0.01
    assert got["b"] - got["a"] >= 0.019


def test_a_monotonic_stamp_orders_exactly_against_marks_made_now() -> None:
    """An event stamped on this process's monotonic clock before later marks stays before
    them (a wall-clock stamp, converted through the anchor, could land microseconds after)."""
    rec = Recorder(8)
    rec.mark("t", "kv_ready")
    before = time.monotonic_ns()
    rec.mark("t", "ready_seen")
    rec.mark("t", "write_posted", mono_ns=before)
    rec.mark("t", "future", mono_ns=time.monotonic_ns() + 10**12)  # never after "now"
    events = rec.get("t")
    assert events is not None
    assert events["kv_ready"] <= events["write_posted"] <= events["ready_seen"]
    assert events["future"] <= time.time() + 0.001


def test_a_phase_reaches_the_histogram_sink_once_when_its_end_is_marked() -> None:
    seen: list[tuple[str, float]] = []
    r = Recorder(on_phase=lambda name, s: seen.append((name, s)))
    r.mark("t", "write_posted", when=10.0)
    r.mark("t", "write_done", when=10.25)
    r.mark("t", "write_done", when=11.0)  # a second mark changes nothing
    r.mark("u", "write_done")  # no start: no phase
    assert seen == [("wire", pytest.approx(0.25, abs=1e-6))]


def test_local_phases_of_a_push_on_p_and_a_pull_on_d() -> None:
    p = {"arrived": 0.0, "scheduled": 0.1, "kv_ready": 0.4, "write_posted": 0.41,
         "write_done": 0.45}
    assert local_phases(p) == pytest.approx({"queue": 0.1, "prefill": 0.3, "post": 0.01,
                                             "wire": 0.04})
    d = {"arrived": 1.0, "scheduled": 1.2, "recv_start": 1.21, "read_posted": 1.23,
         "recv_done": 1.3, "recv_seen": 1.31, "first_step": 1.35}
    assert local_phases(d) == pytest.approx({"queue": 0.2, "plan": 0.01, "claim": 0.02,
                                             "wire": 0.07, "notified": 0.01,
                                             "first_step": 0.04})


def test_marks_from_many_threads_keep_the_bound() -> None:
    r = Recorder(capacity=50)

    def work(k: int) -> None:
        for i in range(500):
            r.mark(f"{k}-{i}", PHASES[i % len(PHASES)][2])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(r) == 50 and r.evicted == 4 * 500 - 50


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Recorder(capacity=0)


def test_a_muted_transfer_keeps_no_record_and_times_no_phase() -> None:
    phases: list[str] = []
    r = Recorder(capacity=2, on_phase=lambda phase, _s: phases.append(phase))
    r.mark("kept", "arrived")
    r.mark("quiet", "arrived")  # recorded before the mute: dropped with it
    r.mute("quiet")
    for event in ("scheduled", "kv_ready"):
        r.mark("quiet", event)
        r.mark("kept", event)
    assert r.get("quiet") is None and "quiet" not in r.snapshot()
    assert r.get("kept") is not None and phases == ["queue", "prefill"]  # kept's phases only
    assert r.evicted == 0  # a muted transfer evicts nothing


def test_muted_ids_are_bounded_and_the_oldest_is_forgotten_first() -> None:
    r = Recorder(capacity=2)
    for tid in ("a", "b", "c"):
        r.mute(tid)
    r.mark("a", "arrived")  # forgotten: recorded again
    r.mark("c", "arrived")
    assert r.get("a") is not None and r.get("c") is None
    r.mute("x" * (2 * MAX_ID))  # cut like every id
    r.mark("x" * MAX_ID, "arrived")
    assert r.get("x" * MAX_ID) is None

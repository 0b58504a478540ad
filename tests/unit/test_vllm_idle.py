"""The wake-on-arrival hook against vLLM's real ``EngineCoreProc._process_engine_step`` (no engine).

An ``EngineCoreProc`` instance is made without its constructor (no model, no processes) with
just what ``_process_engine_step`` touches: a step that computed nothing while the scheduler
still has requests, which is exactly when vLLM sleeps its idle millisecond. The real method runs
and calls the real (patched) module-level ``time.sleep``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

core: Any = pytest.importorskip("vllm.v1.engine.core")

from kvbridge.integrations import vllm_idle  # noqa: E402


def _engine() -> Any:
    engine = object.__new__(core.EngineCoreProc)
    engine.step_fn = lambda: ({}, False)  # nothing scheduled, nothing executed
    engine.output_queue = queue.Queue()
    engine.check_for_draft_tokens = False
    engine.async_scheduling = True
    engine.scheduler = types.SimpleNamespace(has_requests=lambda: True)
    engine.input_queue = queue.Queue()
    return engine


@pytest.fixture
def hook() -> Iterator[list[tuple[Any, float]]]:
    """Install with a waiter that records its calls; always uninstalled afterwards."""
    vllm_idle.uninstall()
    calls: list[tuple[Any, float]] = []
    assert vllm_idle.install(lambda inputs, seconds: calls.append((inputs, seconds)))
    try:
        yield calls
    finally:
        vllm_idle.uninstall()


def test_the_idle_sleep_of_an_empty_step_goes_to_the_waiter(
        hook: list[tuple[Any, float]]) -> None:
    engine = _engine()
    assert not vllm_idle.active()  # installed, but no engine loop has run it yet
    assert core.EngineCoreProc._process_engine_step(engine) is False
    assert hook == [(engine.input_queue, 0.001)]
    assert vllm_idle.active()
    # everything else in vLLM's module is the real time module
    assert core.time.monotonic is time.monotonic and core.time.time is time.time
    assert core.time.sleep is not time.sleep


def test_a_sleep_outside_the_engine_step_is_a_real_sleep(
        hook: list[tuple[Any, float]]) -> None:
    core.EngineCoreProc._process_engine_step(_engine())
    hook.clear()
    core.time.sleep(0.001)  # same module, not inside the engine step
    t = threading.Thread(target=core.time.sleep, args=(0.001,))
    t.start()
    t.join(10)
    assert hook == []


def test_nudge_puts_vllms_wakeup_on_the_engine_input_queue(
        hook: list[tuple[Any, float]]) -> None:
    assert vllm_idle.nudge() is False  # no engine known yet
    engine = _engine()
    core.EngineCoreProc._process_engine_step(engine)
    threading.Thread(target=vllm_idle.nudge).start()
    kind, payload = engine.input_queue.get(timeout=10)
    assert kind == core.EngineCoreRequestType.WAKEUP and payload is None


def test_install_is_idempotent_and_replaces_the_waiter(
        hook: list[tuple[Any, float]]) -> None:
    other: list[float] = []
    assert vllm_idle.install(lambda inputs, seconds: other.append(seconds))
    core.EngineCoreProc._process_engine_step(_engine())
    assert other == [0.001] and hook == []


def test_a_failing_waiter_is_uninstalled_and_the_step_still_completes(
        caplog: pytest.LogCaptureFixture) -> None:
    vllm_idle.uninstall()
    stock_step = core.EngineCoreProc._process_engine_step

    def broken(inputs: Any, seconds: float) -> None:
        raise RuntimeError("boom")

    try:
        assert vllm_idle.install(broken)
        with caplog.at_level(logging.ERROR, logger="kvbridge.connector"):
            assert core.EngineCoreProc._process_engine_step(_engine()) is False
        assert "restoring vLLM's idle sleep" in caplog.text
        assert vllm_idle.status().startswith("uninstalled")
        assert core.time is time
        assert core.EngineCoreProc._process_engine_step is stock_step
    finally:
        vllm_idle.uninstall()


def test_install_refuses_a_vllm_without_the_expected_idle_sleep(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    vllm_idle.uninstall()

    def no_sleep(self: Any) -> bool:
        return False

    assert vllm_idle.installable() is None  # this vLLM has what the hook needs
    monkeypatch.setattr(core.EngineCoreProc, "_process_engine_step", no_sleep)
    assert "time.sleep" in (vllm_idle.installable() or "")
    with caplog.at_level(logging.WARNING, logger="kvbridge.connector"):
        assert not vllm_idle.install(lambda inputs, seconds: None)
    assert "not installed" in caplog.text and "time.sleep" in caplog.text
    assert vllm_idle.status().startswith("not installed")
    assert core.EngineCoreProc._process_engine_step is no_sleep  # nothing was changed
    assert core.time is time
    assert not vllm_idle.active() and vllm_idle.nudge() is False


def test_install_refuses_when_someone_else_patched_the_module_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_idle.uninstall()
    monkeypatch.setattr(core, "time", types.SimpleNamespace(sleep=time.sleep))
    assert not vllm_idle.install(lambda inputs, seconds: None)
    assert "not the time module" in vllm_idle.status()


# -- direct arrival: before_step and deliver_received --------------------------------------------

def test_before_step_runs_on_the_engine_thread_before_each_step() -> None:
    vllm_idle.uninstall()
    order: list[str] = []
    engine = _engine()
    engine.step_fn = lambda: (order.append("step"), ({}, True))[1]
    try:
        assert vllm_idle.install(lambda inputs, seconds: None,
                                 lambda e: order.append("before" if e is engine else "?"))
        core.EngineCoreProc._process_engine_step(engine)
        core.EngineCoreProc._process_engine_step(engine)
        assert order == ["before", "step", "before", "step"]
        assert vllm_idle.install(lambda inputs, seconds: None, None)  # replaced: none now
        core.EngineCoreProc._process_engine_step(engine)
        assert order == ["before", "step", "before", "step", "step"]
    finally:
        vllm_idle.uninstall()


def test_a_failing_before_step_is_dropped_and_the_step_still_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    vllm_idle.uninstall()
    calls: list[int] = []

    def broken(engine: Any) -> None:
        calls.append(1)
        raise RuntimeError("boom")

    try:
        assert vllm_idle.install(lambda inputs, seconds: None, broken)
        with caplog.at_level(logging.ERROR, logger="kvbridge.connector"):
            assert core.EngineCoreProc._process_engine_step(_engine()) is False
            assert core.EngineCoreProc._process_engine_step(_engine()) is False
        assert calls == [1] and "direct arrival is off" in caplog.text
        assert vllm_idle.status().startswith("installed")  # the wake hook itself stays
    finally:
        vllm_idle.uninstall()


def _scheduler(connector: Any, statuses: dict[str, Any]) -> Any:
    """Just what vLLM's real ``Scheduler._update_from_kv_xfer_finished`` touches."""
    from vllm.v1.core.sched.scheduler import Scheduler

    sched = types.SimpleNamespace(
        connector=connector, finished_recving_kv_req_ids=set(), failed_recving_kv_req_ids=set(),
        requests={r: types.SimpleNamespace(request_id=r, status=s) for r, s in statuses.items()},
        _kv_fetch_stages=None, freed=[])
    sched._update_from_kv_xfer_finished = types.MethodType(
        Scheduler._update_from_kv_xfer_finished, sched)
    sched._set_kv_fetch_stage = types.MethodType(Scheduler._set_kv_fetch_stage, sched)
    sched._free_blocks = sched.freed.append
    return sched


class _Connector:
    def __init__(self) -> None:
        self.outputs: list[Any] = []

    def update_connector_output(self, output: Any) -> None:
        self.outputs.append(set(output.finished_recving))


def test_deliver_received_tells_vllm_of_requests_still_waiting_only() -> None:
    from vllm.v1.request import RequestStatus

    conn = _Connector()
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    engine = types.SimpleNamespace(scheduler=_scheduler(conn, {
        "a": waiting, "b": waiting, "c": RequestStatus.FINISHED_ABORTED,
        "d": RequestStatus.RUNNING, "e": waiting, "f": waiting}))
    sched = engine.scheduler
    sched.finished_recving_kv_req_ids.add("e")  # already reported by a worker
    sched.failed_recving_kv_req_ids.add("f")  # failed on another rank
    assert vllm_idle.deliverable(engine, conn) is None
    told = vllm_idle.deliver_received(engine, {"a", "b", "c", "d", "e", "f", "gone"})
    assert told == {"a", "b"}
    assert sched.finished_recving_kv_req_ids == {"a", "b", "e"}  # what schedule() promotes
    assert conn.outputs == [{"a", "b"}]  # the connector saw them as vLLM passes them
    assert sched.freed == []
    assert vllm_idle.deliver_received(engine, {"c", "gone"}) == set()
    assert conn.outputs == [{"a", "b"}]  # nothing to tell: vLLM is not called


def test_deliverable_refuses_schedulers_it_does_not_know() -> None:
    conn = _Connector()
    assert "no scheduler" in (vllm_idle.deliverable(types.SimpleNamespace(), conn) or "")
    engine = types.SimpleNamespace(scheduler=_scheduler(conn, {}))
    assert "not the scheduler's only KV connector" in (
        vllm_idle.deliverable(engine, _Connector()) or "")
    del engine.scheduler._update_from_kv_xfer_finished
    assert "_update_from_kv_xfer_finished" in (vllm_idle.deliverable(engine, conn) or "")
    engine = types.SimpleNamespace(scheduler=_scheduler(conn, {}))
    engine.scheduler.requests = []
    assert "as expected" in (vllm_idle.deliverable(engine, conn) or "")

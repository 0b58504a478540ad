"""``KVBRIDGE_ENGINE_SPIN_MS`` against vLLM's real SpinCondition and MessageQueue (no engines).

The freeze this guards against: with a 2 ms spin, a step-queue reader sleeps on its ZeroMQ
notification between steps; the writer's PUB socket (SNDHWM=1) drops a notification that follows
the previous one within libzmq's command throttle (~1 ms), and the reader slept until vLLM's 5 s
recheck while the block it waited for was already written (kvbridge.integrations.vllm_spin).
These tests lose the notification on purpose and check that the patched reader still finds the
data within milliseconds. The bounds are 100x the cap, so they do not depend on machine speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
sb: Any = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")

from kvbridge.integrations import vllm_spin  # noqa: E402

SLOW_S = 0.5  # far above MAX_IDLE_POLL_MS, far below vLLM's 5 s recheck


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """apply_engine_spin() with KVBRIDGE_ENGINE_SPIN_MS=2; SpinCondition restored afterwards."""
    monkeypatch.setattr(sb.SpinCondition, "wait", sb.SpinCondition.wait)
    monkeypatch.setattr(vllm_spin, "_spin_applied", False)
    monkeypatch.setenv("KVBRIDGE_ENGINE_SPIN_MS", "2")
    vllm_spin.apply_engine_spin()
    yield


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    """A real (writer, reader) SpinCondition pair on one ipc address."""
    ctx = zmq.Context()
    address = sb.get_open_zmq_ipc_path()
    writer = sb.SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = sb.SpinCondition(is_reader=True, context=ctx, notify_address=address)
    try:
        yield writer, reader
    finally:
        ctx.destroy(linger=0)


def _idle(reader: Any) -> None:
    reader.last_read = time.monotonic() - 10.0  # long past any busy window


def test_apply_is_idempotent_and_off_without_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sb.SpinCondition, "wait", sb.SpinCondition.wait)
    monkeypatch.setattr(vllm_spin, "_spin_applied", False)
    stock = sb.SpinCondition.wait
    monkeypatch.delenv("KVBRIDGE_ENGINE_SPIN_MS", raising=False)
    vllm_spin.apply_engine_spin()
    assert sb.SpinCondition.wait is stock
    monkeypatch.setenv("KVBRIDGE_ENGINE_SPIN_MS", "2")
    vllm_spin.apply_engine_spin()
    once = sb.SpinCondition.wait
    assert once is not stock and once.__wrapped__ is stock
    vllm_spin.apply_engine_spin()
    assert sb.SpinCondition.wait is once  # not wrapped twice


@pytest.mark.usefixtures("patched")
def test_idle_reader_with_no_notification_returns_within_the_cap(pair: tuple[Any, Any]) -> None:
    _writer, reader = pair
    _idle(reader)
    t0 = time.monotonic()
    reader.wait(timeout_ms=5000)  # what acquire_read passes (SHM_READER_RECHECK_INTERVAL_MS)
    assert time.monotonic() - t0 < SLOW_S
    assert reader.busy_loop_s == pytest.approx(0.002)
    _idle(reader)
    t0 = time.monotonic()
    reader.wait(timeout_ms=None)  # vLLM's "indefinitely" is bounded too
    assert time.monotonic() - t0 < SLOW_S


def test_the_unpatched_reader_sleeps_the_whole_timeout(pair: tuple[Any, Any]) -> None:
    """The control: vLLM's own wait, past its busy window, sleeps until the timeout."""
    _writer, reader = pair
    _idle(reader)
    t0 = time.monotonic()
    reader.wait(timeout_ms=int(SLOW_S * 1000))
    assert time.monotonic() - t0 >= SLOW_S * 0.9


def test_a_notification_still_wakes_the_reader_at_once(pair: tuple[Any, Any]) -> None:
    """The bound only shortens the sleep; a notification ends it early (cap of 3 s here)."""
    writer, reader = pair
    wait = vllm_spin.bounded_wait(sb.SpinCondition.wait, 0.002, max_poll_ms=3000)
    _idle(reader)
    time.sleep(0.05)  # let the SUB connection come up (a PUB drops what nobody receives)
    timer = threading.Timer(0.05, writer.notify)
    timer.start()
    t0 = time.monotonic()
    wait(reader, 3000)
    elapsed = time.monotonic() - t0
    timer.join()
    assert elapsed < 1.5, f"woke after {elapsed:.3f} s, not on the notification"
    with pytest.raises(zmq.Again):  # and it consumed the notification
        reader.local_notify_socket.recv(flags=zmq.NOBLOCK)


@pytest.mark.usefixtures("patched")
def test_writer_side_is_untouched(pair: tuple[Any, Any]) -> None:
    writer, _reader = pair
    writer.notify()  # a writer never waits; notify is vLLM's
    with pytest.raises(AssertionError):
        writer.wait(timeout_ms=1)  # vLLM: "Only readers can wait"


@pytest.fixture
def queues() -> Iterator[tuple[Any, Any]]:
    """A real MessageQueue writer and its one local reader, in this process."""
    writer = sb.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = sb.MessageQueue.create_from_handle(writer.export_handle(), 0)
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(10)
    yield writer, reader


@pytest.mark.usefixtures("patched")
def test_a_lost_notification_costs_milliseconds_not_the_5_s_recheck(
    queues: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every notification is lost; the reader still gets each message in milliseconds."""
    writer, reader = queues
    monkeypatch.setattr(writer._spin_condition, "notify", lambda: None)
    got: list[tuple[int, float]] = []

    def read() -> None:
        for _ in range(3):
            got.append((reader.dequeue(timeout=30), time.monotonic()))

    thread = threading.Thread(target=read)
    thread.start()
    sent = []
    for i in range(3):
        time.sleep(0.05)  # the reader is past its 2 ms spin, asleep on the notify socket
        sent.append(time.monotonic())
        writer.enqueue(i)
    thread.join(30)
    assert [m for m, _ in got] == [0, 1, 2]
    delays = [t - s for (_, t), s in zip(got, sent, strict=True)]
    assert max(delays) < SLOW_S, f"reader found the messages after {delays} s"

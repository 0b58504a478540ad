"""The GPU fence of push WRITEs, with a fake device stream (no GPU here).

On a GPU the forward's KV writes are asynchronous: a WRITE posted right after ``wait_for_save``
could read KV the kernels have not written yet. The connector records a CUDA event on the
current stream after the KV writes, and the transfer loop posts the WRITE only once
``event.query()`` is true (tests/process/test_loop.py checks the loop side with a hand-made fence).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.scheduling.fences import CudaFence

torch = pytest.importorskip("torch")


class _FakeStream:
    pass


class _FakeEvent:
    instances: list[_FakeEvent] = []

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.recorded_on: Any = None
        self.done = False
        _FakeEvent.instances.append(self)

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.done


def test_cuda_fence_records_on_the_current_stream_and_never_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fence = CudaFence()
    event = _FakeEvent.instances[-1]
    assert event.options == {"blocking": True}  # a waiting thread sleeps, it does not spin
    assert event.recorded_on is stream  # recorded after the KV writes, on their stream
    assert fence.ready() is False  # kernels still running: the loop must not post
    event.done = True
    assert fence.ready() is True


def test_rank_side_makes_one_fence_per_forward_for_push_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.scheduling.handoff import StepPlan
    from kvbridge.scheduling.rank import RankSide
    from kvbridge.testing.handoffs import send

    made: list[object] = []
    posted: list[tuple[Any, Any]] = []
    prepared: list[Any] = []

    class _Loop:
        rank = 0
        config = type("Config", (), {"wake_on_arrival": True})()
        flushed = 0

        def flush(self, timeout: float) -> bool:
            self.flushed += 1
            return True

        def push_ready(self, plan: Any, fence: Any) -> None:
            posted.append((plan, fence))

        def push_prepare(self, plan: Any) -> None:
            prepared.append(plan)

        def mark(self, *args: Any) -> None:
            pass

    def factory() -> object:
        made.append(object())
        return made[-1]

    loop = _Loop()
    side = RankSide(loop, factory)  # type: ignore[arg-type]
    side.apply(StepPlan(push_ready=[send("p1", "t1", [1]), send("p2", "t2", [2])]))
    assert posted == []  # nothing before the forward, but both WRITEs are built meanwhile
    assert [p.req_id for p in prepared] == ["p1", "p2"]
    side.after_forward()
    assert len(made) == 1 and [f for _, f in posted] == [made[0], made[0]]
    assert loop.flushed == 1  # wake on arrival: the worker lets the loop post at once

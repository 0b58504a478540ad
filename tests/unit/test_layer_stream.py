"""LayerStream: the FIFO pipe a forward fills with the layers it wrote (layer-wise push)."""

from __future__ import annotations

import threading

from kvbridge.scheduling.layer_stream import LayerStream
from kvbridge.testing.handoffs import send


def _stream() -> tuple[LayerStream, list[int]]:
    woken: list[int] = []
    return LayerStream([send("r", "t", [1, 2])], lambda: woken.append(1)), woken


def test_layers_come_out_in_order_with_their_fences_then_the_end() -> None:
    s, woken = _stream()
    assert s.take() == ([], False)  # nothing yet: never blocks
    s.written("layer.0", "f0")  # type: ignore[arg-type]
    s.written("layer.1", None)
    assert s.take() == ([("layer.0", "f0"), ("layer.1", None)], False)
    s.written("layer.2", "f2")  # type: ignore[arg-type]
    s.end("final")  # type: ignore[arg-type]
    assert s.take() == ([("layer.2", "f2")], True)  # the end never overtakes a layer
    assert s.final_fence == "final"
    assert s.take() == ([], True)  # the end is seen again, nothing repeats
    assert len(woken) == 4  # every send and the end wake the loop


def test_end_is_idempotent_and_nothing_is_sent_after_it() -> None:
    s, woken = _stream()
    s.end(None)
    s.end("late")  # type: ignore[arg-type]
    s.written("layer.0", None)
    assert s.take() == ([], True) and s.final_fence is None and len(woken) == 1


def test_a_forward_on_another_thread_is_seen_layer_by_layer() -> None:
    s, _ = _stream()
    names = [f"layer.{i}" for i in range(200)]

    def forward() -> None:
        for name in names:
            s.written(name, None)
        s.end(None)

    th = threading.Thread(target=forward)
    th.start()
    seen: list[str] = []
    ended = False
    while not ended:
        layers, ended = s.take()
        seen += [name for name, _ in layers]
    th.join()
    assert seen == names

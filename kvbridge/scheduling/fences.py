"""Device fences a push WRITE waits for, waited on a thread instead of polled.

On a GPU, P may post a WRITE only once the kernels that wrote the KV have finished: the
connector records a fence (a CUDA event) after the forward and hands it to the transfer loop
with the ready KV. Polling it costs up to the loop's poll back-off (2 ms) per hand-off; a fence
that can be *waited* (:class:`WaitableFence`: a blocking ``wait()`` that releases the GIL, e.g.
``cudaEventSynchronize`` on an event made with blocking sync) is instead given to
:class:`FenceWaiter`, whose one daemon thread waits the fences in order and tells the loop the
moment each has passed, so the WRITE is posted right then. Fences without ``wait`` are polled
by the loop as before. :class:`CudaFence` is the fence of a CUDA device (imports torch lazily).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Fence", "WaitableFence", "FenceWaiter"]

log = logging.getLogger("kvbridge.loop")


class Fence(Protocol):
    """Device work a WRITE must wait for (a CUDA event recorded after the KV writes).

    ``ready()`` must not block; the loop polls it until True. On CPU there is no fence.
    """

    def ready(self) -> bool: ...


@runtime_checkable
class WaitableFence(Protocol):
    """A :class:`Fence` that can also be waited: ``wait()`` blocks until ``ready()`` would be
    True, without holding the GIL, and may raise (the fence is then polled instead)."""

    def ready(self) -> bool: ...

    def wait(self) -> None: ...


class FenceWaiter:
    """One daemon thread (started on first use) that waits fences in submission order.

    ``on_passed(fence, ok)`` runs on that thread after each fence: ``ok`` False when its
    ``wait`` raised. :meth:`add` and :meth:`owns` may be called from any thread.
    """

    def __init__(self, on_passed: Callable[[Fence, bool], None], name: str) -> None:
        self._on_passed = on_passed
        self._name = name
        self._queue: queue.SimpleQueue[Fence | None] = queue.SimpleQueue()
        self._owned: set[int] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, fence: Fence) -> bool:
        """Wait ``fence`` on the thread; False when it has no ``wait`` (poll it instead)."""
        if not isinstance(fence, WaitableFence):
            return False
        with self._lock:
            if self._closed:
                return False
            self._owned.add(id(fence))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(fence)
        return True

    def owns(self, fence: Fence) -> bool:
        """``fence`` is being waited here (the loop need not poll it)."""
        return id(fence) in self._owned

    def _run(self) -> None:
        while True:
            fence = self._queue.get()
            if fence is None:
                return
            ok = True
            try:
                fence.wait()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - the loop polls this fence instead
                log.exception("waiting a device fence failed; polling it instead")
                ok = False
            with self._lock:
                self._owned.discard(id(fence))
            try:
                self._on_passed(fence, ok)
            except Exception:  # noqa: BLE001 - never kill the waiter
                log.exception("fence callback failed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the fences already queued (idempotent)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)


class CudaFence:
    """A CUDA event recorded on the current stream after the step's KV writes (make it right
    after the forward was issued). ``ready`` never blocks; ``wait`` blocks — blocking sync: the
    waiting thread sleeps, and torch releases the GIL — until the kernels before it finished,
    so the transfer loop's :class:`FenceWaiter` thread posts the WRITE at once."""

    def __init__(self) -> None:
        import torch

        self._device = torch.cuda.current_device()
        self._event: Any = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream())

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        import torch

        with torch.cuda.device(self._device):
            self._event.synchronize()

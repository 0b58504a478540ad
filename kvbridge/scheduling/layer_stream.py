"""Layer-wise push, P side: the forward pass fills a FIFO pipe with the layers it wrote; the
transfer loop drains it and posts each layer's WRITEs.

With ``layerwise`` push (a request's ``kvbridge_layerwise``, or the ``layerwise`` setting) P
does not wait for the whole forward before writing to D: vLLM calls ``save_kv_layer(layer)``
once a layer's KV of the step is written, and that layer's WRITE can go at once, overlapping
the compute of the layers after it. One :class:`LayerStream` carries one step's layers, for
every layer-wise push that finishes prefill in that step, through a
:func:`~kvbridge.transports.pipe.memory_pipe`:

- the worker opens it when it applies the step's plan and hands the receiving end to the loop
  (:meth:`~kvbridge.scheduling.loop.TransferLoop.push_layers`);
- the forward (model-runner) thread calls :meth:`written` per layer, in the forward's order,
  and :meth:`end` once after the forward: end-of-stream is the whole request's readiness (every
  plane, including any layer never announced). FIFO order means the loop never sees the end
  before a layer sent ahead of it;
- the loop thread calls :meth:`take` whenever it wakes; it never blocks.

Neither side blocks the other: the pipe is unbounded, and bounded in practice by the model's
number of layers (one item each per step). A layer's fence (a device event on GPU; None on CPU)
is recorded before the layer is sent, so the loop finds it with the layer. ``wake`` is called
after each send so that the loop, asleep in its poller, looks at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbridge.errors import PipeClosed
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.specs import SendPlan
from kvbridge.transports.pipe import memory_pipe

__all__ = ["LayerStream"]


class LayerStream:
    """One step's layer-wise push (see the module docstring)."""

    def __init__(self, plans: Sequence[SendPlan], wake: Callable[[], None]) -> None:
        self.plans = tuple(plans)
        self._tx, self._rx = memory_pipe(sender="push-layers")
        self._wake = wake
        self._fences: dict[str, Fence | None] = {}
        self.final_fence: Fence | None = None
        self.ended = False  # the forward ended the stream (forward thread)
        self.drained = False  # the loop took the end of the stream (loop thread)

    # -- the forward (model-runner) thread ----------------------------------------------------

    def written(self, layer: str, fence: Fence | None) -> None:
        """``layer``'s KV of every plan is written (once ``fence`` passes)."""
        if self.ended:
            return
        self._fences[layer] = fence
        self._tx.send(layer.encode())
        self._wake()

    def end(self, fence: Fence | None) -> None:
        """The forward ended: every plane of every plan is written (once ``fence`` passes).
        Idempotent."""
        if self.ended:
            return
        self.ended = True
        self.final_fence = fence
        self._tx.close()
        self._wake()

    # -- the loop thread ----------------------------------------------------------------------

    def take(self) -> tuple[list[tuple[str, Fence | None]], bool]:
        """The layers sent since the last call, in order, with their fences; and whether the
        stream ended (then :attr:`final_fence` is the whole request's). Never blocks."""
        layers: list[tuple[str, Fence | None]] = []
        if self.drained:
            return layers, True
        while True:
            try:
                _, payload = self._rx.recv(timeout=0)
            except TimeoutError:
                return layers, False
            except PipeClosed:
                self.drained = True
                return layers, True
            layer = payload.decode()
            layers.append((layer, self._fences.pop(layer, None)))

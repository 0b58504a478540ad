"""Layer-by-layer tier loads: a loader thread fills a FIFO pipe that the forward pass drains.

Without it, a step's tier hits are copied into their blocks before the step's forward starts
(every layer, then compute). A :class:`LayerFeed` copies them one layer at a time on its own
thread, in the layout's layer order, and after each layer sends that layer's index into a
:func:`~kvbridge.transports.pipe.memory_pipe`. vLLM calls ``wait_for_layer_load(layer)`` before
a layer's attention reads the KV cache; :meth:`LayerFeed.wait` returns once that layer (and,
the pipe being FIFO, every layer before it) is in place. Layer ``L``'s copy overlaps the compute
of the layers before it. ``offload.layerwise_load`` turns it on (docs/offload.md says where it
pays: docs/benchmarks.md has the measurement).

Contract:

- :meth:`start` returns at once; the copy runs on the feed's thread. The caller has checked the
  block ids and chunk sizes (:meth:`~kvbridge.offload.blocks.BlockIO.check`): a copy cannot
  fail on bad input, only on a bug — then the feed stops, every :meth:`wait` returns, and
  :meth:`finish` reports every block of the step as a load error (vLLM's failure policy
  applies), and says why in the log.
- :meth:`wait` blocks the forward (model-runner) thread only; a layer this feed does not load
  (no KV planes) returns at once. It is bounded by ``timeout`` (a copy of host memory; if it
  takes longer, something is broken: the step goes on and :meth:`finish` reports errors).
- :meth:`finish` blocks until the copy ended and returns the block ids not loaded (empty when
  all went well). The worker calls it after the forward and before it applies the next step's
  plan: a feed never outlives its step, so no copy writes a block the next step reuses.
- One thread calls :meth:`wait` and :meth:`finish` (vLLM's model runner); :meth:`start` is
  called from that thread too. The loader thread touches only the blocks it was given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvbridge.errors import PipeClosed
from kvbridge.offload.blocks import BlockIO, Payload
from kvbridge.transports.pipe import memory_pipe

__all__ = ["LayerFeed", "WAIT_S"]

log = logging.getLogger("kvbridge.offload")

#: the longest a forward waits for one layer's copy before going on without it (and the step's
#: loads being reported as errors)
WAIT_S = 30.0


class LayerFeed:
    """One step's tier loads, copied layer by layer (see the module docstring)."""

    def __init__(self, io: BlockIO, loads: Sequence[tuple[Sequence[int], Sequence[Payload]]]
                 ) -> None:
        self._io = io
        self._loads = [(list(ids), list(chunks)) for ids, chunks in loads if ids]
        self._layers = io.layers
        self._index = {name: i for i, (name, _) in enumerate(self._layers)}
        self._tx, self._rx = memory_pipe(sender="tier-load")
        self._arrived = -1  # the last layer index received from the pipe
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.copy_s = 0.0  # time the loader spent copying
        self.waited_s = 0.0  # time the forward spent waiting in wait()
        self.layers_waited = 0  # wait() calls for a layer this feed loads

    @property
    def block_ids(self) -> set[int]:
        return {b for ids, _ in self._loads for b in ids}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvbridge-layer-load",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for i, (_, planes) in enumerate(self._layers):
                for ids, chunks in self._loads:
                    self._io.write(ids, chunks, planes)
                self._tx.send(i.to_bytes(4, "little"))
        except BaseException as exc:  # noqa: BLE001 - reported by finish(), never lost
            self._error = exc
        finally:
            self.copy_s = time.perf_counter() - t0
            self._tx.close()

    def wait(self, layer: str, timeout: float = WAIT_S) -> None:
        """Return once ``layer``'s KV is in place (or the copy ended, failed or timed out)."""
        want = self._index.get(layer)
        if want is None:
            return
        self.layers_waited += 1
        if self._arrived >= want:
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            while self._arrived < want:
                _, payload = self._rx.recv(timeout=max(0.0, deadline - time.monotonic()))
                self._arrived = int.from_bytes(payload, "little")
        except PipeClosed:
            self._arrived = len(self._layers)  # the copy ended: nothing more will come
        except TimeoutError:
            log.error("offload: layer %s not loaded after %.1f s; the step goes on and its "
                      "tier loads are reported as load errors", layer, timeout)
            self._error = self._error or TimeoutError(f"layer {layer} not loaded in time")
            self._arrived = len(self._layers)
        finally:
            self.waited_s += time.perf_counter() - t0

    def finish(self, timeout: float = WAIT_S) -> set[int]:
        """Wait for the copy to end; the block ids not loaded (all of them on any failure)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._error = self._error or TimeoutError("the layer-wise copy did not end")
        self._rx.close()
        if self._error is None:
            return set()
        log.error("offload: layer-wise load of %d block(s) failed (%s); they are reported as "
                  "load errors", len(self.block_ids), self._error)
        return self.block_ids

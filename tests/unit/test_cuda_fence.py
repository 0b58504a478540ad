"""The push WRITE's device fence on a real CUDA device (skipped where there is none).

:class:`~kvbridge.scheduling.fences.CudaFence` is recorded after the forward's KV writes and
:class:`~kvbridge.scheduling.fences.FenceWaiter` waits it on a thread, so the transfer loop
posts the WRITE the moment the kernels finished. What must hold on a real GPU, and what a fake
stream (tests/unit/test_vllm_fence.py) cannot show:

- the fence is not ready while the kernels that write the KV are still running, and is once
  they finished;
- when the waiter says the fence passed, every kernel queued before it has finished (an event
  recorded just before it is complete) and the KV holds the final values;
- the waiting thread sleeps (blocking sync) rather than spinning a core for the whole wait.

Imports only the stdlib module under test and torch, so it runs on a GPU machine without vLLM
or kvbridge's other dependencies: ``python -m pytest --noconftest tests/unit/test_cuda_fence.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvbridge.scheduling.fences import CudaFence, FenceWaiter

torch: Any = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


def _busy_then_write(kv: Any, value: float, seconds: float = 0.3) -> Any:
    """Queue about ``seconds`` of matrix products, then the write of ``value`` into ``kv``
    (all on the current stream, nothing waited); returns an event recorded after the write."""
    # large products: few launches (CUDA's launch queue must not fill and block this thread)
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    (x @ x).clamp_(-1, 1)  # warm-up (cuBLAS set-up)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    (x @ x).clamp_(-1, 1)
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end) / 1000.0, 1e-4)
    for _ in range(min(400, max(1, int(seconds / per)))):
        x = (x @ x).clamp_(-1, 1)
    kv.fill_(value)  # the "KV write" of the forward, after the long work
    written = torch.cuda.Event()
    written.record()
    return written


def test_the_fence_is_ready_only_after_the_kernels_before_it() -> None:
    kv = torch.zeros(1 << 20, device="cuda")
    written = _busy_then_write(kv, 3.0)
    fence = CudaFence()
    assert fence.ready() is False  # the matrix products are still running
    torch.cuda.synchronize()
    assert fence.ready() is True and written.query()


def test_the_waiter_reports_the_fence_once_the_kv_is_written_without_spinning() -> None:
    kv = torch.zeros(1 << 20, device="cuda")
    passed = threading.Event()
    seen: dict[str, Any] = {}

    def on_passed(fence: Any, ok: bool) -> None:
        seen["ok"], seen["at"] = ok, time.perf_counter()
        seen["written_done"] = written.query()  # never blocks: was the KV write finished?
        passed.set()

    waiter = FenceWaiter(on_passed, "test-cuda-fence")
    try:
        written = _busy_then_write(kv, 7.0, seconds=0.5)
        fence = CudaFence()
        assert not fence.ready()
        cpu0, t0 = time.thread_time(), time.perf_counter()
        proc0 = time.process_time()
        assert waiter.add(fence)  # a CudaFence can be waited: the loop need not poll it
        assert waiter.owns(fence)
        assert passed.wait(60)
        waited = seen["at"] - t0
        busy = time.process_time() - proc0 - (time.thread_time() - cpu0)
    finally:
        waiter.close()
    assert seen["ok"] is True and seen["written_done"] is True
    assert torch.equal(kv.cpu(), torch.full((1 << 20,), 7.0))
    assert not waiter.owns(fence)
    # blocking sync: the waiting thread slept through the GPU work instead of spinning
    assert waited > 0.1, f"the fence passed after {waited:.3f} s: the work was not queued"
    assert busy < 0.5 * waited, f"{busy:.3f} CPU-s burnt during a {waited:.3f} s wait"
    print(f"fence waited {waited * 1000:.1f} ms, other threads' CPU {busy * 1000:.1f} ms")

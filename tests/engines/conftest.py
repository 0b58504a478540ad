"""The engine tier's engines run vLLM's worker inside the engine-core process.

vLLM's CPU platform gives each engine a worker process of its own (the ``mp`` executor); with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` it keeps the uni-process executor, the one vLLM runs on a
single GPU, and an engine starts one Python process fewer (27 s instead of 40 s here). That is
what most of this tier runs: the scheduler's and the worker's halves of the connector then share
a process, as they do on one GPU.

vLLM pins a worker process to its ``VLLM_CPU_OMP_THREADS_BIND`` cores; inside the engine core
it pins nothing (``cpu_bind`` then has no effect on where threads run). Tests that need the
engines on cores of their own ask for the CPU default with
:data:`kvbridge.tools.engines.WORKER_PROCESS_ENV`:

- ``test_vllm_e2e.py``'s pairs (every backend, every mode), so each half of the connector is
  also tested in a process of its own;
- ``test_vllm_recorder.py``, whose phase sums were calibrated on pinned engines (with roaming
  engine threads the client's and the proxy's stalls grew: one CI run missed the 25 ms p99).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.tools.engines import WORKER_IN_CORE_ENV


@pytest.fixture(scope="session", autouse=True)
def _worker_in_engine_core() -> Iterator[None]:
    """Every engine this session starts inherits :data:`WORKER_IN_CORE_ENV` unless its own
    ``env`` says otherwise (``VllmServer`` applies ``env`` after the inherited environment)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in WORKER_IN_CORE_ENV.items():
            mp.setenv(key, value)
        yield

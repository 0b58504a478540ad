"""SIGTERM marks a vLLM engine's HTTP side as draining (kvbridge.integrations.vllm_drain).

The signal is a real one, delivered to this process through the running loop's own handler table
as vLLM's server installs it; SIGUSR1 stands in for SIGTERM so a mistake cannot end the test run.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from kvbridge.integrations.vllm_drain import SigtermDrain

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_servers_own_handler_still_runs_after_the_drain_is_marked() -> None:
    loop = asyncio.get_running_loop()
    drain = SigtermDrain(signal.SIGUSR1)
    assert not drain.arm()  # no server handler yet: nothing wrapped, retried later
    seen: list[bool] = []
    loop.add_signal_handler(signal.SIGUSR1, lambda: seen.append(drain.draining))
    try:
        assert drain.arm() and drain.arm()  # idempotent
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [True]  # marked first, then the server's handler ran
        assert drain.draining
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)


async def test_the_servers_shutdown_waits_for_the_requests_in_flight() -> None:
    loop = asyncio.get_running_loop()
    drain = SigtermDrain(signal.SIGUSR1, wait_s=5.0)
    calls: list[float] = []
    loop.add_signal_handler(signal.SIGUSR1, lambda: calls.append(loop.time()))
    try:
        assert drain.arm()
        drain.enter()
        drain.enter()
        os.kill(os.getpid(), signal.SIGUSR1)
        await asyncio.sleep(0.2)
        assert drain.draining and calls == []  # two requests still inside vLLM: not yet
        drain.leave()
        await asyncio.sleep(0.1)
        assert calls == []
        drain.leave()  # the last one ended: vLLM's shutdown begins
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert len(calls) == 1
        # bounded: a request that never ends does not hold the shutdown past wait_s
        stuck = SigtermDrain(signal.SIGUSR2, wait_s=0.3)
        got: list[int] = []
        loop.add_signal_handler(signal.SIGUSR2, lambda: got.append(1))
        assert stuck.arm()
        stuck.enter()
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.sleep(0.1)
        assert got == []
        os.kill(os.getpid(), signal.SIGUSR2)  # a second signal: at once
        await asyncio.sleep(0.1)
        assert got == [1]
        await asyncio.sleep(0.4)
        assert got == [1, 1]  # and the bounded wait ends too
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        loop.remove_signal_handler(signal.SIGUSR2)

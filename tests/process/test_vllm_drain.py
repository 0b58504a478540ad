"""SIGTERM marks a vLLM engine's HTTP side as draining (kvbridge.integrations.vllm_drain).

The signal is a real one, delivered to this process with the server's own handler installed as
vLLM's server installs it (``loop.add_signal_handler``, on asyncio's loop and on uvloop's);
SIGUSR1 stands in for SIGTERM so a mistake cannot end the test run.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest
import uvloop

from kvbridge.integrations.vllm_drain import SigtermDrain

pytestmark = [pytest.mark.timeout(30)]


def _scenario() -> list[object]:
    drain = SigtermDrain(signal.SIGUSR1)
    seen: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert not drain.arm()  # the server has no handler yet: nothing chained, retried later
        loop.add_signal_handler(signal.SIGUSR1, lambda: seen.append(("server", drain.draining)))
        try:
            assert drain.arm() and drain.arm()  # idempotent
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            seen.append(("marked", drain.draining))
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    return [main, seen]


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_sigterm_marks_the_drain_and_the_servers_own_handler_still_runs(
        run: Callable[..., None]) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    main, seen = _scenario()
    try:
        run(main())  # type: ignore[operator]
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [("server", True), ("marked", True)]  # marked first, then the server's

"""Run proxies for tests, the demo and benchmarks: kvbridge proxies on a background event loop
(:class:`ProxyThread`), or any proxy as a process of its own (:class:`ProxyProcess`)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvbridge.proxy.app import ProxyServer
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings
from kvbridge.tools.engines import EngineError, VllmServer, free_port, start_servers
from kvbridge.tools.priority import follow_niceness
from kvbridge.tools.procs import end_group

__all__ = ["ProxyThread", "ProxyProcess", "serve_pd"]

T = TypeVar("T")


class ProxyThread:
    """One event-loop thread hosting one :class:`ProxyServer` per requested mode.

    ``urls[mode]`` is each proxy's base URL once :meth:`start` returned. :meth:`close` stops them
    and joins the thread; it is idempotent.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str],
                 modes: Sequence[str] = ("pull", "push", "auto"), **settings: Any) -> None:
        # keyed by the name asked for: ``plan`` is ``auto``'s other name, yet its own proxy
        self._settings = [(m, ProxySettings(prefill=list(prefill), decode=list(decode),
                                            mode=ProxyMode(m), port=0, **settings))
                          for m in modes]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvbridge-proxies",
                                        daemon=True)
        self.servers: dict[str, ProxyServer] = {}
        self.urls: dict[str, str] = {}

    def start(self, timeout: float = 30.0) -> ProxyThread:
        self._thread.start()
        for name, s in self._settings:
            server = ProxyServer(s)
            asyncio.run_coroutine_threadsafe(server.start(), self._loop).result(timeout)
            self.servers[name] = server
            self.urls[name] = server.url
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``coro`` on the proxies' event loop (e.g. ``server.discover()``); its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        for server in self.servers.values():
            try:
                asyncio.run_coroutine_threadsafe(server.stop(), self._loop).result(15)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ProxyProcess:
    """``python -m MODULE ARGS --host 127.0.0.1 --port PORT`` in its own process group, as a
    proxy runs in production: not a thread of the caller, whose other work (a load generator,
    other proxies on the same event loop) would share its GIL and its loop and delay its relay.
    ``module``: ``kvbridge.proxy`` (default) or the stock proxies of
    :mod:`kvbridge.tools.bench.proxy`. Output goes to ``log_path``.

    :meth:`start` blocks until ``GET /health`` answers 200 (an :class:`EngineError` with the
    log's tail if the process exits or ``timeout`` passes first) and returns the base URL; the
    process inherits the caller's thread's niceness, and its session gets it too
    (:mod:`kvbridge.tools.priority`; where that is refused, a line in the log says why).
    :meth:`stop` sends SIGTERM, then SIGKILL, to the group; idempotent."""

    def __init__(self, args: Sequence[str], log_path: Path,
                 module: str = "kvbridge.proxy") -> None:
        self.args = list(args)
        self.module = module
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 60.0) -> str:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args, "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", "WARNING"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # fmt: skip
            why = follow_niceness(self.proc.pid)
            if why is not None:
                log.write(f"kvbridge: the proxy's session keeps niceness 0: {why}\n".encode())
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = self.log_path.read_text(errors="replace")[-2000:]
                    raise EngineError(f"the proxy exited ({self.proc.returncode}): {tail}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                        if r.status == 200:
                            return self.url
                except (OSError, ValueError):
                    pass
                time.sleep(0.2)
            raise EngineError(f"the proxy at {self.url} was not healthy within {timeout:.0f} s "
                              f"(log: {self.log_path})")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            end_group(proc)

    def __enter__(self) -> ProxyProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_pd(prefill: VllmServer, decode: VllmServer, modes: Sequence[str] = ("pull", "push"),
             timeout: float = 600.0, **settings: Any) -> Iterator[ProxyThread]:
    """Start ``prefill`` and ``decode`` (not yet started), then one proxy per mode in front of
    them; yield the proxies. Everything is stopped on exit, also when starting failed."""
    proxies: ProxyThread | None = None
    try:
        start_servers([prefill, decode], timeout=timeout)
        proxies = ProxyThread([prefill.url], [decode.url], modes=modes, **settings).start()
        yield proxies
    finally:
        if proxies is not None:
            proxies.close()
        prefill.stop()
        decode.stop()

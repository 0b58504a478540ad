"""Run kvbridge proxies on a background event loop (tests, demo, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from kvbridge.proxy.app import ProxyServer
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings
from kvbridge.tools.engines import VllmServer, start_servers

__all__ = ["ProxyThread", "serve_pd"]

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

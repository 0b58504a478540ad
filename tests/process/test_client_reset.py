"""``kvbridge.tools.client.reset_prefix_cache`` against a local HTTP server that answers like
vLLM's ``/reset_prefix_cache``: ``{"success": false}`` while blocks are held. A reset that is
refused must be retried, never taken as done (a bench or test would then measure vLLM's own
prefix cache instead of a tier), and one refused for good must raise."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbridge.tools.client import reset_prefix_cache
from kvbridge.tools.engines import EngineError


class _Engine:
    """Answers ``refusals`` resets with success=false, then true."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.calls = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                engine.calls += 1
                ok = engine.calls > engine.refusals
                body = json.dumps({"success": ok}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> Iterator[_Engine]:
    e = _Engine(request.param)
    try:
        yield e
    finally:
        e.close()


@pytest.mark.parametrize("engine", [0, 3], indirect=True)
def test_a_refused_reset_is_retried_until_it_succeeds(engine: _Engine) -> None:
    reset_prefix_cache(engine.url, timeout=10)
    assert engine.calls == engine.refusals + 1


@pytest.mark.parametrize("engine", [10**6], indirect=True)
def test_a_reset_refused_for_good_raises(engine: _Engine) -> None:
    with pytest.raises(EngineError, match="refused the reset"):
        reset_prefix_cache(engine.url, timeout=0.5)
    assert engine.calls >= 2

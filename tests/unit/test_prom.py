"""kvbridge.tools.prom: the one Prometheus reader, on text a hand parser got wrong."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from kvbridge.tools import prom

TEXT = "\n".join([
    "# HELP vllm:kvbridge_transfer_seconds transfer time",
    "# TYPE vllm:kvbridge_transfer_seconds histogram",
    'vllm:kvbridge_transfer_seconds_bucket{engine="0",le="+Inf",mode="pull"} 3',
    'vllm:kvbridge_transfer_seconds_sum{mode="pull",engine="0"} 0.25 1700000000000',
    'vllm:kvbridge_transfer_seconds_count{mode="pull",engine="0"} 3 1700000000000',
    'vllm:kvbridge_transfer_seconds_sum{engine="1",mode="push"} 0.5',
    'vllm:kvbridge_transfer_seconds_count{engine="1",mode="push"} 1',
    "# TYPE kvbridge_proxy_retries_total counter",
    'kvbridge_proxy_retries_total{reason="decode_failed",mode="pull"} 2 1700000000000',
    'kvbridge_proxy_retries_total{mode="push",reason="decode_failed"} 1',
    'kvbridge_proxy_retries_total{mode="push",reason="prefill_failed"} 4',
    "kvbridge_proxy_retries_total_other 7",
    "",
])


def test_a_timestamp_is_not_part_of_the_value() -> None:
    """``name{…} 2 1700000000000``: the value is 2 (a split on the last blank read the
    timestamp)."""
    assert prom.value(TEXT, "kvbridge_proxy_retries_total", mode="pull",
                      reason="decode_failed") == 2.0
    assert prom.histogram(TEXT, "vllm:kvbridge_transfer_seconds", mode="pull") == (0.25, 3.0)


def test_labels_match_in_any_order() -> None:
    """The exposition lists ``reason`` before ``mode`` on one line and after it on the next."""
    for mode in ("pull", "push"):
        assert prom.value(TEXT, "kvbridge_proxy_retries_total", reason="decode_failed",
                          mode=mode) == {"pull": 2.0, "push": 1.0}[mode]
        assert prom.value(TEXT, "kvbridge_proxy_retries_total", mode=mode,
                          reason="decode_failed") is not None
    assert prom.value(TEXT, "kvbridge_proxy_retries_total", mode="pull") is None  # exactly


def test_total_adds_the_label_sets_that_include_the_asked_labels() -> None:
    assert prom.total(TEXT, "kvbridge_proxy_retries_total") == 7.0  # not the lookalike
    assert prom.total(TEXT, "kvbridge_proxy_retries_total", mode="push") == 5.0
    assert prom.total(TEXT, "kvbridge_proxy_retries_total", reason="decode_failed") == 3.0
    assert prom.total(TEXT, "absent") == 0.0
    assert prom.histogram(TEXT, "vllm:kvbridge_transfer_seconds") == (0.75, 4.0)


def test_by_label_sums_per_value() -> None:
    assert prom.by_label(TEXT, "kvbridge_proxy_retries_total", "reason") == {
        "decode_failed": 3.0, "prefill_failed": 4.0}
    assert prom.by_label(TEXT, "kvbridge_proxy_retries_total_other", "reason") == {}


@pytest.fixture
def server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = TEXT.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_fetch_reads_the_servers_metrics(server: str) -> None:
    assert prom.fetch(server) == TEXT
    assert prom.fetch(server + "/", timeout=5) == TEXT

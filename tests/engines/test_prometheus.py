"""A real Prometheus scrapes a real P, D and proxies; every dashboard query returns data.

One P and one D (KVBridgeConnector over shm) and the proxies (pull, push, headroom: each request a
hand-off) serve a few streamed requests. Debian's ``prometheus`` (scripts/system-deps) then scrapes
the engines' and the proxies' ``/metrics`` every second with deploy/prometheus/kvbridge-rules.yml
loaded. Once it holds two scrapes after the last request, every panel query of
``kvbridge.tools.dashboards`` is evaluated through ``/api/v1/query`` (``$__rate_interval`` as 1m)
and must return data, except the queries whose ``sparse`` says why they may not (labelled children
created by a first failure); those must still evaluate. Every recording rule returns data and no
alert fires on the healthy fleet. Every process is stopped, also on failure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge.tools import dashboards
from kvbridge.tools.client import complete
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.proxies import ProxyThread, serve_pd
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "kvbridge-rules.yml"
WINDOW = "1m"
REQUESTS_PER_MODE = 3


def _connector(role: str, engine_id: str) -> dict[str, Any]:
    return {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"backend": "shm"}}


def _hostport(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


class Prometheus:
    """A ``prometheus`` process on a free 127.0.0.1 port with its storage under ``root``."""

    def __init__(self, root: Path, engines: list[str], proxies: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shutil.copy(RULES, root / RULES.name)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [RULES.name],
                  "scrape_configs": [
                      {"job_name": "kvbridge-engines",
                       "static_configs": [{"targets": [_hostport(u) for u in engines]}]},
                      {"job_name": "kvbridge-proxy",
                       "static_configs": [{"targets": [_hostport(u) for u in proxies]}]}]}
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url + path + query, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/query", query=expr)["result"])

    def wait(self, what: str, ok: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if ok():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus: {what} not within {timeout} s; "
                            f"log: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer,
                                                                       ProxyThread]]:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not on PATH (apt-get install prometheus; scripts/system-deps "
                    "installs it as root)")
    model = build_tiny_model()
    logs = tmp_path_factory.mktemp("logs")
    env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"}
    p = VllmServer(model, name="prefill", port=free_port(), cpu_bind="0", env=env,
                   kv_transfer_config=_connector("kv_producer", "prom-P"),
                   log_path=logs / "prefill.log")
    d = VllmServer(model, name="decode", port=free_port(), cpu_bind="1", env=env,
                   kv_transfer_config=_connector("kv_consumer", "prom-D"),
                   log_path=logs / "decode.log")
    with serve_pd(p, d, modes=("pull", "push", "headroom")) as proxies:
        yield p, d, proxies


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
        fleet: tuple[VllmServer, VllmServer, ProxyThread], tmp_path: Path) -> None:
    p, d, proxies = fleet
    prompts = iter(random_prompts(3 * REQUESTS_PER_MODE, 200, seed=31))
    prom = Prometheus(tmp_path, [p.url, d.url], list(proxies.urls.values()))
    try:
        prom.wait("5 targets up (P, D, 3 proxies)", lambda: sorted(
            float(r["value"][1]) for r in prom.query("up")) == [1.0] * 5)
        for url in proxies.urls.values():
            for _ in range(REQUESTS_PER_MODE):
                complete(url, next(prompts), 4, stream=True, extra={"ignore_eos": True},
                         timeout=120)
        prom.wait("every request's hand-off on D", lambda: sum(
            float(r["value"][1]) for r in prom.query("vllm:kvbridge_recv_ok_total"))
            >= 3 * REQUESTS_PER_MODE)
        time.sleep(3)  # two more scrapes: every rate() has two samples after the last request
        empty, sparse_empty = [], []
        for q in dashboards.queries():
            result = prom.query(q.expr.replace(dashboards.RATE, WINDOW))
            if not result:
                (sparse_empty if q.sparse else empty).append(q.expr)
        assert empty == [], f"queries without data: {empty}"
        recorded = [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"]
                    for r in g["rules"] if "record" in r]
        assert [r for r in recorded if not prom.query(r)] == []
        firing = [a for a in prom.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]
        assert firing == []
        print(f"{len(dashboards.queries())} queries, {len(sparse_empty)} sparse and empty: "
              f"{sparse_empty}")
    finally:
        prom.stop()

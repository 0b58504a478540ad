"""kvbridge as a child of vLLM's own ``MultiConnector``, next to vLLM's ``ExampleConnector``.

P runs ``MultiConnector[KVBridgeShmConnector, ExampleConnector]``, D runs
``MultiConnector[KVBridgeConnector, ExampleConnector]`` (a backend-specific name and the generic
one). Through the proxy, in pull and push mode, D's greedy output equals P's single-engine
output. vLLM keys a MultiConnector's child stats by class name and rebuilds them in the
API-server process through its connector registry by that name, then feeds each child's
Prometheus metrics: the test reads ``vllm:kvbridge_*`` from both engines' ``/metrics`` and the
periodic ``KV Transfer metrics`` log line (counters, and per-transfer histograms labelled by mode,
backend and peer), so a name that did not resolve there (or stats without Prometheus metrics,
which trips an assertion in vLLM) would fail it; it also scrapes the proxy's own series. The
ExampleConnector really runs beside us: P's storage directory fills with its files.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbridge.tools import prom
from kvbridge.tools.client import complete, engine_stats, output_token_ids
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.proxies import ProxyThread, serve_pd
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
GREEDY = {"ignore_eos": True}


@dataclass
class Fleet:
    p: VllmServer
    d: VllmServer
    p_ctl: str
    d_ctl: str
    p_storage: Path
    proxies: ProxyThread | None = None


def _engine(model: str, role: str, ctl_port: int, logs: Path, storage: Path) -> VllmServer:
    ours = "KVBridgeShmConnector" if role == "prefill" else "KVBridgeConnector"
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    extra = {"side_channel_port": ctl_port}
    if ours == "KVBridgeConnector":
        extra["backend"] = "shm"  # type: ignore[assignment]
    kv = {"kv_connector": "MultiConnector", "kv_role": kv_role,
          "engine_id": f"multi-{role}",
          "kv_connector_extra_config": {"connectors": [
              {"kv_connector": ours, "kv_role": kv_role, "kv_connector_extra_config": extra},
              {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}}]}}
    return VllmServer(model, name=role, port=free_port(), kv_transfer_config=kv,
                      cpu_bind="0" if role == "prefill" else "1",
                      env={"KVBRIDGE_ENGINE_SPIN_MS": "2", "VLLM_LOG_STATS_INTERVAL": "1"},
                      log_path=logs / f"{role}.log")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = str(build_tiny_model())
    logs = tmp_path_factory.mktemp("logs")
    p_port, d_port = free_port(), free_port()
    p_store, d_store = tmp_path_factory.mktemp("p-store"), tmp_path_factory.mktemp("d-store")
    f = Fleet(_engine(model, "prefill", p_port, logs, p_store),
              _engine(model, "decode", d_port, logs, d_store),
              f"tcp://127.0.0.1:{p_port}", f"tcp://127.0.0.1:{d_port}", p_store)
    with serve_pd(f.p, f.d) as f.proxies:
        yield f


def _run(url: str, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(url, prompt, MAX_TOKENS, extra=GREEDY, timeout=120))
    assert out is not None
    return out


def _scrape(url: str) -> str:
    return prom.fetch(url, 30)


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of series ``name`` over every label set that includes ``labels``."""
    return prom.total(_scrape(url), name, **labels)


def _wait_metric(url: str, name: str, above: float, timeout: float = 60.0,
                 **labels: str) -> float:
    deadline = time.monotonic() + timeout
    value = _metric(url, name, **labels)
    while value <= above and time.monotonic() < deadline:
        time.sleep(0.5)
        value = _metric(url, name, **labels)
    return value


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_disaggregated_inside_multiconnector(fleet: Fleet, mode: str) -> None:
    assert fleet.proxies is not None
    prompts = random_prompts(3, 90, seed={"pull": 401, "push": 402}[mode])
    refs = [_run(fleet.p.url, p) for p in prompts]
    key, engine = ("pull_bytes", fleet.d) if mode == "pull" else ("push_bytes", fleet.p)
    ctl = fleet.d_ctl if mode == "pull" else fleet.p_ctl
    before_ctl = engine_stats(ctl).get(key, 0)
    before_prom = _metric(engine.url, f"vllm:kvbridge_{key}_total")
    where = {"mode": mode, "backend": "shm",
             "peer": "multi-prefill" if mode == "pull" else "multi-decode"}
    before_hist = _metric(engine.url, "vllm:kvbridge_transfer_seconds_count", **where)
    for prompt, ref in zip(prompts, refs, strict=True):
        assert _run(fleet.proxies.urls[mode], prompt) == ref
    moved = engine_stats(ctl).get(key, 0) - before_ctl
    assert moved > 0, f"no {key} moved: the hand-off did not go through kvbridge"
    # the same increments reach vLLM's /metrics through MultiConnector's stats path
    after_prom = _wait_metric(engine.url, f"vllm:kvbridge_{key}_total", before_prom + moved - 1)
    assert after_prom - before_prom == moved
    # ... and so do the per-transfer histograms, labelled by mode, backend and peer
    hist = "vllm:kvbridge_transfer_seconds_count"
    assert _wait_metric(engine.url, hist, before_hist + len(prompts) - 1, **where
                        ) - before_hist == len(prompts)
    if mode == "pull":  # D measures each hand-off
        assert _metric(fleet.d.url, "vllm:kvbridge_handoff_seconds_count", mode="pull") >= 3
    assert _metric(engine.url, "vllm:kvbridge_transfer_bytes_sum", mode=mode) >= moved
    # the proxy's own series (prometheus_client) counted the same requests
    proxy = _scrape(fleet.proxies.urls[mode])
    assert prom.value(proxy, "kvbridge_proxy_requests_total", mode=mode,
                      outcome="ok") == len(prompts)
    assert (prom.value(proxy, "kvbridge_proxy_upstream_seconds_count", role="decode") or 0
            ) >= len(prompts)


def test_stats_logged_by_child_name(fleet: Fleet) -> None:
    """The API server rebuilt our child's stats by its registered name and logged them."""
    for engine, pattern in (
            (fleet.d, r"KV Transfer metrics: .*KVBridgeConnector=\{.*'recv_ok': \d+"),
            (fleet.p, r"KV Transfer metrics: .*KVBridgeShmConnector=\{.*'pull_served': \d+")):
        deadline = time.monotonic() + 30
        assert engine.log_path is not None
        while not re.search(pattern, engine.log_path.read_text(errors="replace")):
            if time.monotonic() > deadline:
                pytest.fail(f"{engine.name} never logged kvbridge's counters:\n"
                            + engine.log_tail(30))
            time.sleep(0.5)


def test_example_connector_ran_beside_us(fleet: Fleet) -> None:
    prompt = random_prompts(1, 70, seed=403)[0]
    _run(fleet.p.url, prompt)
    assert any(fleet.p_storage.rglob("*.safetensors")), "ExampleConnector stored nothing on P"

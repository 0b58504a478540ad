"""Admission by KV credit on real engines: a decode engine whose KV cache holds two requests,
under a burst of long prompts with long outputs, behind the proxy with ``--kv-admission``.

- ``queue``: every request answers 200 with the single-engine reference, through pull and push;
  no request waits past its bound, and afterwards neither engine holds a transfer.
- ``reject``: what does not fit is answered 503 with ``Retry-After`` before P computes anything
  (P saw only the admitted requests); what was admitted is right.

D runs with ``--kv-cache-memory-bytes 2097152`` (2,048 tokens of KV: vLLM logs it); each request
may hold 900 tokens, so two fit at a time.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbridge.proxy.credit import KvAdmission
from kvbridge.tools import prom
from kvbridge.tools.client import complete, output_token_ids, probe, stats_reply
from kvbridge.tools.engines import EngineError, VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT, MAX_TOKENS, BURST = 600, 300, 8
GREEDY = {"ignore_eos": True}


@dataclass
class Pair:
    p: VllmServer
    d: VllmServer

    def _address(self, e: VllmServer) -> str:
        ref = probe(e.url).peer(0)
        assert ref is not None
        return str(ref.address)

    def pending(self, e: VllmServer) -> int:
        return int(stats_reply(self._address(e)).pending)

    def pulls_served(self) -> int:
        return int(stats_reply(self._address(self.p)).stats.get("pull_served", 0))


def _engine(model: Path, logs: Path, name: str, role: str, core: str,
            extra: list[str]) -> VllmServer:
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": f"adm-{name}",
          "kv_connector_extra_config": {"backend": "shm", "lease_s": 60, "push_timeout_s": 120,
                                        "prefill_wait_s": 120}}
    return VllmServer(model, name=name, kv_transfer_config=kv, cpu_bind=core,
                      env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                      extra_args=["--block-size", "32", *extra], log_path=logs / f"{name}.log")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("kv-admission")
    model = build_tiny_model()
    p = _engine(model, logs, "P", "kv_producer", "0", [])
    d = _engine(model, logs, "D", "kv_consumer", "1", ["--kv-cache-memory-bytes", "2097152"])
    try:
        start_servers([p, d], timeout=900)
        yield Pair(p, d)
    finally:
        d.stop()
        p.stop()


def send(url: str, prompt: list[int]) -> tuple[int, object]:
    try:
        return 200, output_token_ids(complete(url, prompt, MAX_TOKENS, extra=GREEDY,
                                              timeout=240))
    except EngineError as exc:
        return exc.status or 0, exc.body


def test_queue_serves_every_request_right_and_leaves_nothing_held(pair: Pair) -> None:
    prompts = random_prompts(BURST, PROMPT, seed=11)
    refs = [output_token_ids(complete(pair.p.url, pr, MAX_TOKENS, extra=GREEDY, timeout=240))
            for pr in prompts]
    px = ProxyThread([pair.p.url], [pair.d.url], modes=("pull", "push"), timeout_s=240.0,
                     kv_admission=KvAdmission.QUEUE, kv_queue_s=200.0).start()
    try:
        for mode, url in px.urls.items():
            with cf.ThreadPoolExecutor(BURST) as ex:
                results = list(ex.map(lambda pr, u=url: send(u, pr), prompts))
            for i, ((status, out), ref) in enumerate(zip(results, refs, strict=True)):
                assert status == 200, f"{mode} request {i}: {out}"
                assert out == ref, f"{mode} request {i} differs from the single engine"
            text = prom.fetch(url, 30)
            assert prom.value(text, "kvbridge_proxy_kv_capacity_blocks", engine=pair.d.url) == 64
            assert prom.value(text, "kvbridge_proxy_kv_credit_blocks", engine=pair.d.url) == 64
    finally:
        px.close()
    assert pair.pending(pair.d) == 0 and pair.pending(pair.p) == 0


def test_reject_refuses_what_does_not_fit_before_prefill(pair: Pair) -> None:
    prompts = random_prompts(BURST, PROMPT, seed=12)
    served = pair.pulls_served()
    px = ProxyThread([pair.p.url], [pair.d.url], modes=("pull",), timeout_s=240.0,
                     kv_admission=KvAdmission.REJECT).start()
    try:
        with cf.ThreadPoolExecutor(BURST) as ex:
            results = list(ex.map(lambda pr: send(px.urls["pull"], pr), prompts))
    finally:
        px.close()
    statuses = sorted(s for s, _ in results)
    assert statuses.count(200) >= 2 and set(statuses) <= {200, 503}, statuses
    for status, body in results:
        if status == 503:
            assert "no_kv_credit" in str(body)
    # P handed off exactly the admitted requests: the refused ones never reached it
    assert pair.pulls_served() - served == statuses.count(200)
    assert pair.pending(pair.d) == 0 and pair.pending(pair.p) == 0

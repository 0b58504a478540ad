"""A cold 2P2D fleet over NIXL: the first hand-off of every P/D pair succeeds, first time.

Regression test for the cold-start loss found under ``kvbridge bench serve --fleet 2P2D``: with
a P and a D confined to one core (vLLM's CPU worker binds every thread it starts to its
``cpu_bind`` core), the first UCX connection between them livelocked (P's NIXL progress thread
spinning on the half-open socket) and the first request of that pair stalled until its lease
expired. Engines here are placed like any fleet of kvbridge's (:func:`fleet_cores`: P and D on
disjoint cores), and every one of the four (P, D) pairs gets its very first pull and push
through a proxy that knows only that pair, so a stall cannot hide behind a retry on another
pair: each output must equal the single-engine reference, no proxy may have retried anything,
and every D must count the hand-offs it received.

Four tiny-model engines on this host (NIXL over UCX on 127.0.0.1); skipped where nixl does not
load.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvbridge import registry
from kvbridge.host.placement import fleet_cores
from kvbridge.tools import prom
from kvbridge.tools.client import complete, engine_stats, output_token_ids, probe
from kvbridge.tools.engines import VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(900)]

MAX_TOKENS = 8
GREEDY = {"ignore_eos": True}
PREFILLS, DECODES = ("P0", "P1"), ("D0", "D1")
PAIRS = [(p, d) for p in PREFILLS for d in DECODES]


@dataclass
class NixlFleet:
    engines: dict[str, VllmServer]
    proxies: dict[tuple[str, str], ProxyThread] = field(default_factory=dict)

    def control(self, name: str) -> str:
        ref = probe(self.engines[name].url).peer(0)
        assert ref is not None
        return str(ref.address)


def _engine(model: Path, logs: Path, name: str, core: str) -> VllmServer:
    role = "kv_producer" if name.startswith("P") else "kv_consumer"
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": f"fleet-nixl-{name}",
          "kv_connector_extra_config": {
              "backend": "nixl", "lease_s": 6.0, "heartbeat_s": 1, "push_timeout_s": 30,
              "prefill_wait_s": 30, "control_timeout_s": 5}}  # fmt: skip
    return VllmServer(model, name=name, kv_transfer_config=kv, cpu_bind=core,
                      env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                      extra_args=["--block-size", "32"], log_path=logs / f"{name}.log")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NixlFleet]:
    status = {s.name: s for s in registry.status()}
    if "nixl" not in status or not status["nixl"].loadable:
        pytest.skip("nixl backend unavailable: "
                    f"{status['nixl'].detail if 'nixl' in status else 'not installed'}")
    model = build_tiny_model()
    logs = tmp_path_factory.mktemp("fleet-nixl")
    p_cores, d_cores = fleet_cores(sorted(os.sched_getaffinity(0)), 2, 2)
    cores = dict(zip((*PREFILLS, *DECODES), map(str, (*p_cores, *d_cores)), strict=True))
    f = NixlFleet({n: _engine(model, logs, n, c) for n, c in cores.items()})
    try:
        start_servers(f.engines.values(), timeout=900)
        for p, d in PAIRS:  # one proxy per pair: a stalled hand-off cannot move elsewhere
            f.proxies[(p, d)] = ProxyThread([f.engines[p].url], [f.engines[d].url],
                                            modes=("pull", "push"), push_headroom=2,
                                            timeout_s=120.0).start()
        yield f
    finally:
        for px in f.proxies.values():
            px.close()
        for e in f.engines.values():
            e.stop()


def test_first_hand_off_of_every_pair_succeeds_at_once(fleet: NixlFleet) -> None:
    prompts = random_prompts(2 * len(PAIRS), 150, seed=4242)
    before = {d: engine_stats(fleet.control(d)).get("recv_ok", 0) for d in DECODES}
    k = 0
    for mode in ("pull", "push"):
        for pair in PAIRS:  # pull first: the pull of each pair is its first NIXL connection
            prompt = prompts[k]
            k += 1
            got = output_token_ids(complete(fleet.proxies[pair].urls[mode], prompt, MAX_TOKENS,
                                            extra=GREEDY, timeout=120))
            want = output_token_ids(complete(fleet.engines["P1"].url, prompt, MAX_TOKENS,
                                             extra=GREEDY, timeout=120))
            assert got == want, f"{mode} via {pair}"
    for pair, px in fleet.proxies.items():
        for mode, url in px.urls.items():
            text = prom.fetch(url, 30)
            retried = prom.total(text, "kvbridge_proxy_retries_total")
            assert retried == 0, f"the {mode} proxy of {pair} had to retry: {text}"
    for d in DECODES:  # each D received 2 pulls and 2 pushes over NIXL, none prefilled locally
        after = engine_stats(fleet.control(d))
        assert after.get("recv_ok", 0) - before[d] == 4, after
        assert after.get("recv_failed", 0) == 0, after

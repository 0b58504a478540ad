"""The composer end to end: ``compose(nixl, lmcache)`` = P/D over NIXL plus reuse through LMCache,
in one connector (``KVBridgeComposeConnector``), on real engines behind the proxy.

Request A goes through the proxy (P computes, D receives over NIXL and stores into its LMCache
engine); both engines' prefix caches are reset; A again through the proxy is served from the
tiers: P loads its 6 full blocks from its LMCache instead of recomputing, D loads them from its
own and receives only the partial last block from P. Outputs equal the single-engine reference
every time, and the log of the engine that posts the transfers names ``nixl`` as the member that
carries its peer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbridge import registry
from kvbridge.errors import KVBridgeError
from kvbridge.tools.client import (
    complete,
    engine_stats,
    output_token_ids,
    reset_prefix_cache,
    wait_stats,
)
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.proxies import ProxyThread, serve_pd
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 2 * 2 * BLOCK * 2 * 32 * 4  # bytes of one block of the tiny model (fp32)
MAX_TOKENS = 8
GREEDY = {"ignore_eos": True}


@dataclass
class Fleet:
    p: VllmServer
    d: VllmServer
    p_ctl: str
    d_ctl: str
    proxies: ProxyThread | None = None


def _missing() -> str | None:
    try:
        registry.load_class("nixl")
        registry.load_tier_class("lmcache")
    except KVBridgeError as exc:
        return str(exc)
    return None


def _engine(model: str, role: str, ctl_port: int, logs: Path) -> VllmServer:
    kv = {"kv_connector": "KVBridgeComposeConnector",
          "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          "engine_id": f"compose-{role}",
          "kv_connector_extra_config": {
              "side_channel_port": ctl_port,
              "backend_options": {"members": [
                  "nixl", {"name": "lmcache", "capacity_bytes": "64MiB"}]}}}
    return VllmServer(model, name=role, port=free_port(), kv_transfer_config=kv,
                      cpu_bind="0" if role == "prefill" else "1",
                      env={"VLLM_SERVER_DEV_MODE": "1", "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                      extra_args=["--block-size", str(BLOCK)], log_path=logs / f"{role}.log")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    why = _missing()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs nixl and lmcache, yet: {why}")
        pytest.skip(why)
    model = str(build_tiny_model())
    logs = tmp_path_factory.mktemp("logs")
    p_port, d_port = free_port(), free_port()
    f = Fleet(_engine(model, "prefill", p_port, logs), _engine(model, "decode", d_port, logs),
              f"tcp://127.0.0.1:{p_port}", f"tcp://127.0.0.1:{d_port}")
    with serve_pd(f.p, f.d) as f.proxies:
        yield f


def _run(url: str, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(url, prompt, MAX_TOKENS, extra=GREEDY, timeout=180))
    assert out is not None
    return out


def _d(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_handoff_over_nixl_then_reuse_through_lmcache(fleet: Fleet, mode: str) -> None:
    assert fleet.proxies is not None
    url = fleet.proxies.urls[mode]
    prompt = random_prompts(1, 200, seed={"pull": 501, "push": 502}[mode])[0]  # 6 blocks + 8
    ref = _run(fleet.p.url, prompt)
    key, ctl = ("pull_bytes", fleet.d_ctl) if mode == "pull" else ("push_bytes", fleet.p_ctl)
    stored = engine_stats(fleet.d_ctl).get("offload_stored_blocks_lmcache", 0)
    before = engine_stats(ctl)
    assert _run(url, prompt) == ref
    assert _d(engine_stats(ctl), before, key) == 7 * CHUNK  # the whole prompt crossed
    wait_stats(fleet.d_ctl, "offload_stored_blocks_lmcache", stored + 6)
    for e in (fleet.p, fleet.d):
        reset_prefix_cache(e.url)
    p0, d0, x0 = engine_stats(fleet.p_ctl), engine_stats(fleet.d_ctl), engine_stats(ctl)
    assert _run(url, prompt) == ref
    p1, d1, x1 = engine_stats(fleet.p_ctl), engine_stats(fleet.d_ctl), engine_stats(ctl)
    assert _d(d1, d0, "offload_hit_blocks_lmcache") == 6  # D: its prefix from its LMCache
    assert _d(p1, p0, "offload_hit_blocks_lmcache") == 6  # P: loaded, not recomputed
    assert _d(x1, x0, key) == CHUNK  # only the partial last block crossed over NIXL
    initiator = fleet.d if mode == "pull" else fleet.p  # the side that posts READ / WRITE
    assert initiator.log_path is not None
    assert "through nixl" in initiator.log_path.read_text(errors="replace"), (
        initiator.log_tail(30))


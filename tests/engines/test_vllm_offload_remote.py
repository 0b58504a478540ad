"""Remote and plugin tiers on real vLLM engines: Mooncake Store (a real ``mooncake_master`` on
127.0.0.1) shared by two engines, and LMCache. Each: request A, reset the prefix cache, A again
is served from the tier (counters), output identical to the first computation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from kvbridge.tools.engines import VllmServer, free_port, start_servers
from kvbridge.tools.mooncake_master import MooncakeMaster, skip_reason
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
MAX_TOKENS = 8
GREEDY = {"ignore_eos": True}


def _engine(model: str, name: str, ctl_port: int, tiers: list[dict[str, Any]], cpu: str,
            logs: Path) -> VllmServer:
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both", "engine_id": name,
          "kv_connector_extra_config": {"backend": "shm", "side_channel_port": ctl_port,
                                        "offload": {"tiers": tiers}}}
    return VllmServer(model, name=name, port=free_port(), kv_transfer_config=kv, cpu_bind=cpu,
                      env={"VLLM_SERVER_DEV_MODE": "1", "KVBRIDGE_ENGINE_SPIN_MS": "2",
                           "PYTHONHASHSEED": "0"},
                      extra_args=["--block-size", str(BLOCK)], log_path=logs / f"{name}.log")


def _run(url: str, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(url, prompt, MAX_TOKENS, extra=GREEDY, timeout=120))
    assert out is not None
    return out


def _d(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _unavailable(why: str) -> None:
    """Skip on a developer box without the tier; in CI (which installs it) that is a failure."""
    if os.environ.get("CI"):
        pytest.fail(f"CI installs every tier, yet: {why}")
    pytest.skip(why)


def _tier_missing(name: str) -> str | None:
    try:
        registry.load_tier_class(name)
    except KVBridgeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[VllmServer, str]]]:
    why = skip_reason() or _tier_missing("mooncake_store")
    if why:
        _unavailable(why)
    model = str(build_tiny_model())
    logs = tmp_path_factory.mktemp("logs")
    with MooncakeMaster() as master:
        tier = {"name": "mooncake_store", "master": master.master_address,
                "metadata_url": master.metadata_url, "global_segment_bytes": "64MiB",
                "local_buffer_bytes": "16MiB"}
        ports = [free_port(), free_port()]
        engines = [_engine(model, f"store-{i}", ports[i], [tier], str(i), logs)
                   for i in range(2)]
        try:
            start_servers(engines, timeout=600)
            yield [(e, f"tcp://127.0.0.1:{p}") for e, p in zip(engines, ports, strict=True)]
        finally:
            for e in engines:
                e.stop()


def test_mooncake_store_serves_the_same_engine_and_another(
        shared: list[tuple[VllmServer, str]]) -> None:
    (one, one_ctl), (two, two_ctl) = shared
    prompt = random_prompts(1, 200, seed=401)[0]  # 6 full blocks
    ref = _run(one.url, prompt)
    wait_stats(one_ctl, "offload_stored_blocks_mooncake_store", 6)
    reset_prefix_cache(one.url)
    before = engine_stats(one_ctl)
    assert _run(one.url, prompt) == ref
    assert _d(engine_stats(one_ctl), before, "offload_hit_blocks_mooncake_store") == 6
    # another engine, which never saw the prompt, loads it from the shared store
    before = engine_stats(two_ctl)
    assert _run(two.url, prompt) == ref
    after = engine_stats(two_ctl)
    assert _d(after, before, "offload_hit_blocks_mooncake_store") == 6
    assert _d(after, before, "offload_loaded_blocks") == 6


@pytest.fixture(scope="module")
def lmcache_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, str]]:
    why = _tier_missing("lmcache")
    if why:
        _unavailable(why)
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    tier = {"name": "lmcache", "capacity_bytes": "64MiB",
            "disk_path": str(tmp_path_factory.mktemp("lmcache-disk")),
            "disk_capacity_bytes": "128MiB"}
    e = _engine(str(build_tiny_model()), "lmcache", port, [tier], "0", logs)
    try:
        e.start().wait_ready(600)
        yield e, f"tcp://127.0.0.1:{port}"
    finally:
        e.stop()


def test_lmcache_tier_serves_identical_output(lmcache_engine: tuple[VllmServer, str]) -> None:
    e, ctl = lmcache_engine
    prompt = random_prompts(1, 200, seed=402)[0]
    ref = _run(e.url, prompt)
    wait_stats(ctl, "offload_stored_blocks_lmcache", 6)
    reset_prefix_cache(e.url)
    before = engine_stats(ctl)
    assert _run(e.url, prompt) == ref
    after = engine_stats(ctl)
    assert _d(after, before, "offload_hit_blocks_lmcache") == 6
    assert _d(after, before, "offload_load_failed") == 0

"""Hybrid models on real vLLM engines: sliding-window and full-attention KV-cache groups.

The model is :func:`~kvbridge.tools.tiny_model.build_tiny_hybrid_model` (Gemma 3 text, layers
sliding / sliding / full, window 48 tokens, blocks of 32): vLLM's hybrid KV-cache manager gives it
three KV-cache groups, and every prompt here is longer than the window, so the sliding-window
groups really drop blocks. D runs :class:`~kvbridge.testing.null_poison.KVBridgeNullPoisonConnector`
(vLLM's null block filled with NaN), so a read of a block a window dropped spoils the output
instead of passing unnoticed. Prompt lengths include the window's edge (``T - 1 - 48 + 1`` a
multiple of 32), where vLLM's recomputation of a loaded prompt's last token would read such a
block.

D's greedy output must equal a single engine's, in pull, push and headroom mode, with a partial
prefix hit on D, and exactly the blocks D lacks must move (bytes checked against the group
rule computed here). A plain D (``--disable-hybrid-kv-cache-manager``: one group) refuses a
hybrid P's hand-off with a message naming the groups. Three engines start once for the module
(≈1–3 min on 2 cores).
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge import params
from kvbridge.config import TransferMode
from kvbridge.errors import ConfigError
from kvbridge.messages import StatsQuery, StatsReply
from kvbridge.testing.clients import engine_client
from kvbridge.tools.client import complete, output_token_ids, probe
from kvbridge.tools.engines import EngineError, VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.tiny_model import HYBRID_WINDOW, build_tiny_hybrid_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 12
BLOCK = 32
#: one layer's K and V of one block: 2 KV heads x 32 tokens x (K 32 + V 32) x float32
BLOCK_BYTES = 2 * BLOCK * 64 * 4
_GREEDY = {"ignore_eos": True}


def _connector(role: str, engine_id: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"backend": "shm", "lease_s": 6.0, "heartbeat_s": 2,
                                          "push_timeout_s": 30},
            **extra}


def expected_bytes(prompt_tokens: int, hit_tokens: int = 0) -> int:
    """What D lacks of a prompt, per vLLM's rule for each group (computed here, not by
    kvbridge): the hand-off covers all but the last token (D computes it); the full-attention
    layer needs every block after the local hit, each sliding-window layer only those from the
    first one its window still reaches."""
    tokens = prompt_tokens - 1
    n_blocks = -(-tokens // BLOCK)
    first_kept = max(0, tokens - HYBRID_WINDOW + 1) // BLOCK
    skip = hit_tokens // BLOCK
    full = n_blocks - skip
    sliding = n_blocks - max(skip, first_kept)
    return (full + 2 * sliding) * BLOCK_BYTES


@dataclass
class Hybrid:
    p: VllmServer
    d: VllmServer
    plain: VllmServer
    proxies: ProxyThread
    plain_proxies: ProxyThread
    refs: dict[tuple[int, ...], list[int]]

    def stats(self, engine: VllmServer) -> dict[str, int]:
        ref = probe(engine.url).peer(0)
        assert ref is not None
        client = engine_client(30.0)
        try:
            reply = client.request(str(ref.address), StatsQuery())
        finally:
            client.close()
        assert isinstance(reply, StatsReply)
        return dict(reply.stats)

    def reference(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.refs:
            out = output_token_ids(complete(self.p.url, prompt, MAX_TOKENS, extra=_GREEDY))
            assert out is not None
            self.refs[key] = out
        return self.refs[key]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hybrid]:
    model = build_tiny_hybrid_model()
    logs = tmp_path_factory.mktemp("logs-hybrid")
    env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"}
    args = ["--block-size", str(BLOCK)]
    p = VllmServer(model, name="prefill", kv_transfer_config=_connector("kv_producer", "hyb-P"),
                   cpu_bind="0", env=env, extra_args=args, log_path=logs / "prefill.log")
    d = VllmServer(model, name="decode", cpu_bind="1", env=env, extra_args=args,
                   log_path=logs / "decode.log", kv_transfer_config=_connector(
                       "kv_consumer", "hyb-D", kv_connector="KVBridgeNullPoisonConnector",
                       kv_connector_module_path="kvbridge.testing.null_poison"))
    plain = VllmServer(model, name="plain-decode", cpu_bind="1", env=env,
                       extra_args=[*args, "--disable-hybrid-kv-cache-manager"],
                       log_path=logs / "plain.log",
                       kv_transfer_config=_connector("kv_consumer", "plain-D"))
    proxies: list[ProxyThread] = []
    try:
        start_servers([p, d, plain], timeout=900)
        proxies.append(ProxyThread([p.url], [d.url], modes=("pull", "push", "headroom"),
                                   push_headroom=2).start())
        proxies.append(ProxyThread([p.url], [plain.url], modes=("pull", "push")).start())
        yield Hybrid(p, d, plain, proxies[0], proxies[1], {})
    finally:
        for proxy in proxies:
            proxy.close()
        for engine in (p, d, plain):
            engine.stop()


def _via(url: str, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(url, prompt, MAX_TOKENS, extra=_GREEDY, timeout=180))
    assert out is not None
    return out


def _moved(before: dict[str, int], after: dict[str, int]) -> int:
    keys = ("pull_bytes", "push_received_bytes")
    return sum(after.get(k, 0) - before.get(k, 0) for k in keys)


#: longer than the window; 176 and 208 put the window's edge on a block boundary
LENGTHS = {"pull": [100, 176, 300], "push": [150, 208, 257], "headroom": [176, 200]}


# headroom, not auto: every request must hand off (the planner may choose D alone)
@pytest.mark.parametrize("mode", ["pull", "push", "headroom"])
def test_decode_output_equals_a_single_engines(hybrid: Hybrid, mode: str) -> None:
    prompts = [random_prompts(1, n, seed=100 + n)[0] for n in LENGTHS[mode]]
    refs = [hybrid.reference(p) for p in prompts]
    before = hybrid.stats(hybrid.d)
    outs = [_via(hybrid.proxies.urls[mode], p) for p in prompts]
    assert outs == refs
    after = hybrid.stats(hybrid.d)
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == len(prompts)
    assert after.get("recv_failed", 0) == before.get("recv_failed", 0)
    assert _moved(before, after) == sum(expected_bytes(len(p)) for p in prompts)


def test_concurrent_hand_offs_in_both_modes(hybrid: Hybrid) -> None:
    prompts = random_prompts(4, 230, seed=121)
    refs = [hybrid.reference(p) for p in prompts]
    before = hybrid.stats(hybrid.d)
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(_via, hybrid.proxies.urls[m], p)
                for m, p in zip(["pull", "push"] * 2, prompts, strict=True)]
        outs = [f.result(timeout=300) for f in futs]
    assert outs == refs
    after = hybrid.stats(hybrid.d)
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == len(prompts)
    assert _moved(before, after) == len(prompts) * expected_bytes(230)


def test_partial_prefix_hit_on_decode_moves_only_missing_blocks(hybrid: Hybrid) -> None:
    base = random_prompts(1, 160, seed=141)[0]
    # D computes 129 tokens itself: vLLM then has 4 blocks (128 tokens) of every group cached
    # (with a sliding window, a hit ends at a block the last computed token does not end)
    complete(hybrid.d.url, base[:129], 1)
    # the push leaves base + its 40 tokens cached: the pull then hits all of base (5 blocks)
    for mode, seed, hit in (("push", 142, 128), ("pull", 143, 160)):
        prompt = base + random_prompts(1, 40, seed=seed)[0]
        ref = hybrid.reference(prompt)
        before = hybrid.stats(hybrid.d)
        assert _via(hybrid.proxies.urls[mode], prompt) == ref
        after = hybrid.stats(hybrid.d)
        assert _moved(before, after) == expected_bytes(len(prompt), hit_tokens=hit), mode
        assert 0 < expected_bytes(len(prompt), hit) < expected_bytes(len(prompt))


def test_layerwise_push(hybrid: Hybrid) -> None:
    """P writes each layer's blocks of its own group as soon as that layer's KV is written."""
    prompt = random_prompts(1, 250, seed=151)[0]
    ref = hybrid.reference(prompt)
    p_before, d_before = hybrid.stats(hybrid.p), hybrid.stats(hybrid.d)
    d_params = params.push_decode_request(probe(hybrid.p.url), "hybrid-layerwise-1")
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, hybrid.d.url, prompt, MAX_TOKENS, d_params, False, _GREEDY)
        time.sleep(1.0)  # let D register first, so P can write layer by layer
        complete(hybrid.p.url, prompt, 1, params.prefill_request(
            "hybrid-layerwise-1", TransferMode.PUSH, layerwise=True))
        out = output_token_ids(fut.result(timeout=120))
    assert out == ref
    p_after, d_after = hybrid.stats(hybrid.p), hybrid.stats(hybrid.d)
    assert p_after.get("push_layerwise", 0) == p_before.get("push_layerwise", 0) + 1
    assert _moved(d_before, d_after) == expected_bytes(len(prompt))


def test_a_plain_decode_refuses_a_hybrid_prefills_hand_off(hybrid: Hybrid) -> None:
    """One KV-cache group on D, three on P: pull params are refused at D (served locally, the
    warning names the groups); a push fails its handshake and the client learns why."""
    prompt = random_prompts(1, 150, seed=161)[0]
    ref = hybrid.reference(prompt)
    before = hybrid.stats(hybrid.plain)
    assert _via(hybrid.plain_proxies.urls["pull"], prompt) == ref  # computed on D itself
    after = hybrid.stats(hybrid.plain)
    assert after.get("params_rejected", 0) == before.get("params_rejected", 0) + 1
    assert after.get("recv_ok", 0) == before.get("recv_ok", 0)
    log = Path(str(hybrid.plain.log_path)).read_text(errors="replace")
    assert "names 3 KV-cache group(s), this engine has 1" in log

    with pytest.raises(EngineError) as info:
        _via(hybrid.plain_proxies.urls["push"], prompt)
    assert "KV-cache groups differ: 1 (no hybrid KV cache) here, 3 (sliding window 48" in (
        info.value.body), info.value.body


# -- start-up: what is refused (vLLM's own group specs, no engine) ------------------------------


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)])


def test_group_kinds_kvbridge_moves_and_refuses() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvbridge.groups import GroupKind
    from kvbridge.integrations.vllm_groups import kv_groups

    head = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    full = FullAttentionSpec(block_size=32, **head)
    sliding = SlidingWindowSpec(block_size=32, sliding_window=48, **head)
    assert kv_groups(_config(full)) == ()  # one full-attention group: not hybrid
    groups = kv_groups(_config(sliding, full))
    assert [(g.kind, g.window) for g in groups] == [(GroupKind.SLIDING, 48),
                                                   (GroupKind.FULL, None)]
    assert len(kv_groups(_config(sliding))) == 1  # a sliding window alone still drops blocks
    mamba = MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(ConfigError, match=r"group 1 .* is MambaSpec \(Mamba/SSM state"):
        kv_groups(_config(full, mamba))
    local = ChunkedLocalAttentionSpec(block_size=32, attention_chunk_size=64, **head)
    with pytest.raises(ConfigError, match="is ChunkedLocalAttentionSpec"):
        kv_groups(_config(local, full))


def test_offload_is_refused_for_a_hybrid_model() -> None:
    """The connector itself (scheduler and worker role) refuses offload tiers with groups."""
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvbridge.integrations.vllm import KVBridgeConnector, register

    register()
    head = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    groups = _config(SlidingWindowSpec(block_size=32, sliding_window=48, **head),
                     FullAttentionSpec(block_size=32, **head))
    offload = {"tiers": [{"name": "dram", "capacity_bytes": 1 << 20}]}
    config = VllmConfig(kv_transfer_config=KVTransferConfig(
        kv_connector="KVBridgeConnector", kv_role="kv_both",
        kv_connector_extra_config={"backend": "shm", "offload": offload}))
    for role in KVConnectorRole:
        with pytest.raises(ConfigError, match="offload tiers do not support hybrid KV-cache "
                                              r"groups yet \(2 groups\)"):
            KVBridgeConnector(config, role, groups)

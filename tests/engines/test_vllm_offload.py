"""Offload tiers on a real vLLM engine: reuse after the prefix cache is reset, a restart that
keeps the disk tier (and loads layer by layer, ``layerwise_load``), a full tier that evicts, a
corrupted disk chunk that is recomputed.

One engine (``kv_both``, backend ``shm``) with ``dram`` then ``disk`` (restarted once from a
copy of its checkpoint elsewhere, which must still hit the disk tier); every output is compared
with the first, tier-less computation of the same prompt (the single-engine reference), and
the engine's own counters say where the KV came from.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbridge.tools.client import (
    complete,
    engine_stats,
    output_token_ids,
    reset_prefix_cache,
    wait_stats,
)
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 2 * 2 * BLOCK * 2 * 32 * 4  # layers × K/V × block × kv heads × head dim × fp32
MAX_TOKENS = 8
GREEDY = {"ignore_eos": True}


@dataclass
class Engine:
    model: str
    disk: Path
    logs: Path
    ctl_port: int = field(default_factory=free_port)
    server: VllmServer | None = None
    refs: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    events_port: int = 0  # vLLM's KV-events publisher connects here (the test's subscriber)

    @property
    def ctl(self) -> str:
        return f"tcp://127.0.0.1:{self.ctl_port}"

    def start(self, layerwise: bool = False) -> None:
        offload = {"tiers": [{"name": "dram", "capacity_bytes": 24 * CHUNK},
                             {"name": "disk", "path": str(self.disk),
                              "capacity_bytes": 48 * CHUNK}]}
        kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
              "engine_id": "offload-E",
              "kv_connector_extra_config": {"backend": "shm", "side_channel_port": self.ctl_port,
                                            "offload": offload}}
        self.server = VllmServer(self.model, name="offload", port=free_port(),
                                 kv_transfer_config=kv, cpu_bind="0",
                                 env={"VLLM_SERVER_DEV_MODE": "1",
                                      "KVBRIDGE_ENGINE_SPIN_MS": "2",
                                      "KVBRIDGE_OFFLOAD_LAYERWISE_LOAD": str(int(layerwise))},
                                 extra_args=["--block-size", str(BLOCK)] + (
                                     ["--kv-events-config", json.dumps({
                                         "enable_kv_cache_events": True, "publisher": "zmq",
                                         "endpoint": f"tcp://127.0.0.1:{self.events_port}"})]
                                     if self.events_port else []),
                                 log_path=self.logs / f"engine-{time.monotonic_ns()}.log")
        self.server.start().wait_ready(600)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def run(self, prompt: list[int], salt: str | None = None) -> list[int]:
        """Greedy tokens of ``prompt`` (under ``cache_salt`` ``salt``, a tenant)."""
        assert self.server is not None
        extra = {**GREEDY, "cache_salt": salt} if salt else GREEDY
        out = output_token_ids(complete(self.server.url, prompt, MAX_TOKENS, extra=extra,
                                        timeout=120))
        assert out is not None
        return out

    def reference(self, prompt: list[int]) -> list[int]:
        """The first computation of ``prompt`` (call before any tier holds it)."""
        key = tuple(prompt)
        if key not in self.refs:
            self.refs[key] = self.run(prompt)
        return self.refs[key]

    def reset(self) -> None:
        assert self.server is not None
        reset_prefix_cache(self.server.url)

    def stats(self) -> dict[str, int]:
        return engine_stats(self.ctl)

    def settle(self, key: str, at_least: int, timeout: float = 30.0) -> dict[str, int]:
        """Counters once ``key`` reached ``at_least`` (write-behind is asynchronous)."""
        return wait_stats(self.ctl, key, at_least, timeout)


class Subscriber:
    """vLLM's KV events as a router receives them: a ZeroMQ SUB bound on 127.0.0.1 (vLLM's
    publisher connects to a non-wildcard endpoint), each message decoded with vLLM's own
    ``KVEventBatch``."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.events: list[Any] = []
        self.payloads: list[bytes] = []  # as they came: what a proxy's feed decodes itself
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)
                self.payloads.append(payload)

    def taken(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


@pytest.fixture(scope="module")
def subscriber() -> Iterator[Subscriber]:
    sub = Subscriber()
    try:
        yield sub
    finally:
        sub.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, subscriber: Subscriber) -> Iterator[Engine]:
    e = Engine(str(build_tiny_model()), tmp_path_factory.mktemp("disk"),
               tmp_path_factory.mktemp("logs"), events_port=subscriber.port)
    try:
        e.start()
        yield e
    finally:
        e.stop()


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


PROMPTS = random_prompts(12, 200, seed=91)  # 6 full blocks each (the 7th is partial)


def test_reset_prefix_cache_then_the_tier_serves_identical_output(engine: Engine) -> None:
    prompt = PROMPTS[0]
    ref = engine.reference(prompt)
    stats = engine.settle("offload_stored_blocks_disk", 6)
    assert stats.get("offload_stored_blocks_dram", 0) >= 6
    engine.reset()
    before = engine.stats()
    assert engine.run(prompt) == ref
    after = engine.stats()
    assert _delta(after, before, "offload_hit_blocks_dram") == 6
    assert _delta(after, before, "offload_loaded_blocks") == 6
    assert _delta(after, before, "offload_load_failed") == 0
    # a prompt that shares only its first two blocks hits only those
    other = prompt[:2 * BLOCK] + PROMPTS[1][2 * BLOCK:]
    ref_other = engine.reference(other)  # computed: vLLM's own cache has blocks 0-1 now
    engine.reset()
    before = engine.stats()
    assert engine.run(other) == ref_other
    assert _delta(engine.stats(), before, "offload_loaded_blocks") == 6  # stored after ref


def test_tenants_never_share_tier_entries(engine: Engine) -> None:
    """Tier keys are salted with vLLM's ``cache_salt``: tenant B never hits what tenant A
    stored (nor does a request without a salt), and A's repeat does."""
    prompt = random_prompts(1, 200, seed=93)[0]
    before = engine.stats()
    ref = engine.run(prompt, salt="tenant-A")
    engine.settle("offload_stored_blocks_disk",
                  before.get("offload_stored_blocks_disk", 0) + 6)

    def hits(salt: str | None) -> int:
        engine.reset()
        b = engine.stats()
        assert engine.run(prompt, salt) == ref
        a = engine.stats()
        assert _delta(a, b, "offload_load_failed") == 0
        return sum(_delta(a, b, f"offload_hit_blocks_{t}") for t in ("dram", "disk"))

    assert hits("tenant-B") == 0
    assert hits(None) == 0
    assert hits("tenant-A") == 6


def test_full_tiers_evict_without_errors(engine: Engine) -> None:
    refs = {i: engine.reference(PROMPTS[i]) for i in range(2, 12)}  # 60 chunks into 24 / 48
    stats = engine.settle("offload_evicted_blocks_disk", 1)
    assert stats.get("offload_evicted_blocks_dram", 0) > 0
    assert stats.get("offload_evicted_blocks_disk", 0) > 0
    assert not any(k.startswith(("offload_tier_errors", "offload_store_failed")) for k in stats)
    engine.reset()
    for i in (2, 11):  # the oldest (evicted, recomputed) and the newest (a hit)
        assert engine.run(PROMPTS[i]) == refs[i]
    files = list(engine.disk.glob("*/*/*.kvb"))
    assert 0 < len(files) <= 48


def test_kv_events_name_every_tier_store_and_eviction_with_vllms_hashes(
        engine: Engine, subscriber: Subscriber) -> None:
    """A router reading vLLM's KV events sees the tiers' stores and evictions as vLLM's own
    ``BlockStored`` / ``BlockRemoved``, with medium and tier, under the block hashes vLLM
    gives the same blocks in its own cache."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    def ours(kind: type, tier: str) -> list[Any]:
        return [h for e in subscriber.taken() if isinstance(e, kind) and e.ownership == tier
                for h in e.block_hashes]

    def behind(st: dict[str, int]) -> list[str]:
        return [f"{tier} {what}: {len(ours(kind, tier))} events, {st.get(key, 0)} counted"
                for tier in ("dram", "disk")
                for what, kind, key in (("stored", BlockStored, f"offload_stored_blocks_{tier}"),
                                        ("evicted", BlockRemoved,
                                         f"offload_evicted_blocks_{tier}"))
                if len(ours(kind, tier)) != st.get(key, 0)]

    # events reach vLLM with the next engine step after the store (write-behind included)
    deadline = time.monotonic() + 30
    while behind(stats := engine.stats()):
        assert time.monotonic() < deadline, behind(stats)
        engine.run(PROMPTS[0])  # a step that stores nothing new (every tier holds it)
        time.sleep(0.5)
    for tier, medium in (("dram", "CPU"), ("disk", "STORAGE")):
        assert {e.medium for e in subscriber.taken()
                if getattr(e, "ownership", None) == tier} == {medium}
    # the hashes are vLLM's: its own events for the same blocks name them alike
    vllm_own = {h for e in subscriber.taken() if isinstance(e, BlockStored) and e.ownership is None
                for h in e.block_hashes}
    assert ours(BlockStored, "disk") and set(ours(BlockStored, "disk")) <= vllm_own
    assert stats.get("kv_events_unknown", 0) == 0


def test_the_planner_sees_where_a_prefix_is_from_the_engines_events(
        engine: Engine, subscriber: Subscriber) -> None:
    """The proxy's event index (what the planner asks where a prefix's KV is), fed the very
    batches this engine published: a new prompt is held in vLLM's cache (GPU); once that cache
    is dropped, the same prompt is held in the host-memory tier (CPU) — the tier's LookupBuffer,
    seen through its events — and under another tenant's salt, nowhere."""
    from kvbridge.proxy.kvevents import EventIndex
    from kvbridge.proxy.prefixes import prompt_of

    prompt = random_prompts(1, 200, seed=93)[0]  # 6 whole blocks
    start = len(subscriber.payloads)
    stored = engine.stats().get("offload_stored_blocks_dram", 0)
    engine.reference(prompt)
    engine.settle("offload_stored_blocks_dram", stored + 6)
    engine.run(PROMPTS[0])  # a step after the store: its events reach vLLM's publisher
    engine.reset()  # vLLM's own cache dropped: AllBlocksCleared
    engine.run(PROMPTS[0])
    body = {"model": "tiny", "prompt": prompt}
    held: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        index = EventIndex("tiny")
        for payload in subscriber.payloads[start:]:
            index.apply(payload)
        held = index.held(prompt_of(body, chat=False))
        if held.get("CPU", 0) == 6 * 32:
            break
        time.sleep(0.5)
    assert held == {"GPU": 0, "CPU": 6 * 32, "STORAGE": 0}, (held, index.stats)
    assert sum(index.held(prompt_of({**body, "cache_salt": "other"}, chat=False)).values()) == 0


def test_restart_keeps_the_disk_tier_and_corruption_is_recomputed(engine: Engine) -> None:
    prompt, victim = PROMPTS[11], random_prompts(1, 200, seed=92)[0]
    ref = engine.reference(prompt)
    engine.reset()
    engine.run(prompt)  # touch it: most recently used on every tier
    files_before = set(engine.disk.glob("*/*/*.kvb"))
    stored = engine.stats().get("offload_stored_blocks_disk", 0)
    ref_victim = engine.reference(victim)
    engine.settle("offload_stored_blocks_disk", stored + 6)
    victim_files = sorted(set(engine.disk.glob("*/*/*.kvb")) - files_before)
    assert len(victim_files) == 6
    engine.stop()
    path = victim_files[0]  # one chunk of the victim, whichever block it is
    blob = bytearray(path.read_bytes())
    blob[-7] ^= 0x55
    path.write_bytes(bytes(blob))
    # restarted from a copy of the checkpoint in another directory, with other modification
    # times (the model identity is the content: the disk tier still hits), and with layer-wise
    # loads (the FIFO pipe to the forward pass): the same outputs
    engine.model = str(shutil.copytree(engine.model, engine.disk.parent / "model-copy",
                                       copy_function=shutil.copyfile))
    engine.start(layerwise=True)
    before = engine.stats()
    assert engine.run(prompt) == ref
    after = engine.stats()
    assert _delta(after, before, "offload_hit_blocks_disk") == 6  # dram was lost, disk was not
    assert _delta(after, before, "offload_layerwise_steps") >= 1
    # the forward waited for every layer it read (vLLM calls wait_for_layer_load per layer)
    steps = _delta(after, before, "offload_layerwise_steps")
    assert _delta(after, before, "offload_layerwise_layers_waited") == 2 * steps
    assert engine.run(victim) == ref_victim
    final = engine.stats()
    assert _delta(final, after, "offload_load_failed") == 1
    assert _delta(final, after, "offload_loaded_blocks") < 6
    # the corrupted file was removed (and, once the recomputed KV is stored again, rewritten)
    assert not path.exists() or path.read_bytes() != bytes(blob)

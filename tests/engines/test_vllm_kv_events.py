"""The proxy's precise prefix index on a real vLLM engine: the engine, started with a zmq
``--kv-events-config``, names its publisher in its probe answer; a :class:`KvEventsFeed` on that
endpoint fills an :class:`EventIndex` whose answer for a token-id prompt is the prompt's whole
blocks, held on GPU, under its own ``cache_salt`` only."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import requests
import zmq.asyncio

from kvbridge.params import parse
from kvbridge.proxy.kvevents import EventIndex
from kvbridge.proxy.kvfeed import FeedKey, KvEventsFeed
from kvbridge.proxy.prefixes import prompt_of
from kvbridge.proxy.routing import probe_body
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.tiny_model import build_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 32


async def _follow(endpoint: str, topic: str, model: str, url: str) -> None:
    ctx = zmq.asyncio.Context()
    feed = KvEventsFeed(url, FeedKey(endpoint, topic, None, None), EventIndex(model), ctx)
    feed.start()
    try:
        await asyncio.sleep(1.0)  # the SUB joins before the prompt's blocks are published
        ids = [(i * 7919) % 1000 + 10 for i in range(3 * BLOCK + 5)]  # 3 whole blocks
        body = {"model": model, "prompt": ids, "max_tokens": 1, "cache_salt": "tenant-A"}
        r = await asyncio.to_thread(requests.post, url + "/v1/completions", json=body,
                                    timeout=120)
        r.raise_for_status()
        mine = prompt_of(body, chat=False)
        end = time.monotonic() + 20
        while feed.index.held(mine)["GPU"] < 3 * BLOCK and time.monotonic() < end:
            await asyncio.sleep(0.1)
        assert feed.index.held(mine) == {"GPU": 3 * BLOCK, "CPU": 0.0, "STORAGE": 0.0}, (
            feed.stats, feed.index.stats)
        other = prompt_of({**body, "cache_salt": "tenant-B"}, chat=False)
        assert sum(feed.index.held(other).values()) == 0
        unsalted = prompt_of({k: v for k, v in body.items() if k != "cache_salt"}, chat=False)
        assert sum(feed.index.held(unsalted).values()) == 0
        assert feed.stats["bad_messages"] == feed.stats["bad_batches"] == 0
        assert feed.index.stats["unknown_parent"] == feed.index.stats["extra_keys"] == 0
    finally:
        await feed.close()
        ctx.term()


def test_events_of_a_real_engine_fill_the_index(tmp_path: Path) -> None:
    events_port = free_port()
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both", "engine_id": "events-E",
          "kv_connector_extra_config": {"backend": "shm", "side_channel_port": free_port()}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{events_port}", "topic": "kv"}
    server = VllmServer(str(build_tiny_model()), name="events", port=free_port(),
                        kv_transfer_config=kv, cpu_bind="0",
                        extra_args=["--block-size", str(BLOCK),
                                    "--kv-events-config", json.dumps(events)],
                        log_path=tmp_path / "engine.log")
    try:
        server.start().wait_ready(600)
        model = requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        answer = requests.post(server.url + "/v1/completions", json=probe_body(model),
                               timeout=60).json()
        params = parse(answer["kv_transfer_params"])
        assert params.kvbridge_kv_events == f"tcp://{params.remote_host}:{events_port}" or (
            params.kvbridge_kv_events == f"tcp://[{params.remote_host}]:{events_port}")
        assert params.kvbridge_kv_events_topic == "kv"
        asyncio.run(_follow(params.kvbridge_kv_events, "kv", model, server.url))
    finally:
        server.stop()

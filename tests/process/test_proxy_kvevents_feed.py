"""KV events over real ZeroMQ: a PUB on 127.0.0.1 publishing vLLM-format batches, the proxy's
feeds subscribed (kvbridge.proxy.kvfeed), hostile publishers, and a proxy with --kv-events whose
stand-in engines name their publishers in their probe answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvbridge.proxy.app import ProxyServer
from kvbridge.proxy.kvevents import MAX_PAYLOAD, EventIndex
from kvbridge.proxy.kvfeed import EnginePrefixes, FeedKey, KvEventsFeed
from kvbridge.proxy.prefixes import prompt_of
from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
MODEL = "tiny"
IDS = list(range(500, 500 + 130))  # 4 blocks of 32 and 2 tokens
HASHES = [b"blk" + bytes([i]) for i in range(4)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([0.5, list(events), None])


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int],
           salt: str | None = None, medium: str | None = None) -> dict[str, Any]:
    extra = [[salt] if salt and parent is None and i == 0 else None for i in range(len(hashes))]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 32, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": extra}


def removed(hashes: list[bytes], medium: str | None = None) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class Pub:
    """A vLLM-like publisher: (topic, 8-byte big-endian seq, msgpack batch) on a PUB socket."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: str = "kv") -> None:
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0

    async def send(self, payload: bytes, seq: int | None = None) -> None:
        s = self.seq if seq is None else seq
        self.seq = s + 1
        await self.sock.send_multipart((self.topic, s.to_bytes(8, "big"), payload))


async def until(cond: Callable[[], bool], what: str, pub: Pub | None = None,
                resend: bytes | None = None, timeout: float = 10.0) -> None:
    """Wait for ``cond`` (re-sending ``resend`` meanwhile: a SUB joins a moment late)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        if pub is not None and resend is not None:
            await pub.send(resend)
        await asyncio.sleep(0.05)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def test_a_feed_follows_stores_and_removals(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    feed = KvEventsFeed("http://e", FeedKey(pub.endpoint, "kv", "g", None),
                        EventIndex(MODEL), ctx)
    feed.start()
    try:
        salted = prompt_of({"model": MODEL, "prompt": IDS, "cache_salt": "A"}, chat=False)
        first = batch(stored(HASHES[:2], None, IDS[:64], salt="A"))
        await until(lambda: feed.index.held(salted)["GPU"] == 64, "the first store", pub, first)
        await pub.send(batch(stored(HASHES[2:], HASHES[1], IDS[64:128]),
                             stored(HASHES[:4], None, IDS[:128], salt="A", medium="CPU")))
        await until(lambda: feed.index.held(salted) == {"GPU": 128, "CPU": 0, "STORAGE": 0},
                    "the chained store")
        other = prompt_of({"model": MODEL, "prompt": IDS, "cache_salt": "B"}, chat=False)
        assert sum(feed.index.held(other).values()) == 0
        await pub.send(batch(removed(HASHES[:1])))
        await until(lambda: feed.index.held(salted) == {"GPU": 96, "CPU": 32, "STORAGE": 0},
                    "the removal")
        await pub.send(batch(removed(HASHES[3:])), seq=pub.seq + 5)  # 5 batches missed
        await until(lambda: feed.stats["gaps"] == 1, "the gap counted")
        assert feed.running and feed.stats["bad_messages"] == 0
    finally:
        await feed.close()
        pub.sock.close(linger=0)
    assert not feed.running


async def test_a_hostile_publisher_is_counted_and_bounded(ctx: zmq.asyncio.Context) -> None:
    pub = Pub(ctx)
    feed = KvEventsFeed("http://e", FeedKey(pub.endpoint, "kv", "g", None),
                        EventIndex(MODEL, capacity=256), ctx)
    feed.start()
    try:
        hello = batch(stored(HASHES[:1], None, IDS[:32]))
        await until(lambda: feed.stats["batches"] > 0, "subscribed", pub, hello)
        base = rss()
        junk = b"\xc1" * (1 << 20)
        for i in range(150):
            await pub.sock.send(pub.topic + b"garbage")  # one frame
            await pub.sock.send_multipart([pub.topic, b"\x00" * 8, junk])  # not msgpack
            await pub.sock.send_multipart([pub.topic, b"short", b"x"])  # a bad seq frame
            await pub.sock.send_multipart([pub.topic] + [b"f" * 1024] * 500)  # 500 frames
            await pub.send(batch(*[stored([b"%d-%d" % (i, j)], None, [i] * 32)
                                   for j in range(8)]))
            if i % 10 == 0:
                await asyncio.sleep(0.01)
        await pub.sock.send_multipart([pub.topic, b"\x00" * 8, b"\x00" * (MAX_PAYLOAD + 1)])
        await asyncio.sleep(1.0)
        last = batch(stored([b"z"], None, [9] * 32))
        z = prompt_of({"model": MODEL, "prompt": [9] * 33}, chat=False)
        await until(lambda: feed.index.held(z)["GPU"] == 32, "a good batch after the junk",
                    pub, last, timeout=20)
        assert feed.stats["disconnects"] >= 1  # the oversized message: dropped, reconnected
        assert feed.running
        assert feed.stats["bad_messages"] > 0 and feed.stats["bad_batches"] > 0
        assert feed.index.size() <= 256
        assert rss() - base < 200 << 20, (rss() - base) >> 20
    finally:
        await feed.close()
        pub.sock.close(linger=0)


class Engine:
    """A stand-in engine whose probe names a KV-events publisher (a real PUB socket)."""

    def __init__(self, pub: Pub, generation: str) -> None:
        self.pub = pub
        self.generation = generation
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Engine:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": MODEL}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = None
        if (body.get("kv_transfer_params") or {}).get("kvbridge_probe"):
            params = {"remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5601,
                      "kvbridge_generation": self.generation,
                      "kvbridge_kv_events": self.pub.endpoint, "kvbridge_kv_events_topic": "kv"}
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_proxy_with_kv_events_places_by_what_engines_publish(
        ctx: zmq.asyncio.Context) -> None:
    pubs = [Pub(ctx), Pub(ctx), Pub(ctx)]
    engines = [await Engine(pub, "g1").start() for pub in pubs]
    proxy = ProxyServer(ProxySettings([engines[0].url, engines[2].url], [engines[1].url], port=0,
                                      mode=ProxyMode.PULL, kv_events=True,
                                      connect_timeout_s=1.0))
    try:
        await proxy.start()
        prefixes = proxy.prefixes
        assert isinstance(prefixes, EnginePrefixes)
        assert proxy.dispatcher.planning.index is prefixes
        d = engines[1].url
        await until(lambda: len(prefixes.feeds) == 3, "every feed (the decode engine's too)")
        p = prompt_of({"model": MODEL, "prompt": IDS}, chat=False)
        # nothing published yet: the events say nothing is held (no guess from the fallback)
        assert prefixes.held_by_medium(d, p) == {"GPU": 0, "CPU": 0, "STORAGE": 0}
        await until(lambda: prefixes.held(d, p) == 128, "D's store", pubs[1],
                    batch(stored(HASHES, None, IDS[:128])))
        assert prefixes.held(engines[0].url, p) == 0
        # the planner's features split what D holds by medium: its prefix cache here
        planning = proxy.dispatcher.planning
        assert planning._held(d, p) == (128, 0, 0)
        await until(lambda: planning._held(d, p) == (96, 0, 32), "a block moved to disk",
                    pubs[1], batch(removed(HASHES[3:], None),
                                   stored(HASHES[3:], HASHES[2], IDS[96:128],
                                          medium="STORAGE")))
        text = prompt_of({"model": MODEL, "prompt": "some text " * 40}, chat=False)
        prefixes.record(d, text)
        # a text prompt cannot match events: the approximate index answers (6 whole units)
        assert prefixes.held_by_medium(d, text) == {"unknown": 96.0}
        # D restarts: a new generation in its probe closes the feed and forgets its index
        engines[1].generation = "g2"
        e = proxy.fleet.find(d)
        proxy.fleet.drop_probe(e, "generation_changed")
        await until(lambda: d in prefixes.feeds and prefixes.feeds[d].key.generation == "g2",
                    "the new feed")
        assert prefixes.held(d, p) == 0
        # removed: its feed closes
        proxy.fleet.remove(engines[0].url)
        await until(lambda: engines[0].url not in prefixes.feeds, "the feed of a removed engine")
    finally:
        await proxy.stop()
        for eng in engines:
            await eng.stop()
        for pub in pubs:
            pub.sock.close(linger=0)
    assert proxy.prefixes is not None and not proxy.prefixes.feeds
    assert proxy.fleet.probe_listener is None

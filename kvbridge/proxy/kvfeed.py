"""The engines' KV events, subscribed to: a precise prefix index for the planner (asyncio).

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:PORT", "topic": "kv"}'`` names its publisher in its probe answer
(``kvbridge_kv_events``, ``kvbridge_kv_events_topic``). With ``--kv-events`` the proxy:

- probes every engine in rotation that has no probe yet (a decode engine too: the planner needs
  what each D holds), every ``interval_s`` and at once when a probe is learnt or dropped
  (:attr:`kvbridge.proxy.pool.Fleet.probe_listener`);
- runs one :class:`KvEventsFeed` per engine that named a publisher: a ZeroMQ SUB socket on that
  endpoint and topic, each batch applied to the engine's
  :class:`~kvbridge.proxy.kvevents.EventIndex` (keyed by the model name the engine serves,
  learnt from its ``/v1/models``). A dropped or changed probe (the engine left, restarted, or
  reloaded its weights) closes the feed and forgets its index; a new probe starts a new one;
- answers the planner through :class:`EnginePrefixes`, a drop-in
  :class:`~kvbridge.proxy.prefixes.PrefixIndex`: for an engine with a feed and a token-id
  prompt, what the events say (:meth:`EnginePrefixes.held_by_medium`); otherwise the
  approximate index of what the proxy sent where, which keeps learning either way.

Bounded: each SUB socket queues at most :data:`RCV_HWM` messages and refuses a message over
:data:`~kvbridge.proxy.kvevents.MAX_PAYLOAD` (ZeroMQ drops the connection and reconnects); a
message of other than three frames is dropped without its extra frames being kept; a flood
yields to the event loop every :data:`_YIELD_EVERY` messages. Sequence gaps (a missed batch)
are counted; the blocks after one whose parent was missed are skipped by the index.

Contract: runs on the proxy's event loop; :meth:`EnginePrefixes.run` until cancelled,
:meth:`EnginePrefixes.close` closes every socket and the ZeroMQ context (idempotent). Nothing
here raises into the event loop: a feed's failure is logged, counted and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvbridge.proxy.failures import LegFailed
from kvbridge.proxy.kvevents import DEFAULT_BLOCKS, MAX_PAYLOAD, EventIndex
from kvbridge.proxy.members import Engine
from kvbridge.proxy.pool import Fleet
from kvbridge.proxy.prefixes import DEFAULT_CAPACITY, PrefixIndex, Prompt

__all__ = ["RCV_HWM", "EnginePrefixes", "FeedKey", "KvEventsFeed"]

log = logging.getLogger("kvbridge.proxy")

RCV_HWM = 64
"""Most messages a SUB socket queues before ZeroMQ drops new ones (counted as a seq gap)."""
_YIELD_EVERY = 64
_RETRY_S = 1.0


@dataclass(frozen=True)
class FeedKey:
    """What a feed subscribes to; another key (a restarted engine) means another feed."""

    endpoint: str
    topic: str
    generation: str | None
    identity: str | None


@dataclass
class KvEventsFeed:
    """One engine's subscription: applies every batch on ``key.endpoint``/``key.topic`` to
    ``index``. :meth:`start` spawns the receive loop; :meth:`close` ends it and closes the
    socket."""

    url: str
    key: FeedKey
    index: EventIndex
    ctx: zmq.asyncio.Context
    stats: Counter[str] = field(default_factory=Counter)
    last_seq: int | None = None
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def close(self) -> None:
        """End the receive loop and close its socket; idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            sock = self.ctx.socket(zmq.SUB)
            mon: zmq.asyncio.Socket | None = None
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, RCV_HWM)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD)
                sock.setsockopt(zmq.SUBSCRIBE, self.key.topic.encode())
                # a publisher that breaks the protocol (a message over MAXMSGSIZE) is dropped
                # and not reconnected by ZeroMQ: the monitor says so, and a new socket follows
                mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                sock.connect(self.key.endpoint)
                log.info("KV events of %s: subscribed to %s (topic %r)", self.url,
                         self.key.endpoint, self.key.topic)
                await self._receive(sock, mon)
            except asyncio.CancelledError:
                raise
            except ConnectionError as exc:
                self.stats["disconnects"] += 1
                log.info("KV events of %s (%s): %s; reconnecting", self.url, self.key.endpoint,
                         exc)
            except Exception as exc:  # noqa: BLE001 - a feed must never kill the proxy
                self.stats["errors"] += 1
                log.warning("KV events of %s (%s): %s; retrying", self.url, self.key.endpoint,
                            exc)
            finally:
                if mon is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()
                    mon.close(linger=0)
                sock.close(linger=0)
            await asyncio.sleep(_RETRY_S)

    async def _receive(self, sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket) -> None:
        topic = self.key.topic.encode()
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if mon in ready:
                event = parse_monitor_message(await mon.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    raise ConnectionError("the publisher disconnected")
            for _ in range(_YIELD_EVERY):  # then back to the loop: a flood starves nothing
                try:
                    frames = await self._recv_message(sock)
                except zmq.Again:
                    break
                self._message(frames, topic)

    @staticmethod
    async def _recv_message(sock: zmq.asyncio.Socket) -> list[bytes]:
        """One whole message, its first three frames kept (a fourth, empty, marks more);
        :class:`zmq.Again` when none is waiting. The frames of a message arrive together."""
        frames: list[bytes] = []
        while True:
            frame = await sock.recv(zmq.NOBLOCK, copy=False)  # done at once: no wait
            if len(frames) < 3:
                frames.append(frame.bytes)
            elif len(frames) == 3:
                frames.append(b"")
            if not frame.more:
                return frames

    def _message(self, frames: list[bytes], topic: bytes) -> None:
        if len(frames) != 3 or frames[0] != topic or len(frames[1]) != 8:
            self.stats["bad_messages"] += 1
            return
        batch = self.index.decode(frames[2])
        if batch is None:
            self.stats["bad_batches"] += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None:
            if seq <= self.last_seq:  # the publisher restarted: what it held is gone
                self.stats["restarts"] += 1
                self.index.clear_medium("GPU")
            elif seq != self.last_seq + 1:
                self.stats["gaps"] += 1
        self.last_seq = seq
        self.index.apply_batch(batch)
        self.stats["batches"] += 1


def feed_key(e: Engine) -> FeedKey | None:
    """What ``e``'s probe says to subscribe to (None: no probe, or no publisher named)."""
    if e.probe is None or e.probe.params.kvbridge_kv_events is None:
        return None
    p = e.probe.params
    return FeedKey(p.kvbridge_kv_events or "", p.kvbridge_kv_events_topic or "",
                   p.kvbridge_generation, p.kvbridge_identity)


class EnginePrefixes(PrefixIndex):
    """The approximate :class:`~kvbridge.proxy.prefixes.PrefixIndex`, answered from the
    engines' KV events where an engine publishes them (module docstring). A drop-in for
    ``Planning.index``."""

    def __init__(self, fleet: Fleet, *, blocks: int = DEFAULT_BLOCKS, interval_s: float = 5.0,
                 capacity: int | None = None) -> None:
        super().__init__(DEFAULT_CAPACITY if capacity is None else capacity)
        self.fleet = fleet
        self.blocks = blocks
        self.interval_s = interval_s
        self.feeds: dict[str, KvEventsFeed] = {}
        self.stats: Counter[str] = Counter()
        self._ctx: zmq.asyncio.Context | None = None
        self._wake = asyncio.Event()
        self._models: dict[str, str] = {}
        fleet.probe_listener = self._probe_changed

    # -- the planner's side ---------------------------------------------------------------

    def events(self, url: str) -> EventIndex | None:
        """The event index of the engine at ``url`` (None: it publishes none we follow)."""
        feed = self.feeds.get(url)
        return feed.index if feed is not None else None

    def held_by_medium(self, url: str, prompt: Prompt) -> dict[str, float]:
        """Tokens of ``prompt``'s leading units the engine at ``url`` holds: per medium
        (``GPU``, ``CPU``, ``STORAGE``; each unit under its fastest) from its KV events when
        it publishes them and the prompt is of token ids; else ``{"unknown": n}`` with ``n``
        from the approximate index (what the proxy sent there)."""
        ix = self.events(url)
        if ix is not None and prompt.token_ids:
            return ix.held(prompt)
        return {"unknown": super().held(url, prompt)}

    def held(self, url: str, prompt: Prompt) -> float:
        """:meth:`held_by_medium`, all media together (PrefixIndex's contract)."""
        return sum(self.held_by_medium(url, prompt).values())

    def forget(self, url: str) -> None:
        """The engine left or restarted: neither index counts on what it held."""
        super().forget(url)
        feed = self.feeds.get(url)
        if feed is not None:
            feed.index = EventIndex(feed.index.model, self.blocks)

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per engine with a feed: its endpoint, counters and blocks known (admin, tests)."""
        return {url: {"endpoint": f.key.endpoint, "topic": f.key.topic, "running": f.running,
                      "blocks": f.index.size(), **f.stats, **f.index.stats}
                for url, f in self.feeds.items()}

    # -- the fleet's side -----------------------------------------------------------------

    def _probe_changed(self, e: Engine) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Probe engines without a probe and keep one feed per publishing engine; until
        cancelled. Never raises otherwise."""
        while True:
            self._wake.clear()
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the planner falls back; the proxy keeps serving
                self.stats["sync_errors"] += 1
                log.exception("KV events: sync failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def sync(self) -> None:
        """One round: probe what has no probe, then start, restart or stop feeds."""
        engines = self.fleet.engines
        await asyncio.gather(*(self._probe(e) for e in engines
                               if e.probe is None and e.is_up()))
        want = {e.url: (e, k) for e in self.fleet.engines if (k := feed_key(e)) is not None}
        for url in [u for u, f in self.feeds.items() if u not in want or want[u][1] != f.key]:
            await self._stop(url)
        for url, (e, key) in want.items():
            if url in self.feeds:
                continue
            model = await self._model(e)
            if model is None or feed_key(e) != key:
                continue  # no answer, or the probe changed meanwhile: next round
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            feed = KvEventsFeed(url, key, EventIndex(model, self.blocks), self._ctx)
            self.feeds[url] = feed
            feed.start()
            self.stats["feeds_started"] += 1

    async def _probe(self, e: Engine) -> None:
        with contextlib.suppress(LegFailed):
            await self.fleet.probe(e)

    async def _model(self, e: Engine) -> str | None:
        """The model name ``e`` serves (its ``/v1/models``' first id); None when it does not
        answer. Asked once per engine URL."""
        if e.url in self._models:
            return self._models[e.url]
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.fleet.settings.connect_timeout_s))
        try:
            async with self.fleet.session.get(e.url + "/v1/models", timeout=timeout) as r:
                r.raise_for_status()
                model = str((await r.json(content_type=None))["data"][0]["id"])[:1024]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError,
                TypeError) as exc:
            log.warning("KV events of %s: no model name (%s)", e.url, exc)
            return None
        self._models[e.url] = model
        return model

    async def _stop(self, url: str) -> None:
        feed = self.feeds.pop(url, None)
        self._models.pop(url, None)
        if feed is not None:
            await feed.close()
            self.stats["feeds_stopped"] += 1
            log.info("KV events of %s: feed closed (%s)", url, feed.key.endpoint)

    async def close(self) -> None:
        """Close every feed and the ZeroMQ context; idempotent."""
        for url in list(self.feeds):
            await self._stop(url)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.fleet.probe_listener == self._probe_changed:
            self.fleet.probe_listener = None


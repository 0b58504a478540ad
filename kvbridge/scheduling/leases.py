"""Time on the transfer loop: timers, and the decode side's heartbeats to its prefill peers.

* :class:`Timers` — one-shot timers keyed by name; setting a key again replaces it. A heap
  with lazy deletion: O(log n) per set, nothing scans every entry.
* :class:`HeartbeatBook` — which transfers this rank still wants from which prefill address.
  Every ``interval`` it sends one :class:`~kvbridge.messages.Heartbeat` per address (bounded
  batches), through the loop's asynchronous client, and turns the answers into events for the
  owner: a peer answering with another generation restarted; a peer that refuses connections,
  or stays silent for a whole lease, is gone; transfers the peer does not hold are reported.

Both belong to the loop thread (no locks). They never block: the liveness probe (a TCP
connect, to tell "refused" from "slow") runs on a helper thread and posts its result back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvbridge.control import RpcClient
from kvbridge.errors import KVBridgeError
from kvbridge.messages import MAX_IDS_PER_MESSAGE, Heartbeat, HeartbeatReply, Message

__all__ = ["Timers", "HeartbeatBook", "PeerEvents", "Prober", "probe_refused"]

log = logging.getLogger("kvbridge.lease")


class Timers:
    """Named one-shot timers (see the module docstring). ``clock`` is injectable."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = self.clock = clock
        self._heap: list[tuple[float, int, Any]] = []
        self._live: dict[Any, tuple[float, int, Callable[[], None]]] = {}
        self._seq = itertools.count()

    def set(self, key: Any, delay: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` once, ``delay`` seconds from now, unless ``key`` is set or cancelled
        again before."""
        when = self._clock() + delay
        seq = next(self._seq)
        self._live[key] = (when, seq, fn)
        heapq.heappush(self._heap, (when, seq, key))

    def cancel(self, key: Any) -> None:
        self._live.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def due(self) -> list[Callable[[], None]]:
        """Remove and return the callbacks whose time has come, in time order."""
        now = self._clock()
        out: list[Callable[[], None]] = []
        while self._heap and self._heap[0][0] <= now:
            when, seq, key = heapq.heappop(self._heap)
            live = self._live.get(key)
            if live is not None and live[1] == seq:
                del self._live[key]
                out.append(live[2])
        return out

    def next_deadline(self) -> float | None:
        while self._heap:
            when, seq, key = self._heap[0]
            live = self._live.get(key)
            if live is not None and live[1] == seq:
                return when
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return len(self._live)


def probe_refused(address: str, timeout: float = 1.0) -> bool:
    """True if nothing listens at ``tcp://host:port`` any more (connection refused). Blocking:
    run it on a helper thread."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False  # unreachable or slow is not proof that the process is gone


class Prober:
    """Tells "nothing listens there any more" from "slow", off the loop thread.

    ``check(address, callback)`` runs :func:`probe_refused` on one helper thread and calls
    ``callback(refused)`` back on the loop thread (through ``submit``).
    """

    def __init__(self, submit: Callable[..., None]) -> None:
        self._submit = submit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-probe")

    def check(self, address: str, callback: Callable[[bool], None]) -> None:
        def run() -> None:
            self._submit(callback, probe_refused(address))

        try:
            self._pool.submit(run)
        except RuntimeError:  # shutting down
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PeerEvents:
    """What the heartbeat book tells its owner (override the methods)."""

    def peer_gone(self, address: str, why: str) -> None:
        """The prefill engine at ``address`` is proven gone (or restarted)."""

    def transfers_unknown(self, address: str, transfer_ids: list[str], asked: int) -> None:
        """The engine at ``address`` answered that it does not hold these transfers.

        ``asked`` is the number of the heartbeat that asked (:attr:`HeartbeatBook.sent` just
        after it went out): the answer says nothing of what happened after that heartbeat
        left, e.g. a registration the engine took since (and whose confirmation may arrive
        here first, on another connection)."""


@dataclass
class _Target:
    generation: str  # expected ("*": any, learnt from the first answer)
    transfers: set[str] = field(default_factory=set)
    silent_since: float | None = None
    in_flight: bool = False
    probing: bool = False


class HeartbeatBook:
    """D side: heartbeats per prefill address (see the module docstring).

    ``prober`` runs the liveness checks off the loop thread.
    """

    def __init__(self, rpc: RpcClient, events: PeerEvents, prober: Prober, *,
                 interval: float, lease: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rpc = rpc
        self._events = events
        self._prober = prober
        self.interval = interval
        self.lease = lease
        self._clock = clock
        self._targets: dict[str, _Target] = {}
        self.sent = 0
        self.failed = 0

    def watch(self, transfer_id: str, address: str, generation: str = "*") -> None:
        target = self._targets.get(address)
        if target is None:
            target = self._targets[address] = _Target(generation)
        elif target.generation == "*" and generation != "*":
            target.generation = generation
        target.transfers.add(transfer_id)

    def unwatch(self, transfer_id: str, address: str) -> None:
        target = self._targets.get(address)
        if target is not None:
            target.transfers.discard(transfer_id)
            if not target.transfers and not target.in_flight:
                del self._targets[address]

    def watched(self, address: str) -> set[str]:
        target = self._targets.get(address)
        return set(target.transfers) if target else set()

    def __len__(self) -> int:
        return sum(len(t.transfers) for t in self._targets.values())

    def tick(self) -> None:
        """Send one heartbeat round (call every ``interval``)."""
        for address, target in list(self._targets.items()):
            if not target.transfers:
                if not target.in_flight:
                    del self._targets[address]
                continue
            if target.in_flight:
                continue  # the previous round is still unanswered: counted by its timeout
            tids = sorted(target.transfers)
            for start in range(0, len(tids), MAX_IDS_PER_MESSAGE):
                batch = tids[start : start + MAX_IDS_PER_MESSAGE]
                target.in_flight = True
                self.sent += 1
                self._rpc.call(address, Heartbeat(generation=target.generation,
                                                  transfer_ids=batch),
                               self.interval, self._on_reply(address, batch, self.sent))

    def _on_reply(self, address: str, batch: list[str],
                  asked: int) -> Callable[[Message | KVBridgeError], bool]:
        def on_reply(reply: Message | KVBridgeError) -> bool:
            target = self._targets.get(address)
            if target is None:
                return False
            target.in_flight = False
            if isinstance(reply, HeartbeatReply):
                target.silent_since = None
                if target.generation not in ("*", reply.generation):
                    self._gone(address, f"restarted (generation {reply.generation}, expected "
                                        f"{target.generation})")
                    return False
                target.generation = reply.generation
                unknown = [t for t in reply.unknown if t in target.transfers]
                if unknown:
                    self._events.transfers_unknown(address, unknown, asked)
                return False
            self.failed += 1
            now = self._clock()
            if target.silent_since is None:
                target.silent_since = now - self.interval
            if now - target.silent_since >= self.lease:
                self._gone(address, f"silent for {now - target.silent_since:.0f} s")
            elif not target.probing:
                target.probing = True
                self._prober.check(address, lambda refused: self._probed(address, refused))
            return False

        return on_reply

    def _probed(self, address: str, refused: bool) -> None:
        target = self._targets.get(address)
        if target is None:
            return
        target.probing = False
        if refused:
            self._gone(address, "connection refused (process gone)")

    def _gone(self, address: str, why: str) -> None:
        target = self._targets.pop(address, None)
        if target is None:
            return
        log.warning("prefill peer %s is gone: %s; failing %d transfer(s)", address, why,
                    len(target.transfers))
        self._events.peer_gone(address, why)


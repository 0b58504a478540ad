"""Transfer loops for tests and benchmarks: in this process, or in a real child process.

Both hold a numpy KV cache shaped like vLLM's CPU cache ``(num_blocks, 2, block_size,
heads*head_dim)`` per layer, with a :class:`~kvbridge.scheduling.loop.TransferLoop` on it, and
offer the same methods (:class:`Agent`): ``stage``/``ready``/``layer`` (P), ``pull``/``expect``
(D), ``cancel_send``/``cancel_recv``, ``drain`` (accumulate results until the wanted request
ids show up or the timeout passes), ``blocks`` (read KV back), ``fill`` (random KV), ``close``.

* :class:`LocalAgent` runs the loop in this process (use the ``memory`` transport, or ``shm``
  against itself): fast, for state-machine tests.
* :class:`AgentProcess` runs it in a spawned child driven over a multiprocessing pipe (the
  pipe carries Python objects between two processes of the test, never network input). Every
  call is bounded by a timeout; :meth:`AgentProcess.close` kills the child if it does not exit.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Protocol

import numpy as np

from kvbridge import registry
from kvbridge.config import Config
from kvbridge.groups import KVGroup
from kvbridge.layout import KVLayout
from kvbridge.scheduling.layer_stream import LayerStream
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan
from kvbridge.testing.faults import FaultyTransport
from kvbridge.transport import Transport

__all__ = ["Agent", "LocalAgent", "AgentProcess", "CacheShape", "make_caches"]

CacheShape = tuple[int, int, int, int]  # layers, num_blocks, block_size, heads*head_dim


def make_caches(shape: CacheShape, groups: Sequence[KVGroup] = (), aliased: bool = False,
                ) -> tuple[dict[str, np.ndarray[Any, Any]], KVLayout]:
    """Per-layer caches and their layout. ``groups`` (KV-cache groups of a hybrid model) name
    planes by layer index; ``aliased``: every layer is a view of one buffer, as vLLM lays out
    a hybrid model's groups (block ``b`` of any layer is the same bytes)."""
    layers, num_blocks, block_size, hd = shape
    one = np.zeros((num_blocks, 2, block_size, hd), dtype=np.float32)
    caches = {f"layer.{i}": one if aliased else np.zeros_like(one) for i in range(layers)}
    layout = KVLayout.from_tensors(caches, num_blocks, block_size)
    return caches, dataclasses.replace(layout, groups=tuple(groups))


def _drain(loop: TransferLoop, want: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    acc: dict[str, set[Any]] = {"finished_sending": set(), "finished_recving": set(),
                                "failed_recving": set(), "invalid_blocks": set()}
    while True:
        for k, v in asdict(loop.drain()).items():
            acc[k] |= v
        if want <= (acc["finished_sending"] | acc["finished_recving"]):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)
    snap = loop.snapshot()
    return {"results": acc, "stats": snap["stats"], "pending": snap["pending"]}


class Agent(Protocol):
    address: str
    generation: str

    def stage(self, plan: SendPlan) -> None: ...
    def prepare(self, plan: SendPlan) -> None: ...
    def ready(self, plan: SendPlan) -> None: ...
    def layer(self, plan: SendPlan, layer: str) -> None: ...
    def pull(self, spec: PullSpec) -> None: ...
    def expect(self, spec: PushSpec) -> None: ...
    def cancel_send(self, tid: str) -> None: ...
    def cancel_recv(self, tid: str) -> None: ...
    def drain(self, want: set[str] | list[str], timeout: float = 20.0) -> dict[str, Any]: ...
    def blocks(self, ids: list[int]) -> Any: ...
    def outcome(self, tid: str) -> str | None: ...
    def fill(self, seed: int) -> None: ...
    def close(self) -> None: ...


class LocalAgent:
    """A loop in this process (see the module docstring)."""

    def __init__(self, engine_id: str, shape: CacheShape = (2, 64, 16, 64),
                 extra: dict[str, Any] | None = None, *, rank: int = 0, tp_size: int = 1,
                 transport: Transport | None = None, compat: dict[str, str] | None = None,
                 groups: Sequence[KVGroup] = (), aliased: bool = False) -> None:
        self.caches, self.layout = make_caches(shape, groups, aliased)
        self.config = Config.load({"backend": "memory", **(extra or {})}, env={})
        self.loop = TransferLoop(self.config, engine_id, self.layout, rank=rank, tp_size=tp_size,
                                 compat=compat or {"model": "test"}, transport=transport)
        self.address = self.loop.control_address
        self.generation = self.loop.generation
        self._streams: dict[str, LayerStream] = {}

    def stage(self, plan: SendPlan) -> None:
        self.loop.stage_pull(plan)

    def prepare(self, plan: SendPlan) -> None:
        """The connector's call while the forward runs: build the push's WRITE ahead."""
        self.loop.push_prepare(plan)

    def ready(self, plan: SendPlan) -> None:
        stream = self._streams.pop(plan.transfer_id, None)
        if stream is not None:
            stream.end(None)  # a layer-wise push: the end of its stream is its readiness
        else:
            self.loop.push_ready(plan)

    def layer(self, plan: SendPlan, layer: str) -> None:
        """Layer-wise push (as the forward does it): ``layer`` of ``plan`` is written; the
        first call opens the plan's :class:`LayerStream`, :meth:`ready` ends it."""
        stream = self._streams.get(plan.transfer_id)
        if stream is None:
            stream = self._streams[plan.transfer_id] = LayerStream([plan], self.loop.wake)
            self.loop.push_layers(stream)
        stream.written(layer, None)

    def pull(self, spec: PullSpec) -> None:
        self.loop.start_pull(spec)

    def expect(self, spec: PushSpec) -> None:
        self.loop.expect_push(spec)

    def cancel_send(self, tid: str) -> None:
        self.loop.cancel_send(tid)

    def cancel_recv(self, tid: str) -> None:
        self.loop.cancel_recv(tid)

    def drain(self, want: set[str] | list[str], timeout: float = 20.0) -> dict[str, Any]:
        return _drain(self.loop, set(want), timeout)

    def blocks(self, ids: list[int]) -> Any:
        return np.stack([c[ids] for c in self.caches.values()]) if ids else None

    def outcome(self, tid: str) -> str | None:
        return self.loop.outcome(tid)

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for c in self.caches.values():
            c[...] = rng.standard_normal(c.shape, dtype=np.float32)

    def board_words(self) -> list[int]:
        """The addresses of the progress words this rank's push receives hold now (tests of a
        stranger that writes one: kvbridge.scheduling.follow)."""
        board = self.loop.board
        return [] if board is None else board.words()

    def close(self) -> None:
        self.loop.close()


def _child(conn: Any, engine_id: str, shape: CacheShape, extra: dict[str, Any],
           faults: dict[str, Any] | None) -> None:
    transport = None
    if faults is not None:
        config = Config.load(extra, env={})
        inner = registry.create(config.backend, engine_id, config.backend_options)
        transport = FaultyTransport(inner, **faults)
    agent = LocalAgent(engine_id, shape, {"backend": "shm", **extra}, transport=transport)
    conn.send((agent.address, agent.generation))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "close":
                agent.close()
                conn.send(None)
                return
            out = getattr(agent, cmd)(*args)
            conn.send(("ok", out))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class AgentProcess:
    """A loop in a spawned child process (see the module docstring). ``extra`` is the
    kvbridge configuration (backend ``shm`` unless it says otherwise)."""

    def __init__(self, engine_id: str, shape: CacheShape = (2, 64, 16, 64),
                 extra: dict[str, Any] | None = None,
                 faults: dict[str, Any] | None = None, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, engine_id, shape, extra or {}, faults),
                                daemon=True)
        self.proc.start()
        self.timeout = timeout
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"agent {engine_id} did not start")
        self.address, self.generation = self._conn.recv()

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout or self.timeout):
            raise TimeoutError(f"agent command {cmd[0]!r} timed out")
        status, out = self._conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def stage(self, plan: SendPlan) -> None:
        self.call("stage", plan)

    def prepare(self, plan: SendPlan) -> None:
        self.call("prepare", plan)

    def ready(self, plan: SendPlan) -> None:
        self.call("ready", plan)

    def layer(self, plan: SendPlan, layer: str) -> None:
        self.call("layer", plan, layer)

    def pull(self, spec: PullSpec) -> None:
        self.call("pull", spec)

    def expect(self, spec: PushSpec) -> None:
        self.call("expect", spec)

    def cancel_send(self, tid: str) -> None:
        self.call("cancel_send", tid)

    def cancel_recv(self, tid: str) -> None:
        self.call("cancel_recv", tid)

    def drain(self, want: set[str] | list[str], timeout: float = 20.0) -> dict[str, Any]:
        out: dict[str, Any] = self.call("drain", list(want), timeout, timeout=timeout + 10)
        return out

    def blocks(self, ids: list[int]) -> Any:
        return self.call("blocks", ids)

    def outcome(self, tid: str) -> str | None:
        out: str | None = self.call("outcome", tid)
        return out

    def fill(self, seed: int) -> None:
        self.call("fill", seed)

    def board_words(self) -> list[int]:
        out: list[int] = self.call("board_words")
        return out

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("close",))
                if self._conn.poll(10):
                    self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(5)
        self.kill()

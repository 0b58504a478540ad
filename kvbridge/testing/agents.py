"""Run a :class:`~kvbridge.scheduling.agent.TransferAgent` in a real child process.

Used by the agent tests and benchmarks: each :class:`AgentProcess` is a spawned process holding a
numpy KV cache shaped like vLLM's CPU cache ``(num_blocks, 2, block_size, heads*head_dim)`` per
layer, with an agent on it, driven by simple commands over a multiprocessing pipe. Every call is
bounded by a timeout; :meth:`AgentProcess.close` kills the child if it does not exit.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from typing import Any

__all__ = ["AgentProcess", "CacheShape"]

CacheShape = tuple[int, int, int, int]  # layers, num_blocks, block_size, heads*head_dim


def _child(conn: Any, engine_id: str, shape: CacheShape, extra: dict[str, Any],
           backend_wrapper: dict[str, Any] | None) -> None:
    import numpy as np

    from kvbridge.config import Config
    from kvbridge.layout import KVLayout
    from kvbridge.scheduling.agent import PullSpec, PushSpec, TransferAgent

    layers, num_blocks, block_size, hd = shape
    caches = {f"layer.{i}": np.zeros((num_blocks, 2, block_size, hd), dtype=np.float32)
              for i in range(layers)}
    layout = KVLayout.from_tensors(caches, num_blocks, block_size)
    config = Config.load(extra, env={})
    transport = None
    if backend_wrapper is not None:
        from kvbridge import registry
        from kvbridge.testing.faults import FaultyTransport

        inner = registry.create(config.backend, engine_id, config.backend_options)
        transport = FaultyTransport(inner, **backend_wrapper)
    agent = TransferAgent(config, engine_id, layout, compat={"model": "test"},
                          transport=transport)
    conn.send(agent.control_address)
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "close":
                agent.close()
                conn.send(None)
                return
            if cmd == "fill":
                rng = np.random.default_rng(args[0])
                for c in caches.values():
                    c[...] = rng.standard_normal(c.shape, dtype=np.float32)
                out: Any = None
            elif cmd == "blocks":
                ids = list(args[0])
                out = np.stack([c[ids] for c in caches.values()]) if ids else None
            elif cmd == "stage":
                agent.stage_pull(*args)
                out = None
            elif cmd == "layer":
                agent.push_layer(*args)
                out = None
            elif cmd == "ready":
                agent.push_ready(*args)
                out = None
            elif cmd == "pull":
                agent.start_pull(PullSpec(*args))
                out = None
            elif cmd == "expect":
                agent.expect_push(PushSpec(*args))
                out = None
            elif cmd == "cancel_send":
                agent.cancel_send(*args)
                out = None
            elif cmd == "cancel_recv":
                agent.cancel_recv(*args)
                out = None
            elif cmd == "drain":
                want, timeout = args
                deadline = time.monotonic() + timeout
                acc: dict[str, set[Any]] = {"finished_sending": set(), "finished_recving": set(),
                                            "failed_recving": set(), "invalid_blocks": set()}
                while True:
                    for k, v in asdict(agent.drain()).items():
                        acc[k] |= v
                    got = acc["finished_sending"] | acc["finished_recving"]
                    if set(want) <= got or time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
                out = {"results": acc, "stats": dict(agent.stats), "pending": agent.pending()}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", out))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class AgentProcess:
    """A child process hosting one agent (see the module docstring)."""

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
        self.address: str = self._conn.recv()

    def call(self, *cmd: Any, timeout: float | None = None) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout or self.timeout):
            raise TimeoutError(f"agent command {cmd[0]!r} timed out")
        status, out = self._conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def drain(self, want: list[str] | set[str], timeout: float = 20.0) -> dict[str, Any]:
        return self.call("drain", list(want), timeout, timeout=timeout + 10)  # type: ignore[no-any-return]

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

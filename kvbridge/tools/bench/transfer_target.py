"""The target side of ``kvbridge bench transfer``: a spawned process that owns the far buffer.

Contract: :class:`TargetProcess` starts :func:`target_main` in a ``spawn`` child over a local
pipe; the child creates the backend through :func:`kvbridge.registry.create`, registers one
buffer filled with :func:`pattern` ``(seed + 1)`` and answers commands (``peer``, ``fill``,
``zero``, ``check_write``, ``quit``) with msgpack messages ``{"ok": ..., ...}``. A reply that
is not ok raises :class:`~kvbridge.errors.TransferFailed`, a child that dies or stays silent
:class:`~kvbridge.errors.PeerUnreachable` (bounded by :data:`REPLY_TIMEOUT_S`);
:meth:`TargetProcess.stop` always ends the child (quit, then terminate, then kill).
:func:`host_buffer` allocates the bench's buffers on the page size ``pages`` names (see
:mod:`kvbridge.tools.bench.transfer`).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvbridge import registry
from kvbridge.errors import KVBridgeError, PeerUnreachable, TransferFailed
from kvbridge.host.hugepages import back_with_huge_pages
from kvbridge.transport import MemoryRegion, RawResponderHook, Transport, notifying

__all__ = ["REPLY_TIMEOUT_S", "Bytes", "TargetProcess", "host_buffer", "pattern", "target_main"]

Bytes = npt.NDArray[np.uint8]
REPLY_TIMEOUT_S = 120.0


def _send(conn: Connection, msg: Mapping[str, Any]) -> None:
    conn.send_bytes(msgspec.msgpack.encode(msg))


def pattern(seed: int, nbytes: int) -> Bytes:
    """``nbytes`` pseudo-random bytes that depend only on ``seed`` (both sides can rebuild them)."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8).copy()


def host_buffer(nbytes: int, pages: str = "numpy", fill: Bytes | None = None) -> Bytes:
    """``nbytes`` of zeroed (or ``fill``'s) host memory on the pages ``pages`` names (see the
    module docstring)."""
    if pages == "numpy":
        buf = np.zeros(nbytes, dtype=np.uint8)
    else:
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages even where THP is "always"
        buf = np.frombuffer(area, dtype=np.uint8)  # keeps the mapping alive
        buf.fill(0)  # populated, as torch.zeros leaves a KV cache
        if pages == "kvbridge":
            back_with_huge_pages([(int(buf.ctypes.data), nbytes)])
    if fill is not None:
        np.copyto(buf, fill)
    return buf


def target_main(
    conn: Connection, backend: str, options: dict[str, Any], total: int, seed: int,
    raw: bool = False, pages: str = "numpy",
) -> None:
    """Body of the target process: serve commands from the initiator until ``quit`` or EOF.
    With ``raw``, also a raw responder over the same buffer where the backend has one."""
    try:
        transport = registry.create(backend, "kvbridge-bench-target", options)
    except KVBridgeError as exc:
        _send(conn, {"ok": False, "error": str(exc)})
        return
    responder: Any = None
    try:
        buf = host_buffer(total, pages, pattern(seed + 1, total))
        meta = transport.register_memory([MemoryRegion(int(buf.ctypes.data), total)])
        hello: dict[str, Any] = {"ok": True, "metadata": meta, "address": int(buf.ctypes.data),
                                 "proof": transport.invite()}
        hook = registry.bench_hook(backend) if raw else None
        if isinstance(hook, RawResponderHook):
            try:
                responder = hook.raw_responder(int(buf.ctypes.data), total, **options)
                hello["raw"] = responder.metadata
            except Exception as exc:  # noqa: BLE001 - the raw column falls back to its own pair
                hello["raw_error"] = f"{type(exc).__name__}: {exc}"
        _send(conn, hello)
        pending: list[bytes] = []
        src: Bytes | None = None
        while True:
            try:
                msg = msgspec.msgpack.decode(conn.recv_bytes())
            except (EOFError, OSError):
                return
            cmd = msg["cmd"]
            try:
                if cmd == "quit":
                    _send(conn, {"ok": True})
                    return
                if cmd == "peer":
                    _send(conn, {"ok": True, "peer": transport.add_peer(msg["metadata"],
                                                                        msg["proof"])})
                elif cmd == "fill":
                    np.copyto(buf, pattern(seed + 1, total))
                    _send(conn, {"ok": True})
                elif cmd == "zero":
                    buf.fill(0)
                    _send(conn, {"ok": True})
                elif cmd == "check_write":
                    if msg.get("notification"):
                        _await_notification(transport, msg["notification"], pending)
                    if responder is not None:
                        responder.drain()  # the raw WRITEs' notifications
                    if src is None:
                        src = pattern(seed, total)
                    block = int(msg["block"])
                    perm = np.frombuffer(msg["perm"], dtype=np.int64)
                    n = perm.size * block
                    got = buf[:n].reshape(-1, block)[perm]
                    ok = bool(np.array_equal(got, src[:n].reshape(-1, block)))
                    _send(conn, {"ok": ok, "error": None if ok else "WRITE bytes differ"})
                else:
                    _send(conn, {"ok": False, "error": f"unknown command {cmd!r}"})
            except KVBridgeError as exc:
                _send(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if responder is not None:
            responder.close()
        transport.close()


def _await_notification(transport: Transport, want: bytes, pending: list[bytes]) -> None:
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    delay = 1e-4
    while want not in pending:
        got = notifying(transport).get_notifications()
        pending.extend(m for _, m in got)
        if want in pending:
            break
        if time.monotonic() > deadline:
            raise TransferFailed(f"notification {want!r} did not arrive")
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)
    pending.remove(want)


class TargetProcess:
    """The initiator's handle on the target process."""

    def __init__(self, backend: str, options: dict[str, Any], total: int, seed: int,
                 raw: bool = False, pages: str = "numpy") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=target_main,
            args=(child, backend, options, total, seed, raw, pages),
            name="kvbridge-bench-target",
            daemon=True,
        )
        self.proc.start()
        child.close()

    def reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise PeerUnreachable(f"bench target exited with status {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise PeerUnreachable(f"bench target did not answer in {REPLY_TIMEOUT_S} s")
        try:
            msg: dict[str, Any] = msgspec.msgpack.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise PeerUnreachable(f"bench target went away: {exc}") from exc
        if not msg.get("ok"):
            raise TransferFailed(f"bench target: {msg.get('error')}")
        return msg

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        _send(self.conn, {"cmd": cmd, **kw})
        return self.reply()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                _send(self.conn, {"cmd": "quit"})
                self.proc.join(10)
        except (OSError, ValueError):
            pass
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


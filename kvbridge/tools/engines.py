"""Real ``vllm serve`` engines for tests, benchmarks and the demo: start, wait ready, stop.

:class:`VllmServer` runs one ``vllm serve`` (through :mod:`kvbridge.integrations.vllm_serve`)
in its own session and process group, with the settings that work on small CPU hosts
(``--enforce-eager --dtype float32 --max-model-len 1024 --max-num-seqs 8
--kv-cache-memory-bytes 268435456 --host 127.0.0.1``), its output going to a log file.

- :meth:`VllmServer.start` returns at once; :meth:`VllmServer.wait_ready` polls ``/health``
  over HTTP (no subprocesses) and raises :class:`EngineError` with the tail of the log when the
  engine dies or does not become ready in time.
- :meth:`VllmServer.stop` ends the whole process group (SIGTERM to the leader, then SIGKILL to
  the group after a grace period) and reaps the leader. It is idempotent, safe to call from
  ``finally`` blocks and from a KeyboardInterrupt, and every started server is also stopped at
  interpreter exit (atexit).
- :func:`start_servers` starts several engines concurrently and waits for all of them; if one
  fails, all are stopped.

This module uses only the standard library (it imports without vLLM or any HTTP package), and
every network call has a timeout. Requests to a running engine are :mod:`kvbridge.tools.client`'s.

Thread safety: a :class:`VllmServer` is meant to be driven from one thread; ``stop`` is guarded
by a lock so an atexit call racing a ``finally`` is harmless.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvbridge.errors import KVBridgeError

__all__ = [
    "EngineError",
    "BASE_ARGS",
    "WORKER_IN_CORE_ENV",
    "WORKER_PROCESS_ENV",
    "GUARD_MIDDLEWARE",
    "free_port",
    "VllmServer",
    "start_servers",
    "signals_unwind",
    "stop_all",
]

log = logging.getLogger("kvbridge.tools.engines")

BASE_ARGS: tuple[str, ...] = (
    "--enforce-eager",
    "--dtype", "float32",
    "--max-model-len", "1024",
    "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", "268435456",
    "--host", "127.0.0.1",
)  # fmt: skip
"""Arguments every engine gets (later ``extra_args`` may override them: vLLM keeps the last)."""

GUARD_MIDDLEWARE = "kvbridge.integrations.vllm_http.KVTransferParamsGuard"
"""The ``--middleware`` that answers malformed ``kv_transfer_params`` with HTTP 400."""

WORKER_IN_CORE_ENV: Mapping[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""Environment that runs vLLM's worker inside the engine-core process (its uni-process executor,
what vLLM runs on one GPU) instead of in a process of its own (the CPU platform's default, the
``mp`` executor). An engine then starts one Python process fewer: about 27 s instead of 40 s for
the tiny model on the 2-core CI host. ``tests/engines`` runs most engines this way; the demo and
the benches keep the CPU default. vLLM pins threads to ``cpu_bind`` only in a worker process of
their own: inside the engine core every thread may run on any core."""

WORKER_PROCESS_ENV: Mapping[str, str] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
"""Environment for the CPU platform's default: the worker in a process of its own (``mp``)."""

_DEFAULT_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


class EngineError(KVBridgeError):
    """A vLLM engine did not start, died, or answered a request with an error (``status``: the
    HTTP status when it answered, ``body``: the start of its answer)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``), Linux's default elsewhere."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a server started later.

    Picked below the kernel's ephemeral range where that leaves room (from 10000 up), so that
    no outgoing connection is handed it in the meantime: a port from the ephemeral range (bind
    port 0) was taken by some client between the pick and an engine's bind often enough to
    fail a fleet test ("Address already in use"). Random, so that concurrent callers rarely
    collide; falls back to an ephemeral port when nothing below is free.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    tries = 64 if low > 11000 else 0
    for _ in range(tries):
        port = rng.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
        return picked


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read log {path}: {e}>"
    return "\n".join(data.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a pid reused by someone else
        return True
    return True


_LIVE: set[VllmServer] = set()
_LIVE_LOCK = threading.Lock()


def stop_all() -> None:
    """Stop every server this process started and has not stopped yet (the atexit hook)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


atexit.register(stop_all)


class VllmServer:
    """One ``vllm serve`` process group serving *model* as *served_model_name*.

    Construction does nothing; :meth:`start` launches. ``port=0`` picks a free port at start.
    ``kv_transfer_config`` is passed as ``--kv-transfer-config`` JSON; ``cpu_bind`` sets
    ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` for core 0); ``env`` adds or overrides
    environment variables; ``extra_args`` are appended after :data:`BASE_ARGS`. Output goes to
    ``log_path`` (default: a new temporary file, kept after stop so it can be read).
    ``stop_grace`` is how long :meth:`stop` waits after SIGTERM before SIGKILL.
    With ``guard`` (the default) an engine that has a ``kv_transfer_config`` also gets
    ``--middleware kvbridge.integrations.vllm_http.KVTransferParamsGuard``
    (:data:`GUARD_MIDDLEWARE`), so malformed ``kv_transfer_params`` are answered with HTTP 400.
    ``pin_cpus`` restricts the whole process tree (API server, engine core, workers, every
    thread; not only vLLM's OpenMP threads) to the ``cpu_bind`` cores, so two engines on one
    small host do not run on each other's cores. ``cwd`` is the working directory of the
    process (``python -m`` imports from it first: a checkout there is the code that runs).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str = "tiny",
        port: int = 0,
        kv_transfer_config: Mapping[str, Any] | None = None,
        cpu_bind: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | Path | None = None,
        python: str = sys.executable,
        name: str | None = None,
        stop_grace: float = 8.0,
        guard: bool = True,
        pin_cpus: bool = False,
        cwd: str | Path | None = None,
    ) -> None:
        self.model = str(model)
        self.cwd = cwd
        self.served_model_name = served_model_name
        self.port = port
        self.kv_transfer_config = dict(kv_transfer_config) if kv_transfer_config else None
        self.cpu_bind = cpu_bind
        self.env = dict(env or {})
        self.extra_args = list(extra_args)
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.python = python
        self.name = name or served_model_name
        self.stop_grace = stop_grace
        self.guard = guard
        self.pin_cpus = pin_cpus
        if pin_cpus:
            self.cpus()  # refuse a cpu_bind that cannot be pinned before anything starts
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at: float | None = None
        self.ready_at: float | None = None
        self._log_file: IO[bytes] | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    # -- properties ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8100`` (valid after :meth:`start`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """Pid of the ``vllm serve`` leader, which is also its process-group id."""
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        cmd = [
            self.python, "-m", "kvbridge.integrations.vllm_serve", "serve", self.model,
            "--served-model-name", self.served_model_name,
            "--port", str(self.port),
            *BASE_ARGS,
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
            if self.guard:
                cmd += ["--middleware", GUARD_MIDDLEWARE]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """The environment :meth:`start` gives the process."""
        env = dict(os.environ)
        env.update(_DEFAULT_ENV)
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        env.update(self.env)
        return env

    def cpus(self) -> set[int]:
        """The cores of ``cpu_bind`` (``"0"``, ``"0-3"``, ``"0,2"``); EngineError for anything
        else (one rank's list only: ``|`` separates tensor-parallel ranks)."""
        cores: set[int] = set()
        try:
            for part in (self.cpu_bind or "").split(","):
                lo, _, hi = part.strip().partition("-")
                cores.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            cores = set()
        if not cores:
            raise EngineError(f"engine {self.name!r}: cannot pin to cpu_bind {self.cpu_bind!r}")
        return cores

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> VllmServer:
        """Launch the process group and return at once. Raises EngineError if already started."""
        if self.proc is not None:
            raise EngineError(f"engine {self.name!r} was already started (pid {self.pid})")
        if self.port == 0:
            self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        cmd = self.command()
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            cwd=self.cwd,
            start_new_session=True,
        )
        if self.pin_cpus:
            # the leader is still importing: every process and thread it starts inherits this
            os.sched_setaffinity(self.proc.pid, self.cpus())
        with _LIVE_LOCK:
            _LIVE.add(self)
        log.info(
            "started engine %s (pid %d) on port %d, log %s",
            self.name, self.proc.pid, self.port, self.log_path,
        )  # fmt: skip
        return self

    def log_tail(self, lines: int = 40) -> str:
        """The last *lines* lines of the engine's log."""
        return _tail(self.log_path, lines) if self.log_path is not None else ""

    def check_ready(self, probe_timeout: float = 2.0) -> bool:
        """One non-blocking-ish probe: True when ``/health`` answers 200.

        Raises EngineError (with the log tail) if the process has exited.
        """
        if self.proc is None:
            raise EngineError(f"engine {self.name!r} was never started")
        if self.ready_at is not None:
            return True
        rc = self.proc.poll()
        if rc is not None:
            raise EngineError(
                f"engine {self.name!r} exited with code {rc} before it was ready; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=probe_timeout) as r:
                ok = bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            ok = False
        if ok:
            self.ready_at = time.monotonic()
            log.info(
                "engine %s ready after %.1f s", self.name, self.ready_at - (self.started_at or 0)
            )
        return ok

    def wait_ready(self, timeout: float = 300.0, interval: float = 1.0) -> VllmServer:
        """Block until ``/health`` answers 200. Raises EngineError on death or after *timeout* s."""
        deadline = time.monotonic() + timeout
        while not self.check_ready():
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"engine {self.name!r} not ready after {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(interval)
        return self

    def stop(self, grace: float | None = None) -> int | None:
        """Terminate the whole process group; return the leader's exit code (None if never run).

        SIGTERM to the leader (which stops its own children), up to *grace* seconds (default
        ``stop_grace``) for the whole group to exit, then SIGKILL to the group. Blocks until the
        group is gone (at most ``grace + 6`` s). Idempotent.
        """
        if grace is None:
            grace = self.stop_grace
        with self._stop_lock:
            proc = self.proc
            if proc is None:
                return None
            if self._stopped:
                return proc.returncode
            pgid = proc.pid
            try:
                # SIGTERM to the leader only: vLLM's API server then shuts its EngineCore and
                # workers down in order (a group-wide SIGTERM makes them die first, and the
                # server logs a spurious EngineDeadError). Whatever is left gets SIGKILL.
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pgid, signal.SIGTERM)
                else:  # the leader is gone already: tell its orphans directly
                    self._signal_group(pgid, signal.SIGTERM)
                if not self._wait_group(proc, pgid, grace):
                    log.warning("engine %s did not exit in %.0f s; SIGKILL", self.name, grace)
                    self._signal_group(pgid, signal.SIGKILL)
                    if not self._wait_group(proc, pgid, 5.0):
                        log.error("engine %s process group %d survived SIGKILL", self.name, pgid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
            finally:
                self._stopped = True
                if self._log_file is not None:
                    self._log_file.close()
                    self._log_file = None
                with _LIVE_LOCK:
                    _LIVE.discard(self)
            log.info("stopped engine %s (pid %d, rc %s)", self.name, pgid, proc.returncode)
            return proc.returncode

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    @staticmethod
    def _wait_group(proc: subprocess.Popen[bytes], pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            proc.poll()  # reap the leader, or it stays in the group as a zombie
            if not _group_alive(pgid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def __enter__(self) -> VllmServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VllmServer({self.name!r}, port={self.port}, pid={self.pid})"


def start_servers(
    servers: Iterable[VllmServer],
    timeout: float = 300.0,
    *,
    interval: float = 1.0,
    progress: Callable[[float, list[bool]], None] | None = None,
    progress_every: float = 5.0,
) -> list[VllmServer]:
    """Start *servers* concurrently and wait until all are ready.

    *progress*, if given, is called about every *progress_every* seconds with the elapsed time
    and each server's readiness. On any failure (an engine died, the timeout passed, or
    KeyboardInterrupt) every server in the list is stopped and the error propagates.
    """
    group = list(servers)
    t0 = time.monotonic()
    try:
        for s in group:
            if s.proc is None:
                s.start()
        next_report = t0 + progress_every
        while True:
            ready = [s.check_ready() for s in group]
            now = time.monotonic()
            if all(ready):
                if progress is not None:
                    progress(now - t0, ready)
                return group
            if now - t0 >= timeout:
                late = [s for s, r in zip(group, ready, strict=True) if not r]
                raise EngineError(
                    f"engines not ready after {timeout:.0f} s: "
                    + "; ".join(f"{s.name} (log {s.log_path}):\n{s.log_tail(20)}" for s in late)
                )
            if progress is not None and now >= next_report:
                progress(now - t0, ready)
                next_report = now + progress_every
            time.sleep(interval)
    except BaseException:
        for s in group:
            with contextlib.suppress(Exception):
                s.stop()
        raise


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: engines are stopped


@contextlib.contextmanager
def signals_unwind() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise SystemExit, so the ``finally`` blocks of a bench
    stop the engines it started (the old handlers come back on exit; a no-op off the main
    thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)

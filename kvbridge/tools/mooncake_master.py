"""A real ``mooncake_master`` on 127.0.0.1 for tests, docs and CI (no etcd).

:class:`MooncakeMaster` starts the master of a Mooncake Store on free ports (RPC, HTTP metadata
server, metrics), waits until it accepts connections (bounded) and always kills its process
group on exit, also when start-up fails::

    with MooncakeMaster() as m:
        tier_options = {"master": m.master_address, "metadata_url": m.metadata_url}

In pytest, import the module-scoped fixture into a test module::

    from kvbridge.tools.mooncake_master import mooncake_master  # noqa: F401

It skips (with the reason) when Mooncake is not installed. By hand::

    python -m kvbridge.tools.mooncake_master --port 15750     # prints the addresses

The binary is found by :func:`find_master_binary`: ``$KVBRIDGE_MOONCAKE_MASTER``, then the
``mooncake_master`` shipped inside the ``mooncake`` package (mooncake-transfer-engine wheels),
then ``mooncake_master`` on ``PATH`` (the wheel's wrapper script, which ``exec``s the binary).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

import pytest

from kvbridge.tools.engines import free_port as engines_free_port

__all__ = ["MasterError", "MooncakeMaster", "find_master_binary", "free_port", "mooncake_master"]

HOST = "127.0.0.1"
ENV_BINARY = "KVBRIDGE_MOONCAKE_MASTER"


class MasterError(RuntimeError):
    """The master could not be found or started (the message has the tail of its log)."""


def find_master_binary() -> str | None:
    """Path of an executable ``mooncake_master``, or None (see the module docstring)."""
    env = os.environ.get(ENV_BINARY)
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        spec = importlib.util.find_spec("mooncake")  # locates the package, imports nothing
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    for path in (str(Path(sys.executable).parent), None):
        found = shutil.which("mooncake_master", path=path)
        if found:
            return found
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago
    (:func:`kvbridge.tools.engines.free_port`)."""
    return engines_free_port(HOST)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the starting thread dies (Linux; best effort).

    Covers the cases ``stop()`` cannot: the test process killed by a timeout or SIGKILL.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _accepts(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A running ``mooncake_master`` (see the module docstring).

    ``port`` fixes the RPC port (the HTTP metadata and metrics ports default to ``port + 1`` and
    ``port + 2`` then); without it all three are free ports picked by the kernel. ``extra_args``
    are passed to the master as they are (e.g. ``["-default_kv_lease_ttl=2000"]``).
    ``start_timeout`` bounds the wait for both ports to accept connections.
    """

    def __init__(self, port: int | None = None, *, http_port: int | None = None,
                 metrics_port: int | None = None, extra_args: Sequence[str] = (),
                 start_timeout: float = 15.0, binary: str | None = None) -> None:
        self.rpc_port = port or free_port()
        self.http_port = http_port or (self.rpc_port + 1 if port else free_port())
        self.metrics_port = metrics_port or (self.rpc_port + 2 if port else free_port())
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.binary = binary or find_master_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service (the store client's ``master``)."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server the clients use instead of etcd."""
        return f"http://{HOST}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        """The exact command line the master is started with."""
        return [
            self.binary or "mooncake_master",
            f"-rpc_address={HOST}",
            f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={HOST}",
            f"-http_metadata_server_port={self.http_port}",
            f"-metrics_host={HOST}",
            f"-metrics_port={self.metrics_port}",
            *self.extra_args,
        ]

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the master's output (for error messages)."""
        if self._log is None:
            return ""
        try:
            text = self._log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> MooncakeMaster:
        """Start the master and wait until it accepts connections; :class:`MasterError` if not.

        On failure the process is already killed.
        """
        if self.binary is None:
            raise MasterError("mooncake_master not found: pip install "
                              "mooncake-transfer-engine-non-cuda (or set $" + ENV_BINARY + ")")
        if self.proc is not None:
            raise MasterError("this MooncakeMaster is already started")
        fd, log = tempfile.mkstemp(prefix="kvbridge-mooncake-master-", suffix=".log")
        self._log = Path(log)
        try:
            with os.fdopen(fd, "wb") as out:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True,
                                             preexec_fn=_die_with_parent)
            deadline = time.monotonic() + self.start_timeout
            while not (_accepts(self.rpc_port) and _accepts(self.http_port)):
                if self.proc.poll() is not None:
                    raise MasterError(f"mooncake_master exited with rc {self.proc.returncode} "
                                      f"during start-up ({' '.join(self.command())}):\n"
                                      f"{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise MasterError(f"mooncake_master did not accept connections on "
                                      f"{self.master_address} and {self.metadata_url} within "
                                      f"{self.start_timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 3.0) -> None:
        """Kill the master's process group (SIGTERM, then SIGKILL after ``grace``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            # the group id is the leader's pid, which stays reserved until it is reaped by
            # proc.wait(): no signal can reach a stranger's group
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def skip_reason() -> str | None:
    """Why Mooncake Store tests cannot run here, or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake.store cannot load: {str(exc).splitlines()[0]} " \
               "(CPU hosts: apt-get install -y libibverbs1)"
    if find_master_binary() is None:
        return "mooncake_master binary not found (set $" + ENV_BINARY + ")"
    return None


@pytest.fixture(scope="module")
def mooncake_master() -> Iterator[MooncakeMaster]:
    """A master shared by the tests of one module; skips when Mooncake is missing."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with MooncakeMaster() as master:
        yield master


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge.tools.mooncake_master``: run a master until killed."""
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge.tools.mooncake_master",
        description="Run a local mooncake_master (HTTP metadata server, no etcd) until killed.")
    parser.add_argument("--port", type=int, default=None,
                        help="RPC port (metadata = port+1, metrics = port+2; default: free ports)")
    parser.add_argument("extra", nargs="*",
                        help="more mooncake_master flags, after --, e.g. -- -eviction_ratio=0.1")
    args = parser.parse_args(argv)
    master = MooncakeMaster(args.port, extra_args=args.extra)

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)  # also when started in the background (SIG_IGN)
    try:
        master.start()
        print(f"command:      {' '.join(master.command())}")
        print(f"master:       {master.master_address}")
        print(f"metadata_url: {master.metadata_url}", flush=True)
        while master.running:
            time.sleep(0.5)
        print(f"mooncake_master exited:\n{master.log_tail()}", file=sys.stderr)
        return 1
    except MasterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        master.stop()


if __name__ == "__main__":
    sys.exit(main())

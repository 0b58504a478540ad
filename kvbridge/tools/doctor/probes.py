"""Host probes behind ``kvbridge doctor``: each asks the machine one question.

Every function here is a plain function of the host (tests monkeypatch them) and is bounded:
a probe that starts a process waits at most its ``timeout`` and always reaps the child. Probes
report what they found and raise :class:`ProbeFailed` (one line saying what went wrong) when
the question itself could not be answered; they never leave a process or a socket behind.
Nothing here imports vLLM or a backend's native library into this process: NIXL is probed in
a child process (its plugins can crash a process at exit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import secrets
import select
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ProbeFailed",
    "NixlProbe",
    "PTRACE_SCOPE",
    "read_ptrace_scope",
    "has_cap_sys_ptrace",
    "cma_probe",
    "port_in_use",
    "nixl_probe",
    "ucx_devices",
    "libfabric_version",
    "find_ibverbs",
    "rdma_devices",
]

PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
_SYSFS_INFINIBAND = Path("/sys/class/infiniband")
_CAP_SYS_PTRACE = 19
_MARK = "KVBRIDGE-DOCTOR "


class ProbeFailed(Exception):
    """A probe could not get its answer; the message says why, in one line."""


def read_ptrace_scope(path: Path = PTRACE_SCOPE) -> int | None:
    """Yama's ``ptrace_scope`` (0–3), or None when Yama is not in this kernel."""
    try:
        return int(path.read_text().strip())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ProbeFailed(f"cannot read {path}: {exc}") from exc


def has_cap_sys_ptrace() -> bool:
    """True when this process holds CAP_SYS_PTRACE (``CapEff`` of /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


# The target of the CMA probe: hold a buffer, allow any same-user tracer (as the shm transport
# does on register_memory), say where the buffer is, wait for stdin to close (or 30 s).
_CMA_CHILD = """
import ctypes, os, select, sys
token = bytes.fromhex(sys.argv[1])
buf = ctypes.create_string_buffer(token, len(token))
try:
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), ctypes.c_ulong(0),
                            ctypes.c_ulong(0), ctypes.c_ulong(0))
except Exception:
    pass
sys.stdout.write("%d\\n" % ctypes.addressof(buf))
sys.stdout.flush()
select.select([sys.stdin], [], [], 30.0)
"""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _read_line(stream: Any, deadline: float) -> str:
    """One line from a child's pipe, waiting until ``deadline`` at most."""
    fd = stream.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ProbeFailed("the probe process did not answer in time")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise ProbeFailed("the probe process exited before answering")
        data += chunk
    return data.decode(errors="replace").strip()


def _reap(proc: subprocess.Popen[bytes], grace: float = 2.0) -> None:
    """Close the child's pipes, give it ``grace`` seconds, then kill it; always waits."""
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cma_probe(timeout: float = 10.0) -> str:
    """Read a buffer of a freshly spawned child with ``process_vm_readv``; return a one-line
    success detail. Raises :class:`ProbeFailed` naming the errno (EPERM: ptrace_scope, a
    seccomp profile or another user; ENOSYS: a kernel without CMA) or the mismatch. Blocks for
    one child start-up (well under a second), at most ``timeout`` seconds."""
    if not sys.platform.startswith("linux"):
        raise ProbeFailed("process_vm_readv is Linux only")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    readv = libc.process_vm_readv
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    token = secrets.token_bytes(64)
    proc = subprocess.Popen([sys.executable, "-I", "-c", _CMA_CHILD, token.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        addr = int(_read_line(proc.stdout, time.monotonic() + timeout))
        got = ctypes.create_string_buffer(len(token))
        local = _Iovec(ctypes.cast(got, ctypes.c_void_p), len(token))
        remote = _Iovec(addr, len(token))
        n = readv(proc.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            raise ProbeFailed(f"process_vm_readv of child {proc.pid}: "
                              f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")
        if got.raw != token:
            raise ProbeFailed(f"process_vm_readv read {n} bytes that differ from the child's")
        return f"process_vm_readv read {n} bytes from a child process"
    except ValueError as exc:
        raise ProbeFailed(f"the probe process answered nonsense: {exc}") from exc
    finally:
        _reap(proc)


def port_in_use(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound (TCP, ``SO_REUSEADDR`` off; closed at once), else
    why not: ``"in use"``, ``"only TIME_WAIT"`` (bindable with SO_REUSEADDR, which ZeroMQ
    sets), or the error. Raises :class:`ProbeFailed` when ``host`` does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ProbeFailed(f"cannot resolve {host!r}: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    for reuse in (False, True):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                if exc.errno == errno.EADDRNOTAVAIL:
                    return f"{host} is not an address of this host"
                return f"cannot bind: {exc.strerror or exc}"
            return None if not reuse else "only TIME_WAIT"
    return "in use"


@dataclass(frozen=True)
class NixlProbe:
    """What a throw-away NIXL agent in a child process said."""

    ok: bool
    detail: str
    plugins: tuple[str, ...] = ()


# Runs in a child: create (and close) a nixl transport through the registry, as an engine would.
_NIXL_CHILD = """
import json, sys
from kvbridge import registry
out = {"ok": False}
try:
    t = registry.create("nixl", "kvbridge-doctor", json.loads(sys.argv[1]))
    cfg = getattr(t, "agent_config", {})
    out = {"ok": True, "backends": cfg.get("backends", []), "plugins": cfg.get("plugins", [])}
    t.close()
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)
print("@MARK@" + json.dumps(out), flush=True)
""".replace("@MARK@", _MARK)


def nixl_probe(options: dict[str, Any], timeout: float = 90.0) -> NixlProbe:
    """Start a NIXL agent with backend ``options`` in a child process and report whether every
    configured NIXL backend (plugin) came up. Blocking: plugin loading takes a few seconds;
    at most ``timeout``. Raises :class:`ProbeFailed` when the child says nothing (a crash,
    a timeout)."""
    proc = subprocess.Popen([sys.executable, "-c", _NIXL_CHILD, json.dumps(options)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise ProbeFailed(f"the NIXL probe did not finish within {timeout:.0f} s") from exc
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith(_MARK):
            answer = json.loads(line[len(_MARK):])
            if answer.get("ok"):
                plugins = tuple(str(p) for p in answer.get("plugins", []))
                return NixlProbe(True, f"NIXL agent started with {answer.get('backends')}",
                                 plugins)
            return NixlProbe(False, str(answer.get("error", "unknown error")))
    tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise ProbeFailed(f"the NIXL probe process exited with status {proc.returncode} without "
                      f"answering ({tail[0][:200]})")


def _run_tool(argv: list[str], timeout: float) -> str | None:
    """stdout of ``argv`` (None if the tool is not installed, fails or times out)."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, *argv[1:]], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def ucx_devices(timeout: float = 15.0) -> list[str] | None:
    """``transport/device`` pairs that ``ucx_info -d`` lists; None without ``ucx_info``."""
    out = _run_tool(["ucx_info", "-d"], timeout)
    if out is None:
        return None
    found: list[str] = []
    transport = ""
    for line in out.splitlines():
        text = line.strip("# \t")
        if text.startswith("Transport:"):
            transport = text.split(":", 1)[1].strip()
        elif text.startswith("Device:"):
            pair = f"{transport}/{text.split(':', 1)[1].strip()}"
            if pair not in found:
                found.append(pair)
    return found


def libfabric_version(timeout: float = 5.0) -> str | None:
    """libfabric's version from ``fi_info --version`` (also under /opt/amazon/efa/bin), else
    the library file that ``ctypes.util.find_library`` finds, else None."""
    for exe in ("fi_info", "/opt/amazon/efa/bin/fi_info"):
        out = _run_tool([exe, "--version"], timeout)
        if out:
            for line in out.splitlines():
                if "libfabric" in line and ":" in line:
                    return line.split(":", 1)[1].strip()
            return out.strip().splitlines()[0]
    efa_lib = Path("/opt/amazon/efa/lib/libfabric.so.1")
    if efa_lib.exists():
        return f"{efa_lib} (version unknown: no fi_info)"
    lib = ctypes.util.find_library("fabric")
    return f"{lib} (version unknown: no fi_info)" if lib else None


def find_ibverbs() -> str | None:
    """The libibverbs the dynamic loader finds (a name or path), else None."""
    lib = ctypes.util.find_library("ibverbs")
    if lib:
        return lib
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return None
    return "libibverbs.so.1"


def rdma_devices(root: Path = _SYSFS_INFINIBAND) -> list[str]:
    """RDMA devices in ``/sys/class/infiniband`` (InfiniBand, RoCE, EFA); [] for none."""
    try:
        return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    except OSError:
        return []

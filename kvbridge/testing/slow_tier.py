"""``slow_disk``: the ``disk`` tier with injected read latency. Fault injection only.

NOT FOR PRODUCTION: a test and benchmark facility (entry point ``slow_disk`` in
``kvbridge.tiers``). It stores, verifies and evicts exactly like
:class:`~kvbridge.offload.tiers.disk.DiskTier` (it is one: same options ``path``,
``capacity_bytes``, ``fsync``, ``drain_only``, same files, same MAC), but sleeps before every
``load`` — the call that reads chunk contents, which the manager makes for every lookup that
reaches this tier — for a delay that can be changed while the engine runs. What it is for: the
hand-off planner's benchmark (a tier that turns slow mid-run, then fast again) and the soak
test's "slow disk" fault. Nothing else in kvbridge uses it.

Options, on top of the disk tier's:

``delay_file`` (a path)
    The read delay in milliseconds, as text in that file (``echo 300 > FILE``; ``0``, an empty
    or an absent file: no delay). Re-read at most every 100 ms, and only when its ``lstat``
    (mtime, ctime, size, inode) changed. The file is treated as hostile: anything but a plain number
    from 0 to :data:`MAX_DELAY_MS` — text, a negative number, NaN, infinity, a larger number,
    more than 64 bytes, a symbolic link, a FIFO or other non-regular file, a file that cannot
    be read — is **no delay**, with one WARNING naming the file and what it held (one per
    change of the file, never one per read). Nothing about the file ever raises into the engine.
``read_delay_ms`` (default 0)
    A fixed read delay, used when there is no ``delay_file`` (a bad value stops the engine at
    start-up, like any tier option).
``write_delay_ms`` (default 0)
    A fixed delay before every ``store`` (writes are not slowed unless this is set).

``contains``, ``evict`` and ``entries`` are never slowed: they read no chunk contents (the
manager's lookups use its own index and then ``load``).

Blocking: like ``disk`` (``blocking = True``), so the manager calls it only from its I/O threads,
one call at a time — the sleep happens exactly where a slow disk would block (off the engine's
scheduler and model-runner threads): a lookup answers later, the engine keeps stepping.

Counters (:meth:`SlowDiskTier.stats`; also in :meth:`describe`): delays injected, their total
milliseconds, and the delay now in force. Tiers have no counter channel to the engine's stats,
so these are read from the tier object (tests, in-process benchmarks).
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.offload.tier import TierContext
from kvbridge.offload.tiers.disk import DiskTier

__all__ = ["DelayFile", "MAX_DELAY_MS", "RECHECK_S", "SlowDiskTier"]

log = logging.getLogger("kvbridge.offload")

#: the largest delay accepted (ms); a larger one, in the file, is refused (no delay)
MAX_DELAY_MS = 60_000.0
#: the delay file is looked at no more often than this (seconds)
RECHECK_S = 0.1
#: more than this many bytes in the delay file is not a number of milliseconds
_MAX_FILE_BYTES = 64
_NUMBER = re.compile(r"^[0-9]+(?:\.[0-9]+)?$")


class DelayFile:
    """A delay in milliseconds read from a control file (see the module docstring).

    :meth:`ms` is thread-safe and cheap: between re-reads (at most every :data:`RECHECK_S`) it
    returns the cached value; a re-read does one ``lstat`` and reads the file only when its
    mtime, size or inode changed. Never raises.
    """

    def __init__(self, path: str | os.PathLike[str], *, owner: str = "slow_disk",
                 recheck_s: float = RECHECK_S) -> None:
        self.path = Path(os.path.abspath(Path(path).expanduser()))
        self.owner = owner
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._checked = -math.inf
        self._seen: tuple[int, int, int, int] | None = None
        self._ms = 0.0
        self._warned: str | None = None

    def ms(self) -> float:
        """The delay now in force (0 when the file is absent, empty or not acceptable)."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= self.recheck_s:
                self._checked = now
                try:
                    self._refresh()
                except Exception as exc:  # noqa: BLE001 - a control file never breaks a read
                    self._set(0.0, f"cannot be read ({type(exc).__name__}: {exc})")
            return self._ms

    def _refresh(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            self._seen = None
            self._set(0.0)
            return
        except OSError as exc:
            self._seen = None
            self._set(0.0, f"cannot be read ({exc.strerror or exc})")
            return
        seen = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        if seen == self._seen:
            return
        self._seen = seen
        if stat.S_ISLNK(st.st_mode):
            self._set(0.0, f"is a symbolic link (to {_readlink(self.path)!r}), not a file")
            return
        if not stat.S_ISREG(st.st_mode):
            self._set(0.0, "is not a regular file")
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._set(0.0, f"cannot be read ({exc.strerror or exc})")
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the lstat
                self._set(0.0, "is not a regular file")
                return
            raw = os.read(fd, _MAX_FILE_BYTES + 1)
        except OSError as exc:
            self._set(0.0, f"cannot be read ({exc.strerror or exc})")
            return
        finally:
            os.close(fd)
        self._parse(raw)

    def _parse(self, raw: bytes) -> None:
        if len(raw) > _MAX_FILE_BYTES:
            self._set(0.0, f"holds more than {_MAX_FILE_BYTES} bytes ({raw[:16]!r}…)")
            return
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            self._set(0.0, f"holds {raw!r}, not a number of milliseconds")
            return
        if not text:
            self._set(0.0)
            return
        if not _NUMBER.match(text):  # "-5", "nan", "inf", "1e9", "300ms", "0x10": refused
            self._set(0.0, f"holds {text!r}, not a number of milliseconds from 0 to "
                      f"{MAX_DELAY_MS:.0f}")
            return
        value = float(text)
        if not value <= MAX_DELAY_MS:
            self._set(0.0, f"holds {text!r}, above the largest delay accepted "
                      f"({MAX_DELAY_MS:.0f} ms)")
            return
        self._set(value)

    def _set(self, ms: float, problem: str | None = None) -> None:
        self._ms = ms
        if problem is None:
            self._warned = None
            return
        if problem != self._warned:  # one line per change into a bad state, never per read
            self._warned = problem
            log.warning("offload tier %s: delay file %s %s: no delay injected until it holds a "
                        "number of milliseconds (fault injection)", self.owner, self.path,
                        problem)


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)[:200]
    except OSError:
        return "?"


def _static_ms(ctx: TierContext, key: str) -> float:
    value = float(ctx.option(key, 0, float))
    if not 0 <= value <= MAX_DELAY_MS:
        raise ConfigError(f"offload tier {ctx.name!r}: {key} must be between 0 and "
                          f"{MAX_DELAY_MS:.0f} ms, got {ctx.options.get(key)!r}")
    return value


class SlowDiskTier(DiskTier):
    """The ``disk`` tier, slowed on reads for fault injection (see the module docstring).
    Options: the disk tier's, plus ``delay_file``, ``read_delay_ms``, ``write_delay_ms``."""

    #: no ``KVBridgeSlowDiskConnector``: a fault-injection tier gets no connector name of its own
    connector_word = ""

    @staticmethod
    def probe() -> str:
        """What ``kvbridge backends`` shows next to it."""
        return "ok (FAULT INJECTION for tests and benchmarks: reads sleep; not for production)"

    def __init__(self, ctx: TierContext) -> None:
        read_ms = _static_ms(ctx, "read_delay_ms")
        write_ms = _static_ms(ctx, "write_delay_ms")
        delay_file = ctx.options.get("delay_file")
        if delay_file is not None and not isinstance(delay_file, (str, os.PathLike)):
            raise ConfigError(f"offload tier {ctx.name!r}: delay_file must be a path, got "
                              f"{delay_file!r}")
        super().__init__(ctx)
        self.read_delay_ms = read_ms
        self.write_delay_ms = write_ms
        self.delay_file = DelayFile(delay_file, owner=ctx.name) if delay_file else None
        if self.delay_file is not None and read_ms:
            log.info("offload tier %s: read_delay_ms is ignored, the delay file %s sets the "
                     "delay", ctx.name, self.delay_file.path)
        self._stats_lock = threading.Lock()
        self._counts = {"delays": 0, "delay_ms": 0.0, "write_delays": 0, "write_delay_ms": 0.0}
        log.warning("offload tier %s is a FAULT-INJECTION tier (kvbridge.testing.slow_tier): "
                    "reads are delayed on purpose; not for production", ctx.name)

    def current_read_delay_ms(self) -> float:
        """The read delay in force now (the file's, else ``read_delay_ms``)."""
        return self.delay_file.ms() if self.delay_file is not None else self.read_delay_ms

    def _pause(self, ms: float, kind: str) -> None:
        if ms <= 0:
            return
        start = time.monotonic()
        time.sleep(ms / 1000.0)
        slept = (time.monotonic() - start) * 1000.0
        with self._stats_lock:
            self._counts[kind + "s"] += 1
            self._counts[kind + "_ms"] += slept

    def load(self, keys: Sequence[str]) -> list[bytes]:
        if keys:
            self._pause(self.current_read_delay_ms(), "delay")
        return super().load(keys)

    def store(self, items: Sequence[tuple[str, bytes]]) -> list[str]:
        if items:
            self._pause(self.write_delay_ms, "write_delay")
        return super().store(items)

    def stats(self) -> dict[str, Any]:
        """``slow_delays`` / ``slow_delay_ms`` (reads delayed, milliseconds slept),
        ``slow_write_delays`` / ``slow_write_delay_ms``, ``slow_read_delay_ms_now``."""
        with self._stats_lock:
            out: dict[str, Any] = {f"slow_{k}": v for k, v in self._counts.items()}
        out["slow_read_delay_ms_now"] = self.current_read_delay_ms()
        return out

    def describe(self) -> str:
        how = (f"delay from {self.delay_file.path}" if self.delay_file is not None
               else f"read delay {self.read_delay_ms:g} ms")
        with self._stats_lock:
            done = f"{self._counts['delays']} reads delayed"
        return (f"{super().describe()}; FAULT INJECTION: {how}, write delay "
                f"{self.write_delay_ms:g} ms, {done}")

"""What the chaos soak (``benchmarks/soak.py``) reads from its engines' and proxy's logs.

Contract: each function takes the soak's log directory (``DIR/logs``: one file per engine
process, ``P0-<ns>.log`` … ``D1-<ns>.log``, and per proxy process ``proxy-<ns>.log``) and returns
plain data for the report card; nothing here starts a process or touches the network, and a log
that cannot be read is skipped. They are meant to be called **before** the soak stops the
fleet: vLLM's own shutdown logs tracebacks and warnings that are not the run's.

- :func:`tracebacks`: per engine log, how many Python tracebacks and the last exception line.
- :func:`warnings`: per engine log, the WARNING and ERROR lines logged after the engine was up
  (vLLM's ``Application startup complete``), folded (ids and numbers dropped) and counted, so a
  card says *what* went wrong on which engine (e.g. vLLM's ``Potentially invalid KV blocks …
  were retrieved by a decode worker``).
- :func:`lines_of`: for given request ids (the soak sends its own ``X-Request-Id``, which the
  proxy passes on and vLLM puts in its request ids), every log line that names one: how a wrong
  or failed answer came about, with the log it is in.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["READY", "fold", "lines_of", "tracebacks", "warnings"]

READY = "Application startup complete"
"""vLLM's API server logs this once the engine serves; earlier warnings are start-up's."""

_EXCEPTION = re.compile(r"^[\w.]*(?:Error|Exception|Interrupt)\b.*")
_LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b")


def _engine_logs(logs: Path) -> list[Path]:
    return sorted(logs.glob("[PD]*.log"))


def _read(path: Path) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _message(line: str) -> str:
    """The message of a log line, past vLLM's ``(Proc pid=N) LEVEL date time [file:line] ``
    prefix (or Python logging's ``date time LEVEL logger: ``)."""
    if "] " in line:
        return line.rsplit("] ", 1)[-1].strip()
    found = _LEVEL.search(line)
    return line[found.end():].lstrip(" :").strip() if found else line.strip()


def fold(message: str, width: int = 160) -> str:
    """``message`` with ids, addresses and numbers replaced by ``#`` (so that the same event
    on different requests counts as one), cut to ``width``."""
    msg = re.sub(r"https?://\S+|tcp://\S+|\b[\w-]*[0-9a-f]{8,}[\w-]*|\d+(\.\d+)?", "#", message)
    return re.sub(r"\s+", " ", msg).strip()[:width]


def tracebacks(logs: Path) -> list[dict[str, Any]]:
    """Per engine log holding a Python traceback: its path, how many, and the last exception
    line (what a crash or a failed request died of)."""
    found = []
    for path in _engine_logs(logs):
        lines = _read(path)
        n = sum("Traceback (most recent call last)" in line for line in lines)
        if n:
            last = next((m.group(0)[:300] for line in reversed(lines)
                         for m in [_EXCEPTION.match(_message(line))] if m), "")
            found.append({"log": str(path), "tracebacks": n, "last": last})
    return found


def warnings(logs: Path, top: int = 8) -> list[dict[str, Any]]:
    """Per engine log with WARNING or ERROR lines after its start-up: the path and the ``top``
    most frequent folded messages with their level and count (traceback bodies, which vLLM
    logs line by line at ERROR, are left to :func:`tracebacks`)."""
    out = []
    for path in _engine_logs(logs):
        lines = _read(path)
        start = next((i for i, line in enumerate(lines) if READY in line), None)
        if start is None:  # never came up: everything it said is about why
            start = 0
        seen: Counter[tuple[str, str]] = Counter()
        for line in lines[start + 1:]:
            level = _LEVEL.search(line.split("] ", 1)[0] if "] " in line else line)
            msg = _message(line)
            if not level or not msg or msg.startswith(("File ", "Traceback", "^", "raise ")) \
                    or line.endswith("]") or line.rsplit("] ", 1)[-1].startswith(" "):
                continue
            seen[(level.group(1), fold(msg))] += 1
        if seen:
            out.append({"log": str(path), "lines": [
                {"level": lv, "message": m, "count": n} for (lv, m), n in seen.most_common(top)]})
    return out


def lines_of(logs: Path, rids: Iterable[str], per_rid: int = 12) -> dict[str, list[str]]:
    """For each request id of ``rids``: the log lines (every log, the proxy's too) that name
    it, each prefixed with its log's file name, at most ``per_rid``."""
    wanted = {rid: re.compile(re.escape(rid) + r"(?![0-9A-Za-z])") for rid in rids}
    out: dict[str, list[str]] = {rid: [] for rid in wanted}
    if not wanted:
        return out
    for path in sorted(logs.glob("*.log")):
        for line in _read(path):
            for rid, pattern in wanted.items():
                if len(out[rid]) < per_rid and pattern.search(line):
                    out[rid].append(f"{path.name}: {line.strip()[:400]}")
    return out

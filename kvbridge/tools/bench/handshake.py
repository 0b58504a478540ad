"""``kvbridge bench handshake``: what one peer handshake costs, this code against another.

A handshake is what an engine rank does the first time it meets a peer: ``Hello`` round trip,
compatibility checks, loading the peer into the transport (shm: the socket handshake with its
proof; NIXL: loading the agent and, since the proven-peer change, READing its proof board).
Per code version (this checkout, and optionally a ``--baseline-code`` checkout of another
commit), one child process runs a responder transfer loop in a grandchild
(:class:`~kvbridge.testing.agents.AgentProcess`) and a dialler loop in itself
(:class:`~kvbridge.testing.agents.LocalAgent`); each round the dialler forgets the peer and
handshakes again, timed on its loop thread from ``ensure`` to the answer. Both versions' rounds
alternate (ABBA), so they see the same host noise. Both run with one random fleet secret, so the
baseline (which may predate the per-user secret) and this code authenticate alike.

Blocking; every child is stopped before returning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools.report import percentile, table

__all__ = ["code_path", "run_handshake_bench", "format_handshake_report", "add_arguments",
           "cli_main"]

#: The child: ``ready`` once both loops are up; each ``go`` line, one timed handshake
#: (``{"ms": …}`` or ``{"error": …}``); ``quit`` ends it. Answers are ``KVB <json>`` lines.
#: It imports only what every version since core v2 has, so that it runs against a checkout
#: of an older commit too.
CHILD = textwrap.dedent('''
    import json, sys, threading, time
    from kvbridge.testing.agents import AgentProcess, LocalAgent
    from kvbridge.testing.handoffs import FAST

    extra = {**FAST, **json.loads(sys.argv[1])}
    responder = AgentProcess("hs-responder", extra=extra)
    dialler = LocalAgent("hs-dialler", extra=extra)
    loop = dialler.loop

    def once():
        done, out = threading.Event(), {}
        def start():
            loop.peers.forget(responder.address)
            out["t0"] = time.perf_counter()
            def answered(result):
                out["t1"] = time.perf_counter()
                out["result"] = result
                done.set()
            loop.peers.ensure(responder.address, "*", answered)
        loop.submit(start)
        if not done.wait(30):
            return {"error": "no answer in 30 s"}
        if isinstance(out["result"], Exception):
            return {"error": str(out["result"])[:300]}
        return {"ms": (out["t1"] - out["t0"]) * 1000.0}

    try:
        print("KVB " + json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print("KVB " + json.dumps(once()), flush=True)
    finally:
        dialler.close()
        responder.close()
''')


class _Version:
    """One code version's child process."""

    def __init__(self, name: str, code: Path | None, backend: str, secret: str,
                 timeout: float) -> None:
        self.name = name
        env = dict(os.environ)
        if code is not None:
            env["PYTHONPATH"] = code_path(code, env.get("PYTHONPATH"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps({"backend": backend, "secret": secret})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=str(code) if code is not None else None)
        self.timeout = timeout
        self.ms: list[float] = []
        self.errors: list[str] = []
        if not self._read().get("ready"):
            raise ConfigError(f"handshake bench: the {name} child did not start")

    def _read(self) -> dict[str, Any]:
        """The child's next answer (native libraries print to the same stdout: their lines
        are skipped)."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise ConfigError(f"handshake bench: the {self.name} child exited "
                                  f"(code {self.proc.poll()})")
            if line.startswith("KVB "):
                out: dict[str, Any] = json.loads(line[4:])
                return out

    def round(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out = self._read()
        if "ms" in out:
            self.ms.append(float(out["ms"]))
        else:
            self.errors.append(str(out.get("error")))

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


def code_path(code: Path, rest: str | None = None) -> str:
    """``PYTHONPATH`` that imports kvbridge and its backend packages from the checkout
    ``code`` (they live in ``backends/``) before anything installed."""
    parts = [str(code), str(code / "backends")] + ([rest] if rest else [])
    return os.pathsep.join(parts)


def run_handshake_bench(backend: str, rounds: int, baseline: Path | None,
                        timeout: float = 120.0) -> dict[str, Any]:
    """Interleaved handshakes of this code and, with ``baseline``, of that checkout."""
    secret = os.urandom(16).hex()
    versions: list[_Version] = []
    try:
        versions.append(_Version("this", None, backend, secret, timeout))
        if baseline is not None:
            versions.append(_Version("baseline", baseline, backend, secret, timeout))
        first: dict[str, float | None] = {}
        for v in versions:  # the first handshake connects (UCX, Mooncake) and warms up
            v.round()
            first[v.name] = v.ms[0] if v.ms else None
            v.ms.clear()
        for i in range(rounds):
            for v in (versions if i % 4 in (0, 3) else versions[::-1]):
                v.round()
    finally:
        for v in versions:
            v.close()
    rows = [{"code": v.name, "rounds": len(v.ms), "failed": len(v.errors),
             "first_ms": first.get(v.name),
             "p50_ms": percentile(v.ms, 50), "p90_ms": percentile(v.ms, 90),
             "max_ms": max(v.ms) if v.ms else None, "errors": v.errors[:3]} for v in versions]
    report: dict[str, Any] = {"backend": backend, "rounds": rounds,
                              "baseline": str(baseline) if baseline else None,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows,
                              "load": os.getloadavg()[0]}
    if len(versions) == 2:
        pairs = [a - b for a, b in zip(versions[0].ms, versions[1].ms, strict=False)]
        report["paired_p50_ms"] = statistics.median(pairs) if pairs else None
    return report


def format_handshake_report(report: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [f"kvbridge bench handshake, {report['date']}, backend {report['backend']}, "
             f"{report['rounds']} rounds (ABBA), load {report['load']:.2f}", ""]
    lines += table(["code", "ok/failed", "first ms", "p50 ms", "p90 ms", "max ms"],
                   [[r["code"], f"{r['rounds']}/{r['failed']}", f(r["first_ms"]),
                     f(r["p50_ms"]), f(r["p90_ms"]), f(r["max_ms"])] for r in report["rows"]],
                   "r")
    lines += ["", "first: the first handshake of a fresh pair (connection set-up included), not "
                  "in the percentiles"]
    if "paired_p50_ms" in report:
        lines += ["", f"paired, this - baseline ({report['baseline']}): median "
                      f"{f(report['paired_p50_ms'])} ms per handshake"]
    for r in report["rows"]:
        for e in r["errors"]:
            lines.append(f"{r['code']} error: {e}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("shm", "nixl", "mooncake"), default="shm",
                   help="transport whose handshake is timed")
    p.add_argument("--rounds", type=int, default=40, help="handshakes per code version")
    p.add_argument("--baseline-code", type=Path, default=None,
                   help="a checkout of another commit (git worktree add DIR COMMIT): its "
                        "handshakes alternate with this code's")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def cli_main(args: argparse.Namespace) -> int:
    if args.rounds < 2:
        raise ConfigError("--rounds must be >= 2")
    if args.baseline_code is not None and not (args.baseline_code / "kvbridge").is_dir():
        raise ConfigError(f"--baseline-code {args.baseline_code}: no kvbridge package there")
    report = run_handshake_bench(args.backend, args.rounds, args.baseline_code)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2) if args.json else format_handshake_report(report))
    return 0 if all(r["failed"] == 0 for r in report["rows"]) else 1

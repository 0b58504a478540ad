"""Kill one engine of a 2P2D fleet in the middle of a ``vllm bench serve`` run, per mode.

    PYTHONPATH=. .venv/bin/python benchmarks/fleet_faults.py [--backend shm] \
        [--modes pull,push,headroom] [--roles prefill,decode] [--rate 4] [--num-prompts 48] \
        [--kill-at 0.3] [--input-len 200] [--output-len 32] [--out DIR]

Starts two P and two D ``vllm serve`` engines on the tiny model
(:func:`kvbridge.tools.bench.fleet.fleet_specs`) and one kvbridge proxy per mode in front of all
four (:class:`kvbridge.tools.proxies.ProxyThread`, health checks every second). Then, per (mode,
role), it runs vLLM's ``bench serve`` (random dataset, streamed, ``--ignore-eos``, Poisson
arrivals) through that mode's proxy, SIGKILLs the process group of P0 (role prefill) or D0
(role decode) once the proxy has dispatched ``--kill-at`` of the prompts and holds a request on
that engine (or 10 s later if none comes), lets the run finish, restarts the engine at the same
URL and waits until the proxy has it back in rotation.

It prints a table, one row per run (each also on standard error as it ends): requests completed /
failed as bench serve counts them, requests **truncated** (bench serve counts a stream that ended
with an in-band error event as a success: fewer output tokens than asked for is how it shows), the
proxy's retries by reason during the run, TTFT p50 / p99 and E2E p99 / max. A request the proxy
could re-route (everything a dead P held; what a dead D held before its first token went out)
should be neither failed nor truncated; the streams a dead D was in the middle of are truncated.

A benchmark, not a test: nothing is asserted; the exit status is 0 unless the setup failed.
Engines, proxies and bench serve are stopped on any exit (also Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.tools import prom
from kvbridge.tools.bench.fleet import fleet_specs
from kvbridge.tools.bench.serve_process import bench_serve_command
from kvbridge.tools.bench.serve_results import result_metrics
from kvbridge.tools.engines import VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.report import print_table
from kvbridge.tools.tiny_model import build_tiny_model

# headroom (push or pull by D's load: auto before the planner) by default: every request is a
# hand-off, so a killed P holds some; auto (the planner) may serve requests by D alone
MODES = ("pull", "push", "headroom", "auto")
DEFAULT_MODES = ("pull", "push", "headroom")


def _retries(url: str) -> dict[str, float]:
    return prom.by_label(prom.fetch(url, 30), "kvbridge_proxy_retries_total", "reason")


def _restart(old: VllmServer, log_dir: Path) -> VllmServer:
    """The same engine again, at the same URL (the proxy knows engines by URL)."""
    new = VllmServer(old.model, served_model_name=old.served_model_name, port=old.port,
                     kv_transfer_config=old.kv_transfer_config, cpu_bind=old.cpu_bind,
                     env=old.env, extra_args=old.extra_args, name=old.name,
                     log_path=log_dir / f"{old.name}-{time.monotonic_ns()}.log")
    start_servers([new], timeout=600)
    return new


def _wait_in_rotation(proxies: ProxyThread, url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = [e for s in proxies.servers.values()
                   for e in (*s.prefills.engines, *s.decodes.engines) if e.url == url]
        if all(e.is_up() for e in engines):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not back in rotation after {timeout:.0f} s")


def _wait_for_load(proxies: ProxyThread, mode: str, url: str, dispatched: int,
                   bench: subprocess.Popen[bytes]) -> int:
    """Wait until ``mode``'s proxy sent ``dispatched`` P legs, then (at most 10 s) until it
    holds a request on the engine at ``url``; how many it holds then."""
    server = proxies.servers[mode]
    engine = server.prefills.by_url(url) or server.decodes.by_url(url)
    assert engine is not None
    base = sum(e.total for e in server.prefills.engines)  # P legs of earlier runs
    while (sum(e.total for e in server.prefills.engines) - base < dispatched
           and bench.poll() is None):
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while engine.in_flight == 0 and time.monotonic() < deadline and bench.poll() is None:
        time.sleep(0.002)
    return engine.in_flight


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = Path(args.out or tempfile.mkdtemp(prefix="kvbridge-fleet-faults-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"results and logs in {out}", file=sys.stderr, flush=True)
    model = build_tiny_model()
    ps, ds = fleet_specs(f"kvbridge-{args.backend}", model, out / "logs", 2.0, 2, 2)
    fleet = {"prefill": ps, "decode": ds}
    proxies: ProxyThread | None = None
    rows: list[dict[str, Any]] = []
    try:
        start_servers([*ps, *ds], timeout=900)
        proxies = ProxyThread([p.url for p in ps], [d.url for d in ds], modes=args.modes,
                              health_interval_s=1.0, timeout_s=120.0).start()
        for i, (mode, role) in enumerate((m, r) for m in args.modes for r in args.roles):
            url = proxies.urls[mode]
            victim = fleet[role][0]
            name = f"{mode}-kill-{role}"
            before = _retries(url)
            cmd = bench_serve_command(url, model, out, name, rate=args.rate,
                                      num_prompts=args.num_prompts, input_len=args.input_len,
                                      output_len=args.output_len, seed=100 + i, warmups=0,
                                      ready_check_s=0)
            load = time.strftime("%H:%M:%S")
            with open(out / f"{name}.log", "wb") as log:
                bench = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
                try:
                    held = _wait_for_load(proxies, mode, victim.url,
                                          int(args.kill_at * args.num_prompts), bench)
                    assert victim.pid is not None
                    os.killpg(victim.pid, signal.SIGKILL)
                    victim.stop(grace=10)
                    rc = bench.wait(timeout=900)
                finally:
                    if bench.poll() is None:
                        os.killpg(bench.pid, signal.SIGKILL)
                        bench.wait()
            after = _retries(url)
            row: dict[str, Any] = {"mode": mode, "killed": f"{role} ({victim.name})", "rc": rc,
                                   "start": load, "held_at_kill": held,
                                   "loadavg": os.getloadavg()[0]}
            path = out / f"{name}.json"
            if rc == 0 and path.is_file():
                result = json.loads(path.read_text())
                row.update(result_metrics(result))
                lens = [n for n, e in zip(result.get("output_lens") or [],
                                          result.get("errors") or [], strict=False) if not e]
                row["truncated"] = sum(1 for n in lens if n < args.output_len)
            row["retries"] = {k: int(v - before.get(k, 0)) for k, v in after.items()
                              if v - before.get(k, 0)}
            rows.append(row)
            print(f"{name}: " + ", ".join(f"{h} {c}" for h, c in zip(HEAD, table_row(row),
                                                                      strict=True)),
                  file=sys.stderr, flush=True)
            fleet[role][0] = _restart(victim, out / "logs")
            _wait_in_rotation(proxies, fleet[role][0].url)
    finally:
        if proxies is not None:
            proxies.close()
        for e in (*fleet["prefill"], *fleet["decode"]):
            e.stop()
        (out / "summary.json").write_text(json.dumps({"argv": sys.argv, "rows": rows},
                                                     indent=1) + "\n")
        print_table(HEAD, [table_row(r) for r in rows], ["l", "l"] + ["r"] * 6 + ["l"])
    return rows


HEAD = ["mode", "killed", "holding", "ok/fail", "truncated", "TTFT p50/p99 ms",
        "E2E p99/max ms", "load", "retries"]


def table_row(r: dict[str, Any]) -> list[str]:
    """One run's row under :data:`HEAD`."""
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.0f}" if isinstance(v, float) else str(v)

    return [str(r["mode"]), str(r["killed"]), str(r["held_at_kill"]),
            f"{f(r.get('completed'))}/{f(r.get('failed'))}", f(r.get("truncated")),
            f"{f(r.get('ttft_p50'))}/{f(r.get('ttft_p99'))}",
            f"{f(r.get('e2e_p99'))}/{f(r.get('e2e_max'))}", f"{r['loadavg']:.1f}",
            str(r["retries"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="shm", choices=("shm", "nixl"))
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--roles", default="prefill,decode")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--kill-at", type=float, default=0.3,
                    help="kill once this share of the prompts was dispatched")
    ap.add_argument("--input-len", type=int, default=200)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    args.roles = [r for r in args.roles.split(",") if r]
    if not set(args.modes) <= set(MODES) or not set(args.roles) <= {"prefill", "decode"}:
        ap.error(f"--modes: {', '.join(MODES)}; --roles: prefill, decode")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

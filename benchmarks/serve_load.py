"""``vllm bench serve`` through the kvbridge proxy, per mode, to catch freezes under load.

    PYTHONPATH=. .venv/bin/python benchmarks/serve_load.py [--backend nixl] \
        [--modes pull,push,auto,headroom] [--runs 3] [--spin-ms 2|off] [--rate 8] \
        [--num-prompts 40] [--input-len 200] [--output-len 16] [--out DIR]

Starts one P and one D ``vllm serve`` engine on the tiny random-weight model
(:func:`kvbridge.tools.tiny_model.build_tiny_model`; P on core 0, D on core 1, ``--block-size 32``,
the KVBridgeConnector config of ``kvbridge bench e2e``), one kvbridge proxy per mode
(:class:`kvbridge.tools.proxies.ProxyThread`), then runs vLLM's own ``bench serve`` (random
dataset, streamed ``/v1/completions``, ``--ignore-eos``) against each proxy ``--runs`` times and
prints a table at the end (each run's verdict on standard error as it ends), one row per run: TTFT
p50 / p99 / max, TPOT p50 / p99, E2E p99, ``TTFT p99/p50`` and a verdict, ``freeze`` when TTFT p99
> ``--freeze-ratio`` x p50 or any request took longer than ``--freeze-s`` seconds end to end.

``--spin-ms`` sets ``KVBRIDGE_ENGINE_SPIN_MS`` for both engines (``off``: unset, vLLM's 1 s
spin). ``--engine-env KEY=VALUE`` adds engine environment variables (e.g.
``VLLM_LOGGING_LEVEL=DEBUG``). Before the load, engine CPU (each engine's whole process group)
is measured for ``--idle-s`` seconds: both idle, then D holding one push request whose KV never
comes. Every ``vllm bench serve`` result JSON (with per-request detail), the engine logs, each
run's wall-clock start (to line requests up with engine logs) and a ``summary.json`` go to
``--out``.

A benchmark, not a test: nothing is asserted; the exit status is 0 unless the setup failed.
Engines, proxies and a running ``bench serve`` are stopped on any exit (also Ctrl-C).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbridge.params import push_decode_request
from kvbridge.tools.bench.serve_process import bench_serve_command, run_bench_process
from kvbridge.tools.bench.serve_results import result_metrics
from kvbridge.tools.client import complete, probe
from kvbridge.tools.cpumeter import cpu_seconds, group_cpu
from kvbridge.tools.engines import EngineError, VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.report import print_table
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

MODES = ("pull", "push", "auto", "headroom")  # auto: the planner; headroom: auto before it
BACKENDS = ("shm", "nixl", "mooncake", "compose")


class _Server(VllmServer):
    """A VllmServer that can also remove variables this shell exports (``drop``)."""

    def __init__(self, *args: Any, drop: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drop = drop

    def environment(self) -> dict[str, str]:
        env = super().environment()
        for key in self.drop:
            env.pop(key, None)
        return env


def engines(backend: str, model: Path, log_dir: Path, spin_ms: str,
            extra_env: dict[str, str], members: list[str] | None = None,
            ) -> tuple[VllmServer, VllmServer]:
    """P (core 0) and D (core 1), as ``kvbridge bench e2e`` and the e2e tests start them."""
    env = {"VLLM_TARGET_DEVICE": "cpu", **extra_env}
    drop: tuple[str, ...] = ()
    if spin_ms == "off":
        drop = ("KVBRIDGE_ENGINE_SPIN_MS",)  # unset, even if this shell exports it
    else:
        env["KVBRIDGE_ENGINE_SPIN_MS"] = spin_ms
    servers = []
    for name, core, role in (("P", "0", "kv_producer"), ("D", "1", "kv_consumer")):
        kv = {"kv_connector": "KVBridgeConnector", "kv_role": role,
              "engine_id": f"load-{backend}-{name}",
              "kv_connector_extra_config": {"backend": backend}}
        if backend == "compose":
            kv["kv_connector_extra_config"]["backend_options"] = {  # type: ignore[index]
                "members": members or ["shm", "nixl"]}
        servers.append(_Server(model, name=f"load-{backend}-{name}", kv_transfer_config=kv,
                               cpu_bind=core, env=env, extra_args=["--block-size", "32"],
                               log_path=log_dir / f"{backend}-spin{spin_ms}-{name}.log",
                               drop=drop))
    return servers[0], servers[1]


def _group_cpu(server: VllmServer, seconds: float) -> float:
    """CPU seconds per second used by *server*'s whole process group over *seconds*."""
    assert server.pid is not None
    before, t0 = group_cpu(server.pid), time.monotonic()
    time.sleep(seconds)
    return cpu_seconds(before, group_cpu(server.pid)) / (time.monotonic() - t0)


def idle_cpu(p: VllmServer, d: VllmServer, seconds: float) -> dict[str, float]:
    """Engine CPU-s/s: both idle, then D holding one push request whose KV never comes.

    The second is ``tests/engines/test_vllm_e2e.py::test_decode_waiting_for_a_push_sleeps…``: the
    request is parked on D waiting for a WRITE from P that is never sent; the client then gives
    up, which makes vLLM abort it.
    """
    out = {"idle_P": _group_cpu(p, seconds), "idle_D": _group_cpu(d, seconds)}
    params = push_decode_request(probe(p.url), f"never-{time.monotonic_ns()}")
    prompt = random_prompts(1, 100, seed=91)[0]
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, d.url, prompt, 4, params, False, None, timeout=seconds + 4)
        time.sleep(2.0)  # parked, waiting for the push
        out["push_wait_D"] = _group_cpu(d, seconds)
        with contextlib.suppress(EngineError):
            fut.result(timeout=60)  # the client gives up: vLLM aborts the request
    time.sleep(1.0)
    return out


def bench_command(args: argparse.Namespace, url: str, model: Path, out: Path, name: str,
                  seed: int) -> list[str]:
    return bench_serve_command(url, model, out, name, rate=args.rate,
                               num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, seed=seed, warmups=args.warmups)


def summarize(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The row of one run, from ``bench serve``'s saved JSON (times in ms): the figures of
    :func:`kvbridge.tools.bench.serve_results.result_metrics`, the p99/p50 ratio and the verdict."""
    row: dict[str, Any] = result_metrics(result)
    lat = [t * 1000 for t, e in zip(result.get("latencies") or [], result.get("errors") or [],
                                    strict=False) if e in (None, "")]
    p50, p99 = row["ttft_p50"], row["ttft_p99"]
    row["ratio"] = p99 / p50 if p50 and p99 is not None else None
    slow = [x for x in lat if x > args.freeze_s * 1000]
    row["slow_requests"] = len(slow)
    reasons: list[str] = []
    if slow:
        reasons.append(f">{args.freeze_s:g}s")
    if row["ratio"] is not None and row["ratio"] > args.freeze_ratio:
        reasons.append(f"p99>{args.freeze_ratio:g}xp50")
    if not row["completed"]:
        row["verdict"] = "FAILED"
    else:
        verdict = f"freeze ({', '.join(reasons)})" if reasons else "ok"
        if row["failed"]:
            verdict += f", {row['failed']} failed"
        row["verdict"] = verdict
    return row


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def table_head(freeze_s: float) -> list[str]:
    """The columns of the runs' table (``>Ns``: requests slower than ``--freeze-s``)."""
    return ["backend", "spin", "mode", "run", "ok/fail", "TTFT p50 ms", "TTFT p99 ms",
            "TTFT max ms", "TPOT p50 ms", "TPOT p99 ms", "E2E p99 ms", "p99/p50",
            f">{_f(freeze_s, 0)}s", "verdict"]


def table_row(r: dict[str, Any]) -> list[str]:
    """One run's row under :func:`table_head`."""
    return [str(r["backend"]), str(r["spin"]), str(r["mode"]), str(r["run"]),
            f"{_f(r.get('completed'))}/{_f(r.get('failed'))}", _f(r.get("ttft_p50")),
            _f(r.get("ttft_p99")), _f(r.get("ttft_max")), _f(r.get("tpot_p50")),
            _f(r.get("tpot_p99")), _f(r.get("e2e_p99")), _f(r.get("ratio"), 2),
            _f(r.get("slow_requests")), str(r["verdict"])]


def print_runs(rows: list[dict[str, Any]], freeze_s: float) -> None:
    """The table of every run in ``rows`` (the idle CPU entry is not a run)."""
    head = table_head(freeze_s)
    print_table(head, [table_row(r) for r in rows if "verdict" in r],
                ["l"] * 4 + ["r"] * (len(head) - 5) + ["l"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS, default="nixl")
    p.add_argument("--members", default="shm,nixl",
                   help="compose backend: comma-separated members, in order")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                   "pull,push,auto,headroom")
    p.add_argument("--runs", type=int, default=3, help="bench serve runs per mode")
    p.add_argument("--spin-ms", default="2",
                   help="KVBRIDGE_ENGINE_SPIN_MS for the engines; 'off' leaves it unset")
    p.add_argument("--rate", type=float, default=8.0, help="request rate (req/s, Poisson)")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--warmups", type=int, default=2,
                   help="unmeasured warm-up requests before each run (bench serve --num-warmups)")
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="before the load, measure engine CPU over this many seconds idle and "
                   "with D waiting for a push that never comes (0: skip)")
    p.add_argument("--push-headroom", type=int, default=4, help="headroom proxy: push headroom")
    p.add_argument("--seed", type=int, default=0, help="run i of a mode uses seed + i")
    p.add_argument("--freeze-ratio", type=float, default=3.0,
                   help="verdict freeze when TTFT p99 > this x TTFT p50 ...")
    p.add_argument("--freeze-s", type=float, default=3.0,
                   help="... or when any request took longer than this (s, end to end)")
    p.add_argument("--bench-timeout", type=float, default=300.0,
                   help="kill one bench serve run after this many seconds")
    p.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra engine environment variable (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="results + logs (default: temp dir)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes: unknown {bad}; expected some of {','.join(MODES)}")
    if args.spin_ms != "off":
        try:
            if float(args.spin_ms) < 0:
                raise ValueError
        except ValueError:
            p.error("--spin-ms must be a number of milliseconds >= 0, or 'off'")
    for kv in args.engine_env:
        if "=" not in kv:
            p.error(f"--engine-env {kv!r}: expected KEY=VALUE")
    return args


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks below


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvbridge-serve-load-"))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra_env = dict(kv.split("=", 1) for kv in args.engine_env)
    spin = args.spin_ms
    model = build_tiny_model()
    p, d = engines(args.backend, model, out, spin, extra_env, args.members.split(","))
    proxies: ProxyThread | None = None
    rows: list[dict[str, Any]] = []
    try:
        say(f"starting P and D ({args.backend}, KVBRIDGE_ENGINE_SPIN_MS={spin}); logs in {out}")
        start_servers([p, d], timeout=600)
        if args.idle_s > 0:
            cpu = idle_cpu(p, d, args.idle_s)
            print(f"engine CPU-s/s over {args.idle_s:g} s: idle P {cpu['idle_P']:.3f}, idle D "
                  f"{cpu['idle_D']:.3f}; D holding a push that never comes "
                  f"{cpu['push_wait_D']:.3f}", flush=True)
            rows.append({"idle_cpu": cpu})
        proxies = ProxyThread([p.url], [d.url], modes=args.modes,
                              push_headroom=args.push_headroom).start()
        # perf_counter (bench serve's start_times) is CLOCK_MONOTONIC, shared by processes
        offset = time.time() - time.perf_counter()
        for mode in args.modes:
            for i in range(1, args.runs + 1):
                name = f"{args.backend}-spin{spin}-{mode}-run{i}"
                cmd = bench_command(args, proxies.urls[mode], model, out, name, args.seed + i)
                t_wall = time.time()
                say(f"{name}: vllm bench serve -> {proxies.urls[mode]}")
                rc = run_bench_process(cmd, out / f"{name}.bench.log", args.bench_timeout)
                path = out / f"{name}.json"
                row: dict[str, Any] = {"backend": args.backend, "spin": spin, "mode": mode,
                                       "run": i, "rc": rc, "wall_start": t_wall,
                                       "perf_to_wall": offset, "result": str(path)}
                if rc == 0 and path.is_file():
                    row.update(summarize(json.loads(path.read_text()), args))
                else:
                    row["verdict"] = f"bench failed (rc {rc}, log {name}.bench.log)"
                rows.append(row)
                say(f"{name}: {row['verdict']}")
    finally:
        if proxies is not None:
            proxies.close()
        p.stop()
        d.stop()
        (out / "summary.json").write_text(json.dumps(
            {"argv": sys.argv, "args": {k: str(v) for k, v in vars(args).items()},
             "rows": rows}, indent=1) + "\n")
        say(f"engines and proxies stopped; results in {out}")
        print_runs(rows, args.freeze_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())

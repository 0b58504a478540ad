"""One ``kvbridge bench serve`` run: start each engine group, drive every (setup, rate), stop.

Contract: :func:`run_serve_bench` runs the groups of its :class:`~kvbridge.tools.bench.
serve_settings.ServeSettings` one after another into an output directory and returns the
report, which it also rewrites to ``results.json`` after every row (an interrupted run keeps
what it measured). Engines, proxies and ``vllm bench serve`` processes are always stopped
before it returns or raises (also on Ctrl-C, and at interpreter exit). A group that fails is
reported in its rows, and the next group runs. Blocking; for the command line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvbridge.tools import prom
from kvbridge.tools.bench.dispatch import control_addresses, control_stats
from kvbridge.tools.bench.fleet import fleet_specs, side_channel_port
from kvbridge.tools.bench.serve_process import bench_serve_command, run_bench_process
from kvbridge.tools.bench.serve_results import (
    RESULTS_FILE,
    RESULTS_KIND,
    handoff_summary,
    phase_gaps,
    result_metrics,
    run_window,
)
from kvbridge.tools.bench.serve_settings import (
    KVBRIDGE_GROUP,
    MODE_SLOT,
    ServeSettings,
    fleet_name,
    rate_name,
    run_seed,
    setup_group,
    setup_groups,
    setup_mode,
)
from kvbridge.tools.bench.stallprobe import StallProbe, summarize
from kvbridge.tools.client import stream_complete
from kvbridge.tools.cpumeter import loadavg
from kvbridge.tools.engines import EngineError, start_servers
from kvbridge.tools.fleetctl import AdminClient, AdminError
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

__all__ = ["engines_idle", "new_report", "run_serve_bench"]

log = logging.getLogger("kvbridge.tools.bench.serve")

_IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


Say = Callable[[str], None]


def _scrape_idle(url: str, timeout: float = 5.0) -> float:
    """Requests running or waiting on one engine (its ``/metrics``)."""
    text = prom.fetch(url, timeout)
    return sum(prom.total(text, name) for name in _IDLE_METRICS)


def engines_idle(urls: Sequence[str], timeout: float, interval: float = 0.5) -> tuple[bool, float]:
    """Wait until no engine of *urls* runs or queues a request, twice in a row; (idle, seconds
    waited). Gives up after *timeout* seconds (or when an engine stops answering)."""
    t0 = time.monotonic()
    quiet = 0
    while True:
        try:
            busy = sum(_scrape_idle(u) for u in urls)
        except OSError as exc:
            log.warning("cannot read engine metrics: %s", exc)
            return False, time.monotonic() - t0
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            return False, time.monotonic() - t0
        time.sleep(interval)


def _warm_up(url: str, settings: ServeSettings, setup: str) -> str | None:
    """*settings.warmups* streamed requests through *url*; None if one succeeded, else why not."""
    if settings.warmups <= 0:
        return None
    prompts = random_prompts(settings.warmups, settings.input_len,
                             seed=900_000 + settings.seed * 10 + MODE_SLOT[setup_mode(setup)])
    last = "no warm-up ran"
    ok = 0
    for prompt in prompts:
        try:
            res = stream_complete(url, prompt, settings.output_len, None, {"ignore_eos": True},
                                  timeout=settings.request_timeout)
            if res.ttft is None:
                raise EngineError("no token streamed")
            ok += 1
        except EngineError as exc:
            last = str(exc)[:300]
    return None if ok else f"warm-up failed ({settings.warmups} requests): {last}"


@contextlib.contextmanager
def _endpoints(group: str, setups: Sequence[str], ps: Sequence[Any], ds: Sequence[Any],
               settings: ServeSettings, log_dir: Path) -> Iterator[dict[str, str]]:
    """The one URL per setup that ``vllm bench serve`` is pointed at: a proxy process per
    setup, as in production (a thread of this process would share its GIL, and the kvbridge
    proxies of every setup one event loop); all stopped on exit."""
    from kvbridge.tools.proxies import ProxyProcess  # aiohttp: keeps --help fast

    procs: dict[str, ProxyProcess] = {}
    if group == KVBRIDGE_GROUP:
        for s in setups:
            procs[s] = ProxyProcess(
                ["--prefill", *[p.url for p in ps], "--decode", *[d.url for d in ds],
                 "--mode", setup_mode(s), "--push-headroom", str(settings.push_headroom)],
                log_dir / f"proxy-{s}.log")
    else:
        [p], [d] = ps, ds  # the stock proxies speak to one P and one D
        mode = setup_mode(group)
        stock = ["--protocol", mode, "--prefill", p.url, "--decode", d.url, "--timeout-s",
                 str(max(settings.request_timeout, settings.bench_timeout))]
        if mode == "push":
            stock += ["--p-side-channel-port", str(side_channel_port(p))]
        procs[group] = ProxyProcess(stock, log_dir / f"proxy-{group}.log",
                                    module="kvbridge.tools.bench.proxy")
    try:
        yield {s: proc.start() for s, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.stop()


class _Recorder:
    """Collects rows, rewrites ``results.json`` after each, drives the progress bar."""

    def __init__(self, report: dict[str, Any], out: Path, bar: Any) -> None:
        self.report = report
        self.out = out
        self.bar = bar

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def add(self, row: dict[str, Any]) -> None:
        self.report["rows"].append(row)
        self.save()
        if self.bar is not None:
            self.bar.update(1)

    def save(self) -> None:
        path = self.out / RESULTS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        tmp.replace(path)


def _failed_rows(setups: Sequence[str], settings: ServeSettings, error: str,
                 done: set[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"setup": s, "rate": rate, "seed": run_seed(settings.seed, s, i), "error": error}
            for s in setups for i, rate in enumerate(settings.rates) if (s, rate) not in done]


def _run_group(group: str, setups: Sequence[str], settings: ServeSettings, model: Path,
               out: Path, rec: _Recorder) -> None:
    """Start the group's engines, run every (setup, rate), stop everything."""
    config = f"kvbridge-{settings.backend}" if group == KVBRIDGE_GROUP else group
    log_dir = out / "logs"
    ps, ds = fleet_specs(config, model, log_dir, settings.engine_spin_ms,
                         settings.prefill_engines, settings.decode_engines, settings.pin_engines)
    engines = [*ps, *ds]
    info: dict[str, Any] = {"setups": list(setups), "engines": config, "logs": str(log_dir),
                            "fleet": fleet_name(len(ps), len(ds))}
    rec.report["groups"][group] = info
    done: set[tuple[str, float]] = set()
    t_start = time.monotonic()
    nice0 = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        rec.say(f"{group}: starting engines ({config}; logs in {log_dir})")
        start_servers(engines, timeout=settings.start_timeout, progress_every=30.0,
                      progress=lambda s, r: rec.say(f"{group}: waiting for engines {s:.0f} s, "
                                                    f"ready={r}"))
        info["ready_s"] = round(time.monotonic() - t_start, 1)
        info["client_nice"] = _boost(settings.client_nice, rec)
        controls = None  # the engines' hand-off timings: read on a 1P1D kvbridge pair
        if group == KVBRIDGE_GROUP and len(ps) == len(ds) == 1:
            controls = control_addresses(ps[0].url, ds[0].url, settings.request_timeout)[:2]
        with _endpoints(group, setups, ps, ds, settings, log_dir) as urls:
            for setup in setups:
                _run_setup(setup, urls[setup], settings, model, out, rec, engines, done,
                           controls)
    except Exception as exc:  # noqa: BLE001 - report the group failed, go on with the next
        info["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec.say(f"{group}: FAILED: {info['error'][:300]}")
        for row in _failed_rows(setups, settings, f"{group}: {info['error'][:300]}", done):
            rec.add(row)
    finally:
        if os.getpriority(os.PRIO_PROCESS, 0) != nice0:  # the next group's engines: as before
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, nice0)
        for e in engines:
            e.stop()
        info["elapsed_s"] = round(time.monotonic() - t_start, 1)
        rec.save()
        rec.say(f"{group}: engines stopped")


def _run_setup(setup: str, url: str, settings: ServeSettings, model: Path, out: Path,
               rec: _Recorder, engines: Sequence[Any], done: set[tuple[str, float]],
               controls: tuple[str, str] | None = None) -> None:
    engine_urls = [e.url for e in engines]
    rec.say(f"{setup}: {settings.warmups} warm-up request(s) through {url}")
    warm_error = _warm_up(url, settings, setup)
    if warm_error is not None:
        rec.say(f"{setup}: {warm_error}")
    for i, rate in enumerate(settings.rates):
        seed = run_seed(settings.seed, setup, i)
        row: dict[str, Any] = {"setup": setup, "rate": rate, "seed": seed}
        dead = [e.name for e in engines if e.proc is None or e.proc.poll() is not None]
        if warm_error is not None or dead:
            row["error"] = warm_error or f"engine(s) exited: {', '.join(dead)}"
            rec.add(row)
            done.add((setup, rate))
            continue
        if rec.bar is not None:
            rec.bar.set_description(f"{setup} @ {rate:g} req/s")
        idle, waited = engines_idle(engine_urls, settings.idle_timeout)
        row["idle_wait_s"] = round(waited, 2)
        row["idle"] = idle
        if not idle:
            rec.say(f"{setup}: engines not idle after {waited:.0f} s; running anyway")
        name = f"{setup}-rate{rate_name(rate)}"
        cmd = bench_serve_command(url, model, out, name, rate=rate,
                                  num_prompts=settings.num_prompts, input_len=settings.input_len,
                                  output_len=settings.output_len, seed=seed, warmups=0,
                                  ready_check_s=0, request_id_prefix=f"{name}-")
        rec.say(f"{setup}: vllm bench serve at {rate:g} req/s ({settings.num_prompts} prompts, "
                f"seed {seed}) -> {url}")
        row["wall_start"] = time.time()

        seen = set(control_stats(controls[1]).timings) if controls else set()
        probe = StallProbe(out / f"{name}.probe.json")
        if not probe.start():
            rec.say(f"{setup}: the host stall probe did not start; no stall figures this run")
        try:
            rc = run_bench_process(cmd, out / f"{name}.bench.log", settings.bench_timeout)
        finally:
            stalls = probe.stop()
        if controls is not None:
            try:
                time.sleep(0.3)  # the last first_step reaches D's rank with its next step
                p_t, d_t = (control_stats(c).timings for c in controls)
                row.update(handoff_summary(p_t, d_t, sorted(set(d_t) - seen)))
            except Exception as exc:  # noqa: BLE001 - timings are extra; the run stands
                rec.say(f"{setup}: no hand-off timings: {exc}")
        path = out / f"{name}.json"
        row.update(rc=rc, result_file=path.name, log_file=f"{name}.bench.log")
        if rc == 0 and path.is_file():
            try:
                result = json.loads(path.read_text())
                row.update(result_metrics(result))
            except (OSError, ValueError) as exc:
                row["error"] = f"unreadable result {path.name}: {exc}"
            else:
                if not row.get("completed"):
                    row["error"] = f"no request completed ({row.get('failed')} failed)"
                elif setup_group(setup) == KVBRIDGE_GROUP:
                    whys = _whys(url, f"{name}-", len(result.get("ttfts") or []), rec)
                    # bench serve's start_times are perf_counter values of this host
                    offset = time.time() - time.perf_counter()
                    row.update(phase_gaps(result, whys, offset))
                    row.update(summarize(stalls, *run_window(result, offset)))
        else:
            why = "timed out" if rc == -1 else f"exit status {rc}"
            row["error"] = f"vllm bench serve {why}; see {name}.bench.log"
        rec.add(row)
        done.add((setup, rate))


def _boost(nice: int, rec: _Recorder) -> int:
    """Set this thread's niceness to ``nice`` (0: leave it) once the engines run: the proxy's
    thread and the ``vllm bench serve`` processes started from here inherit it, the engines keep
    theirs. Linux niceness is per thread. Returns the niceness in force."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == 0 or nice == now:
        return now
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        rec.say(f"--client-nice {nice}: not allowed here ({exc}); the client runs at {now}")
        return now
    return nice


def _whys(url: str, prefix: str, n: int, rec: _Recorder) -> dict[int, dict[str, Any]]:
    """The kvbridge proxy's ``/admin/why`` answer of each of a run's ``n`` requests (request
    ``i``'s id is ``<prefix><i>``); those it no longer or never knew are left out."""
    try:
        admin = AdminClient(url, timeout_s=10.0)
    except AdminError as exc:
        rec.say(f"no flight records: {exc}")
        return {}
    out: dict[int, dict[str, Any]] = {}
    for i in range(n):
        try:
            out[i] = admin.call("GET", f"/admin/why/{prefix}{i}")
        except AdminError:
            continue
    return out


def new_report(settings: ServeSettings, out: Path) -> dict[str, Any]:
    return {
        # version 2: kvbridge-auto is the planner (kvbridge-headroom is version 1's kvbridge-auto)
        "kind": RESULTS_KIND, "version": 2,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "fleet": fleet_name(settings.prefill_engines, settings.decode_engines),
        "host": {"cpus": os.cpu_count(), "loadavg_start": loadavg()},
        "settings": {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple)
                         else v) for k, v in vars(settings).items()},
        "out": str(out), "groups": {}, "rows": [],
    }


def run_serve_bench(settings: ServeSettings, out: Path, *, progress_bar: bool = True
                    ) -> dict[str, Any]:
    """Run every group of *settings* in turn into *out*; return the report (also written to
    ``out/results.json``). Engines and proxies are stopped before this returns or raises."""
    out.mkdir(parents=True, exist_ok=True)
    report = new_report(settings, out)
    bar: Any = None
    if progress_bar:
        from tqdm import tqdm  # optional: comes with vLLM, not a kvbridge dependency

        bar = tqdm(total=len(settings.setups) * len(settings.rates), unit="run",
                   desc="kvbridge bench serve", file=sys.stderr, dynamic_ncols=True)
    rec = _Recorder(report, out, bar)
    try:
        rec.save()
        model = build_tiny_model(settings.model_dir)
        for group, setups in setup_groups(settings.setups):
            _run_group(group, setups, settings, model, out, rec)
    finally:
        report["host"]["loadavg_end"] = loadavg()
        rec.save()
        if bar is not None:
            bar.close()
    return report


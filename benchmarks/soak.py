"""A chaos soak: a 2P2D fleet under steady load while faults are injected, every answer checked.

    PYTHONPATH=.:backends .venv/bin/python benchmarks/soak.py --minutes 8 --seed 1 \
        [--connector kvbridge|vllm-nixl] [--backend shm|nixl] [--rate 1.5] \
        [--faults kill,stop,drain,proxy,transfer_error[,slow_disk]] [--repeat-share 0.3] \
        [--fail-share 0.05] [--out DIR] [--proxy-mode pull|push|headroom|auto] \
        [--rolling [--quiet-s 75] [--from-code DIR] [--order D0,D1,P0,P1]]

Starts two P and two D ``vllm serve`` engines on the tiny model (CPU, each with a fixed HTTP
and control port, so a restarted engine keeps its address) and one kvbridge proxy in headroom
mode (push or pull by D's load: auto before the planner, so every request is a hand-off;
``--proxy-mode`` picks another, e.g. ``pull`` so that every hand-off is a pull),
as its own process (``python -m kvbridge.proxy``) so that it can be killed and restarted at its
port. Then, for ``--minutes``:

- **load**: a seeded Poisson stream of ``--rate`` greedy completions per second through the
  proxy, half streamed, prompts of 64/150/300 token ids never sent before, 8/16/32 tokens out,
  ``return_token_ids``. Its own load generator rather than ``vllm bench serve``, which cannot
  check outputs: here *every* answer is compared with the single-engine reference (computed
  after the run on P1 directly, prefix cache reset, no hand-off).
- **faults**, one at a time at seeded moments (:func:`kvbridge.tools.bench.soak_card.schedule`):
  ``kill`` (SIGKILL an engine's process group, restart it at its port), ``stop`` (SIGSTOP it
  for 2-12 s, then SIGCONT), ``drain`` (drain it through the proxy's ``/admin``, remove it,
  stop it, start its successor, add it back), ``proxy`` (SIGKILL the proxy, restart it at its
  port). Each fault's window lasts until the fleet is whole again (every engine ``active``).
  ``transfer_error`` is not a moment: P1 and D1 run the fault-injecting transport wrapper
  (:class:`kvbridge.testing.faults.FaultyBackend` around the chosen backend), failing a seeded
  ``--fail-share`` of their transfers for the whole run.
- ``slow_disk`` (asked for by name; not in the default set): every engine runs one offload tier,
  ``slow_disk`` (:mod:`kvbridge.testing.slow_tier`, a ``disk`` tier whose reads sleep for the
  delay its ``delay_file`` holds), in a directory of its own under ``DIR/tiers`` that a
  restarted engine finds again, all reading one delay file ``DIR/slow_disk_delay_ms``; vLLM's KV
  cache is cut to 8 MiB (256 blocks) so that a prompt sent a minute earlier has left vLLM's
  prefix cache and is looked up in the tier. The fault writes a seeded 300-1500 ms into the
  delay file for a seeded 10-40 s, then 0; its window is while the delay is in force, and its
  note counts the blocks read from the slow tiers meanwhile (``offload_hit_blocks_slow_disk``),
  lookups that timed out (a miss, recomputed) and failed loads. Prompts are otherwise never
  repeated, so with ``slow_disk`` a seeded ``--repeat-share`` (default 0.3) of requests re-send
  an earlier request's prompt (:func:`~kvbridge.tools.bench.soak_card.repeat_of`); without it
  the load is what it always was.

``--connector vllm-nixl`` runs the same card against vLLM's own ``NixlConnector`` as shipped
(P ``kv_producer``, D ``kv_consumer``, ``kv_buffer_device`` cpu, each engine's NIXL side
channel at a fixed port), behind the same proxy in ``--mode pull``. Faults that apply: ``kill``,
``stop``, ``drain``, ``proxy`` (``transfer_error`` and ``slow_disk`` are kvbridge's transport
wrapper and tier: refused). vLLM's engines answer no ``StatsQuery``, so their leaks are "not
measurable"; what their /metrics say after the run (requests running and waiting, KV cache in
use) is on the card instead. For either connector the card lists engines that exited on their
own and every engine log holding a Python traceback (path, count, last exception line), the
WARNING and ERROR lines each engine logged after start-up (folded and counted,
:mod:`kvbridge.tools.bench.soak_logs`), and for every wrong output the log lines that name its
request: each request carries ``X-Request-Id: soak-s<seed>-<i>``, which the proxy passes on
and vLLM puts in its own request ids.

``--rolling`` is a measured rolling upgrade instead (issue 28): no faults but a ``drain`` of every
engine, P0, P1, D0 then D1 (:func:`kvbridge.tools.bench.soak_card.rolling`; ``--order`` names
another order, e.g. ``D0,D1,P0,P1`` so that old P engines hand off to new D engines), one at a
time, the
first after ``--quiet-s`` of steady load, each step starting when the fleet is whole again; the
load goes on for another ``--quiet-s`` after the last (``--minutes`` is then its upper bound).
The card's "during faults" are the upgrade's windows, "quiet" the steady state around them.
With ``--from-code DIR`` the upgrade changes version: the initial fleet's engines import kvbridge
from ``DIR``, a checkout of another commit (``git worktree add --detach DIR REV``, then in it
``python setup.py -q build_ext --inplace`` and ``python setup.py -q egg_info``, for shm's range
copy and the entry points), through ``PYTHONPATH`` and their working directory as
``kvbridge bench handoff --against code`` runs them; every successor, the proxy and the
references run this tree. Before anything starts, each version's imports are checked in the
environment its engines get (kvbridge, shm's range copy and the ``shm`` backend must come from
its checkout); the card names both commits and which code each engine's processes ran.
Every drained engine's hand-off counters (pulls served, pushes sent, KV received, failures) are
read just before it is stopped and written in its step's note: with ``--from-code`` they say
which hand-offs each old engine took part in.

At the end it waits until no engine holds a transfer (at most a lease and 30 s), reads what each
still holds (``StatsQuery.pending``: leaked leases/registrations, must be 0; vLLM's engines: its
/metrics, see above), computes the
references and prints the report card (:func:`~kvbridge.tools.bench.soak_card.card`); the card
and every request go to ``DIR/card.json`` and ``DIR/requests.jsonl``, the logs to ``DIR/logs``.
Exit status 0 when the card is clean (no wrong output, nothing leaked; with ``--rolling`` no
failed request either), 1 otherwise. Every engine and the proxy are stopped on any exit (also
Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbridge.host.placement import fleet_cores
from kvbridge.messages import StatsQuery, StatsReply
from kvbridge.testing.clients import engine_client
from kvbridge.tools import prom
from kvbridge.tools.bench import soak_logs
from kvbridge.tools.bench.handshake import code_path
from kvbridge.tools.bench.soak_card import (
    CONNECTORS,
    DEFAULT_FAULTS,
    ENGINES,
    FAULTS,
    PROXY_MODES,
    ROLLING_ORDER,
    Fault,
    Outcome,
    Window,
    applicable,
    card,
    card_rows,
    code_version,
    proxy_mode,
    reason,
    repeat_of,
    rolling,
    rolling_order,
    schedule,
)
from kvbridge.tools.client import (
    complete,
    engine_stats,
    output_token_ids,
    reset_prefix_cache,
    stream_complete,
)
from kvbridge.tools.engines import EngineError, VllmServer, free_port, start_servers
from kvbridge.tools.fleetctl import AdminClient, AdminError
from kvbridge.tools.procs import end_group
from kvbridge.tools.report import print_table
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

LEASE_S = 6.0
GREEDY = {"ignore_eos": True}
LENGTHS = (64, 150, 300)
MAX_TOKENS = (8, 16, 32)
CLIENT_TIMEOUT_S = 180.0
TIER_KV_CACHE_BYTES = 8 * 2**20
"""vLLM's KV cache per engine when the engines run the slow tier (256 blocks of the tiny model,
about 60 s of one engine's share of the load at 1.5 req/s, and more than 8 running requests of
the longest kind need): prompts sent a minute earlier have left vLLM's prefix cache, so a repeat
is looked up in the tier (the default 256 MiB would hold a whole short soak)."""
HANDOFF_COUNTERS = ("pull_served", "push_sent", "recv_ok", "recv_failed", "pull_claimed",
                    "pull_cancelled", "push_failed", "lease_expired", "params_rejected",
                    "peer_gone", "checksum_mismatch")
"""The counters a drained engine's step note shows (those not 0): which hand-offs it served."""
ADMIN_TIMEOUT_S = 60.0
"""How long the injector waits for one answer of the proxy's /admin: a proxy starved of CPU (four
vLLM NixlConnector engines busy-polling two cores) took over 10 s to answer."""
END_WAIT_S = 60.0
"""How long the soak waits, once the load ended, for a fault still being injected (an engine
restarting on a starved host can take minutes) before its final checks."""
REPEAT_SHARE = 0.3
"""Share of requests that re-send an earlier prompt when ``slow_disk`` is on (else 0)."""
THIS_CODE = Path(__file__).resolve().parent.parent
"""The checkout this soak runs from: the code of the proxy and of every engine's successor."""
_IMPORTS = """
import importlib, json, kvbridge
from kvbridge import registry
copy = importlib.import_module("kvbridge.transports.shm._rangecopy")
shm = importlib.import_module(registry.load_class("shm").__module__)
print(json.dumps({"kvbridge": kvbridge.__file__, "rangecopy": copy.__file__,
                  "shm": shm.__file__}))
"""
"""Run in an engine's environment: where its kvbridge, shm's range copy and backend come from."""


def _git(code: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(code), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def code_info(label: str, code: Path, env: dict[str, str], cwd: Path | None) -> dict[str, Any]:
    """One kvbridge version of the soak: its checkout's commit, subject and whether it has
    uncommitted changes to tracked files, and where an engine started with ``env`` in ``cwd``
    imports kvbridge, shm's range copy and the ``shm`` backend from (RuntimeError when any of
    them is not under ``code``: the engines would not run the version the card names)."""
    full = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(f"{code}: kvbridge does not import in the engines' environment: "
                           f"{proc.stderr.strip()[-1500:]}")
    imports = json.loads(proc.stdout.strip().splitlines()[-1])
    outside = {k: v for k, v in imports.items() if not Path(v).resolve().is_relative_to(code)}
    if outside:
        raise RuntimeError(f"{code}: the engines would import {outside} from elsewhere (is "
                           "shm's range copy built there, and egg_info run?)")
    return {"label": label, "path": str(code), "commit": _git(code, "rev-parse", "HEAD"),
            "subject": _git(code, "log", "-1", "--format=%ad %s", "--date=iso"),
            "dirty": bool(_git(code, "status", "--porcelain", "--untracked-files=no")),
            "imports": imports}


def _faulty_backend_path(where: Path) -> str:
    """A directory that registers the test-only backend ``faulty`` for the engines that have it
    on their ``PYTHONPATH`` (as ``tests/engines/test_vllm_faults.py`` does)."""
    dist = where / "kvbridge_faulty_soak-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbridge-faulty-soak\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(
        "[kvbridge.backends]\nfaulty = kvbridge.testing.faults:FaultyBackend\n")
    return os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH", "")) if p)


def mapped_code(pgid: int) -> list[str]:
    """The checkouts whose shm range copy (``…/kvbridge/transports/shm/_rangecopy*.so``) the
    processes of process group ``pgid`` have mapped: the code an engine really runs, read from
    ``/proc`` (empty until a transfer loaded it, or where ``/proc`` cannot say)."""
    found: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if "/_rangecopy" in path:
                    found.add(path.split("/kvbridge/transports/shm/")[0])
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)


class Fleet:
    """Four engines and a proxy process at fixed ports; every start and stop goes through it."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out, self.logs = args, out, out / "logs"
        self.model = str(build_tiny_model())
        self.http = {n: free_port() for n in ENGINES}
        self.ctl = {n: free_port() for n in ENGINES}
        self.proxy_port = free_port()
        cpus = sorted(os.sched_getaffinity(0))
        self.cores = dict(zip(ENGINES, map(str, sum(fleet_cores(cpus, 2, 2), [])), strict=True))
        self.engines: dict[str, VllmServer] = {}
        self.proxy: subprocess.Popen[bytes] | None = None
        atexit.register(self.stop_proxy)  # engines have their own (kvbridge.tools.engines)
        self.lock = threading.Lock()  # the injector and the final checks, never both at once
        self.starts = {n: 0 for n in ENGINES}  # per engine: its n-th process draws its own fails
        self.vllm = args.connector == "vllm-nixl"  # vLLM's own NixlConnector, as shipped
        self.tiers = "slow_disk" in args.faults
        self.delay_file = out / "slow_disk_delay_ms"  # every engine's slow tier reads this
        self.delay_file.write_text("0\n")
        self.vllm_after: dict[str, dict[str, Any]] = {}
        self.old_code: Path | None = args.from_code  # the initial fleet's kvbridge, if not ours
        self.ran: dict[str, list[str]] = {n: [] for n in ENGINES}  # code label per process
        self.mapped: dict[str, list[list[str]]] = {n: [] for n in ENGINES}  # seen per process

    def see_code(self, name: str) -> None:
        """Record which checkout's code the engine's running process has mapped."""
        pid = self.engines[name].pid
        if pid is not None:
            self.mapped[name].append(mapped_code(pid))

    def code_env(self, label: str, env: dict[str, str]) -> Path | None:
        """Make ``env`` import the kvbridge of version ``label`` (``from``: ``--from-code``,
        before anything else on ``PYTHONPATH``; ``to``: this tree, as inherited); the working
        directory its engine needs (``python -m`` imports from there first)."""
        if label != "from":
            return None
        assert self.old_code is not None
        env["PYTHONPATH"] = code_path(self.old_code,
                                      env.get("PYTHONPATH", os.environ.get("PYTHONPATH")))
        return self.old_code

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.http[name]}"

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def engine(self, name: str) -> VllmServer:
        role = "kv_producer" if name.startswith("P") else "kv_consumer"
        log = self.logs / f"{name}-{time.monotonic_ns()}.log"
        self.starts[name] += 1  # this engine's n-th process
        if self.vllm:  # as tests/engines/test_vllm_stock_nixl.py runs it (tools.bench.fleet)
            return VllmServer(
                self.model, name=name, port=self.http[name], cpu_bind=self.cores[name],
                kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": role,
                                    "kv_buffer_device": "cpu"},
                env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1",
                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.ctl[name])},
                extra_args=["--block-size", "32"], log_path=log)
        extra: dict[str, Any] = {
            "backend": self.args.backend, "lease_s": LEASE_S, "heartbeat_s": 1,
            "push_timeout_s": 60, "prefill_wait_s": 60, "control_timeout_s": 5,
            "side_channel_port": self.ctl[name]}
        env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2",
               "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache, before the references
        if "transfer_error" in self.args.faults and name in ("P1", "D1"):
            rng = random.Random(f"{self.args.seed}-{name}-{self.starts[name]}")
            fail = [n for n in range(1, 5001) if rng.random() < self.args.fail_share]
            extra.update(backend="faulty", backend_options={"inner": self.args.backend,
                                                            "faults": {"fail": fail}})
            env["PYTHONPATH"] = _faulty_backend_path(self.out / "plugin")
        args = ["--block-size", "32"]
        if self.tiers:  # its own directory, kept across restarts; the delay file is shared
            extra["offload"] = {"tiers": [{
                "name": "slow_disk", "path": str(self.out / "tiers" / name),
                "capacity_bytes": "256MiB", "delay_file": str(self.delay_file)}]}
            args += ["--kv-cache-memory-bytes", str(TIER_KV_CACHE_BYTES)]
        kv = {"kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": f"soak-{name}",
              "kv_connector_extra_config": extra}
        label = code_version(self.starts[name], "from" if self.old_code else None, "to")
        self.ran[name].append(label)
        cwd = self.code_env(label, env)
        return VllmServer(self.model, name=name, port=self.http[name], kv_transfer_config=kv,
                          cpu_bind=self.cores[name], env=env, extra_args=args, log_path=log,
                          cwd=cwd)

    def start(self) -> None:
        self.engines = {n: self.engine(n) for n in ENGINES}
        start_servers(self.engines.values(), timeout=900)
        self.start_proxy()

    def start_proxy(self) -> None:
        # headroom by default, not auto (the planner): every request hands off, so the faults
        # hit transfers (--proxy-mode: soak_card.proxy_mode)
        cmd = [sys.executable, "-m", "kvbridge.proxy", "--mode", self.args.proxy_mode,
               "--prefill", self.url("P0"), self.url("P1"),
               "--decode", self.url("D0"), self.url("D1"),
               "--port", str(self.proxy_port), "--health-interval", "0.5", "--timeout", "120"]
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"proxy-{time.monotonic_ns()}.log", "wb") as log:
            self.proxy = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_whole(60)

    def stop_proxy(self, sig: int = signal.SIGKILL) -> None:
        proc, self.proxy = self.proxy, None
        if proc is not None:
            end_group(proc, sig, grace_s=15.0)

    def admin(self) -> AdminClient:
        return AdminClient(self.proxy_url, timeout_s=ADMIN_TIMEOUT_S)

    def states(self) -> dict[str, str]:
        rows = self.admin().engines()
        by_url = {r["url"]: r["state"] for r in rows}
        return {n: by_url.get(self.url(n), "absent") for n in ENGINES}

    def wait_whole(self, timeout: float) -> None:
        """Until the proxy answers and has all four engines active."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            if self.proxy is not None and self.proxy.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proxy.returncode}")
            try:
                last = self.states()
                if all(s == "active" for s in last.values()):
                    return
            except AdminError as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"the fleet is not whole after {timeout:.0f} s: {last}")

    def restart(self, name: str) -> None:
        self.engines[name] = self.engine(name)
        start_servers([self.engines[name]], timeout=600)

    def signal(self, name: str, sig: int) -> None:
        pid = self.engines[name].pid
        assert pid is not None
        os.killpg(pid, sig)

    def pending(self, name: str) -> int | None:
        """Transfers the engine holds (leases, registrations); None for vLLM's own connector,
        which answers no ``StatsQuery``: its /metrics are read instead (:meth:`vllm_metrics`)."""
        if self.vllm:
            return None
        client = engine_client(30.0)
        try:
            reply = client.request(f"tcp://127.0.0.1:{self.ctl[name]}", StatsQuery())
        finally:
            client.close()
        assert isinstance(reply, StatsReply)
        return int(reply.pending)

    def vllm_metrics(self, name: str) -> dict[str, float | None]:
        """What vLLM's own /metrics say the engine holds: requests running and waiting, and its
        KV cache in use (0 to 1; blocks of finished requests that vLLM keeps cached count as
        free)."""
        text = prom.fetch(self.url(name), 10)
        return {"running": prom.total(text, "vllm:num_requests_running"),
                "waiting": prom.total(text, "vllm:num_requests_waiting"),
                "kv_cache_usage": prom.total(text, "vllm:kv_cache_usage_perc")}

    def wait_idle(self, names: tuple[str, ...] = ENGINES, timeout: float = LEASE_S + 30
                  ) -> dict[str, int | None]:
        """What each engine of ``names`` still holds, once none holds anything (or when
        ``timeout`` ran out). vLLM's own engines: None each (not measurable), after waiting
        until their /metrics show nothing running and no KV in use (kept in ``vllm_after``)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.vllm:
                seen: dict[str, dict[str, Any]] = {}
                for n in names:
                    try:
                        seen[n] = self.vllm_metrics(n)
                    except Exception as exc:  # noqa: BLE001 - an engine that cannot answer
                        seen[n] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                self.vllm_after.update(seen)
                busy = any(m.get("error") or any(v for k, v in m.items() if k != "error")
                           for m in seen.values())
                if not busy or time.monotonic() >= deadline:
                    return {n: None for n in names}
            else:
                left = {n: self.pending(n) for n in names}
                if not any(left.values()) or time.monotonic() >= deadline:
                    return left
            time.sleep(0.5)

    def set_delay(self, ms: float) -> None:
        """Every engine's slow tier reads ``ms`` per read from now (within its 100 ms re-check)."""
        tmp = self.delay_file.with_suffix(".tmp")
        tmp.write_text(f"{ms:g}\n")
        os.replace(tmp, self.delay_file)  # a new inode: the tiers see the change at once

    def tier_counts(self) -> dict[str, int]:
        """Over the engines now running: blocks read from the slow tier, tier lookups that
        timed out (a miss: recomputed), loads that failed."""
        keys = {"offload_hit_blocks_slow_disk": "read", "offload_lookup_timeouts": "timeouts",
                "offload_load_failed": "failed"}
        out = dict.fromkeys(keys.values(), 0)
        for n in ENGINES:
            with contextlib.suppress(Exception):  # an engine restarting: counted when back
                stats = engine_stats(f"tcp://127.0.0.1:{self.ctl[n]}", 10)
                for k, short in keys.items():
                    out[short] += int(stats.get(k, 0))
        return out

    def handoff_counts(self, name: str) -> str:
        """The engine's hand-off counters that are not 0 (``pull_served 12, recv_ok 3``), or why
        they could not be read (vLLM's own engines answer no ``StatsQuery``)."""
        if self.vllm:
            return "not measurable"
        try:
            stats = engine_stats(f"tcp://127.0.0.1:{self.ctl[name]}", 10)
        except Exception as exc:  # noqa: BLE001 - the note says why
            return f"unread ({type(exc).__name__})"
        seen = [f"{k} {stats[k]}" for k in HANDOFF_COUNTERS if stats.get(k)]
        return ", ".join(seen) or "all 0"

    def close(self, keep: tuple[str, ...] = ()) -> None:
        """Stop the proxy and every engine but those of ``keep``."""
        self.stop_proxy()
        for name, server in self.engines.items():
            if name in keep:
                continue
            if server.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGCONT)  # a SIGSTOPped group stops as well
            with contextlib.suppress(Exception):
                server.stop(grace=10)


def inject(fleet: Fleet, fault: Fault, t0: float) -> Window:
    """Run one fault to the end of its recovery; its window on the soak's clock."""
    start = time.monotonic() - t0
    note = ""
    name = fault.target
    if fault.kind == "kill":
        fleet.signal(name, signal.SIGKILL)
        fleet.engines[name].stop(grace=10)
        fleet.restart(name)
    elif fault.kind == "stop":
        fleet.signal(name, signal.SIGSTOP)
        try:
            time.sleep(fault.hold_s)
        finally:
            fleet.signal(name, signal.SIGCONT)
        note = f"stopped {fault.hold_s:.1f} s"
    elif fault.kind == "drain":
        admin, url = fleet.admin(), fleet.url(name)
        admin.drain(url)
        row = admin.wait_drained(url, 120)
        took = time.monotonic() - t0 - start
        held: Any = fleet.wait_idle((name,))[name]  # a drained engine holds nothing a lease later
        if held is None:  # vLLM's own: what its /metrics say
            held = fleet.vllm_after.get(name)
        note = (f"{row['state']} after {took:.1f} s, then holding {held}; counters: "
                f"{fleet.handoff_counts(name)}")
        admin.remove(url, force=row["state"] != "drained")
        fleet.see_code(name)
        fleet.engines[name].stop()
        fleet.restart(name)
        admin.add("prefill" if name.startswith("P") else "decode", url)
    elif fault.kind == "proxy":
        fleet.stop_proxy(signal.SIGKILL)
        fleet.start_proxy()
    elif fault.kind == "slow_disk":
        before = fleet.tier_counts()
        fleet.set_delay(fault.delay_ms)
        try:
            time.sleep(fault.hold_s)
        finally:
            fleet.set_delay(0)
        after = fleet.tier_counts()
        note = (f"{fault.delay_ms:g} ms per read for {fault.hold_s:.1f} s: "
                + ", ".join(f"{k} {after[k] - before[k]}" for k in after)
                + " (blocks read from the slow tiers, lookups timed out, loads failed)")
    else:
        raise ValueError(fault.kind)
    fleet.wait_whole(120)
    return Window(fault.kind, name, round(start, 2), round(time.monotonic() - t0, 2), note)


def rid_of(seed: int, i: int) -> str:
    """The ``X-Request-Id`` of request ``i``: the proxy passes it on and vLLM's request ids
    contain it, so every log line about the request can be found (:func:`soak_logs.lines_of`)."""
    return f"soak-s{seed}-{i}"


def send(url: str, i: int, prompt: list[int], stream: bool, max_tokens: int,
         t0: float, repeats: int | None = None, rid: str = "") -> Outcome:
    start = time.monotonic() - t0
    o = Outcome(i, stream, len(prompt), max_tokens, round(start, 3), 0.0, 0, repeat_of=repeats)
    headers = {"X-Request-Id": rid} if rid else None
    try:
        if stream:
            res = stream_complete(url, prompt, max_tokens, None, GREEDY, timeout=CLIENT_TIMEOUT_S,
                                  headers=headers)
            o.tokens, o.ttft = res.token_ids, res.ttft
            if len(res.token_ids) != max_tokens:
                o.why = f"stream ended after {len(res.token_ids)} of {max_tokens} tokens"
        else:
            o.tokens = output_token_ids(complete(url, prompt, max_tokens, extra=GREEDY,
                                                 timeout=CLIENT_TIMEOUT_S, headers=headers)) or []
        o.status = 200
    except EngineError as exc:
        o.status = exc.status or 0
        o.why = reason(o.status, str(exc))
    except Exception as exc:  # noqa: BLE001 - counted as a failure with its cause
        o.why = reason(0, f"{type(exc).__name__}: {exc}")
    o.end = round(time.monotonic() - t0, 3)
    return o


def prompt_of(seed: int, i: int, length: int) -> list[int]:
    return random_prompts(1, length, seed=seed * 1_000_003 + i)[0]


def load(fleet: Fleet, args: argparse.Namespace, t0: float, until: Callable[[], float],
         ex: cf.ThreadPoolExecutor) -> list[cf.Future[Outcome]]:
    """Send the seeded Poisson stream until ``until()`` (soak clock, asked before each
    request); the futures of every request. With ``--repeat-share`` a seeded share re-sends
    the prompt of an earlier request (:func:`~kvbridge.tools.bench.soak_card.repeat_of`; the
    first sender's prompt and length, the rest drawn as usual)."""
    rng = random.Random(args.seed)
    futures: list[cf.Future[Outcome]] = []
    first: list[tuple[int, int]] = []  # per request: whose prompt it sends, of what length
    at = 0.0
    while True:
        at += rng.expovariate(args.rate)
        if at >= until():
            return futures
        length, max_tokens, stream = rng.choice(LENGTHS), rng.choice(MAX_TOKENS), rng.random() < .5
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        i = len(futures)
        j = repeat_of(args.seed, i, args.repeat_share)
        first.append((i, length) if j is None else first[j])
        src, length = first[i]
        futures.append(ex.submit(send, fleet.proxy_url, i, prompt_of(args.seed, src, length),
                                 stream, max_tokens, t0, None if src == i else src,
                                 rid_of(args.seed, i)))


def check(fleet: Fleet, args: argparse.Namespace, outcomes: list[Outcome]) -> None:
    """Compare every answered request with the single-engine reference (P1, prefix cache
    reset, no hand-off)."""
    with contextlib.suppress(EngineError):  # best effort: a cached prefix gives the same tokens
        reset_prefix_cache(fleet.url("P1"))

    def ref(o: Outcome) -> None:
        src = o.i if o.repeat_of is None else o.repeat_of
        out = output_token_ids(complete(fleet.url("P1"), prompt_of(args.seed, src, o.prompt_len),
                                        o.max_tokens, extra=GREEDY, timeout=120))
        o.correct = out == o.tokens

    with cf.ThreadPoolExecutor(4) as ex:
        for fut in [ex.submit(ref, o) for o in outcomes if o.ok]:
            with contextlib.suppress(EngineError):
                fut.result()


def injected_failures(logs: Path) -> int:
    """Transfers the fault-injecting wrapper failed, from the engines' logs (each is logged,
    with its transfer id, by the side that saw it fail)."""
    ids: set[str] = set()
    for path in logs.glob("[PD]*.log"):
        with open(path, errors="replace") as f:
            ids.update(m.group(0) for line in f if "injected failure" in line
                       for m in [re.search(r"xfer-[0-9a-f]+", line)] if m)
    return len(ids)


def exited(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """The engines whose process ended on its own (a crash: the soak restarts those it kills)."""
    out = {}
    for name, server in fleet.engines.items():
        proc = getattr(server, "proc", None)
        if proc is not None and proc.poll() is not None:
            out[name] = {"returncode": proc.returncode, "log": str(server.log_path)}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or tempfile.mkdtemp(prefix="kvbridge-soak-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"results and logs in {out}", file=sys.stderr, flush=True)
    duration = args.minutes * 60.0
    plan = (rolling(args.quiet_s, args.order) if args.rolling
            else schedule(args.seed, duration, args.faults))
    end = [duration]  # when the load stops (soak clock); a rolling upgrade's is set when done
    fleet = Fleet(args, out)
    code: dict[str, Any] = {"from": None, "engines": fleet.ran, "mapped": fleet.mapped}
    for label, where in (("to", THIS_CODE), ("from", args.from_code)):
        if where is not None:  # checked before anything starts
            env: dict[str, str] = {}
            cwd = fleet.code_env(label, env)
            code[label] = code_info(label, where, env, cwd)
            print(f"code {label}: {code[label]['commit'][:10]} {code[label]['subject']}",
                  file=sys.stderr, flush=True)
    windows: list[Window] = []
    errors: list[str] = []
    outcomes: list[Outcome] = []
    pending: dict[str, int | None] = {}
    crashed: dict[str, dict[str, Any]] = {}
    found: dict[str, Any] = {}
    tiers: dict[str, int] = {}
    try:
        fleet.start()
        t0 = time.monotonic()
        stop = threading.Event()

        def injector() -> None:
            try:
                run_plan()
            finally:
                if args.rolling:
                    end[0] = min(duration, time.monotonic() - t0 + args.quiet_s)

        doing: list[Any] = [None, 0.0]  # the fault being injected and when: for the card when
        # the end does not wait for it
        gave_up = threading.Event()  # set when it did not: the injector then records nothing

        def run_plan() -> None:
            for fault in plan:
                if stop.wait(max(0.0, t0 + fault.at_s - time.monotonic())):
                    return
                began = time.monotonic() - t0
                doing[:] = [fault, began]
                print(f"[{began:6.1f} s] {fault.kind} {fault.target}", file=sys.stderr,
                      flush=True)
                try:
                    with fleet.lock:
                        window = inject(fleet, fault, t0)
                    if gave_up.is_set():  # the card has its window already
                        return
                    windows.append(window)
                    print(f"[{time.monotonic() - t0:6.1f} s] whole again {windows[-1].note}",
                          file=sys.stderr, flush=True)
                except Exception as exc:  # noqa: BLE001 - a fault the fleet did not recover from
                    why = f"{type(exc).__name__}: {exc}"[:2000]
                    if gave_up.is_set():
                        return
                    errors.append(f"{fault.kind} {fault.target}: {why}")
                    windows.append(Window(fault.kind, fault.target, round(began, 2),
                                          round(time.monotonic() - t0, 2), "not recovered"))
                    print(f"injector stopped: {errors[-1]}", file=sys.stderr, flush=True)
                    return

        chaos = threading.Thread(target=injector, name="soak-injector", daemon=True)
        chaos.start()
        with cf.ThreadPoolExecutor(32) as ex:
            futures = load(fleet, args, t0, lambda: end[0], ex)
            outcomes = [f.result() for f in futures]
        stop.set()
        chaos.join(END_WAIT_S)  # a restart still going on is not waited for past this
        if chaos.is_alive():
            gave_up.set()
            fault, began = doing
            errors.append(f"{fault.kind} {fault.target} (since {began:.1f} s): still going "
                          f"{END_WAIT_S:.0f} s after the load ended; the final checks ran "
                          "without waiting for it")
            windows.append(Window(fault.kind, fault.target, round(began, 2),
                                  round(time.monotonic() - t0, 2), "not recovered by the end"))
        locked = fleet.lock.acquire(timeout=1.0 if chaos.is_alive() else -1)
        try:
            crashed = exited(fleet)
            for name in ENGINES:
                fleet.see_code(name)
            pending = fleet.wait_idle()
            if fleet.tiers:
                tiers = fleet.tier_counts()
            found = {"engine_log_errors": soak_logs.tracebacks(out / "logs"),
                     "engine_log_warnings": soak_logs.warnings(out / "logs")}
            fleet.close(keep=("P1",))  # the references run alone: faster on a small host
            check(fleet, args, outcomes)
            wrong = [o.i for o in outcomes if o.correct is False]
            found["wrong_in_logs"] = soak_logs.lines_of(
                out / "logs", [rid_of(args.seed, i) for i in wrong])
        finally:
            if locked:
                fleet.lock.release()
    finally:
        fleet.close()
    result = card(outcomes, windows, pending, extra={
        "argv": sys.argv, "connector": args.connector, "code": code,
        "backend": "vLLM's NixlConnector" if fleet.vllm else args.backend,
        "minutes": args.minutes, "seed": args.seed, "repeat_share": args.repeat_share,
        "proxy_mode": args.proxy_mode, "order": list(args.order) if args.rolling else None,
        "slow_tier_after_run": tiers or None,
        "vllm_metrics_after_run": fleet.vllm_after or None,
        "engines_exited": crashed, **found,
        "logs": str(out / "logs"),
        "rate": args.rate, "faults_enabled": args.faults, "rolling": args.rolling,
        "quiet_s": args.quiet_s if args.rolling else None, "load_s": round(end[0], 1),
        "fail_share": args.fail_share,
        "scheduled": len(plan), "injector_errors": errors,
        "transfers_failed_injected": injected_failures(out / "logs")})
    (out / "card.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(out / "requests.jsonl", "w") as f:
        for o in outcomes:
            f.write(json.dumps({k: v for k, v in asdict(o).items() if k != "tokens"}) + "\n")
    extra_rows = [["transfers failed on purpose", str(result["transfers_failed_injected"])]]
    if tiers:
        extra_rows.append(["slow tier, engines running at the end",
                           ", ".join(f"{k} {v}" for k, v in tiers.items())])
    for name, m in fleet.vllm_after.items():
        extra_rows.append([f"vLLM /metrics after the run: {name}", json.dumps(m)])
    for name, c in crashed.items():
        extra_rows.append([f"engine exited on its own: {name}",
                           f"rc {c['returncode']}, {c['log']}"])
    for e in result.get("engine_log_errors", []):
        extra_rows.append([f"tracebacks: {Path(e['log']).name}",
                           f"{e['tracebacks']}: {e['last']}"])
    for e in result.get("engine_log_warnings", []):
        top = e["lines"][0]
        extra_rows.append([f"warnings: {Path(e['log']).name}",
                           f"{top['count']} x {top['level']} {top['message'][:90]}"
                           + (f" (+{len(e['lines']) - 1} more kinds)" if len(e["lines"]) > 1
                              else "")])
    for rid, lines in result.get("wrong_in_logs", {}).items():
        extra_rows.append([f"wrong output {rid}: {len(lines)} log lines",
                           lines[0][:160] if lines else "none names it"])
    print_table(["item", "value"], [*card_rows(result), *extra_rows])
    for e in errors:
        print(f"injector stopped: {e}")
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's options, checked (``ap.error``: exit status 2 and the flag at fault)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0,
                    help="how long the load runs (with --rolling: at most)")
    ap.add_argument("--seed", type=int, default=1, help="seeds the load and the fault schedule")
    ap.add_argument("--connector", default="kvbridge", choices=tuple(CONNECTORS),
                    help="the engines' KV connector: kvbridge's, or vLLM's own NixlConnector "
                         "as shipped (behind the same proxy, in pull mode; faults: "
                         f"{', '.join(CONNECTORS['vllm-nixl'])})")
    ap.add_argument("--backend", default="shm", choices=("shm", "nixl"),
                    help="KV transport (--connector kvbridge)")
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--faults", default=None,
                    help=f"comma-separated, of {', '.join(FAULTS)} (default: "
                         f"{','.join(DEFAULT_FAULTS)}, those that apply to the connector)")
    ap.add_argument("--repeat-share", type=float, default=None,
                    help="share of requests that re-send an earlier prompt (default "
                         f"{REPEAT_SHARE} with slow_disk, so the tiers are read; else 0)")
    ap.add_argument("--fail-share", type=float, default=0.05,
                    help="transfer_error: share of P1's and D1's transfers that fail")
    ap.add_argument("--out", default=None, help="directory for card.json, requests and logs")
    ap.add_argument("--proxy-mode", default=None, choices=PROXY_MODES,
                    help="the proxy's --mode (default: headroom, push or pull by D's load, so "
                         "every request is a hand-off; pull with --connector vllm-nixl, the only "
                         "mode it takes): pull makes every hand-off a pull, push a push")
    ap.add_argument("--rolling", action="store_true",
                    help="a rolling upgrade instead of faults: drain and replace every engine "
                         "one at a time (in --order), with no other fault (transfer_error "
                         "neither)")
    ap.add_argument("--order", default=",".join(ROLLING_ORDER), metavar="NAMES",
                    help="--rolling: the engines in the order they are replaced, comma-"
                         f"separated, each of {', '.join(ENGINES)} once (default "
                         f"{','.join(ROLLING_ORDER)}; D0,D1,P0,P1 replaces the decode engines "
                         "first, so old P engines hand off to new D engines)")
    ap.add_argument("--from-code", type=Path, default=None, metavar="DIR",
                    help="--rolling: the initial fleet's engines import kvbridge from DIR, a "
                         "checkout of another commit with shm's range copy built in place and "
                         "egg_info run; every successor runs this tree (an upgrade across "
                         "versions)")
    ap.add_argument("--quiet-s", type=float, default=75.0,
                    help="--rolling: seconds of steady load before the first step and after "
                         "the last")
    args = ap.parse_args(argv)
    try:
        args.order = rolling_order(args.order)
    except ValueError as exc:
        ap.error(f"--order: {exc}")
    if args.order != ROLLING_ORDER and not args.rolling:
        ap.error("--order: only with --rolling")
    try:
        args.proxy_mode = proxy_mode(args.connector, args.proxy_mode)
    except ValueError as exc:
        ap.error(f"--proxy-mode: {exc}")
    if args.faults is None:
        args.faults = ",".join(f for f in DEFAULT_FAULTS if f in CONNECTORS[args.connector])
    args.faults = [] if args.rolling else [f for f in args.faults.split(",") if f]
    try:
        applicable(args.connector, args.faults)
    except ValueError as exc:
        ap.error(f"--faults: {exc}")
    if args.from_code is not None:
        args.from_code = args.from_code.resolve()
        if not args.rolling or args.connector != "kvbridge":
            ap.error("--from-code: only with --rolling and --connector kvbridge")
        if not (args.from_code / "kvbridge").is_dir():
            ap.error(f"--from-code {args.from_code}: no kvbridge package there")
    if args.repeat_share is None:
        args.repeat_share = REPEAT_SHARE if "slow_disk" in args.faults else 0.0
    if args.rate <= 0 or args.minutes <= 0 or args.quiet_s < 0 \
            or not 0 <= args.repeat_share <= 1:
        ap.error("--rate and --minutes: positive; --quiet-s: not negative; --repeat-share: "
                 "0 to 1")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    clean = not result["wrong"] and not result["leaked_total"] and not result["injector_errors"]
    clean = clean and not (args.rolling and result["failed"])  # a drain fails no request
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

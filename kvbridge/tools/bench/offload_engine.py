"""``kvbridge bench offload``'s engine side: start one row's engine, measure its rows, stop it.

Contract: :func:`run_engine` starts one real ``vllm serve`` (``KVBridgeConnector``, ``kv_both``,
backend ``shm``) with the offload tiers of its row (and a local ``mooncake_master`` for
``mooncake_store``) — or, with ``--against``, one per variant, all at once, each with its own
tier directory — runs the warm-up, the cold request and every repetition of each row it
serves (the variants' repetitions interleaved ABBA: repetition ``i`` on every engine back to
back, the order reversed every other one), and always stops the engines (and the master)
before returning; a failure becomes the rows' ``error``, never an exception.
:func:`row_unavailable` says why a row cannot run here; :func:`foreign_engines` /
:func:`wait_quiet` keep other people's engines out of the numbers. Blocking.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbridge import registry
from kvbridge.errors import KVBridgeError
from kvbridge.tools import prom
from kvbridge.tools.bench.offload_results import (
    ENGINE_OF,
    LAYERWISE,
    TIER_OF,
    BenchSettings,
    Rep,
    RowResult,
    shared_blocks,
)
from kvbridge.tools.client import complete, engine_stats, reset_prefix_cache, stream_complete
from kvbridge.tools.cpumeter import loadavg
from kvbridge.tools.engines import EngineError, VllmServer, free_port

__all__ = ["SERVE_MODULE", "Progress", "drop_page_cache", "foreign_engines", "offload_config",
           "row_unavailable", "run_engine", "wait_quiet"]

SERVE_MODULE = "kvbridge.integrations.vllm_serve"
_GREEDY = {"ignore_eos": True}
_POKE = (5, 6, 7)
_METRICS = {"queue": "vllm:request_queue_time_seconds",
            "prefill": "vllm:request_prefill_time_seconds",
            "ttft_server": "vllm:time_to_first_token_seconds"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchPrompts:
    """The prompts of a run: ``cold`` is computed once and stored by the tier; ``reps[i]`` is
    repetition ``i``'s (``cold`` itself, or ``cold`` + a tail of its own with
    ``hit_fraction`` < 1); ``warm`` warms the engine up."""

    cold: list[int]
    warm: list[int]
    reps: list[list[int]]


# -- engines -------------------------------------------------------------------------------------


def offload_config(row: str, settings: BenchSettings, disk_dir: Path,
                   master: Any = None) -> dict[str, Any] | None:
    """The ``offload`` object of *row*'s engine (None: no tiers)."""
    tier = TIER_OF[row]
    if tier is None:
        return None
    spec: dict[str, Any] = {"name": tier}
    if tier == "dram":
        spec["capacity_bytes"] = "2GiB"
    elif tier == "disk":
        spec.update(path=str(disk_dir), capacity_bytes="4GiB")
    elif tier == "lmcache":
        spec["capacity_bytes"] = "2GiB"
    elif tier == "mooncake_store":
        spec["global_segment_bytes"] = 2 << 30
        if master is not None:
            spec.update(master=master.master_address, metadata_url=master.metadata_url)
    spec.update(settings.tier_options.get(ENGINE_OF.get(row, row), {}))
    return {"tiers": [spec], "layerwise_load": row in LAYERWISE}


def row_unavailable(row: str) -> str | None:
    """Why *row*'s tier cannot run on this host, or None (imports the tier's module)."""
    tier = TIER_OF[row]
    if tier is None:
        return None
    try:
        registry.load_tier_class(tier)
    except KVBridgeError as exc:
        return str(exc).splitlines()[0]
    if tier == "mooncake_store":
        try:
            # mooncake_master imports pytest (its fixture): not a runtime dependency
            from kvbridge.tools.mooncake_master import skip_reason
        except ImportError as exc:
            return f"kvbridge.tools.mooncake_master cannot be imported: {exc}"
        return skip_reason()
    return None


def foreign_engines(own_pgids: Sequence[int] = ()) -> list[int]:
    """Pids of ``vllm_serve`` processes on this host not in process groups *own_pgids*
    (what ``pgrep -f kvbridge.integrations.vllm_serve`` finds, less ours)."""
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            if SERVE_MODULE.encode() not in cmd:
                continue
            if os.getpgid(int(entry)) in own_pgids:
                continue
        except OSError:
            continue
        out.append(int(entry))
    return sorted(out)


def wait_quiet(settings: BenchSettings, say: Progress,
               own_pgids: Sequence[int] = ()) -> float:
    """Wait (bounded by ``quiet_wait_s``) until :func:`foreign_engines` is empty; seconds."""
    t0 = time.monotonic()
    others = foreign_engines(own_pgids)
    while others and time.monotonic() - t0 < settings.quiet_wait_s:
        say(f"other engines running (pids {' '.join(map(str, others))}); waiting "
            f"{settings.quiet_poll_s:.0f} s (waited {time.monotonic() - t0:.0f} of "
            f"{settings.quiet_wait_s:.0f} s)")
        time.sleep(settings.quiet_poll_s)
        others = foreign_engines(own_pgids)
    if others:
        say(f"still other engines after {settings.quiet_wait_s:.0f} s: going on anyway")
    return time.monotonic() - t0


def _metrics(url: str) -> dict[str, tuple[float, float]]:
    text = prom.fetch(url)
    return {k: prom.histogram(text, n) for k, n in _METRICS.items()}


def _metric_delta(before: Mapping[str, tuple[float, float]],
                  after: Mapping[str, tuple[float, float]], key: str) -> float | None:
    ds = after[key][0] - before[key][0]
    dc = after[key][1] - before[key][1]
    return ds / dc if dc > 0 else None


def drop_page_cache(root: Path) -> int:
    """``fsync`` + ``POSIX_FADV_DONTNEED`` every file under *root*; how many files."""
    n = 0
    for path in root.rglob("*.kvb"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


class _Engine:
    """One running engine of the bench and what the rows need from it."""

    def __init__(self, server: Any, ctl: str) -> None:
        self.server = server
        self.ctl = ctl

    @property
    def url(self) -> str:
        return str(self.server.url)

    def stats(self) -> dict[str, int]:
        return engine_stats(self.ctl)

    def poke(self) -> None:
        """A 3-token, 1-token-output request (no full block: no lookup, no store). Counters
        are current without it since the manager delivers them after every job; the poke is
        kept as a cheap barrier so a settle never waits on an engine that is asleep."""
        complete(self.url, list(_POKE), 1, extra=_GREEDY, timeout=60.0)

    def settle(self, key: str | None, at_least: int, timeout: float) -> dict[str, int]:
        """Counters once ``key`` reached ``at_least`` (poking the engine meanwhile); with
        ``key`` None, the counters after one poke."""
        deadline = time.monotonic() + timeout
        self.poke()
        stats = self.stats()
        while key is not None and stats.get(key, 0) < at_least and time.monotonic() < deadline:
            time.sleep(0.2)
            self.poke()
            stats = self.stats()
        return stats


@contextlib.contextmanager
def _engine(row: str, settings: BenchSettings, model: Path, model_cfg: Mapping[str, Any],
            offload: dict[str, Any] | None, log_dir: Path, say: Progress,
            info: dict[str, Any], settings_extra: Mapping[str, Any]) -> Iterator[_Engine]:
    ctl_port = free_port()
    extra: dict[str, Any] = {"backend": "shm", "side_channel_port": ctl_port, **settings_extra}
    if offload is not None:
        extra["offload"] = offload
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both",
          "engine_id": f"bench-offload-{row}", "kv_connector_extra_config": extra}
    per_token = (model_cfg["num_hidden_layers"] * 2 * model_cfg["num_key_value_heads"]
                 * model_cfg["head_dim"] * 4)
    mml = settings.max_model_len
    kv_bytes = max(256 << 20, 4 * mml * per_token)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if settings.engine_spin_ms >= 0:
        env["KVBRIDGE_ENGINE_SPIN_MS"] = f"{settings.engine_spin_ms:g}"
    log_path = log_dir / f"engine-{row}.log"
    server = VllmServer(model, name=f"offload-{row}", port=free_port(), kv_transfer_config=kv,
                        cpu_bind=settings.cpu_bind, env=env, log_path=log_path,
                        extra_args=["--block-size", str(settings.block_size),
                                    "--max-model-len", str(mml),
                                    "--max-num-batched-tokens", str(mml),
                                    "--max-num-seqs", "4",
                                    "--kv-cache-memory-bytes", str(kv_bytes)])
    info["log"] = str(log_path)
    t0 = time.monotonic()
    try:
        say(f"{row}: starting engine (tiers {offload['tiers'] if offload else 'none'}"
            f"{''.join(f'; {k} {v}' for k, v in settings_extra.items())}; log {log_path})")
        server.start().wait_ready(settings.start_timeout)
        info["ready_s"] = round(time.monotonic() - t0, 1)
        say(f"{row}: engine ready after {info['ready_s']} s")
        yield _Engine(server, f"tcp://127.0.0.1:{ctl_port}")
    finally:
        server.stop()
        info["engine_s"] = round(time.monotonic() - t0, 1)


def _request(eng: _Engine, prompt: list[int], settings: BenchSettings, index: int,
             expect: tuple[str, int] | None = None) -> Rep:
    """One streamed request with counter and metric deltas around it."""
    rep = Rep(index)
    try:
        before, m0 = eng.stats(), _metrics(eng.url)
        res = stream_complete(eng.url, prompt, settings.max_tokens, extra=_GREEDY,
                              timeout=settings.request_timeout)
        m1 = _metrics(eng.url)
        # stores are written behind: wait (briefly) until the expected counter moved
        after = (eng.settle(expect[0], before.get(expect[0], 0) + expect[1], 5.0)
                 if expect else eng.settle(None, 0, 0.0))
    except (EngineError, OSError) as exc:
        rep.error = f"{type(exc).__name__}: {exc}"
        return rep
    rep.ok = res.ttft is not None
    rep.ttft, rep.total, rep.token_ids = res.ttft, res.total, list(res.token_ids)
    rep.queue = _metric_delta(m0, m1, "queue")
    rep.prefill = _metric_delta(m0, m1, "prefill")
    rep.deltas = {k: after.get(k, 0) - before.get(k, 0)
                  for k in sorted(set(after) | set(before))
                  if k.startswith("offload_") and after.get(k, 0) != before.get(k, 0)}
    if not rep.ok:
        rep.error = "no token streamed"
    return rep


def _measure(eng: _Engine, settings: BenchSettings, prompt: list[int], res: RowResult,
             i: int, say: Progress) -> None:
    """Repetition ``i`` of one row on a running engine (after its cold request)."""
    tier = TIER_OF[res.row]
    disk_dir = res.engine.get("disk_dir")
    expect = (f"offload_hit_blocks_{tier}", res.expected_blocks) if tier else None
    reset_prefix_cache(eng.url)
    if res.row == "disk_cold" and disk_dir:
        n = drop_page_cache(Path(disk_dir))
        if i == 0:
            res.notes.append(f"page cache of {n} files dropped before each rep")
    time.sleep(0.3)  # let the previous request's store bookkeeping finish
    rep = _request(eng, prompt, settings, i, expect)
    res.reps.append(rep)
    say(f"{res.row}{f' ({res.variant})' if res.variant else ''}: rep {i + 1}/{settings.reps}: "
        + (f"TTFT {rep.ttft:.3f} s, counters {rep.deltas}" if rep.ok
           else f"failed: {rep.error}"))


def _prime(name: str, eng: _Engine, settings: BenchSettings, prompts: BenchPrompts,
           tier: str | None, say: Progress) -> tuple[Rep, int | None]:
    """The warm-up and the cold request (the tier stores the prompt): the cold request and how
    many blocks were stored (None: no tier); raises when either request fails."""
    prompt, warm = prompts.cold, prompts.warm
    say(f"{name}: warm-up request ({len(warm)} tokens, another prompt)")
    w = _request(eng, warm, settings, -1)
    if not w.ok:
        raise RuntimeError(f"warm-up failed: {w.error}")
    stored_key = f"offload_stored_blocks_{tier}"
    full = len(prompt) // settings.block_size
    if tier:  # the warm-up prompt's store first, so it is not counted as the cold's
        eng.settle(stored_key, full, settings.settle_timeout)
    reset_prefix_cache(eng.url)
    base = eng.stats().get(stored_key, 0) if tier else 0
    cold = _request(eng, prompt, settings, 0)
    if not cold.ok:
        raise RuntimeError(f"cold request failed: {cold.error}")
    say(f"{name}: cold (computed) TTFT {cold.ttft:.3f} s")
    stored = None
    if tier:
        stats = eng.settle(stored_key, base + full, settings.settle_timeout)
        stored = stats.get(stored_key, 0) - base
        if stored < full:
            say(f"{name}: only {stored} of {full} blocks stored in "
                f"{settings.settle_timeout:.0f} s")
    return cold, stored


def run_engine(engine_row: str, rows: Sequence[str], settings: BenchSettings, model: Path,
               model_cfg: Mapping[str, Any], prompts: BenchPrompts, work: Path,
               log_dir: Path, say: Progress,
               variants: Mapping[str, Mapping[str, Any]] | None = None) -> list[RowResult]:
    """Start *engine_row*'s engine — one per variant of *variants* (name → extra connector
    settings; default: one plain engine), all at once — measure every row of *rows* on each
    (repetitions interleaved ABBA across the variants), stop them."""
    variants = variants or {"": {}}
    names = list(variants)
    expected = shared_blocks(settings)
    results = {v: [RowResult(r, expected_blocks=expected, variant=v) for r in rows]
               for v in names}
    infos: dict[str, dict[str, Any]] = {v: {"loadavg_start": loadavg()} for v in names}
    master: Any = None
    t0 = time.monotonic()
    tier = TIER_OF[engine_row]
    try:
        if tier == "mooncake_store":
            # mooncake_master imports pytest (its fixture): not a runtime dependency
            from kvbridge.tools.mooncake_master import MooncakeMaster

            master = MooncakeMaster().start()
            for info in infos.values():
                info["mooncake_master"] = master.master_address
        with contextlib.ExitStack() as stack:
            engines: dict[str, _Engine] = {}
            for v in names:
                name = f"{engine_row}-{v}" if v else engine_row
                disk_dir = work / f"disk-{name}"
                infos[v]["disk_dir"] = str(disk_dir)
                offload = offload_config(engine_row, settings, disk_dir, master)
                for r in results[v]:
                    r.tiers = [t["name"] for t in offload["tiers"]] if offload else []
                engines[v] = stack.enter_context(_engine(
                    name, settings, model, model_cfg, offload, log_dir, say, infos[v],
                    variants[v]))
            for v in names:
                cold, stored = _prime(f"{engine_row} ({v})" if v else engine_row, engines[v],
                                      settings, prompts, tier, say)
                for r in results[v]:
                    r.cold, r.stored_blocks, r.engine = cold, stored, infos[v]
            for k in range(len(rows)):
                for i in range(settings.reps):
                    for v in (names if i % 2 == 0 else names[::-1]):  # ABBA
                        _measure(engines[v], settings, prompts.reps[i], results[v][k], i, say)
    except Exception as exc:  # noqa: BLE001 - report the row as failed, go on
        for res in results.values():
            for r in res:
                if not r.reps:
                    r.error = (f"{type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}")
        say(f"{engine_row}: FAILED: {exc}")
    finally:
        if master is not None:
            master.stop()
        for v, info in infos.items():
            info["loadavg_end"] = loadavg()
            info["elapsed_s"] = round(time.monotonic() - t0, 1)
            for r in results[v]:
                r.engine = info
    return [r for v in names for r in results[v]]

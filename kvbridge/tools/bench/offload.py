"""``kvbridge bench offload``: TTFT of one long prompt served from each offload tier vs recompute.

One real ``vllm serve`` engine at a time (``KVBridgeConnector``, ``kv_both``, backend ``shm``;
the ~100 M-parameter bench model of :func:`kvbridge.tools.tiny_model.build_bench_model`), one
engine per row, each started with the offload tiers of its row and stopped before the next
(also on error or Ctrl-C):

==================  ===========================================================================
``recompute``       no tier: the prompt is computed every time (the baseline)
``dram``            ``tiers: [dram]``
``disk``            ``tiers: [disk]`` (a fresh directory; no DRAM tier above it, so every hit
                    is read from the files — which the OS page cache may still hold)
``*_layerwise``     ``dram`` / ``disk`` with ``layerwise_load``: hits copied layer by layer
                    while the forward runs (the JSON adds the copy and wait times)
``disk_cold``       the same engine as ``disk``; before every repetition the tier's files are
                    dropped from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``)
``lmcache``         ``tiers: [lmcache]``
``mooncake_store``  ``tiers: [mooncake_store]`` against a local ``mooncake_master``
                    (:class:`~kvbridge.tools.mooncake_master.MooncakeMaster`)
==================  ===========================================================================

A row whose tier cannot load here (package missing, placeholder, no master binary) stays in the
table as ``not available: <reason>``.

Per engine: one warm-up request (another prompt of the same length), then the *cold* request
(the bench prompt, computed: the tier is empty) whose output is the row's reference; the bench
waits until the tier has stored the prompt's blocks; then ``--reps`` repetitions of
``POST /reset_prefix_cache`` + the same prompt, streamed, so vLLM's own prefix cache never
serves it and any reuse comes from the tier. Every repetition records:

- TTFT (client side, to the first streamed token) and vLLM's own queue and prefill times
  (``/metrics`` histogram deltas: queue includes waiting for a tier lookup's answer);
- the engine counters' deltas (:func:`~kvbridge.tools.client.engine_stats`):
  ``offload_hit_blocks_<tier>`` and ``offload_loaded_blocks`` must both equal the usable
  blocks of the prompt (``(len - 1) // block_size``; vLLM computes at least one token) and
  ``offload_load_failed`` must stay 0 — column ``source``;
- the output token ids, which must equal the recompute row's (or, without that row, the row's
  own cold output) — column ``out``.

The table reports median and minimum TTFT and the median's ratio to recompute's median.

``--against noseal``: every tier row runs on two engines at once, the default one (``seal``:
tier chunks sealed with their digest, checked on every load) and one with ``checksum: false``
(``noseal``: chunks stored and loaded unchecked, :mod:`kvbridge.offload.seal`), each with its
own tier; their repetitions are interleaved ABBA (repetition ``i`` on both engines back to
back, the order reversed every other one), and a second table puts each row's TTFT with and
without seals side by side with the paired ratio (:func:`~kvbridge.tools.bench.offload_results
.against_rows`). Recompute (no tier) runs once.
Before every engine start the bench waits (bounded) until no ``vllm_serve`` process of someone
else runs on the host, and notes any that appeared during a row. Blocking; for the command
line. Numbers from small shared hosts are noisy: compare ratios within one run.

This module runs the rows and is the command; one engine and its rows are
:mod:`~kvbridge.tools.bench.offload_engine`'s, the rows, settings, results and their table
:mod:`~kvbridge.tools.bench.offload_results`'.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.tools import tiny_model as tm
from kvbridge.tools.bench.offload_engine import (
    BenchPrompts,
    Progress,
    foreign_engines,
    row_unavailable,
    run_engine,
    wait_quiet,
)
from kvbridge.tools.bench.offload_results import (
    AGAINST,
    BASELINE,
    ENGINE_OF,
    ROW_NAMES,
    TIER_OF,
    BenchSettings,
    RowResult,
    add_ratios,
    against_rows,
    format_report,
    parse_rows,
    parse_tier_options,
    shared_blocks,
    summarize,
    variants_of,
    verdicts,
)
from kvbridge.tools.cpumeter import loadavg

__all__ = ["add_arguments", "cli_main", "run_benchmark", "settings_from_args"]

log = logging.getLogger("kvbridge.tools.bench.offload")


# -- the whole run -------------------------------------------------------------------------------


def _model(settings: BenchSettings) -> tuple[Path, dict[str, Any], int, str]:
    if settings.quick:
        spec = tm.tiny_model_spec()
        path = tm.build_tiny_model(settings.model_dir)
        name = "tiny-qwen3"
    else:
        spec = tm.bench_model_spec()
        path = tm.build_bench_model(settings.model_dir)
        name = "bench-qwen3"
    return path, spec["config"], tm.spec_param_count(spec), name


def _prompts(settings: BenchSettings) -> BenchPrompts:
    """The cold prompt, the warm-up prompt and each repetition's prompt (deterministic)."""
    make = tm.random_prompts if settings.quick else tm.bench_prompts
    prompt, warm = make(2, settings.prompt_len, settings.seed)
    if settings.hit_fraction >= 1.0:
        return BenchPrompts(prompt, warm, [prompt] * settings.reps)
    shared = prompt[:shared_blocks(settings) * settings.block_size]
    tails = make(settings.reps, settings.prompt_len - len(shared), settings.seed + 1)
    return BenchPrompts(shared, warm, [shared + tail for tail in tails])


def run_benchmark(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run every row of *settings*, one engine at a time; return the JSON-able report."""
    say: Progress = progress or (lambda msg: log.info("%s", msg))
    t_start = time.monotonic()
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-bench-offload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvbridge-bench-offload-work-",
                                 dir=str(settings.work_dir) if settings.work_dir else None))
    model, cfg, params, name = _model(settings)
    prompts = _prompts(settings)
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    expected = shared_blocks(settings)
    report: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "loadavg_start": loadavg()},
        "model": {"name": name, "path": str(model), "params": params,
                  "kv_bytes_per_token": per_token},
        "settings": {k: (str(v) if isinstance(v, Path) else v)
                     for k, v in vars(settings).items()},
        "expected_blocks": expected,
        "prompt_kv_bytes": expected * settings.block_size * per_token,
        "log_dir": str(log_dir), "foreign_waits": {}, "rows": [],
    }
    results: dict[tuple[str, str], RowResult] = {}
    try:
        engines: dict[str, list[str]] = {}
        for row in settings.rows:
            engines.setdefault(ENGINE_OF.get(row, row), []).append(row)
        for engine_row, rows in engines.items():
            reason = row_unavailable(engine_row)
            variants = variants_of(engine_row, settings)
            if reason:
                say(f"{engine_row}: not available: {reason}")
                for r in rows:
                    for v in variants:
                        results[r, v] = RowResult(r, tiers=[str(TIER_OF[r])], variant=v,
                                                  unavailable=reason)
                continue
            waited = wait_quiet(settings, say)
            if waited >= 1.0:
                report["foreign_waits"][engine_row] = round(waited, 1)
            measured = run_engine(engine_row, rows, settings, model, cfg, prompts, work,
                                  log_dir, say, variants)
            others = foreign_engines()
            for res in measured:
                results[res.row, res.variant] = res
                if others:
                    res.notes.append(f"other engines ran meanwhile: {others}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results.get((BASELINE, ""))
    ref = base.cold.token_ids if base is not None and base.cold is not None and base.cold.ok \
        else None
    own_prompts = settings.hit_fraction < 1.0  # each repetition has a prompt of its own
    for res in results.values():
        if own_prompts:
            if base is not None:
                res.rep_references = {r.index: r.token_ids for r in base.reps if r.ok}
                res.reference_from = "recompute's output for the same repetition"
        elif ref is not None:
            res.reference, res.reference_from = ref, "recompute's output"
        elif res.cold is not None and res.cold.ok:
            res.reference, res.reference_from = res.cold.token_ids, "the row's own cold output"
    report["reference_from"] = (
        "recompute's output for the same repetition" if own_prompts and base is not None
        else "recompute's first output" if ref is not None and not own_prompts
        else "each row's own cold output" if not own_prompts else "none (no recompute row)")
    rows_out = [summarize(res) for r in settings.rows for (row, _), res in results.items()
                if row == r]
    add_ratios(rows_out)
    report["rows"] = rows_out
    if settings.against is not None:
        report["against"] = against_rows(rows_out, settings.against)
    # the aims are for a whole prompt served from a tier
    report["verdicts"] = verdicts(rows_out) if not own_prompts else [
        f"aims not judged: the tier holds {settings.hit_fraction:g} of each prompt"]
    report["host"]["loadavg_end"] = loadavg()
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    return report


# -- command line --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvbridge bench offload`` flags (defaults: the full run; ``--quick`` a smoke run)."""
    d, q = BenchSettings(), BenchSettings.quick_defaults()
    p.add_argument("--rows", default="all",
                   help=f"comma-separated subset of {','.join(ROW_NAMES)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: the tiny model, --prompt-len {q.prompt_len}, --reps "
                   f"{q.reps}, --block-size {q.block_size} (flags given still win)")
    p.add_argument("--reps", type=int, default=None,
                   help=f"measured repetitions per row (default {d.reps})")
    p.add_argument("--prompt-len", type=int, default=None,
                   help=f"prompt tokens (default {d.prompt_len})")
    p.add_argument("--hit-fraction", type=float, default=d.hit_fraction,
                   help="share of the prompt the tier holds (default 1: all; 0.5: the first "
                   "half, and every repetition computes a tail of its own)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="output tokens per request")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"vLLM --block-size = offload chunk (default {d.block_size}, vLLM's CPU "
                   "default)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the prompts")
    p.add_argument("--tier-options", action="append", default=[], metavar="ROW=JSON",
                   help="extra options of a row's tier, e.g. lmcache='{\"disk_path\": \"/x\"}' "
                   "(repeatable)")
    p.add_argument("--cpu-bind", default=d.cpu_bind,
                   help="VLLM_CPU_OMP_THREADS_BIND of the engines ('' : unset)")
    p.add_argument("--engine-spin-ms", type=float, default=d.engine_spin_ms,
                   help="KVBRIDGE_ENGINE_SPIN_MS (negative: vLLM default)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help=f"seconds one request may take (default {d.request_timeout:g}; "
                   f"--quick: {q.request_timeout:g})")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout,
                   help="seconds an engine may take to answer /health")
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout,
                   help="seconds to wait for the tier to store the prompt after the cold run")
    p.add_argument("--quiet-wait", type=float, default=d.quiet_wait_s,
                   help="before each engine, wait at most this long for other people's "
                   "vllm_serve processes to end (0: do not wait)")
    p.add_argument("--quiet-poll", type=float, default=d.quiet_poll_s,
                   help="seconds between two looks while --quiet-wait waits")
    p.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: a temp dir)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="parent of the disk tier's temporary directory (default: $TMPDIR)")
    p.add_argument("--model-dir", type=Path, default=None, help="model directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the JSON report here")
    p.add_argument("--against", choices=tuple(AGAINST), default=None,
                   help="also measure every tier row against a baseline, on two engines at "
                   "once with their repetitions interleaved (ABBA), and print both side by "
                   "side with the paired ratio: noseal (checksum false: tier chunks stored "
                   "and loaded without their digest; what the seals cost). Recompute runs once")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validate the parsed flags into :class:`BenchSettings` (ConfigError names a bad one)."""
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    chosen = {k: getattr(args, k) for k in ("reps", "prompt_len", "block_size",
                                             "request_timeout")
              if getattr(args, k) is not None}
    s = replace(base, rows=parse_rows(args.rows), max_tokens=args.max_tokens, seed=args.seed,
                hit_fraction=args.hit_fraction,
                tier_options=parse_tier_options(args.tier_options),
                cpu_bind=args.cpu_bind or None, engine_spin_ms=args.engine_spin_ms,
                start_timeout=args.start_timeout, settle_timeout=args.settle_timeout,
                quiet_wait_s=args.quiet_wait, quiet_poll_s=args.quiet_poll,
                log_dir=args.log_dir, work_dir=args.work_dir, model_dir=args.model_dir,
                against=args.against, **chosen)
    for name in ("reps", "max_tokens", "block_size"):
        if getattr(s, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if s.prompt_len < 2 * s.block_size:
        raise ConfigError(f"--prompt-len must be at least two blocks ({2 * s.block_size} "
                          f"tokens with --block-size {s.block_size})")
    limit = 4096 if s.quick else 8192  # the models' max_position_embeddings
    if s.max_model_len > limit:
        raise ConfigError(f"--prompt-len {s.prompt_len} + --max-tokens {s.max_tokens} does not "
                          f"fit the model's {limit} positions")
    if s.quiet_poll_s <= 0:
        raise ConfigError("--quiet-poll must be > 0")
    if not 0.0 < s.hit_fraction <= 1.0:
        raise ConfigError(f"--hit-fraction must be in (0, 1], got {s.hit_fraction}")
    return s


def cli_main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    report = run_benchmark(settings, progress)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_report(report))
    return 0

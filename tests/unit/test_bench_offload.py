"""Fast unit tests of ``kvbridge bench offload``'s helpers: flags, ratios, checks, the table,
the bench model's size. No engines are started; the benchmark itself is run by hand
(docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvbridge.errors import ConfigError
from kvbridge.tools import cli
from kvbridge.tools import tiny_model as tm
from kvbridge.tools.bench import offload as b
from kvbridge.tools.bench.offload_engine import foreign_engines, offload_config
from kvbridge.tools.bench.offload_results import (
    ROW_NAMES,
    TABLE_HEADERS,
    TIER_OF,
    BenchSettings,
    Rep,
    RowResult,
    add_ratios,
    format_report,
    format_table,
    median_min,
    parse_rows,
    parse_tier_options,
    source_ok,
    summarize,
    usable_blocks,
    verdicts,
)

pytestmark = pytest.mark.timeout(60)


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["bench", "offload", *argv]).parse_args(["bench", "offload", *argv])


# -- flags ---------------------------------------------------------------------------------------


def test_defaults_are_the_full_run() -> None:
    s = b.settings_from_args(_args())
    assert s.rows == ROW_NAMES
    assert (s.reps, s.prompt_len, s.max_tokens, s.block_size) == (5, 3000, 2, 128)
    assert not s.quick and s.cpu_bind == "0-1"
    assert s.max_model_len == 3072
    assert s.quiet_wait_s == 1500 and s.quiet_poll_s == 30


def test_quick_changes_defaults_but_explicit_flags_win() -> None:
    s = b.settings_from_args(_args("--quick"))
    assert s.quick and (s.reps, s.prompt_len, s.block_size) == (2, 600, 32)
    s = b.settings_from_args(_args("--quick", "--reps", "4", "--prompt-len", "900"))
    assert (s.reps, s.prompt_len, s.block_size) == (4, 900, 32)


def test_rows_keep_the_table_order_and_drop_duplicates() -> None:
    s = b.settings_from_args(_args("--rows", "disk, dram,recompute,dram", "--cpu-bind", "",
                                   "--log-dir", "/tmp/x", "--json", "/tmp/r.json"))
    assert s.rows == ("recompute", "dram", "disk")
    assert s.cpu_bind is None and s.log_dir == Path("/tmp/x")
    assert parse_rows("all") == ROW_NAMES


@pytest.mark.parametrize("text", ["", " , ", "dram,nope", "DRAM"])
def test_bad_rows_are_named(text: str) -> None:
    with pytest.raises(ConfigError, match="row"):
        parse_rows(text)


@pytest.mark.parametrize("argv,match", [
    (("--reps", "0"), "--reps"),
    (("--max-tokens", "0"), "--max-tokens"),
    (("--prompt-len", "100"), "--prompt-len"),
    (("--prompt-len", "9000"), "positions"),
    (("--quick", "--prompt-len", "4090"), "positions"),
    (("--quiet-poll", "0"), "--quiet-poll"),
])
def test_bad_numbers_are_refused(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        b.settings_from_args(_args(*argv))


def test_tier_options_merge_into_the_engine_row() -> None:
    opts = parse_tier_options(['lmcache={"disk_path": "/x"}', 'disk_cold={"fsync": true}',
                                 'disk={"capacity_bytes": "1GiB"}'])
    assert opts == {"lmcache": {"disk_path": "/x"},
                    "disk": {"fsync": True, "capacity_bytes": "1GiB"}}
    s = BenchSettings(tier_options=opts)
    cfg = offload_config("disk_cold", s, Path("/d"))
    assert cfg == {"tiers": [{"name": "disk", "path": "/d", "capacity_bytes": "1GiB",
                              "fsync": True}], "layerwise_load": False}
    layerwise = offload_config("dram_layerwise", s, Path("/d"))
    assert layerwise is not None and layerwise["layerwise_load"] is True
    for bad in ("recompute={}", "nope={}", "dram", "dram=[1]", "dram={oops"):
        with pytest.raises(ConfigError, match="--tier-options"):
            parse_tier_options([bad])


def test_cli_reports_bad_rows_without_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "offload", "--rows", "bogus"]) == 1
    assert "unknown row 'bogus'" in capsys.readouterr().err


# -- engine configuration ------------------------------------------------------------------------


class _Master:
    master_address = "127.0.0.1:1"
    metadata_url = "http://127.0.0.1:2/metadata"


def test_offload_config_per_row() -> None:
    s = BenchSettings()
    assert offload_config("recompute", s, Path("/d")) is None
    assert offload_config("dram", s, Path("/d"))["tiers"][0]["name"] == "dram"
    mc = offload_config("mooncake_store", s, Path("/d"), _Master())["tiers"][0]
    assert mc["master"] == "127.0.0.1:1" and mc["metadata_url"].endswith("/metadata")
    for row in ROW_NAMES:  # every tier row parses as a valid offload object
        cfg = offload_config(row, s, Path("/d"), _Master())
        if cfg is not None:
            from kvbridge.offload.config import OffloadConfig

            assert OffloadConfig.parse(cfg).tiers[0].name == TIER_OF[row]


def test_foreign_engines_ignores_our_own_group() -> None:
    assert foreign_engines([os.getpgid(0)]) == [p for p in foreign_engines()
                                                  if os.getpgid(p) != os.getpgid(0)]


# -- checks, ratios, the table -------------------------------------------------------------------


def test_usable_blocks_leave_one_token_to_compute() -> None:
    assert usable_blocks(3000, 128) == 23
    assert usable_blocks(2945, 128) == 23
    assert usable_blocks(2944, 128) == 22
    assert usable_blocks(1, 128) == 0


def test_median_min() -> None:
    assert median_min([]) == (None, None)
    assert median_min([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0)


def _rep(i: int, ttft: float, ids: list[int], **deltas: int) -> Rep:
    return Rep(i, ok=True, ttft=ttft, total=ttft + 0.01, queue=0.002, prefill=ttft - 0.01,
                 token_ids=ids, deltas=dict(deltas))


def test_source_check_uses_the_counters() -> None:
    hit = {"offload_hit_blocks_dram": 23, "offload_loaded_blocks": 23}
    assert source_ok("dram", _rep(0, 1.0, [], **hit), 23)
    assert not source_ok("dram", _rep(0, 1.0, [], **hit), 22)
    assert not source_ok("disk", _rep(0, 1.0, [], **hit), 23)
    assert not source_ok("dram", _rep(0, 1.0, [], **hit, offload_load_failed=1), 23)
    assert not source_ok("dram", _rep(0, 1.0, [], **hit, offload_hit_blocks_disk=2), 23)
    assert source_ok("disk_cold", _rep(0, 1.0, [], offload_hit_blocks_disk=5,
                                         offload_loaded_blocks=5), 5)
    assert source_ok("recompute", _rep(0, 1.0, []), 23)
    assert not source_ok("recompute", _rep(0, 1.0, [], offload_loaded_blocks=3), 23)


def _rows() -> list[dict[str, object]]:
    ref = [7, 8]
    base = RowResult("recompute", expected_blocks=23, reference=ref,
                       cold=_rep(0, 6.1, ref),
                       reps=[_rep(i, t, ref) for i, t in enumerate([6.0, 6.4, 6.2])])
    hit = {"offload_hit_blocks_dram": 23, "offload_loaded_blocks": 23}
    dram = RowResult("dram", tiers=["dram"], expected_blocks=23, reference=ref,
                       cold=_rep(0, 6.2, ref),
                       reps=[_rep(0, 0.3, ref, **hit), _rep(1, 0.31, [9, 9], **hit),
                             Rep(2, error="EngineError: boom")])
    disk = RowResult("disk", tiers=["disk"], expected_blocks=23, reference=ref,
                       reps=[_rep(0, 4.0, ref, offload_hit_blocks_disk=20,
                                  offload_loaded_blocks=20)])
    lm = RowResult("lmcache", tiers=["lmcache"], unavailable="no LMCacheTier")
    rows = [summarize(r) for r in (base, dram, disk, lm)]
    add_ratios(rows)
    return rows


def test_summary_and_ratios() -> None:
    base, dram, disk, lm = _rows()
    assert base["ttft_median_s"] == 6.2 and base["ttft_min_s"] == 6.0 and base["ratio"] == 1.0
    assert dram["ok"] == 2 and dram["reps"] == 3
    assert dram["ttft_median_s"] == pytest.approx(0.305)
    assert dram["ratio"] == pytest.approx(0.305 / 6.2)
    assert dram["ratio_min"] == pytest.approx(0.3 / 6.0)
    assert dram["source_ok"] is True and dram["output_ok"] is False
    assert disk["source_ok"] is False and disk["output_ok"] is True
    assert lm["ratio"] is None and lm["source_ok"] is None and lm["output_ok"] is None


def test_ratios_without_a_baseline_are_none() -> None:
    rows = [r for r in _rows() if r["row"] != "recompute"]
    add_ratios(rows)
    assert all(r["ratio"] is None for r in rows)


def test_table_marks_checks_and_keeps_unavailable_rows() -> None:
    text = format_table(_rows())
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["row", "tiers", "ok/reps", "TTFT"]
    assert set(lines[1]) <= {"-", " "}
    by_row = {ln.split()[0]: ln for ln in lines[2:]}
    assert set(by_row) == {"recompute", "dram", "disk", "lmcache"}
    assert "3/3" in by_row["recompute"] and "1.000" in by_row["recompute"]
    assert "2/3" in by_row["dram"] and "0.049" in by_row["dram"] and "23/23" in by_row["dram"]
    assert "✓" in by_row["dram"] and "✗" in by_row["dram"]
    assert "20/23" in by_row["disk"]
    assert "not available: no LMCacheTier" in by_row["lmcache"]
    # the columns line up: each header word starts where its rule starts
    starts = [i for i in range(len(lines[1])) if lines[1][i] == "-" and
              (i == 0 or lines[1][i - 1] == " ")]
    assert [lines[0][i - 1] if i else " " for i in starts] == [" "] * len(TABLE_HEADERS)
    assert by_row["dram"].index("dram", 4) == lines[0].index("tiers")


def test_verdicts_say_whether_the_aims_hold() -> None:
    lines = verdicts(_rows())
    assert lines[0].startswith("dram: aim <= 0.2 x recompute: holds (0.049 x")
    assert lines[1].startswith("disk: aim <= 0.5 x recompute: NOT met (0.645 x")


def test_report_formats_with_facts() -> None:
    rows = _rows()
    report = {"date": "d", "host": {"cpus": 2, "loadavg_start": "0", "loadavg_end": "1"},
              "model": {"name": "bench-qwen3", "params": 100_684_032},
              "settings": {"prompt_len": 3000, "block_size": 128, "max_tokens": 2, "reps": 3},
              "expected_blocks": 23, "prompt_kv_bytes": 23 * 128 * 24576, "log_dir": "/l",
              "rows": rows, "reference_from": "recompute's first output", "elapsed_s": 5.0}
    text = format_report(report)
    assert "100.7 M parameters" in text and "prompt 3000 tokens" in text
    assert "69.0 MiB" in text and "dram: aim" in text


# -- the bench model -----------------------------------------------------------------------------


def test_bench_model_spec_has_at_least_100m_parameters() -> None:
    spec = tm.bench_model_spec()
    n = tm.spec_param_count(spec)
    assert n >= tm.BENCH_MIN_PARAMS == 100_000_000
    assert n == 100_684_032
    c = spec["config"]
    assert c["vocab_size"] == tm.BENCH_VOCAB_SIZE and c["dtype"] == "float32"
    assert c["max_position_embeddings"] >= 8192
    assert tm.spec_param_count(tm.tiny_model_spec()) == 623_360  # same formula, tiny model
    assert spec != tm.bench_model_spec(seed=1)


def test_bench_prompts_use_the_big_vocabulary() -> None:
    a = tm.bench_prompts(2, 3000, seed=5)
    assert a == tm.bench_prompts(2, 3000, seed=5) and a[0] != a[1]
    ids = {i for p in a for i in p}
    assert min(ids) >= tm.NUM_SPECIAL_TOKENS and max(ids) >= tm.VOCAB_SIZE
    assert max(ids) < tm.BENCH_VOCAB_SIZE


def test_hit_fraction_shares_a_prefix_and_gives_every_repetition_a_tail_of_its_own() -> None:
    from kvbridge.tools.bench.offload import _prompts
    from kvbridge.tools.bench.offload_results import shared_blocks

    whole = BenchSettings.quick_defaults()
    assert shared_blocks(whole) == (whole.prompt_len - 1) // whole.block_size
    p = _prompts(whole)
    assert p.reps == [p.cold] * whole.reps and len(p.cold) == whole.prompt_len

    half = replace(whole, hit_fraction=0.5, reps=3)
    n = shared_blocks(half)
    assert n == (half.prompt_len // 2) // half.block_size
    p = _prompts(half)
    assert len(p.cold) == n * half.block_size
    assert all(len(r) == half.prompt_len and r[:len(p.cold)] == p.cold for r in p.reps)
    tails = [tuple(r[len(p.cold):]) for r in p.reps]
    assert len(set(tails)) == 3  # no repetition can hit another's tail in the tier
    assert _prompts(half) == p  # deterministic

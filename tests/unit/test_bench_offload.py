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
    against_rows,
    format_against,
    format_report,
    format_table,
    median_min,
    parse_rows,
    parse_tier_options,
    source_ok,
    summarize,
    usable_blocks,
    variants_of,
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


# -- --against noseal ----------------------------------------------------------------------------


def test_against_noseal_gives_tier_rows_two_engines_and_recompute_one() -> None:
    assert b.settings_from_args(_args()).against is None
    s = b.settings_from_args(_args("--against", "noseal", "--rows", "recompute,dram,disk"))
    assert s.against == "noseal"
    assert variants_of("dram", s) == {"seal": {}, "noseal": {"checksum": False}}
    assert variants_of("recompute", s) == {"": {}}
    assert variants_of("dram", BenchSettings()) == {"": {}}
    with pytest.raises(SystemExit):
        _args("--against", "nothing")


def _variant(row: str, variant: str, ttfts: list[float]) -> RowResult:
    res = RowResult(row, tiers=[row], variant=variant, expected_blocks=23)
    for i, t in enumerate(ttfts):
        res.reps.append(Rep(i, ok=True, ttft=t, token_ids=[1],
                            deltas={f"offload_hit_blocks_{row}": 23,
                                    "offload_loaded_blocks": 23}))
    return res


def test_against_rows_pair_the_repetitions_and_state_the_overhead() -> None:
    rows = [summarize(r) for r in (
        RowResult("recompute", reps=[Rep(0, ok=True, ttft=6.0)]),
        _variant("dram", "seal", [0.33, 0.36, 0.31, 0.40]),
        _variant("dram", "noseal", [0.30, 0.30, 0.30, 0.40]),
        _variant("disk", "seal", [0.5, 0.5]),
        _variant("disk", "noseal", [0.5]))]
    add_ratios(rows)
    assert rows[1]["ratio"] == pytest.approx(0.345 / 6.0)  # both variants against recompute
    dram, disk = against_rows(rows, "noseal")
    assert dram["row"] == "dram" and dram["pairs"] == 4
    assert dram["ttft_median_s"] == pytest.approx(0.345)
    assert dram["ttft_median_noseal_s"] == pytest.approx(0.30)
    assert dram["ratio_of_medians"] == pytest.approx(0.345 / 0.30)
    # the paired ratios are 1.1, 1.2, 1.0333 and 1.0
    assert dram["paired_ratio"] == pytest.approx((0.31 / 0.30 + 1.1) / 2)
    assert dram["overhead_pct"] == pytest.approx(((0.31 / 0.30 + 1.1) / 2 - 1) * 100)
    assert dram["paired_diff_ms"] == pytest.approx(20.0)
    assert disk["pairs"] == 1 and disk["overhead_pct"] == pytest.approx(0.0)
    text = format_against([dram, disk], "noseal")
    assert "TTFT med seal s" in text.splitlines()[0] and "overhead %" in text
    assert "6.7" in text and "1.067 [1.000, 1.200]" in text
    by_row = [ln.split()[0] for ln in format_table(rows).splitlines()[2:]]
    assert by_row[1:3] == ["dram", "dram"] and "(noseal)" in format_table(rows)
    # the aims are judged on the default engines only
    assert [ln.split(":")[0] for ln in verdicts(rows)] == ["dram", "disk"]


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


def test_run_engine_interleaves_the_variants_abba(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """Both variants' engines run at once, each with its own tier directory and settings; the
    repetitions alternate A B B A; every engine is stopped."""
    import contextlib

    from kvbridge.tools.bench import offload_engine as oe

    started: list[tuple[str, dict[str, object], str]] = []
    stopped: list[str] = []
    order: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def fake_engine(name, settings, model, cfg, offload, log_dir, say, info, extra):  # type: ignore[no-untyped-def]
        started.append((name, dict(extra), offload["tiers"][0]["path"]))
        try:
            yield name
        finally:
            stopped.append(name)

    def fake_prime(name, eng, settings, prompts, tier, say):  # type: ignore[no-untyped-def]
        return Rep(0, ok=True, ttft=5.0), 23

    def fake_measure(eng, settings, prompt, res, i, say):  # type: ignore[no-untyped-def]
        order.append((eng, i))
        res.reps.append(Rep(i, ok=True, ttft=0.3))

    monkeypatch.setattr(oe, "_engine", fake_engine)
    monkeypatch.setattr(oe, "_prime", fake_prime)
    monkeypatch.setattr(oe, "_measure", fake_measure)
    s = replace(BenchSettings(), reps=3, against="noseal")
    prompts = oe.BenchPrompts([1] * 10, [2] * 10, [[1] * 10] * 3)
    out = oe.run_engine("disk", ["disk", "disk_cold"], s, tmp_path, {}, prompts, tmp_path,
                        tmp_path, lambda m: None, variants_of("disk", s))
    assert [(n, e) for n, e, _ in started] == [("disk-seal", {}),
                                                ("disk-noseal", {"checksum": False})]
    assert len({p for _, _, p in started}) == 2 and sorted(stopped) == ["disk-noseal",
                                                                          "disk-seal"]
    assert order == [("disk-seal", 0), ("disk-noseal", 0), ("disk-noseal", 1), ("disk-seal", 1),
                     ("disk-seal", 2), ("disk-noseal", 2)] * 2
    assert [(r.row, r.variant, len(r.reps)) for r in out] == [
        ("disk", "seal", 3), ("disk_cold", "seal", 3), ("disk", "noseal", 3),
        ("disk_cold", "noseal", 3)]
    assert all(r.error is None and r.engine["disk_dir"] for r in out)

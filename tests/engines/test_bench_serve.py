"""``kvbridge bench serve``: flags, the result JSON -> table and -> plots path, the stock-protocol
proxy against fake engines, and one small run on real engines (marked ``vllm``).

The unit tests start no engines. matplotlib is installed under CI (``.ci/install-steps``): there a
missing matplotlib fails the plot tests instead of skipping them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.routing import ProxyMode
from kvbridge.tools import cli
from kvbridge.tools.bench import serve as bs
from kvbridge.tools.bench.dispatch import vllm_pull_params
from kvbridge.tools.bench.fleet import VLLM_PUSH_P_ENGINE
from kvbridge.tools.bench.serve_plots import PLOT_FILE, write_plots
from kvbridge.tools.bench.serve_process import bench_serve_command
from kvbridge.tools.bench.serve_results import (
    RESULTS_FILE,
    RESULTS_KIND,
    format_push_pull,
    format_steps,
    format_table,
    handoff_summary,
    push_pull,
    result_metrics,
    sustained,
)
from kvbridge.tools.bench.serve_run import new_report
from kvbridge.tools.bench.serve_settings import (
    MAX_RATES,
    SETUP_NAMES,
    parse_fleet,
    parse_rates,
    parse_setups,
    run_seed,
    setup_groups,
    setup_mode,
)

pytestmark = pytest.mark.timeout(60)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _need_matplotlib() -> None:
    if bs.matplotlib_available():
        return
    if os.environ.get("CI"):
        pytest.fail("matplotlib is not installed, but CI installs it (.ci/install-steps)")
    pytest.skip("matplotlib is not installed")


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["bench", "serve", *argv]).parse_args(["bench", "serve", *argv])


# -- flags ---------------------------------------------------------------------------------------


def test_defaults() -> None:
    s = bs.settings_from_args(_args())
    assert s.setups == SETUP_NAMES
    assert s.rates == (2.0, 4.0, 8.0, 16.0)
    assert (s.num_prompts, s.input_len, s.output_len, s.backend) == (40, 200, 16, "nixl")
    assert s.plots and s.out is None


def test_flags_map_to_settings() -> None:
    s = bs.settings_from_args(_args("--setups", "vllm-nixl-pull, kvbridge-pull,vllm-nixl-pull",
                                    "--rates", "4, 2,0.5,4", "--num-prompts", "8",
                                    "--backend", "shm", "--out", "/tmp/x", "--no-plots"))
    assert s.setups == ("vllm-nixl-pull", "kvbridge-pull")
    assert s.rates == (4.0, 2.0, 0.5)
    assert (s.num_prompts, s.backend, s.out, s.plots) == (8, "shm", Path("/tmp/x"), False)
    assert parse_setups("all") == SETUP_NAMES


@pytest.mark.parametrize("text", ["", " , ", "kvbridge-pull,nope", "vllm-nixl", "kvbridge-shm"])
def test_unknown_setups_are_named(text: str) -> None:
    with pytest.raises(ConfigError, match="--setups"):
        parse_setups(text)


@pytest.mark.parametrize("text", ["", ",", "0", "-2", "2,abc", "inf", "nan", "2,1e400"])
def test_bad_rates_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--rates"):
        parse_rates(text)


def test_too_many_rates_are_refused() -> None:
    with pytest.raises(ConfigError, match="at most"):
        parse_rates(",".join(str(i) for i in range(1, MAX_RATES + 2)))


@pytest.mark.parametrize("flag,value", [("--num-prompts", "0"), ("--output-len", "1"),
                                        ("--warmups", "-1"), ("--idle-timeout", "0"),
                                        ("--input-len", "0")])
def test_bad_numbers_are_refused(flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        bs.settings_from_args(_args(flag, value))


@pytest.mark.parametrize("argv,message", [
    (["--setups", "bogus"], "unknown setup 'bogus'"),
    (["--rates", "2,zero"], "'zero' is not a number"),
    (["--rates", "-4"], "positive, finite"),
])
def test_cli_reports_bad_flags_without_starting_anything(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "serve", *argv]) == 1
    assert message in capsys.readouterr().err


def test_unknown_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--backend", "tcp"])
    assert exc.value.code == 2
    assert "invalid choice: 'tcp'" in capsys.readouterr().err


def test_fleet_shape_is_parsed_and_recorded(tmp_path: Path) -> None:
    assert parse_fleet("2P2D") == (2, 2) and parse_fleet(" 1p3d ") == (1, 3)
    s = bs.settings_from_args(_args("--fleet", "2P1D", "--setups", "kvbridge-pull,kvbridge-auto"))
    assert (s.prefill_engines, s.decode_engines) == (2, 1)
    report = new_report(s, tmp_path)
    assert report["fleet"] == "2P1D"
    assert (report["settings"]["prefill_engines"], report["settings"]["decode_engines"]) == (2, 1)
    assert new_report(bs.settings_from_args(_args()), tmp_path)["fleet"] == "1P1D"


@pytest.mark.parametrize("text", ["", "2P", "P2D", "2D2P", "0P1D", "1P9D", "2P2D2", "xPyD",
                                  "-1P1D", "100P1D"])
def test_bad_fleet_shapes_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--fleet"):
        parse_fleet(text)


def test_a_fleet_refuses_the_one_pair_vllm_setups() -> None:
    with pytest.raises(ConfigError, match="vllm-nixl-pull, vllm-nixl-push run 1P1D only"):
        bs.settings_from_args(_args("--fleet", "2P2D"))  # the default setups include them
    assert bs.settings_from_args(_args("--fleet", "1P1D")).setups == SETUP_NAMES


def test_fleet_engines_are_distinct_and_spread_over_the_cpus(tmp_path: Path) -> None:
    from kvbridge.host.placement import fleet_cores
    from kvbridge.tools.bench.fleet import engine_specs, fleet_specs

    ps, ds = fleet_specs("kvbridge-shm", tmp_path, tmp_path, 2.0, prefill=2, decode=2)
    engines = [*ps, *ds]
    assert all(e.proc is None for e in engines)  # built, not started
    ids = [e.kv_transfer_config["engine_id"] for e in engines if e.kv_transfer_config]
    assert ids == ["bench-shm-P0", "bench-shm-P1", "bench-shm-D0", "bench-shm-D1"]
    assert [e.kv_transfer_config["kv_role"] for e in engines if e.kv_transfer_config] == (
        ["kv_producer"] * 2 + ["kv_consumer"] * 2)
    assert len({e.log_path for e in engines}) == 4
    cpus = sorted(os.sched_getaffinity(0))
    p_cores, d_cores = fleet_cores(cpus, 2, 2)
    assert [e.cpu_bind for e in engines] == [str(c) for c in (*p_cores, *d_cores)]
    if len(cpus) > 1:  # a P and a D never share a core (UCX livelock, docs/backends/nixl.md)
        assert not {p.cpu_bind for p in ps} & {d.cpu_bind for d in ds}
    # 1P1D is exactly the pair bench e2e and bench serve always ran
    [p], [d] = fleet_specs("vllm-nixl-push", tmp_path, tmp_path)
    p1, d1 = engine_specs("vllm-nixl-push", tmp_path, tmp_path)
    assert (p.name, p.cpu_bind, d.name, d.cpu_bind) == (p1.name, p1.cpu_bind, d1.name,
                                                        d1.cpu_bind)
    with pytest.raises(ConfigError, match="runs 1P1D only"):
        fleet_specs("vllm-nixl-pull", tmp_path, tmp_path, prefill=2)
    with pytest.raises(ConfigError, match="engines per role"):
        fleet_specs("kvbridge-shm", tmp_path, tmp_path, decode=0)


# -- grouping and seeds --------------------------------------------------------------------------


def test_kvbridge_modes_share_one_pair_and_vllm_connectors_get_their_own() -> None:
    groups = setup_groups(("vllm-nixl-push", "kvbridge-push", "vllm-nixl-pull",
                              "kvbridge-pull"))
    assert groups == [("vllm-nixl-push", ("vllm-nixl-push",)),
                      ("kvbridge", ("kvbridge-push", "kvbridge-pull")),
                      ("vllm-nixl-pull", ("vllm-nixl-pull",))]


def test_seeds_pair_the_same_mode_and_never_repeat_on_a_shared_pair() -> None:
    assert run_seed(7, "kvbridge-pull", 1) == run_seed(7, "vllm-nixl-pull", 1)
    assert run_seed(7, "kvbridge-push", 0) == run_seed(7, "vllm-nixl-push", 0)
    shared = {run_seed(7, s, i) for s in ("kvbridge-pull", "kvbridge-push", "kvbridge-auto",
                                          "kvbridge-headroom")
              for i in range(MAX_RATES)}
    assert len(shared) == 4 * MAX_RATES


def test_auto_is_the_planner_and_headroom_the_old_auto() -> None:
    """kvbridge-auto runs the proxy's auto mode, the planner since issue 30; kvbridge-headroom
    the load rule auto was before it. The default setups run both, on the kvbridge pair."""
    assert setup_mode("kvbridge-auto") == "auto" and setup_mode("kvbridge-headroom") == "headroom"
    assert ProxyMode(setup_mode("kvbridge-auto")) is ProxyMode.AUTO
    assert {"kvbridge-auto", "kvbridge-headroom"} <= set(bs.settings_from_args(_args()).setups)
    assert setup_groups(("kvbridge-auto", "kvbridge-headroom")) == [
        ("kvbridge", ("kvbridge-auto", "kvbridge-headroom"))]


def test_bench_serve_command_asks_for_what_is_parsed(tmp_path: Path) -> None:
    cmd = bench_serve_command("http://127.0.0.1:9", tmp_path / "m", tmp_path, "x-rate2",
                                 rate=2.0, num_prompts=8, input_len=200, output_len=16, seed=5,
                                 ready_check_s=0)
    text = " ".join(cmd)
    for part in ("bench serve", "--base-url http://127.0.0.1:9", "--endpoint /v1/completions",
                 "--dataset-name random", "--request-rate 2 ", "--ignore-eos", "--seed 5",
                 "--num-warmups 0", "--ready-check-timeout-sec 0", "--metric-percentiles 50,99",
                 "--result-filename x-rate2.json", "--random-input-len 200",
                 "--random-output-len 16", "--num-prompts 8"):
        assert part in text, part
    default = bench_serve_command("u", tmp_path, tmp_path, "n", rate=8, num_prompts=1,
                                     input_len=1, output_len=2, seed=0, warmups=2)
    assert "--ready-check-timeout-sec" not in default and "--num-warmups" in default
    assert "--request-id-prefix" not in default
    named = bench_serve_command("u", tmp_path, tmp_path, "n", rate=8, num_prompts=1, input_len=1,
                                output_len=2, seed=0, request_id_prefix="n-")
    assert named[named.index("--request-id-prefix") + 1] == "n-"


# -- result JSON -> rows -> table and plots ------------------------------------------------------


BENCH_RESULT = {
    "completed": 3, "failed": 1, "duration": 2.5, "request_throughput": 1.2,
    "p50_ttft_ms": 40.0, "p99_ttft_ms": 90.0, "median_ttft_ms": 41.0,
    "p50_tpot_ms": 3.5, "p99_tpot_ms": 6.0, "p50_e2el_ms": 100.0, "p99_e2el_ms": 150.0,
    "ttfts": [0.04, 0.09, 0.03, 0.0], "latencies": [0.1, 0.15, 0.09, 9.0],
    "errors": ["", None, "", "boom"],
}


def test_result_metrics_reads_bench_serves_json() -> None:
    m = result_metrics(BENCH_RESULT)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["ttft_p50"], m["ttft_p99"], m["tpot_p50"], m["tpot_p99"]) == (40.0, 90.0, 3.5, 6.0)
    assert (m["e2e_p50"], m["e2e_p99"], m["request_throughput"]) == (100.0, 150.0, 1.2)
    assert m["ttft_max"] == pytest.approx(90.0)  # the failed request's values are left out
    assert m["e2e_max"] == pytest.approx(150.0)
    empty = result_metrics({"completed": 0, "failed": 4, "p50_ttft_ms": float("nan")})
    assert empty["ttft_p50"] is None and empty["ttft_max"] is None


def _report() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for setup, base in (("kvbridge-pull", 30.0), ("vllm-nixl-pull", 60.0),
                        ("kvbridge-push", 20.0)):
        for i, rate in enumerate((2.0, 4.0, 8.0)):
            rows.append({"setup": setup, "rate": rate, "seed": i, "rc": 0, "completed": 8,
                         "failed": 0, "ttft_p50": base * (i + 1), "ttft_p99": base * 40 * (i + 1),
                         "tpot_p50": 3.0 + i, "tpot_p99": 5.0 + i, "e2e_p99": 200.0 + i,
                         "request_throughput": rate * 0.9})
    rows.append({"setup": "vllm-nixl-push", "rate": 2.0, "seed": 1000,
                 "error": "warm-up failed (2 requests): HTTP 502"})
    rows[4]["ttft_p50"] = None  # a run without the value: a gap in its line
    settings = {"backend": "nixl", "num_prompts": 8, "input_len": 200, "output_len": 16}
    return {"kind": RESULTS_KIND, "version": 1, "date": "2026-12-03T15:00:00+00:00",
            "host": {"cpus": 2, "loadavg_start": "1 1 1", "loadavg_end": "2 2 2"},
            "settings": settings, "out": "/tmp/nowhere", "groups": {}, "rows": rows}


def test_table_has_one_row_per_run_and_names_errors() -> None:
    text = format_table(_report()["rows"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["setup", "rate", "ok/fail"]
    assert any(line.split()[:3] == ["kvbridge-pull", "4", "8/0"] for line in lines)
    assert "vllm-nixl-push @ 2 req/s: warm-up failed" in text
    assert "vllm-nixl-push  2     -/-" in text


def _run(setup: str, rate: float, ttft: float, thr: float, **kw: Any) -> dict[str, Any]:
    return {"setup": setup, "rate": rate, "ttft_p50": ttft, "request_throughput": thr,
            "completed": 32, "failed": 0, **kw}


def test_push_pull_ratio_at_the_highest_rate_both_sustain() -> None:
    rows = [_run("kvbridge-pull", 4, 50.0, 3.9), _run("kvbridge-push", 4, 15.0, 3.95),
            _run("kvbridge-pull", 8, 90.0, 7.6), _run("kvbridge-push", 8, 60.0, 7.7),
            _run("kvbridge-pull", 16, 200.0, 9.0), _run("kvbridge-push", 16, 100.0, 15.0),
            _run("kvbridge-auto", 16, 10.0, 16.0)]
    summary = push_pull(rows)
    assert summary["ratios"] == pytest.approx({"4": 0.3, "8": 60 / 90, "16": 0.5})
    assert summary["sustained_rate"] == 8  # pull fell behind at 16 (9 of 16 req/s)
    assert summary["ratio"] == pytest.approx(60 / 90) and summary["met"] is False
    text = format_push_pull(summary)
    assert "4 req/s 0.30, 8 req/s 0.67, 16 req/s 0.50" in text
    assert "highest rate both sustain, 8 req/s: push/pull = 0.67 (bar <= 1/3: NOT met)" in text
    rows[2:4] = [_run("kvbridge-pull", 8, 90.0, 7.6, failed=1), rows[3]]
    summary = push_pull(rows)
    assert summary["sustained_rate"] == 4 and summary["met"] is True  # 0.30 <= 1/3


def test_push_pull_without_both_setups_or_sustained_rates() -> None:
    assert push_pull([_run("kvbridge-pull", 4, 50.0, 3.9)]) == {}
    assert format_push_pull({}) == ""
    rows = [_run("kvbridge-pull", 4, 50.0, 1.0), _run("kvbridge-push", 4, 15.0, 3.9)]
    summary = push_pull(rows)
    assert summary["sustained_rate"] is None
    assert "no rate was sustained" in format_push_pull(summary)
    assert not sustained({"rate": 4, "request_throughput": 4.0, "error": "boom"})


def test_handoff_summary_and_steps_from_the_engines_timings() -> None:
    p_t = {"a": {"kv_ready": 1.0, "write_posted": 1.0005, "write_done": 1.0015},
           "b": {"kv_ready": 2.0, "write_posted": 2.0005, "write_done": 2.0025},
           "old": {"kv_ready": 0.0}}
    d_t = {"a": {"recv_done": 1.002, "first_step": 1.003},
           "b": {"recv_done": 2.003, "first_step": 2.005}}
    got = handoff_summary(p_t, d_t, ["a", "b"])
    assert got["handoff_n"] == 2 and got["handoff_p50"] == pytest.approx(4.0)
    assert got["beyond_wire_p50"] == pytest.approx(2.5)  # (3 - 1) and (5 - 2)
    assert got["handoff_steps"]["recv_done->first_step"] == pytest.approx(1.5)
    row = {"setup": "kvbridge-push", "rate": 8.0, **got}
    assert "kvbridge-push @ 8: kv_ready->write_posted 0.5" in format_steps([row])
    assert " 4.00 " in format_table([row]) and " 2.50" in format_table([row])
    assert format_steps([{"setup": "vllm-nixl-pull", "rate": 8.0}]) == ""


def _assert_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    from PIL import Image

    with Image.open(path) as img:
        img.verify()
    return width, height


def test_plots_are_valid_pngs(tmp_path: Path) -> None:
    _need_matplotlib()
    paths = write_plots(_report(), tmp_path / "plots")
    assert paths == [tmp_path / "plots" / PLOT_FILE]
    width, height = _assert_png(paths[0])
    assert width > 2 * height  # three panels side by side


def test_plots_survive_a_report_without_values(tmp_path: Path) -> None:
    _need_matplotlib()
    report = _report()
    report["rows"] = [{"setup": "kvbridge-pull", "rate": 2.0, "error": "engines did not start"}]
    _assert_png(write_plots(report, tmp_path)[0])


def test_plot_only_redraws_from_a_results_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _need_matplotlib()
    results = tmp_path / "run" / RESULTS_FILE
    results.parent.mkdir()
    results.write_text(json.dumps(_report()))
    assert cli.main(["bench", "serve", "--plot-only", str(results)]) == 0
    out = capsys.readouterr().out
    assert "kvbridge-push" in out and "TTFT p50 ms" in out
    _assert_png(results.parent / PLOT_FILE)
    other = tmp_path / "docs"
    assert cli.main(["bench", "serve", "--plot-only", str(results), "--out", str(other)]) == 0
    _assert_png(other / PLOT_FILE)


@pytest.mark.parametrize("content,message", [
    (None, "cannot read"), ("{not json", "is not JSON"), ('{"rows": []}', "not a kvbridge"),
    (json.dumps({"kind": RESULTS_KIND, "rows": [{"setup": "a"}]}), "'rows' must be"),
])
def test_plot_only_refuses_bad_files(tmp_path: Path, content: str | None, message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["bench", "serve", "--plot-only", str(path)]) == 1
    assert message in capsys.readouterr().err


# -- the stock-protocol proxy --------------------------------------------------------------------


def test_stock_prefill_body_is_a_one_token_non_streamed_copy() -> None:
    from kvbridge.tools.bench.proxy import stock_decode_body, stock_prefill_body

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 16, "max_completion_tokens": 16,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4,
            "ignore_eos": True, "nested": {"a": [1]}}
    p = stock_prefill_body(body, vllm_pull_params())
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["ignore_eos"] is True and p["kv_transfer_params"] == vllm_pull_params()
    p["nested"]["a"].append(2)
    assert body["nested"] == {"a": [1]} and body["max_tokens"] == 16  # the original is untouched
    d = stock_decode_body(body, {"remote_engine_id": "e"})
    assert d["kv_transfer_params"] == {"remote_engine_id": "e"}
    assert {k: v for k, v in d.items() if k != "kv_transfer_params"} == body


class _FakeEngines:
    """A fake P and D on 127.0.0.1: P answers JSON with kv_transfer_params, D streams SSE."""

    def __init__(self) -> None:
        self.p_bodies: list[dict[str, Any]] = []
        self.d_bodies: list[dict[str, Any]] = []
        self.p_headers: list[str | None] = []
        self.d_headers: list[str | None] = []
        self.p_seen = asyncio.Event()
        self.d_seen = asyncio.Event()
        self.d_closed = asyncio.Event()
        self.p_handler: Callable[[Any], Awaitable[Any]] | None = None
        self.d_handler: Callable[[Any], Awaitable[Any]] | None = None
        self.runners: list[Any] = []

    async def start(self) -> tuple[str, str]:
        from aiohttp import web

        urls = []
        for role in ("p", "d"):
            app = web.Application()
            app.router.add_post("/v1/completions", getattr(self, f"_{role}"))
            # like vLLM, a client that goes away cancels its request
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        return urls[0], urls[1]

    async def stop(self) -> None:
        for r in self.runners:
            await r.cleanup()

    async def _p(self, request: Any) -> Any:
        from aiohttp import web

        self.p_bodies.append(await request.json())
        self.p_headers.append(request.headers.get("X-Request-Id"))
        self.p_seen.set()
        if self.p_handler is not None:
            return await self.p_handler(request)
        return web.json_response({"choices": [{"text": "x"}],
                                  "kv_transfer_params": {"remote_engine_id": "P-engine",
                                                         "remote_block_ids": [[1, 2]]}})

    async def _d(self, request: Any) -> Any:
        from aiohttp import web

        self.d_bodies.append(await request.json())
        self.d_headers.append(request.headers.get("X-Request-Id"))
        self.d_seen.set()
        try:
            if self.d_handler is not None:
                return await self.d_handler(request)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(3):
                chunk = {"choices": [{"text": f"t{i}", "index": 0}]}
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        finally:
            self.d_closed.set()


async def _through_proxy(protocol: str, fake: _FakeEngines,
                         body: dict[str, Any]) -> tuple[int, bytes, dict[str, int]]:
    import aiohttp

    from kvbridge.tools.bench.proxy import StockProxy

    p_url, d_url = await fake.start()
    proxy = StockProxy(protocol, p_url, d_url, p_side_channel_port=5599, timeout_s=10.0)
    await proxy.start()
    try:
        assert proxy.url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as s, s.post(
                proxy.url + "/v1/completions", json=body,
                headers={"x-request-id": "benchmark-0"}) as r:
            return r.status, await r.read(), dict(proxy.stats)
    finally:
        await proxy.stop()
        await fake.stop()


BODY = {"model": "tiny", "prompt": "a b c", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_stock_pull_prefills_then_streams_d_with_ps_params() -> None:
    fake = _FakeEngines()
    status, raw, stats = asyncio.run(_through_proxy("pull", fake, BODY))
    assert status == 200
    assert raw.count(b"data: ") == 4 and raw.endswith(b"data: [DONE]\n\n")
    (p,), (d,) = fake.p_bodies, fake.d_bodies
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == vllm_pull_params()
    assert d["kv_transfer_params"] == {"remote_engine_id": "P-engine",
                                       "remote_block_ids": [[1, 2]]}
    assert d["stream"] is True and d["max_tokens"] == 3 and d["stream_options"]
    assert stats["ok"] == 1 and stats["failed"] == 0


def test_stock_push_sends_both_legs_at_once_with_one_request_id() -> None:
    fake = _FakeEngines()

    async def p_waits_for_d(request: Any) -> Any:  # deadlocks unless D was sent concurrently
        from aiohttp import web

        await asyncio.wait_for(fake.d_seen.wait(), 5)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": None})

    fake.p_handler = p_waits_for_d
    status, raw, stats = asyncio.run(_through_proxy("push", fake, BODY))
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    (p,), (d,) = fake.p_bodies, fake.d_bodies
    rid = fake.p_headers[0]
    assert rid and rid == fake.d_headers[0] and rid != "benchmark-0"
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"]["transfer_id"] == f"xfer-{rid}"
    kvp = d["kv_transfer_params"]
    assert kvp["do_remote_prefill"] is True and kvp["remote_engine_id"] == VLLM_PUSH_P_ENGINE
    assert kvp["remote_port"] == 5599 and kvp["remote_request_id"] == f"cmpl-{rid}-0"
    assert kvp["transfer_id"] == f"xfer-{rid}"
    assert stats["ok"] == 1 and stats["p_failed_late"] == 0


def test_stock_push_aborts_d_when_p_fails_first() -> None:
    fake = _FakeEngines()

    async def p_fails(request: Any) -> Any:
        from aiohttp import web

        await asyncio.wait_for(fake.d_seen.wait(), 5)
        return web.json_response({"error": "prefill broke"}, status=500)

    async def d_hangs(request: Any) -> Any:
        await asyncio.sleep(30)  # waiting for a push that never comes

    fake.p_handler = p_fails
    fake.d_handler = d_hangs

    async def run() -> tuple[int, bytes, dict[str, int], bool]:
        status, raw, stats = await _through_proxy("push", fake, BODY)
        return status, raw, stats, fake.d_closed.is_set()

    status, raw, stats, d_closed = asyncio.run(asyncio.wait_for(run(), 20))
    assert status == 502
    assert b"prefill leg failed, decode leg aborted" in raw and b"prefill broke" in raw
    assert d_closed  # D's request was dropped, not left waiting
    assert stats["failed"] == 1


def test_stock_pull_without_ps_params_is_a_502() -> None:
    fake = _FakeEngines()

    async def p_without_params(request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"choices": [{"text": "x"}]})

    fake.p_handler = p_without_params
    status, raw, _ = asyncio.run(_through_proxy("pull", fake, BODY))
    assert status == 502 and b"no kv_transfer_params" in raw
    assert fake.d_bodies == []


def test_stock_proxy_refuses_bad_settings() -> None:
    from kvbridge.tools.bench.proxy import StockProxy

    with pytest.raises(ConfigError, match="protocol"):
        StockProxy("auto", "http://p", "http://d")
    with pytest.raises(ConfigError, match="side-channel"):
        StockProxy("push", "http://p", "http://d")


def test_stock_proxy_thread_starts_and_closes_idempotently() -> None:
    import urllib.request

    from kvbridge.tools.bench.proxy import StockProxyThread

    t = StockProxyThread("pull", "http://127.0.0.1:9", "http://127.0.0.1:9").start()
    try:
        with urllib.request.urlopen(t.url + "/health", timeout=5) as r:
            assert json.loads(r.read())["protocol"] == "pull"
    finally:
        t.close()
    t.close()


def test_a_run_without_matplotlib_stops_before_starting_engines(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bs, "matplotlib_available", lambda: False)
    monkeypatch.setattr(bs, "run_serve_bench", lambda *a, **k: pytest.fail("started a run"))
    assert cli.main(["bench", "serve", "--out", str(tmp_path)]) == 1
    assert "--no-plots" in capsys.readouterr().err


# -- one small real run --------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_small_real_run_writes_results_and_plots(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """kvbridge-pull (shm), one rate, 4 prompts: ~80 s on an idle 2-core host (engines ~45 s,
    one ``vllm bench serve`` ~20 s). The vLLM setups' stock proxy is covered above against fake
    engines and by the smoke run of docs/results/2026-12-03-bench-serve-and-fleets.md."""
    from kvbridge.tools import engines

    plots = bs.matplotlib_available()
    before = set(engines._LIVE)  # a session fixture of another module may hold engines
    argv = ["bench", "serve", "--setups", "kvbridge-pull", "--backend", "shm", "--rates", "4",
            "--num-prompts", "4", "--warmups", "1", "--start-timeout", "240",
            "--bench-timeout", "150", "--idle-timeout", "30", "--out", str(tmp_path),
            "--no-progress", *([] if plots else ["--no-plots"])]
    assert cli.main(argv) == 0, capsys.readouterr().err[-3000:]
    report = json.loads((tmp_path / RESULTS_FILE).read_text())
    (row,) = report["rows"]
    assert row["setup"] == "kvbridge-pull" and row["rate"] == 4.0 and row["rc"] == 0
    assert row["completed"] == 4 and row["failed"] == 0 and not row.get("error")
    assert row["idle"] is True
    assert 0 < row["ttft_p50"] <= row["ttft_p99"] and row["tpot_p50"] > 0
    # every request's flight record, joined by the proxy, was read back by its request id;
    # the gap to the client's TTFT is what lies outside the proxy (bounded loosely here)
    assert row["phases_n"] == 4 and 0 <= row["phases_gap_p99"] < 50, row
    assert report["groups"]["kvbridge"]["engines"] == "kvbridge-shm"
    assert "kvbridge-pull" in capsys.readouterr().out
    assert engines._LIVE <= before, "an engine of this run was left running"
    if plots:
        _assert_png(tmp_path / PLOT_FILE)
    elif os.environ.get("CI"):
        pytest.fail("matplotlib is not installed, but CI installs it (.ci/install-steps)")


def test_the_stock_proxy_runs_as_a_process_of_its_own(tmp_path: Path) -> None:
    """``python -m kvbridge.tools.bench.proxy`` under ProxyProcess (as ``bench serve`` runs it):
    healthy, relays a pull, and is gone after stop()."""
    import aiohttp

    from kvbridge.tools.proxies import ProxyProcess

    fake = _FakeEngines()

    async def run() -> tuple[int, bytes, ProxyProcess]:
        p_url, d_url = await fake.start()
        proc = ProxyProcess(["--protocol", "pull", "--prefill", p_url, "--decode", d_url,
                             "--timeout-s", "10"], tmp_path / "stock.log",
                            module="kvbridge.tools.bench.proxy")
        url = proc.start(timeout=60.0)  # blocks on the proxy's /health only
        try:
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                            json=BODY) as r:
                return r.status, await r.read(), proc
        finally:
            proc.stop()
            await fake.stop()

    status, raw, proc = asyncio.run(asyncio.wait_for(run(), 90))
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert fake.p_bodies[0]["kv_transfer_params"] == vllm_pull_params()
    assert proc.proc is None  # stopped: stop() is idempotent
    proc.stop()


def test_a_proxy_process_that_cannot_start_says_why(tmp_path: Path) -> None:
    from kvbridge.tools.engines import EngineError
    from kvbridge.tools.proxies import ProxyProcess

    proc = ProxyProcess(["--protocol", "push", "--prefill", "http://127.0.0.1:1", "--decode",
                         "http://127.0.0.1:2"], tmp_path / "bad.log",
                        module="kvbridge.tools.bench.proxy")
    with pytest.raises(EngineError, match="side-channel port"):
        proc.start(timeout=60.0)
    assert proc.proc is None

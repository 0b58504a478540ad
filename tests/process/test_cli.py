"""The ``kvbridge`` console script (run as a real subprocess) and its lazy subcommands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from kvbridge.tools import cli

pytestmark = pytest.mark.timeout(180)


def kvbridge(*args: str, env: dict[str, str] | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed console script (or ``python -m kvbridge.tools.cli`` if it is missing)."""
    script = Path(sys.executable).with_name("kvbridge")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvbridge.tools.cli"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    full_env.update(env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, check=False)


# -- backends -------------------------------------------------------------------------------------


def test_backends_table() -> None:
    res = kvbridge("backends")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:2] == ["backend", "loadable"]
    shm = next(line for line in lines if line.startswith("shm "))
    assert shm.split()[1] == "yes"


def test_backends_json() -> None:
    res = kvbridge("backends", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert rows["shm"]["loadable"] is True
    assert set(rows["shm"]) == {"name", "target", "loadable", "detail"}
    tiers = {row["name"]: row for row in data["tiers"]}
    assert tiers["dram"]["loadable"] is True and tiers["disk"]["loadable"] is True
    assert rows["compose"]["loadable"] is True
    conns = {row["connector"]: row for row in data["connectors"]}
    assert conns["KVBridgeShmConnector"] == {"connector": "KVBridgeShmConnector",
                                             "kind": "transport", "backend": "shm",
                                             "loadable": True}
    assert conns["KVBridgeLMCacheConnector"]["kind"] == "tier"
    assert "KVBridgeConnector" in conns and "KVBridgeMemoryConnector" not in conns


def test_backends_table_lists_connector_names() -> None:
    res = kvbridge("backends")
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("KVBridgeNixlConnector "))
    assert "transport nixl" in line


def test_config_with_a_connector_name() -> None:
    res = kvbridge("config", "--connector", "KVBridgeNixlConnector", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["backend"] == {"value": "nixl", "source": "kv_connector KVBridgeNixlConnector"}
    res = kvbridge("config", "--connector", "KVBridgeComposeConnector", "--extra-config",
                   '{"backend_options": {"members": ["shm", "disk"]}}')
    assert res.returncode == 0, res.stderr
    assert "effective offload tiers: disk" in res.stdout


def test_config_shows_offload_from_env(tmp_path: Any) -> None:
    res = kvbridge("config", "--extra-config", '{"offload": {"tiers": ["dram"]}}',
                   env={"KVBRIDGE_OFFLOAD_TIERS": "dram,disk",
                        "KVBRIDGE_OFFLOAD_DISK_PATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("offload "))
    assert '"disk"' in line and str(tmp_path) in line and "KVBRIDGE_OFFLOAD_TIERS" in line


# -- config ---------------------------------------------------------------------------------------


def test_config_table_shows_sources() -> None:
    res = kvbridge("config", "--extra-config", '{"backend": "nixl", "mode": "push"}',
                   env={"KVBRIDGE_MODE": "pull", "KVBRIDGE_SECRET": "hunter2"})
    assert res.returncode == 0, res.stderr
    assert "precedence: env KVBRIDGE_<KEY> > kv_connector_extra_config > default" in res.stdout
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()[3:]}
    assert rows["backend"] == ["nixl", "kv_connector_extra_config"]
    assert rows["mode"] == ["pull", "env", "KVBRIDGE_MODE"]
    assert rows["lease_s"] == ["30.0", "default"]
    assert "hunter2" not in res.stdout


def test_config_json() -> None:
    res = kvbridge("config", "--json", "--extra-config", '{"lease_s": 10, "checksum": true}',
                   env={"KVBRIDGE_BACKEND_OPTIONS": '{"backends": ["UCX"]}'})
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["lease_s"] == {"value": 10.0, "source": "kv_connector_extra_config"}
    assert data["checksum"]["value"] is True
    assert data["backend_options"] == {"value": {"backends": ["UCX"]},
                                       "source": "env KVBRIDGE_BACKEND_OPTIONS"}
    assert data["mode"] == {"value": "pull", "source": "default"}


def test_config_takes_vllms_kv_transfer_config() -> None:
    ktc = {"kv_connector": "KVBridgeNixlConnector", "kv_role": "kv_producer",
           "kv_connector_extra_config": {"mode": "push"}, "kv_buffer_device": "cpu"}
    res = kvbridge("config", "--json", "--kv-transfer-config", json.dumps(ktc))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["backend"] == {"value": "nixl", "source": "kv_connector KVBridgeNixlConnector"}
    assert data["mode"] == {"value": "push", "source": "kv_connector_extra_config"}


@pytest.mark.parametrize(("ktc", "extra", "message"), [
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', [],
     "--kv-transfer-config: kv_connector 'NixlConnector' is not a kvbridge connector"),
    ('{"kv_role": "kv_both"}', [], "--kv-transfer-config: kv_connector is missing"),
    ('{"kv_connector": "KVBridgeConnector", "kv_role": "producer"}', [],
     "kv_role must be one of kv_producer, kv_consumer, kv_both"),
    ('{"kv_connector": "KVBridgeConnector", "kv_connector_extra_config": [1]}', [],
     "kv_connector_extra_config must be a JSON object"),
    ('{"kv_connector": "KVBridgeConnector"}', ["--connector", "KVBridgeShmConnector"],
     "drop --connector and --extra-config"),
], ids=["not-kvbridge", "no-connector", "bad-role", "extra-not-object", "both"])
def test_kv_transfer_config_errors_name_the_key(ktc: str, extra: list[str], message: str) -> None:
    for command in ("config", "doctor"):
        res = kvbridge(command, "--kv-transfer-config", ktc, *extra)
        assert res.returncode == 1 and message in res.stderr, (command, res.stderr)
        assert "Traceback" not in res.stderr
    assert "KVBridgeConnector, KVBridge" in kvbridge(
        "config", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}').stderr


def test_doctor_reads_the_connector_and_extra_config_of_kv_transfer_config() -> None:
    from kvbridge.tools.connector_args import connector_args

    ktc = '{"kv_connector": "KVBridgeLMCacheConnector", "kv_connector_extra_config": {"x": 1}}'
    args = cli.build_parser(["doctor"]).parse_args(["doctor", "--kv-transfer-config", ktc])
    named = connector_args(args)
    assert named.connector == "KVBridgeLMCacheConnector" and named.extra == {"x": 1}
    assert named.preset is not None and named.preset.tier == "lmcache"


def test_config_prints_the_configurations_warnings() -> None:
    res = kvbridge("config", env={"KVBRIDGE_MODEE": "push", "KVBRIDGE_CACHE_DIR": "/tmp/x"})
    assert res.returncode == 0, res.stderr
    assert "kvbridge: warning: unknown environment variable KVBRIDGE_MODEE 'modee'" in res.stderr
    assert "did you mean 'mode'?" in res.stderr and "CACHE_DIR" not in res.stderr
    res = kvbridge("config", "--json", env={"KVBRIDGE_MODEE": "push"})
    assert "KVBRIDGE_MODEE" in res.stderr and json.loads(res.stdout)["mode"]["value"] == "pull"


def test_config_says_engine_spin_ms_from_extra_config_is_not_applied() -> None:
    res = kvbridge("config", "--extra-config", '{"engine_spin_ms": 2}')
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("engine_spin_ms "))
    assert line.split()[1] == "-1.0" and "not applied" in line
    assert "KVBRIDGE_ENGINE_SPIN_MS" in res.stderr

@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--extra-config", '{"bakend": "x"}'], {}, "did you mean 'backend'?"),
        (["--extra-config", "{oops"], {}, "--extra-config is not valid JSON"),
        (["--extra-config", "[1]"], {}, "--extra-config must be a JSON object"),
        ([], {"KVBRIDGE_LEASE_S": "soon"}, "bad value for lease_s: 'soon'"),
        (["--connector", "KVBridgeNopeConnector"], {}, "no kvbridge connector is called"),
        (["--connector", "KVBridgeNixlConnector"], {"KVBRIDGE_BACKEND": "shm"},
         "selects backend 'nixl'"),
        (["--connector", "KVBridgeComposeConnector"], {}, "backend_options.members"),
        (["--extra-config", '{"mode": "pushh"}'], {}, "mode: 'pushh' from "
         "kv_connector_extra_config: expected one of pull, push, auto (did you mean 'push'?)"),
    ],
    ids=["unknown-key", "bad-json", "not-object", "bad-env", "unknown-connector",
         "connector-conflict", "compose-without-members", "bad-enum"],
)
def test_config_errors_are_one_line(args: list[str], env: dict[str, str], message: str) -> None:
    res = kvbridge("config", *args, env=env)
    assert res.returncode == 1
    assert res.stderr.startswith("kvbridge: error: ") and message in res.stderr
    assert "Traceback" not in res.stderr


# -- bench ----------------------------------------------------------------------------------------


def test_bench_transfer_shm_paired_checks_bytes_and_prints_ratio_intervals() -> None:
    res = kvbridge("bench", "transfer", "--backend", "shm", "--total-mib", "8",
                   "--block-kib", "16", "256", "--reps", "6")
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert "6 paired reps" in first and "95% CI" in first and "every byte checked" in first
    assert "load average" in first
    header = next(line for line in res.stdout.splitlines() if "kvb/memcpy" in line)
    assert header.split() == ["block", "op", "descs", "kvbridge", "memcpy", "raw", "kvb/memcpy",
                              "kvb/raw"]
    rows = [line.split() for line in res.stdout.splitlines()
            if " read " in line or " write " in line]
    assert [(r[0] + r[1], r[2]) for r in rows] == [("16KiB", "read"), ("16KiB", "write"),
                                                   ("256KiB", "read"), ("256KiB", "write")]
    for r in rows:  # kvb/memcpy and kvb/raw: "0.812 [0.75, 0.90]", a median in its interval
        for at in (7, 10):
            median, low, high = float(r[at]), float(r[at + 1].strip("[,")), float(
                r[at + 2].strip("]"))
            assert low <= median + 0.01 and median <= high + 0.01


def test_bench_transfer_shm_json_paired() -> None:
    res = kvbridge("bench", "transfer", "--backend", "shm", "--total-mib", "8", "--block-kib",
                   "64", "--reps", "7", "--confidence", "0.9", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["backend"] == "shm" and report["verified"] is True
    assert report["mode"] == "paired" and report["reps"] == 7 and report["confidence"] == 0.9
    assert report["total_bytes"] == 8 << 20 and len(report["load_average"]) == 2
    assert [(r["block_bytes"], r["op"]) for r in report["rows"]] == [(65536, "read"),
                                                                     (65536, "write")]
    for row in report["rows"]:
        assert row["descriptors"] == 128  # scattered: nothing coalesced
        assert row["kvbridge_gbps"] > 0 and row["memcpy_gbps"] > 0
        ci = row["vs_memcpy"]
        assert ci["n"] == 7 and ci["low"] <= ci["median"] <= ci["high"]
        assert row["ratio_memcpy"] == ci["median"]
        raw = row["vs_raw"]  # shm's raw column: process_vm_readv/writev alone
        assert row["raw_gbps"] > 0 and raw["low"] <= raw["median"] <= raw["high"]
        assert row["ratio_raw"] == raw["median"] and row["raw_error"] is None


def test_bench_transfer_sequential_is_best_of() -> None:
    res = kvbridge("bench", "transfer", "--backend", "shm", "--total-mib", "4", "--block-kib",
                   "256", "--op", "read", "--mode", "sequential", "--reps", "2", "--no-raw",
                   "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["mode"] == "sequential" and report["statistic"] == "best of reps"
    row = report["rows"][0]
    assert row["vs_memcpy"] is None
    assert row["ratio_memcpy"] == pytest.approx(row["kvbridge_gbps"] / row["memcpy_gbps"])
    assert row["raw_gbps"] is None  # --no-raw


def test_bench_transfer_pages_choices_are_the_benchs() -> None:
    """cli.py lists them without importing the bench (start-up time); they must agree."""
    from kvbridge.tools.bench import transfer as bench

    res = kvbridge("bench", "transfer", "--pages", "bogus")
    assert res.returncode == 2
    assert "choose from " + ", ".join(repr(p) for p in bench.PAGES) in res.stderr


@pytest.mark.parametrize("pages", ["small", "kvbridge"])
def test_bench_transfer_on_small_or_refaulted_pages_checks_every_byte(pages: str) -> None:
    res = kvbridge("bench", "transfer", "--backend", "shm", "--total-mib", "8", "--block-kib",
                   "256", "--reps", "2", "--no-raw", "--pages", pages, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["pages"] == pages and report["verified"] is True
    assert [r["op"] for r in report["rows"]] == ["read", "write"]
    assert all(r["kvbridge_gbps"] > 0 and r["memcpy_gbps"] > 0 for r in report["rows"])


def test_bench_transfer_shm_raw_column() -> None:
    res = kvbridge("bench", "transfer", "--backend", "shm", "--total-mib", "4", "--block-kib",
                   "64", "--op", "write", "--reps", "3")
    assert res.returncode == 0, res.stderr
    row = next(line.split() for line in res.stdout.splitlines() if " write " in line)
    assert float(row[5]) > 0 and row[-2].startswith("[")  # raw GB/s, kvb/raw interval


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "shn"], "did you mean 'shm'?"),
        (["--block-kib", "0"], "block size 0 bytes must be > 0"),
        (["--total-mib", "1", "--block-kib", "2048"], "at most the total"),
        (["--reps", "0"], "reps must be >= 1"),
        (["--options", "nope"], "--options is not valid JSON"),
        (["--confidence", "1.5"], "confidence must be in [0.5, 1)"),
    ],
    ids=["unknown-backend", "zero-block", "block-too-big", "zero-reps", "bad-options",
         "bad-confidence"],
)
def test_bench_transfer_bad_input(args: list[str], message: str) -> None:
    res = kvbridge("bench", "transfer", *args)
    assert res.returncode == 1, res.stdout
    assert res.stderr.startswith("kvbridge: error: ") and message in res.stderr


def test_bench_transfer_bad_mode() -> None:
    res = kvbridge("bench", "transfer", "--mode", "best")
    assert res.returncode == 2 and "invalid choice: 'best'" in res.stderr


def test_bench_descriptors_json() -> None:
    res = kvbridge("bench", "descriptors", "--reps", "3", "--backends", "shm", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["planes"] == 128 and report["blocks"] == 1024
    assert report["block_bytes"] == 16 * 8 * 128 * 2
    rows = {(r["case"], r["path"]): r for r in report["rows"]}
    assert sorted({p for _, p in rows}) == sorted(
        ["descriptor_pair", "+ submit checks", "blocks: validate", "shm: + iovecs"])
    for path in ("descriptor_pair", "+ submit checks", "blocks: validate", "shm: + iovecs"):
        assert rows[("scattered", path)]["descriptors"] == 128 * 1024
        assert rows[("contiguous", path)]["descriptors"] == 128
        assert rows[("scattered", path)]["native_median_ms"] is None
    r = rows[("scattered", "descriptor_pair")]
    assert 0 < r["median_ms"] <= r["p90_ms"]


@pytest.mark.nixl
def test_bench_descriptors_nixl_row() -> None:
    pytest.importorskip("nixl._api", reason="the nixl package is not installed")
    res = kvbridge("bench", "descriptors", "--reps", "2", "--layers", "4", "--tokens", "256",
                   "--backends", "nixl", env={"UCX_NET_DEVICES": "lo"})
    assert res.returncode == 0, res.stderr
    lines = [line.split() for line in res.stdout.splitlines() if "nixl:" in line]
    assert [(r[0], r[4]) for r in lines] == [("scattered", "128"), ("contiguous", "8")]
    assert all(float(r[-1]) > 0 for r in lines)  # NIXL's request creation was measured


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--num-blocks", "10"], "num_blocks 10 is below the 1024 blocks"),
     (["--backends", "rdma"], "--backends: unknown backend 'rdma'")],
    ids=["num-blocks", "backends"],
)
def test_bench_descriptors_bad_input(args: list[str], message: str) -> None:
    res = kvbridge("bench", "descriptors", *args)
    assert res.returncode == 1
    assert message in res.stderr


# -- parser and lazy subcommands (in process) -----------------------------------------------------


def test_help_lists_all_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in ("backends", "config", "bench", "proxy", "demo"):
        assert name in out


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["backends", "--bogus"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_bad_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--log-level", "loud", "backends"])
    assert info.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_log_level_is_taken_in_any_case_after_the_proxy_command_too() -> None:
    pytest.importorskip("aiohttp")
    from kvbridge.proxy import cli as proxy_cli

    engines = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    args = cli.build_parser(["proxy"]).parse_args(["proxy", *engines, "--log-level", "info"])
    assert args.log_level == "INFO"  # docs/proxy.md lists --log-level among the proxy's flags
    args = cli.build_parser(["proxy"]).parse_args(["--log-level", "debug", "proxy", *engines])
    assert args.log_level == "DEBUG"  # the proxy's own default does not override kvbridge's
    assert cli.build_parser(["proxy"]).parse_args(["proxy", *engines]).log_level == "WARNING"
    assert proxy_cli.build_parser().parse_args([*engines, "--log-level", "Error"]).log_level == (
        "ERROR")
    assert proxy_cli.build_parser().parse_args(engines).log_level == "INFO"
    for parser, argv in ((cli.build_parser(["proxy"]), ["proxy", *engines]),
                         (proxy_cli.build_parser(), engines)):
        with pytest.raises(SystemExit) as info:
            parser.parse_args([*argv, "--log-level", "loud"])
        assert info.value.code == 2


def test_proxy_mode_auto_is_the_planner_by_default_plan_its_other_name() -> None:
    pytest.importorskip("aiohttp")
    from kvbridge.proxy import cli as proxy_cli
    from kvbridge.proxy.routing import ProxyMode

    engines = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    parser = proxy_cli.build_parser()

    def mode(*extra: str) -> ProxyMode:
        return proxy_cli.settings_from_args(parser.parse_args([*engines, *extra])).mode

    assert mode() is ProxyMode.AUTO  # the default: the planner
    assert mode("--mode", "plan") is ProxyMode.AUTO
    assert mode("--mode", "headroom") is ProxyMode.HEADROOM  # what auto was before the planner
    assert {mode("--mode", m) for m in ("pull", "push", "local")} == {
        ProxyMode.PULL, ProxyMode.PUSH, ProxyMode.LOCAL}
    with pytest.raises(SystemExit):
        parser.parse_args([*engines, "--mode", "planner"])

def test_lazy_command_missing_module_gives_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ghost = cli.LazyCommand("ghost", "kvbridge_no_such_module_xyz.app", "a ghost", "pip install x")
    monkeypatch.setattr(cli, "LAZY_COMMANDS", (*cli.LAZY_COMMANDS, ghost))
    assert cli.main(["ghost", "--port", "1", "extra"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvbridge: error: `kvbridge ghost` is not available: ")
    assert "kvbridge_no_such_module_xyz" in err and "(install: pip install x)" in err


def test_lazy_command_loads_only_when_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "kvbridge_fake_cmd.py").write_text(textwrap.dedent("""
        LOADED = True

        def add_arguments(parser):
            parser.add_argument("--answer", type=int, required=True)

        def cli_main(args):
            print("answer", args.answer)
            return args.answer
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvbridge_fake_cmd", raising=False)
    fake = cli.LazyCommand("fake", "kvbridge_fake_cmd", "a fake command")
    monkeypatch.setattr(cli, "LAZY_COMMANDS", (*cli.LAZY_COMMANDS, fake))
    assert cli.main(["backends", "--json"]) == 0
    assert "kvbridge_fake_cmd" not in sys.modules
    capsys.readouterr()
    assert cli.main(["--log-level", "ERROR", "fake", "--answer", "7"]) == 7
    assert "answer 7" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["fake", "--answer", "1", "--bogus"])
    assert info.value.code == 2


def test_stats_reads_a_live_agent_and_fails_cleanly_when_nobody_answers() -> None:
    """`kvbridge stats` against a real agent process, then against a closed port."""
    from kvbridge.testing.agents import AgentProcess

    agent = AgentProcess("stats-engine", (1, 8, 16, 16))
    try:
        out = subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", "stats", agent.address,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        assert data["engine_id"] == "stats-engine" and data["pending"] == 0
    finally:
        agent.close()
    out = subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", "stats", agent.address,
                          "--timeout", "0.5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "no answer from" in out.stderr


@pytest.mark.parametrize("address", ["127.0.0.1", "http://127.0.0.1:8100"])
def test_stats_refuses_an_http_url_or_bare_host_with_a_clear_message(address: str) -> None:
    res = kvbridge("stats", address, "--timeout", "0.5")
    assert res.returncode == 1, res.stdout
    assert res.stderr.startswith("kvbridge: error: kvbridge stats: ")
    assert "tcp://HOST:PORT" in res.stderr and "Traceback" not in res.stderr


def test_help_imports_no_engine_or_cpu_meter_library() -> None:
    """``kvbridge --help`` imports the CLI's modules (the CPU meter among them) but not what
    their work needs: psutil, torch, vLLM."""
    code = ("import sys\nsys.argv = ['kvbridge', '--help']\nfrom kvbridge.tools.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(','.join(m for m in ('psutil', 'torch', 'vllm') if m in sys.modules), "
            "file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stderr.strip() == "", out.stderr

"""``kvbridge doctor``: the real checks on this host, and each way a deployment fails, forced.

The forced failures use the real check functions against real configurations; only the probe a
failure needs (the ptrace scope, vLLM's import, a plugin's entry point) is replaced, or the
condition is made real (a port really bound).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from kvbridge import registry
from kvbridge.config import Config
from kvbridge.tools.doctor import checks as doctor_checks
from kvbridge.tools.doctor import probes
from kvbridge.tools.doctor import run as doctor_run
from kvbridge.tools.doctor.target import Check, Status, Target

pytestmark = [pytest.mark.timeout(300)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    return subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=240, env=env)


def _target(extra: dict[str, Any] | None = None, tp: int = 1) -> Target:
    return Target.of(Config.load(extra or {}, env={}), tp)


def _one(out: Check | list[Check]) -> Check:
    return out if isinstance(out, Check) else out[0]


def test_this_host_passes_and_json_is_one_object_per_check() -> None:
    res = _cli("--json")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout)
    assert all(set(r) == {"check", "status", "detail"} for r in rows)
    by = {r["check"]: r for r in rows}
    assert by["shm cma"]["status"] == "ok"  # a real process_vm_readv against a child
    assert by["backend shm"]["status"] == "ok" and "used by this configuration" in by[
        "backend shm"]["detail"]
    assert by["vllm connectors"]["status"] == "ok"
    assert by["wake on arrival"]["status"] == "ok"  # this vLLM's idle sleep can be hooked
    assert by["security"]["status"] == "ok" and by["ports"]["status"] == "ok"
    assert {r["status"] for r in rows} <= {"ok", "warn", "skip"}


def test_routable_address_without_secret_fails_the_run() -> None:
    res = _cli("--extra-config", '{"side_channel_host": "10.1.2.3"}', "--width", "0")
    assert res.returncode == 1
    line = next(x for x in res.stdout.splitlines() if x.startswith("security"))
    assert "FAIL" in line and "KVBRIDGE_SECRET" in line


def test_security_levels() -> None:
    routable = _target({"side_channel_host": "10.1.2.3"})
    assert doctor_checks.check_security(routable).status is Status.FAIL
    assert doctor_checks.check_security(_target({"side_channel_host": "10.1.2.3",
                                                 "allow_insecure_control": True})
                                        ).status is Status.WARN
    assert doctor_checks.check_security(_target({"side_channel_host": "10.1.2.3",
                                                 "secret": "s3"})).status is Status.OK


def test_security_names_the_per_user_secret_and_refuses_an_unsafe_one(tmp_path: Path) -> None:
    path = tmp_path / "kv" / "secret"
    ok = doctor_checks.check_security(_target({"secret_file": str(path)}))
    assert ok.status is Status.OK and f"per-user secret {path}" in ok.detail
    assert path.read_bytes().strip().decode() not in ok.detail
    (tmp_path / "kv").chmod(0o755)
    bad = doctor_checks.check_security(_target({"secret_file": str(path)}))
    assert bad.status is Status.FAIL and str(tmp_path / "kv") in bad.detail
    insecure = doctor_checks.check_security(_target({"allow_insecure_control": True}))
    assert insecure.status is Status.WARN and "no secret at all" in insecure.detail


def test_a_bound_port_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        check = doctor_checks.check_ports(_target({"side_channel_port": port}))
        assert check.status is Status.FAIL and str(port) in check.detail
        # tp 2 checks port + 1 too
        check = doctor_checks.check_ports(_target({"side_channel_port": port - 1}, tp=2))
        assert check.status is Status.FAIL and str(port) in check.detail
    top = _target({"side_channel_port": 65535}, tp=2)
    assert doctor_checks.check_ports(top).status is Status.FAIL


def test_a_host_that_is_not_ours_fails_once_with_the_right_fix() -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this host
    for port in (0, 5600):
        check = doctor_checks.check_ports(_target({"side_channel_host": "192.0.2.1",
                                                   "side_channel_port": port}, tp=2))
        assert check.status is Status.FAIL, check.detail
        assert check.detail.count("not an address of this host") == 1
        assert "KVBRIDGE_SIDE_CHANNEL_HOST" in check.detail and "ss -ltnp" not in check.detail


@pytest.mark.parametrize("scope, status", [(0, Status.OK), (1, Status.OK), (3, Status.FAIL)])
def test_ptrace_scope(monkeypatch: pytest.MonkeyPatch, scope: int, status: Status) -> None:
    monkeypatch.setattr(probes, "read_ptrace_scope", lambda *a: scope)
    monkeypatch.setattr(probes, "has_cap_sys_ptrace", lambda: False)
    check = _one(doctor_checks.check_ptrace_scope(_target()))
    assert check.status is status, check.detail


@pytest.mark.parametrize("mode, huge, status, says", [
    ("madvise", True, Status.OK, "moves CPU KV caches onto huge pages"),
    ("madvise", False, Status.WARN, "KVBRIDGE_HUGE_PAGES=1"),
    ("never", True, Status.WARN, "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"),
    ("always", True, Status.OK, "get huge pages"),
    ("", True, Status.SKIP, "no transparent huge pages"),
])
def test_huge_pages(monkeypatch: pytest.MonkeyPatch, mode: str, huge: bool, status: Status,
                    says: str) -> None:
    monkeypatch.setattr(doctor_checks.hugepages, "thp_mode", lambda: mode)
    monkeypatch.setattr(doctor_checks.hugepages, "thp_disabled_here", lambda: False)
    check = _one(doctor_checks.check_huge_pages(_target({"huge_pages": huge})))
    assert check.status is status and says in check.detail, check.detail


def test_huge_pages_disabled_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_checks.hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(doctor_checks.hugepages, "thp_disabled_here", lambda: True)
    check = _one(doctor_checks.check_huge_pages(_target()))
    assert check.status is Status.WARN and "PR_SET_THP_DISABLE" in check.detail


def test_mapped_copies_here_and_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.transports.shm import rangecopy as _rangecopy

    if _rangecopy.load() is None:
        pytest.skip("range copy not built here (no C compiler at install)")
    check = _one(doctor_checks.check_mapped_copies(_target({"backend": "shm"})))
    assert check.status is Status.OK and "range copy installed" in check.detail, check.detail
    monkeypatch.setattr(_rangecopy, "load", lambda: None)
    check = _one(doctor_checks.check_mapped_copies(_target({"backend": "shm"})))
    assert check.status is Status.WARN and "not built" in check.detail, check.detail
    off = _target({"backend": "shm", "map_kv_cache": False})
    check = _one(doctor_checks.check_mapped_copies(off))
    assert check.status is Status.WARN and "KVBRIDGE_MAP_KV_CACHE=1" in check.detail


def _broken_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry._entry_points

    def fake(group: str = registry.GROUP) -> dict[str, Any]:
        eps = dict(real(group))
        if group == registry.GROUP:
            eps["nixl"] = EntryPoint("nixl", "kvbridge_no_such_nixl_xyz:T", group)
        return eps

    monkeypatch.setattr(registry, "_entry_points", fake)


def test_a_broken_backend_fails_only_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _broken_backend(monkeypatch)
    unused = {c.name: c for c in doctor_checks.check_backends(_target())}
    assert unused["backend nixl"].status is Status.WARN
    assert "not used by this configuration" in unused["backend nixl"].detail
    used = {c.name: c for c in doctor_checks.check_backends(_target({"backend": "nixl"}))}
    assert used["backend nixl"].status is Status.FAIL
    assert "install" in used["backend nixl"].detail
    composed = {c.name: c for c in doctor_checks.check_backends(_target(
        {"backend": "compose", "backend_options": {"members": ["shm", "nixl"]}}))}
    assert composed["backend nixl"].status is Status.FAIL


def test_vllm_missing_is_a_failure_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_vllm() -> Any:
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(doctor_checks, "import_vllm_integration", no_vllm)
    lines = doctor_checks.check_vllm(_target())
    assert lines[0].status is Status.FAIL and "pip install" in lines[0].detail
    assert lines[1].status is Status.SKIP


def test_wake_on_arrival_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbridge.integrations import vllm_idle

    assert _one(doctor_checks.check_wake(_target({"wake_on_arrival": False}))).status is Status.SKIP
    monkeypatch.setattr(vllm_idle, "installable", lambda: "vLLM has no EngineCoreProc")
    line = _one(doctor_checks.check_wake(_target()))
    assert line.status is Status.WARN and "vLLM has no EngineCoreProc" in line.detail
    assert "polling" in line.detail


def test_a_check_that_crashes_becomes_a_fail_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(t: Target) -> Check:
        raise RuntimeError("surprise")

    monkeypatch.setattr(doctor_run, "CHECKS",
                        (("exploding", boom), ("python", doctor_checks.check_python)))
    checks = doctor_run.run_checks(Config.load({}, env={}))
    assert checks[0] == Check("exploding", Status.FAIL,
                              "the check itself failed: RuntimeError: surprise")
    assert checks[1].status is Status.OK and doctor_run.failed(checks)


def test_a_bad_configuration_is_the_first_line() -> None:
    checks = doctor_run.diagnose({"backend": "compose"}, env={})
    assert checks[0].name == "config" and checks[0].status is Status.FAIL
    assert "backend_options.members" in checks[0].detail
    with pytest.raises(Exception, match="tp must be"):
        doctor_run.run_checks(Config.load({}, env={}), tp=0)


def test_unknown_connector_is_a_usage_error() -> None:
    res = _cli("--connector", "KVBridgeNopeConnector")
    assert res.returncode == 1 and "no kvbridge connector is called" in res.stderr


def test_the_table_wraps_its_detail_column_to_the_width() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}
    code = ("import sys; from kvbridge.tools.doctor import run; "
            "from kvbridge.tools.doctor.target import Check, Status; "
            "run.diagnose = lambda *a, **k: [Check('tier lmcache', Status.WARN, 'x ' * 200)]; "
            "from kvbridge.tools import cli; sys.exit(cli.main(['doctor', *sys.argv[1:]]))")
    for args, width in (([], 100), (["--width", "72"], 72)):
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                             timeout=120, env={**env, "COLUMNS": ""})
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert max(len(line) for line in lines) <= width and len(lines) > 4, res.stdout

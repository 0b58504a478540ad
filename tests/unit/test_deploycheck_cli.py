"""The README's Kubernetes check, ``python -m kvbridge.tools.deploycheck.k8s OVERLAY``, works on
a fresh clone: no ``secret.env`` written yet (a placeholder secret, and a note saying so) and no
vLLM (its serve flags are read by :mod:`kvbridge.tools.deploycheck.serve_args`; ``--vllm`` asks
for vLLM's own parser). The fleet checks themselves are tests/process/test_deploy.py's."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from kvbridge.tools.deploycheck import k8s
from kvbridge.tools.deploycheck.serve_args import parse_serve_args

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("1p1d", "8p2d")


@pytest.fixture()
def fresh(tmp_path: Path) -> Path:
    """deploy/k8s as a fresh clone has it: no secret.env anywhere."""
    root = tmp_path / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", root)
    for stale in root.rglob("secret.env"):
        stale.unlink()
    return root


def test_the_documented_command_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python -m kvbridge.tools.deploycheck.k8s deploy/k8s/overlays/8p2d" in readme


def test_a_fresh_clone_checks_ok_without_vllm(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # any import of vLLM fails
    assert k8s.main([str(fresh / "overlays" / o) for o in OVERLAYS]) == 0
    out = capsys.readouterr().out.splitlines()
    for o in OVERLAYS:
        overlay = fresh / "overlays" / o
        assert f"{overlay}: note: {overlay / 'secret.env'} does not exist, checked with a " \
               "placeholder KVBRIDGE_SECRET; write it before kubectl apply -k (docs/deploy.md, " \
               "the secret)" in out
        assert any(line.startswith(f"{overlay}: ok (9 objects") for line in out)
    assert not any((fresh / "overlays" / o / "secret.env").exists() for o in OVERLAYS)


def test_a_written_secret_env_is_used_and_no_note(fresh: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    overlay = fresh / "overlays" / "1p1d"
    (overlay / "secret.env").write_text("KVBRIDGE_SECRET=" + "ab" * 32 + "\n")
    assert k8s.main([str(overlay)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_problems_are_still_found_without_vllm(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    prefill = fresh / "base" / "prefill.yaml"
    prefill.write_text(prefill.read_text().replace('"kv_role": "kv_producer"',
                                                   '"kv_role": "kv_consumer"'))
    assert k8s.main([str(fresh / "overlays" / "1p1d")]) == 1
    assert "kv_role 'kv_consumer', a prefill engine needs 'kv_producer'" in \
        capsys.readouterr().out


def test_the_light_serve_parser() -> None:
    ns = parse_serve_args(["MODEL", "--port", "8100", "-tp", "2", "--enforce-eager",
                           "--middleware", "a.B", "--kv-transfer-config",
                           '{"kv_connector": "KVBridgeConnector", "kv_role": "kv_consumer"}'])
    assert (ns.model, ns.port, ns.tensor_parallel_size, ns.pipeline_parallel_size,
            ns.middleware) == ("MODEL", 8100, 2, 1, ["a.B"])
    ktc = ns.kv_transfer_config
    assert (ktc.kv_connector, ktc.kv_role, ktc.kv_connector_extra_config) == (
        "KVBridgeConnector", "kv_consumer", {})
    assert ktc.engine_id and ktc.engine_id != parse_serve_args(
        ["--kv-transfer-config", "{}"]).kv_transfer_config.engine_id  # a new UUID each, as vLLM
    for argv, message in ((["--port", "x"], "--port: invalid int value"),
                          (["--kv-transfer-config", "[1]"], "a JSON object is needed"),
                          (["--kv-transfer-config", "{"], "not JSON"),
                          (["--kv-transfer-config", '{"kv_role": "kv_sideways"}'],
                           "kv_role 'kv_sideways' is not one of")):
        with pytest.raises(ValueError, match="vllm serve: error: .*" + message):
            parse_serve_args(argv)

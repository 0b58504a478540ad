"""``kvbridge demo`` end to end against stand-in engines (fast; no vLLM).

The stand-in speaks the HTTP API the demo and the proxy use (health, models, completions with
``return_token_ids``, streaming, the proxy's probe, ``kv_transfer_params`` hand-back), and its
greedy output is a pure function of the prompt, so the demo's real proxies, client threads,
checks, report and teardown are all exercised for real.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("transformers")

from kvbridge.tools import demo

pytestmark = pytest.mark.timeout(180)

_FAKE = textwrap.dedent(
    """
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    kv = {}
    if "--kv-transfer-config" in args:
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    role = kv.get("kv_role", "plain")
    print("pid", os.getpid(), "role", role, flush=True)

    def greedy(prompt, n):
        return [(sum(prompt) * 7 + i * 13) % 1000 + 4 for i in range(n)]

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a):
            pass
        def _json(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/v1/models":
                return self._json({"data": [{"id": "tiny"}]})
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            params = body.get("kv_transfer_params") or {}
            if params.get("kvbridge_probe"):
                return self._json({"choices": [{"text": "", "token_ids": [5]}],
                                   "kv_transfer_params": {"remote_engine_id": "fake-P",
                                   "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1}})
            out = greedy(body["prompt"], body["max_tokens"])
            if params.get("transfer_mode") == "push" and os.environ.get("FAKE_WRONG_PUSH"):
                out = [t + 1 for t in out]
            back = None
            if params.get("do_remote_decode"):
                back = {"do_remote_prefill": True, "remote_engine_id": "fake-P",
                        "transfer_id": params.get("transfer_id"), "remote_block_ids": [1]}
            if not body.get("stream"):
                return self._json({"choices": [{"text": "x", "token_ids": out}],
                                   "kv_transfer_params": back})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for t in out:
                c = {"choices": [{"text": "x", "token_ids": [t], "finish_reason": None}]}
                self.wfile.write(b"data: " + json.dumps(c).encode() + b"\\n\\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\\n\\n")
            self.wfile.flush()
            self.close_connection = True
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake_engine.py"
    script.write_text(_FAKE)
    wrapper = tmp_path / "fakepython"
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model") / "tiny"


def _args(fake_python: str, model_dir: Path, work: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(
        ["--engine-python", fake_python, "--model-dir", str(model_dir), "--work-dir", str(work),
         "--requests", "3", "--concurrency", "2", "--prompt-len", "16", "--max-tokens", "4",
         "--engine-timeout", "60", "--request-timeout", "20", *extra]
    )  # fmt: skip


def _engine_pids(work: Path) -> list[int]:
    pids = []
    for log in work.glob("*.log"):
        for line in log.read_text().splitlines():
            if line.startswith("pid "):
                pids.append(int(line.split()[1]))
    return pids


def _all_gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_demo_pass(
    fake_python: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    rc = demo.main(_args(fake_python, model_dir, work))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS: 21/21 outputs equal the single-engine reference" in out
    for mode in ("pull", "push", "auto"):
        for phase in ("warm-up", "sequential", "concurrent"):
            assert f"{mode:<4}  {phase}" in out, out
    # auto is the planner: every one of its 7 requests went down some path (D alone included)
    chose = re.search(r"auto chose: (.*)", out)
    assert chose, out
    counts = dict(part.rsplit(" ", 1) for part in chose.group(1).split(", "))
    assert set(counts) <= {"local", "push", "pull"} and sum(map(int, counts.values())) == 7, out
    assert "TTFT p50 ms" in out and "shutting down" in out
    pids = _engine_pids(work)
    assert len(pids) == 2 and _all_gone(pids)
    assert (work / "prefill.log").exists()  # --work-dir given: never deleted


def test_demo_headroom_mode(
    fake_python: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--modes headroom: the rule auto was before the planner; 2 in flight is under the default
    --push-headroom of 4, so every request is pushed."""
    rc = demo.main(_args(fake_python, model_dir, tmp_path / "work", "--modes", "headroom"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS: 7/7 outputs equal the single-engine reference" in out
    assert "headroom chose: push 7" in out, out


def test_demo_reports_mismatch(
    fake_python: str,
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_WRONG_PUSH", "1")
    work = tmp_path / "work"
    rc = demo.main(_args(fake_python, model_dir, work, "--modes", "pull", "push"))
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "FAIL: 7/14 outputs" in out
    assert "push/warm-up prompt #7: output differs from the reference at token 0" in out
    assert "engine logs kept in" in out
    assert _all_gone(_engine_pids(work))


def test_demo_no_connector(
    fake_python: str, model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    rc = demo.main(_args(fake_python, model_dir, work, "--no-connector"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "direct-D" in out and "PASS: 3/3" in out
    assert "role plain" in (work / "prefill.log").read_text()
    assert _all_gone(_engine_pids(work))


def test_demo_engine_failure_is_reported(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "brokenpython"
    broken.write_text("#!/bin/sh\necho 'cannot start: broken engine' >&2\nexit 7\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    rc = demo.main(_args(str(broken), model_dir, tmp_path / "w"))
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL: engine" in out and "cannot start: broken engine" in out


def test_bad_flags() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.main(parser.parse_args(["--requests", "0"])) == 2
    assert demo.main(parser.parse_args(["--max-tokens", "1"])) == 2
    assert demo.main(parser.parse_args(["--prompt-len", "1020"])) == 2

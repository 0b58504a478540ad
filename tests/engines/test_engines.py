"""Engine process management: a fake engine (fast) and ONE real vLLM engine (marked ``vllm``)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbridge.tools.client import complete, output_token_ids, stream_complete
from kvbridge.tools.engines import (
    GUARD_MIDDLEWARE,
    EngineError,
    VllmServer,
    free_port,
    start_servers,
)

# A stand-in for `python -m kvbridge.integrations.vllm_serve serve ...`: it parses --port,
# forks a grandchild that ignores SIGTERM (so stop() must escalate to SIGKILL for the group),
# and serves /health and /v1/completions after an optional delay.
_FAKE_ENGINE = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = os.environ.get("FAKE_MODE", "ok")
    print("fake engine", args, flush=True)
    if mode == "die":
        print("boom: fake failure", flush=True)
        sys.exit(3)
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def do_POST(self):
            if self.path != "/v1/completions":
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            out = [t + 1 for t in body["prompt"][: body["max_tokens"]]]
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for t in out:
                    c = {"choices": [{"text": "x", "token_ids": [t], "finish_reason": None}]}
                    self.wfile.write(b"data: " + json.dumps(c).encode() + b"\\n\\n")
                    self.wfile.flush()
                    time.sleep(0.01)
                self.wfile.write(b"data: [DONE]\\n\\n")
                return
            data = json.dumps({"choices": [{"text": "x", "token_ids": out}],
                               "kv_transfer_params": body.get("kv_transfer_params")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "fake_engine.py"
    script.write_text(_FAKE_ENGINE)
    wrapper = tmp_path / "fakepython"
    # Drop "-m kvbridge.integrations.vllm_serve" and run the fake with the remaining args.
    wrapper.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
def test_free_port() -> None:
    """Outside the ephemeral range, so no client connection is handed it before the server
    binds it; bindable; and not the same port every time."""
    from kvbridge.tools.engines import _ephemeral_range

    low, _ = _ephemeral_range()
    ports = {free_port() for _ in range(8)}
    assert len(ports) > 1
    for p in ports:
        assert (10000 <= p < low) if low > 11000 else (1024 <= p < 65536)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.timeout(60)
def test_fake_engine_lifecycle(fake_python: str, tmp_path: Path) -> None:
    s = VllmServer(
        "/no/model", python=fake_python, cpu_bind="0", log_path=tmp_path / "e.log",
        env={"FAKE_DELAY": "1"}, kv_transfer_config={"kv_role": "kv_producer"},
    )  # fmt: skip
    cmd = s.command()
    assert cmd[1:5] == ["-m", "kvbridge.integrations.vllm_serve", "serve", "/no/model"]
    assert "--enforce-eager" in cmd and "--kv-transfer-config" in cmd
    assert s.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    try:
        s.start().wait_ready(timeout=30, interval=0.2)
        assert s.port > 0 and s.pid is not None
        r = complete(s.url, [5, 6, 7], 2, kv_transfer_params={"a": 1}, timeout=10)
        assert output_token_ids(r) == [6, 7]
        assert r["kv_transfer_params"] == {"a": 1}
        st = stream_complete(s.url, [1, 2, 3], 3, timeout=10)
        assert st.token_ids == [2, 3, 4] and st.chunks == 3
        assert st.ttft is not None and st.tpot is not None and st.total >= st.ttft
        folded = complete(s.url, [1, 2], 2, stream=True, timeout=10)
        assert output_token_ids(folded) == [2, 3] and folded["timing"]["ttft"] is not None
        with pytest.raises(EngineError, match="HTTP 404"):
            complete(s.url + "/nothing", [1], 1, timeout=5)
    finally:
        t0 = time.monotonic()
        s.stop(grace=1.0)  # the grandchild ignores SIGTERM: this needs the SIGKILL path
    assert time.monotonic() - t0 < 10
    assert s.pid is not None and _gone(s.pid)
    assert s.proc is not None
    assert s.stop() == s.proc.returncode  # idempotent
    assert "fake engine" in (tmp_path / "e.log").read_text()


@pytest.mark.timeout(60)
def test_pin_cpus_restricts_the_whole_process_tree(fake_python: str, tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    s = VllmServer("/no/model", python=fake_python, cpu_bind=str(core), pin_cpus=True,
                   env={"FAKE_DELAY": "1"}, log_path=tmp_path / "e.log", stop_grace=0.5)
    try:
        s.start().wait_ready(timeout=30, interval=0.2)
        assert s.pid is not None
        group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == s.pid]
        assert len(group) >= 2  # the leader and the grandchild it forked
        assert all(os.sched_getaffinity(pid) == {core} for pid in group)
    finally:
        s.stop()
    assert VllmServer("/m", cpu_bind="0-2,5").cpus() == {0, 1, 2, 5}
    for bad in (None, "0|1", "x"):
        with pytest.raises(EngineError, match="cannot pin"):
            VllmServer("/m", cpu_bind=bad, pin_cpus=True)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.timeout(60)
def test_guard_middleware_on_the_command_line() -> None:
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both"}
    cmd = VllmServer("/m", kv_transfer_config=kv, extra_args=["--seed", "1"]).command()
    i = cmd.index("--middleware")
    assert cmd[i + 1] == GUARD_MIDDLEWARE == "kvbridge.integrations.vllm_http.KVTransferParamsGuard"
    assert cmd.count("--middleware") == 1 and cmd[-2:] == ["--seed", "1"]
    assert cmd[cmd.index("--kv-transfer-config") + 1] == json.dumps(kv)
    # the named class exists and is importable the way vLLM imports it
    module, name = GUARD_MIDDLEWARE.rsplit(".", 1)
    assert isinstance(getattr(importlib.import_module(module), name), type)
    assert "--middleware" not in VllmServer("/m", kv_transfer_config=kv, guard=False).command()
    assert "--middleware" not in VllmServer("/m").command()  # no connector: nothing to guard
    assert VllmServer("/m", guard=False).command() == VllmServer("/m").command()


@pytest.mark.timeout(60)
def test_engine_death_reports_log(fake_python: str) -> None:
    s = VllmServer("/no/model", python=fake_python, env={"FAKE_MODE": "die"}, stop_grace=0.5)
    with pytest.raises(EngineError, match="boom: fake failure"):
        start_servers([s], timeout=30, interval=0.2)
    assert s.pid is not None and _gone(s.pid)


@pytest.mark.timeout(60)
def test_start_servers_timeout_stops_all(fake_python: str) -> None:
    a = VllmServer("/m", python=fake_python, name="a", stop_grace=0.5)
    b = VllmServer("/m", python=fake_python, name="b", env={"FAKE_DELAY": "60"}, stop_grace=0.5)
    seen: list[list[bool]] = []
    with pytest.raises(EngineError, match="not ready after"):
        start_servers([a, b], timeout=3, interval=0.2, progress_every=0.5,
                      progress=lambda t, r: seen.append(r))  # fmt: skip
    assert seen and seen[-1] == [True, False]
    for s in (a, b):
        assert s.pid is not None and _gone(s.pid)


# -- one real vLLM engine --------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(420)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_real_vllm_engine_greedy(tmp_path: Path) -> None:
    from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

    model = build_tiny_model(tmp_path / "tiny")
    s = VllmServer(model, cpu_bind="0", log_path=tmp_path / "vllm.log")
    try:
        s.start().wait_ready(timeout=300, interval=2.0)
        prompt = random_prompts(1, 40, seed=7)[0]
        extra = {"ignore_eos": True}
        r1 = complete(s.url, prompt, 16, extra=extra, timeout=60)
        r2 = complete(s.url, prompt, 16, extra=extra, timeout=60)
        ids1, ids2 = output_token_ids(r1), output_token_ids(r2)
        assert ids1 is not None and len(ids1) == 16, r1
        assert ids1 == ids2
        st = stream_complete(s.url, prompt, 16, extra=extra, timeout=60)
        assert st.token_ids == ids1
        assert st.ttft is not None and st.tpot is not None
        text = complete(s.url, "hello world the capital of france is", 4, timeout=60)
        assert output_token_ids(text) is not None
    finally:
        s.stop()
    assert s.pid is not None and _gone(s.pid)
    # this tier runs the worker inside the engine core (tests/engines/conftest.py): no worker
    # process of its own was started (the CPU default, mp, names one "VllmWorker-0")
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert "Starting to load model" in log
    assert "VllmWorker-" not in log

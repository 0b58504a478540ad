"""``kvbridge bench mix`` against a stand-in OpenAI streaming server (no vLLM engines).

The stand-in is a small aiohttp server on 127.0.0.1 (port 0, its own event-loop thread) that
answers streamed ``/v1/completions`` with token ids computed from the prompt, records the
``X-KVBridge-Mode`` header and ``cache_salt`` of every request, answers ``X-KVBridge-Plan`` to
``plan`` requests, and can be told to corrupt one token (push, one request) or refuse one request
(pull, HTTP 503): the replay must count exactly that one mismatch and that one failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvbridge.tools.bench.mix import MODE_HEADER, PLAN_HEADER, cache_salt, format_rate, run_rate
from kvbridge.tools.bench.mix_tier import SlowTier, flips
from kvbridge.tools.bench.mix_workload import DISK_SHARES, generate_trace

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SEED, RATE, N = 5, 40.0, 24


def _answer(prompt: list[int], max_tokens: int) -> list[int]:
    return [4 + (sum(prompt) * 31 + j * 7) % 1000 for j in range(max_tokens)]


class FakeServer:
    """Streams deterministic tokens; ``corrupt``/``refuse``: (policy, prompt) to spoil."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.corrupt: tuple[str, tuple[int, ...]] | None = None
        self.refuse: tuple[str, tuple[int, ...]] | None = None
        self.tiers_off = False
        """plan answers say ``tiers=off`` (a planner that left a slow tier out)."""
        self.in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        policy = request.headers.get(MODE_HEADER, "")
        prompt = tuple(body["prompt"])
        self.seen.append({"mode": policy, "salt": body.get("cache_salt"), "prompt": prompt,
                          "stream": body.get("stream")})
        if self.refuse == (policy, prompt):
            return web.json_response({"error": {"message": "busy"}}, status=503)
        headers = {"Content-Type": "text/event-stream"}
        if policy == "auto":
            path = "local" if len(prompt) < 100 else "push"
            off = "tiers=off; " if self.tiers_off else ""
            headers[PLAN_HEADER] = f"path={path}; est_ms=1.5;local=1.5 ; {off}why=fastest"
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        self.in_flight += 1
        try:
            ids = _answer(list(prompt), body["max_tokens"])
            if self.corrupt == (policy, prompt):
                ids[-1] += 1
            for tok in ids:
                chunk = {"choices": [{"index": 0, "text": f"t{tok} ", "token_ids": [tok],
                                      "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self.in_flight -= 1
        return resp

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def close(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer().start()
    try:
        yield server
    finally:
        server.close()


def _whole(run: dict[str, Any]) -> dict[str, Any]:
    rows = run["rows"]
    assert rows[-1]["class"] == "all"
    return dict(rows[-1])


def test_every_policy_replays_the_trace_and_one_spoilt_answer_is_counted(
        fake: FakeServer) -> None:
    trace = generate_trace(N, RATE, SEED)
    spoilt = trace.requests[5]
    fake.corrupt = ("push", spoilt.prompt)
    fake.refuse = ("pull", trace.requests[2].prompt)
    entry = run_rate(fake.url, trace, ["push", "pull", "local", "auto"], ttft_slo_ms=5000,
                     tpot_slo_ms=1000)
    runs = {r["policy"]: r for r in entry["policies"]}
    assert [r["policy"] for r in entry["policies"]] == ["local", "push", "pull", "auto"]

    # the very same prompts, with each policy's header and salt, and nothing else
    for policy in runs:
        got = [s for s in fake.seen if s["mode"] == policy]
        assert sorted(s["prompt"] for s in got) == sorted(r.prompt for r in trace.requests)
        assert {s["salt"] for s in got} == {cache_salt(policy, SEED, RATE)}
        assert all(s["stream"] is True for s in got)
    assert len(fake.seen) == 4 * N
    assert len({cache_salt(p, SEED, RATE) for p in runs}) == 4

    counts = trace.counts()
    for run in runs.values():
        assert {r["class"]: r["count"] for r in run["rows"][:-1]} == counts
        assert _whole(run)["count"] == N
        assert len(run["requests"]) == N
    local, push, pull, plan = (_whole(runs[p]) for p in ("local", "push", "pull", "auto"))
    assert local["mismatches"] is None and local["failures"] == 0
    assert push["mismatches"] == 1 and push["failures"] == 0
    bad = [r for r in runs["push"]["rows"] if r["mismatches"]]
    assert [(r["class"], r["mismatches"]) for r in bad] == [(spoilt.klass, 1), ("all", 1)]
    assert [o["index"] for o in runs["push"]["requests"] if o["mismatch"]] == [spoilt.index]
    assert pull["failures"] == 1 and pull["mismatches"] == 0
    assert "503" in next(o["error"] for o in runs["pull"]["requests"] if not o["ok"])
    assert plan["mismatches"] == 0 and sum(plan["paths"].values()) == N
    assert set(plan["paths"]) <= {"local", "push"} and push["paths"] == {}
    for o in runs["local"]["requests"]:
        assert o["ok"] and o["ttft_s"] > 0 and o["e2e_s"] >= o["ttft_s"]
        assert o["tokens"] == trace.requests[o["index"]].max_tokens and o["tpot_s"] > 0
    assert local["goodput_rps"] > 0 and local["slo_met"] == N
    assert fake.in_flight == 0

    text = format_rate(entry)
    assert "mismatch" in text and "ref" in text


def test_on_send_runs_before_each_request_in_order_and_the_flips_are_read_back(
        fake: FakeServer) -> None:
    """The slow-tier schedule's hook runs once per request, in trace order, before the request
    reaches the server; a server whose plans leave the tier out exactly while it is slow gives
    a flip at the window's first disk request and back at the first one after it."""
    trace = generate_trace(40, RATE, SEED, shares=DISK_SHARES)
    slow = SlowTier(10, 800.0, 15)
    sent: list[tuple[int, int]] = []

    def on_send(index: int) -> None:
        sent.append((index, len(fake.seen)))  # before the request reached the server
        if slow.delay_before(index) is not None:
            fake.tiers_off = slow.slow(index)

    entry = run_rate(fake.url, trace, ["auto"], ttft_slo_ms=5000, tpot_slo_ms=1000,
                     on_send=on_send)
    assert [i for i, _ in sent] == list(range(40))
    assert all(seen <= i for i, seen in sent)
    got = flips(entry["policies"][0]["requests"], slow)
    disk = [r.index for r in trace.requests if r.klass == "disk"]
    first_slow = next(i for i in disk if i >= 10)
    first_after = next(i for i in disk if i >= 25)
    assert got["flip_after"] == {"class_requests": 1, "requests": first_slow - 10 + 1,
                                 "index": first_slow}
    assert got["back_after"] == {"class_requests": 1, "requests": first_after - 25 + 1,
                                 "index": first_after}


def test_the_command_against_a_running_proxy_reports_and_exits(fake: FakeServer,
                                                               tmp_path: Path) -> None:
    trace = generate_trace(12, RATE, SEED)
    fake.corrupt = ("headroom", trace.requests[3].prompt)
    out = tmp_path / "mix.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "bench", "mix", "--proxy", fake.url,
         "--policies", "headroom,local", "--rates", f"{RATE:g},{2 * RATE:g}", "--num-requests",
         "12", "--seed", str(SEED), "--out", str(out)],
        capture_output=True, text=True, timeout=45, env=env)
    assert proc.returncode == 1, proc.stderr  # one mismatch: not clean
    assert "goodput (whole mix, req/s) against the rate" in proc.stdout
    report = json.loads(out.read_text())
    assert [e["rate"] for e in report["rates"]] == [RATE, 2 * RATE]
    for entry in report["rates"]:
        assert [r["policy"] for r in entry["policies"]] == ["local", "headroom"]
        assert _whole(entry["policies"][1])["mismatches"] == 1
    assert len(fake.seen) == 2 * 2 * 12
    assert fake.in_flight == 0


def test_a_bad_flag_is_named(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "backends")])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvbridge", "bench", "mix", "--proxy", "http://127.0.0.1:9",
         "--policies", "push,teleport"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 1 and "--policies" in proc.stderr

"""End to end on real vLLM engines: one P and one D with KVBridgeConnector, per backend.

The whole module runs once per transport backend (``shm``, ``nixl``, ``mooncake``; restrict with
``KVB_E2E_BACKENDS=shm,nixl``); a backend that cannot load here is skipped with its reason.

D's greedy output must equal a single engine's output for the same prompt, in pull, push and
headroom mode (push or pull by D's load), sequential and concurrent, and the KV must really have
moved (the agents' counters, read over the control channel, prove it; nothing was silently
recomputed); through auto (the planner) every path it can take gives that output too. The
engines start once per session (≈1–2 min on 2 cores) and are killed on teardown, also on failure.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge import params, registry
from kvbridge.config import TransferMode
from kvbridge.host.hugepages import thp_mode
from kvbridge.messages import StatsQuery, StatsReply
from kvbridge.scheduling import follow
from kvbridge.testing.clients import engine_client
from kvbridge.tools.client import complete, output_token_ids, probe
from kvbridge.tools.cpumeter import group_cpu
from kvbridge.tools.engines import WORKER_PROCESS_ENV, EngineError, VllmServer, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts
from kvbridge.transports.shm import rangecopy as _rangecopy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
LEASE_S = 6.0


@dataclass
class Cluster:
    p: VllmServer
    d: VllmServer
    proxies: ProxyThread
    p_ctl: str
    d_ctl: str
    refs: dict[tuple[int, ...], list[int]]
    backend: str = ""

    def stats(self, address: str) -> StatsReply:
        # generous: on a loaded 2-core host a busy engine process can be slow to answer
        client = engine_client(30.0)
        try:
            reply = client.request(address, StatsQuery())
        finally:
            client.close()
        assert isinstance(reply, StatsReply)
        return reply

    def reference(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.refs:
            out = output_token_ids(complete(self.p.url, prompt, MAX_TOKENS, extra=_GREEDY))
            assert out is not None
            self.refs[key] = out
        return self.refs[key]


_GREEDY = {"ignore_eos": True}


BACKENDS = [b for b in os.environ.get("KVB_E2E_BACKENDS", "shm,nixl,mooncake").split(",")
            if b]


def _connector(role: str, engine_id: str, backend: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"backend": backend, "lease_s": LEASE_S,
                                      "heartbeat_s": 2, "push_timeout_s": 30},
    }


def _control_address(url: str) -> str:
    ref = probe(url).peer(0)
    assert ref is not None
    return str(ref.address)


@pytest.fixture(scope="session", params=BACKENDS)
def cluster(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    backend = str(request.param)
    status = {s.name: s for s in registry.status()}
    if backend not in status or not status[backend].loadable:
        pytest.skip(f"backend {backend} unavailable: "
                    f"{status[backend].detail if backend in status else 'not installed'}")
    model = build_tiny_model()
    logs = tmp_path_factory.mktemp(f"logs-{backend}")
    # the CPU default, a worker process of its own (the rest of the tier runs it in the
    # engine core: tests/engines/conftest.py)
    env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2", **WORKER_PROCESS_ENV}
    args = ["--block-size", "32"]
    p = VllmServer(model, name="prefill",
                   kv_transfer_config=_connector("kv_producer", "e2e-P", backend), cpu_bind="0",
                   env=env, extra_args=args, log_path=logs / "prefill.log")
    # D runs a copy of the checkpoint in another directory, with other modification times:
    # the model identity is the content, so every hand-off below crosses copies
    d = VllmServer(str(shutil.copytree(model, logs / "model-copy",
                                       copy_function=shutil.copyfile)), name="decode",
                   kv_transfer_config=_connector("kv_consumer", "e2e-D", backend), cpu_bind="1",
                   env=env, extra_args=args, log_path=logs / "decode.log")
    proxies: ProxyThread | None = None
    try:
        start_servers([p, d], timeout=600)
        proxies = ProxyThread([p.url], [d.url], modes=("pull", "push", "headroom", "auto"),
                              push_headroom=2).start()
        yield Cluster(p, d, proxies, _control_address(p.url), _control_address(d.url), {},
                      backend)
    finally:
        if proxies is not None:
            proxies.close()
        p.stop()
        d.stop()


def _via(url: str, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(url, prompt, MAX_TOKENS, extra=_GREEDY, timeout=180))
    assert out is not None
    return out


def test_the_pairs_run_the_cpu_default_a_worker_process_each(cluster: Cluster) -> None:
    """The rest of the tier runs vLLM's worker inside the engine core (conftest.py): these pairs
    keep the CPU platform's default, so the connector's halves are tested in two processes."""
    for engine in (cluster.p, cluster.d):
        assert engine.log_path is not None
        assert "(VllmWorker-0 pid=" in engine.log_path.read_text(errors="replace")


# headroom, not auto: every request must hand off (the planner may choose D alone)
@pytest.mark.parametrize("mode", ["pull", "push", "headroom"])
def test_sequential_outputs_match_single_engine(cluster: Cluster, mode: str) -> None:
    seed = {"pull": 11, "push": 12, "headroom": 13}[mode]
    prompts = random_prompts(3, 150, seed=seed)  # 150 tokens = 5 blocks of 32
    refs = [cluster.reference(p) for p in prompts]
    before = cluster.stats(cluster.d_ctl).stats
    outs = [_via(cluster.proxies.urls[mode], p) for p in prompts]
    assert outs == refs
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == len(prompts)
    assert after.get("recv_failed", 0) == before.get("recv_failed", 0)
    moved = (after.get("pull_bytes", 0) + after.get("push_received_bytes", 0)
             - before.get("pull_bytes", 0) - before.get("push_received_bytes", 0))
    assert moved > 0
    if mode == "pull" and cluster.backend == "shm" and _rangecopy.load() is not None:
        # every range mapped: D digested each pull in the pass that copied it (issue 27)
        landed = after.get("pull_digested_landing", 0) - before.get("pull_digested_landing", 0)
        assert landed == len(prompts), (before, after)
    if mode == "push" and cluster.backend == "shm" and follow.available():
        # P's copy kept D's word: D hashed behind it (kvbridge.scheduling.follow)
        behind = after.get("push_digested_behind", 0) - before.get("push_digested_behind", 0)
        assert behind == len(prompts), (before, after)


def test_d_alone_and_the_planner_match_single_engine_and_a_held_prefix_moves_only_the_rest(
        cluster: Cluster) -> None:
    """Through the planner's proxy, every path it can take gives the single engine's output:
    D alone (no hand-off), push, pull, and the planner's own choice; and a conversation whose
    history D computed alone is then pushed with only its new blocks moving (D's prefix hit)."""
    if cluster.backend != "shm":  # the paths are the proxy's: one transport shows them
        pytest.skip("checked over shm")
    url = cluster.proxies.urls["auto"]
    prompts = random_prompts(3, 150, seed=41) + random_prompts(1, 20, seed=42)
    refs = [cluster.reference(p) for p in prompts]
    for mode in ("local", "push", "pull", "auto", "plan"):  # plan: auto's other name
        before = cluster.stats(cluster.d_ctl).stats
        outs = [output_token_ids(complete(url, p, MAX_TOKENS, timeout=180,
                                          extra={**_GREEDY, "cache_salt": f"plan-{mode}"},
                                          headers={"X-KVBridge-Mode": mode}))
                for p in prompts]
        assert outs == refs, mode
        after = cluster.stats(cluster.d_ctl).stats
        received = after.get("recv_ok", 0) - before.get("recv_ok", 0)
        if mode == "local":
            assert received == 0  # D alone: nothing handed off
        elif mode in ("push", "pull"):
            assert received == len(prompts)
    history = random_prompts(1, 160, seed=43)[0]  # 5 whole blocks of 32
    turn = history + random_prompts(1, 70, seed=44)[0]
    salt = {**_GREEDY, "cache_salt": "plan-conversation"}
    assert output_token_ids(complete(url, history, MAX_TOKENS, extra=salt, timeout=180,
                                     headers={"X-KVBridge-Mode": "local"})) \
        == cluster.reference(history)
    before = cluster.stats(cluster.d_ctl).stats
    assert output_token_ids(complete(url, turn, MAX_TOKENS, extra=salt, timeout=180,
                                     headers={"X-KVBridge-Mode": "push"})) \
        == cluster.reference(turn)
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == 1
    moved = after.get("push_received_bytes", 0) - before.get("push_received_bytes", 0)
    # the same 230 tokens under another salt: nothing held, all 8 blocks move
    assert output_token_ids(complete(url, turn, MAX_TOKENS, timeout=180,
                                     extra={**_GREEDY, "cache_salt": "plan-cold"},
                                     headers={"X-KVBridge-Mode": "push"})) \
        == cluster.reference(turn)
    whole = cluster.stats(cluster.d_ctl).stats.get("push_received_bytes", 0) \
        - after.get("push_received_bytes", 0)
    assert moved * 8 == whole * 3, (moved, whole)  # blocks 5-7 of 0-7: D held the history


def test_a_salted_request_is_handed_off_under_its_salt(cluster: Cluster) -> None:
    """``cache_salt`` is part of the prompt digest P and D compare: both legs carry the same
    salt (the proxy passes it, or sets it from the tenant header), so the hand-off works."""
    prompts = random_prompts(2, 150, seed=14)
    refs = [cluster.reference(p) for p in prompts]
    before = cluster.stats(cluster.d_ctl).stats
    outs = [output_token_ids(complete(cluster.proxies.urls[mode], p, MAX_TOKENS,
                                      extra={**_GREEDY, "cache_salt": "tenant-A"}, timeout=180))
            for mode, p in zip(("pull", "push"), prompts, strict=True)]
    assert outs == refs
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == 2
    assert after.get("recv_failed", 0) == before.get("recv_failed", 0)


def test_concurrent_push_and_pull_in_the_same_engines(cluster: Cluster) -> None:
    prompts = random_prompts(6, 200, seed=21)
    refs = [cluster.reference(p) for p in prompts]
    modes = ["pull", "push", "headroom"] * 2
    before = cluster.stats(cluster.d_ctl).stats
    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(_via, cluster.proxies.urls[m], p)
                for m, p in zip(modes, prompts, strict=True)]
        outs = [f.result(timeout=300) for f in futs]
    assert outs == refs
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("recv_ok", 0) - before.get("recv_ok", 0) == len(prompts)
    assert after.get("push_registered", 0) > before.get("push_registered", 0)
    assert after.get("pull_bytes", 0) > before.get("pull_bytes", 0)


def test_stock_toy_proxy_protocol_pull(cluster: Cluster) -> None:
    prompt = random_prompts(1, 100, seed=31)[0]
    ref = cluster.reference(prompt)
    p_resp = complete(cluster.p.url, prompt, 1, {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    params = p_resp["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    out = output_token_ids(complete(cluster.d.url, prompt, MAX_TOKENS, params, extra=_GREEDY))
    assert out == ref


def test_decode_leg_without_prefill_address_is_prefilled_locally(cluster: Cluster) -> None:
    """Malformed params never crash or hang D: it computes the prompt itself (and says so)."""
    prompt = random_prompts(1, 100, seed=35)[0]
    ref = cluster.reference(prompt)
    before = cluster.stats(cluster.d_ctl).stats
    out = output_token_ids(complete(cluster.d.url, prompt, MAX_TOKENS,
                                    {"do_remote_prefill": True, "transfer_mode": "pull"},
                                    extra=_GREEDY))
    assert out == ref
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("recv_ok", 0) == before.get("recv_ok", 0)  # nothing was transferred


def test_partial_prefix_hit_on_decode_moves_only_missing_blocks(cluster: Cluster) -> None:
    base = random_prompts(1, 160, seed=41)[0]
    # Warm D's own prefix cache with the first 128 tokens (4 blocks of 32).
    complete(cluster.d.url, base[:128], 1)
    for mode in ("push", "pull"):
        prompt = base + random_prompts(1, 40, seed=42 if mode == "push" else 43)[0]
        ref = cluster.reference(prompt)
        before = cluster.stats(cluster.d_ctl).stats
        assert _via(cluster.proxies.urls[mode], prompt) == ref
        after = cluster.stats(cluster.d_ctl).stats
        key = "push_received_bytes" if mode == "push" else "pull_bytes"
        moved = after.get(key, 0) - before.get(key, 0)
        full = 7 * 2 * 2 * 32 * 64 * 4  # 7 blocks x 2 layers x K,V x 32 tokens x 64 x fp32
        assert 0 < moved < full, (mode, moved, full)


def test_push_whose_decode_never_arrives_is_released_after_lease(cluster: Cluster) -> None:
    prompt = random_prompts(1, 120, seed=61)[0]
    _wait_idle(cluster, cluster.p_ctl)
    before = cluster.stats(cluster.p_ctl).stats.get("lease_expired", 0)
    complete(cluster.p.url, prompt, 1, {"do_remote_decode": True, "transfer_id": "orphan-1",
                                        "transfer_mode": "push"})
    deadline = time.monotonic() + LEASE_S + 20
    while time.monotonic() < deadline:
        reply = cluster.stats(cluster.p_ctl)
        if reply.stats.get("lease_expired", 0) > before and reply.pending == 0:
            break
        time.sleep(0.5)
    reply = cluster.stats(cluster.p_ctl)
    assert reply.stats.get("lease_expired", 0) == before + 1
    assert reply.pending == 0


def test_layerwise_push_matches_single_engine(cluster: Cluster) -> None:
    prompt = random_prompts(1, 250, seed=81)[0]
    ref = cluster.reference(prompt)
    before = cluster.stats(cluster.p_ctl).stats.get("push_layerwise", 0)
    d_params = params.push_decode_request(probe(cluster.p.url), "layerwise-1")
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, cluster.d.url, prompt, MAX_TOKENS, d_params, False, _GREEDY)
        time.sleep(1.0)  # let D register first, so P can write layer by layer
        complete(cluster.p.url, prompt, 1,
                 params.prefill_request("layerwise-1", TransferMode.PUSH, layerwise=True))
        out = output_token_ids(fut.result(timeout=120))
    assert out == ref
    assert cluster.stats(cluster.p_ctl).stats.get("push_layerwise", 0) == before + 1


def _push_decode_first(cluster: Cluster, d_url: str, prompt: list[int], tid: str,
                       wait_s: float = 1.5) -> list[int]:
    """A push whose D leg arrives ``wait_s`` before its P leg (D idles, backing off, until P's
    KV lands); returns D's output."""
    d_params = params.push_decode_request(probe(cluster.p.url), tid)
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, d_url, prompt, MAX_TOKENS, d_params, False, _GREEDY)
        time.sleep(wait_s)
        complete(cluster.p.url, prompt, 1, params.prefill_request(tid, TransferMode.PUSH))
        out = output_token_ids(fut.result(timeout=120))
    assert out is not None
    return out


def _timings(cluster: Cluster, address: str, tid: str) -> dict[str, float]:
    return dict(cluster.stats(address).timings.get(tid) or {})


def test_push_completion_reaches_decode_through_the_wake_up(cluster: Cluster) -> None:
    """Wake on arrival: D's engine idles (its only request waits for KV) until P's push lands;
    the transfer loop's completion nudges the engine loop through the hook in vLLM's idle path,
    which then does not wait out a back-off: the nudge ends the wait in progress, or, when it
    lands while the engine is mid-step, the next idle point does not wait at all."""
    prompt = random_prompts(1, 140, seed=101)[0]
    ref = cluster.reference(prompt)
    _wait_idle(cluster, cluster.d_ctl)
    before = cluster.stats(cluster.d_ctl).stats
    assert _push_decode_first(cluster, cluster.d.url, prompt, "wake-1") == ref
    time.sleep(0.5)  # the scheduler's marks reach the rank with its next step
    after = cluster.stats(cluster.d_ctl).stats
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in
            ("wake_nudges", "wake_woken", "wake_skipped", "wake_waits", "wake_missed",
             "recv_ok", "recv_direct", "recv_arrival_late", "wake_refused")}
    assert grew["recv_ok"] == 1
    # direct arrival: vLLM learned of it from the arrival, or (the KV landed while D was in an
    # empty step) from that step's output first; either way exactly once, nothing refused
    assert grew["recv_direct"] + grew["recv_arrival_late"] == 1, grew
    assert grew["wake_refused"] == 0, grew
    assert grew["wake_waits"] >= 1, grew  # D idled (hooked) while P's leg was on its way
    assert grew["wake_nudges"] >= 1 and grew["wake_woken"] + grew["wake_skipped"] >= 1, grew
    assert grew["wake_missed"] == 0, grew  # no wait ran out its back-off past a poke
    d_t, p_t = _timings(cluster, cluster.d_ctl, "wake-1"), _timings(cluster, cluster.p_ctl,
                                                                      "wake-1")
    # the steps of the hand-off, each recorded where it happens, in order (same host clock)
    assert d_t["recv_done"] <= d_t["recv_seen"] <= d_t["first_step"]
    assert p_t["kv_ready"] <= p_t["ready_seen"] <= p_t["write_posted"] <= p_t["write_done"]


@pytest.fixture
def fallback_d(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[VllmServer, str]]:
    """A second decode engine with ``wake_on_arrival: false``: the wake-up's fallback path (the
    same as where vLLM's idle path cannot be hooked), pushed to by the cluster's P."""
    backend = cluster.backend
    if backend != "shm":
        pytest.skip("the fallback path does not depend on the backend: checked over shm")
    kv = _connector("kv_consumer", "e2e-D-nowake", backend)
    kv["kv_connector_extra_config"]["wake_on_arrival"] = False
    kv["kv_connector_extra_config"]["huge_pages"] = False  # and P's huge pages into D's small
    d = VllmServer(build_tiny_model(), name="decode-nowake", kv_transfer_config=kv,
                   cpu_bind="1", env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                   extra_args=["--block-size", "32"], log_path=tmp_path / "decode-nowake.log")
    try:
        start_servers([d], timeout=600)
        yield d, _control_address(d.url)
    finally:
        d.stop()


def test_a_finished_receive_reaches_the_idle_scheduler_directly(cluster: Cluster) -> None:
    """Direct arrival: a push that lands while D's engine idles is scheduled from the arrival,
    not from a worker's step output, and the workers' later report of it is dropped (vLLM
    asserts if it learns of a receive twice: the output would not match). An arrival can lose
    the race to an empty step's output (then it counts as late), so up to 4 pushes are sent;
    with direct arrival broken none is ever direct."""
    before = cluster.stats(cluster.d_ctl).stats
    grew: dict[str, int] = {}
    for i in range(4):
        prompt = random_prompts(1, 120, seed=140 + i)[0]
        ref = cluster.reference(prompt)
        _wait_idle(cluster, cluster.d_ctl)
        assert _push_decode_first(cluster, cluster.d.url, prompt, f"direct-{i}") == ref
        time.sleep(0.5)  # the scheduler's counters reach the rank with its next step
        after = cluster.stats(cluster.d_ctl).stats
        grew = {k: after.get(k, 0) - before.get(k, 0)
                for k in ("recv_ok", "recv_direct", "recv_arrival_late")}
        assert grew["recv_direct"] + grew["recv_arrival_late"] == grew["recv_ok"] == i + 1
        if grew["recv_direct"]:
            break
    assert grew["recv_direct"] >= 1, grew


def test_without_the_wake_hook_decode_falls_back_to_polling(
        cluster: Cluster, fallback_d: tuple[VllmServer, str]) -> None:
    d, d_ctl = fallback_d
    prompt = random_prompts(1, 140, seed=103)[0]
    ref = cluster.reference(prompt)
    assert _push_decode_first(cluster, d.url, prompt, "nowake-1") == ref
    stats = cluster.stats(d_ctl).stats
    assert stats.get("recv_ok", 0) == 1 and stats.get("recv_failed", 0) == 0
    assert stats.get("wake_nudges", 0) == 0  # no hook, no listener: the step polls instead
    assert stats.get("recv_direct", 0) == 0  # and no direct arrival without the hook
    # it waited (bounded back-off) and the receive still completed: polling, not a poke. Whether
    # one of those waits was cut short by input depends on when the request came in (under load
    # all may run out), so only their sum is checked.
    waits = stats.get("wake_waits", 0)
    assert waits >= 1 and stats.get("wake_woken", 0) + stats.get("wake_timeouts", 0) == waits
    log = (d.log_path.read_text() if d.log_path else "")
    assert "wake-on-arrival hook installed" not in log
    assert "huge pages:" not in log


def test_the_cpu_kv_cache_refaults_on_huge_pages(cluster: Cluster) -> None:
    """Both engines moved their fresh, all-zero KV cache onto huge pages before any transport
    registered it (kvbridge.host.hugepages); the outputs-match tests above ran on it."""
    if thp_mode() != "madvise":
        pytest.skip(f"transparent huge pages are {thp_mode() or 'unavailable'} here")
    for server in (cluster.p, cluster.d):
        log = server.log_path.read_text() if server.log_path else ""
        found = re.findall(r"huge pages: (\d+) MiB of the KV cache now on", log)
        assert found and all(int(n) > 0 for n in found), log[-2000:]
        assert "held data and kept their pages" not in log


def test_shm_engines_share_their_kv_cache_and_map_each_others(cluster: Cluster) -> None:
    """Over shm, each engine moved its CPU KV cache onto a sealed memfd at registration
    (map_kv_cache) and mapped the other's at the handshake, so the outputs-match tests above
    copied KV with the native range copy (kvbridge.transports.shm.memfd)."""
    if cluster.backend != "shm":
        pytest.skip("mapped copies are the shm transport's")
    if _rangecopy.load() is None:
        pytest.skip("range copy not built here: shm keeps cross-memory attach")
    for server in (cluster.p, cluster.d):
        log = server.log_path.read_text() if server.log_path else ""
        shared = re.findall(r"(\d+) of (\d+) registered bytes shared through a memfd", log)
        assert shared and all(int(a) > 0.99 * int(b) for a, b in shared), log[-2000:]
        assert re.search(r"maps \d+ bytes of peer", log), log[-2000:]


def test_idle_engines_stay_idle(cluster: Cluster) -> None:
    """The wake-up adds no polling: engines with nothing to do stay asleep (loose bound: a busy
    loop burns >= 1 CPU-s/s here, vLLM's idle engine ~0.01)."""
    _wait_idle(cluster, cluster.d_ctl)
    _wait_idle(cluster, cluster.p_ctl)
    time.sleep(1.0)
    assert cluster.p.pid is not None and cluster.d.pid is not None
    pids = (cluster.p.pid, cluster.d.pid)
    cpu0, t0 = [_group_cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(4.0)
    elapsed = time.monotonic() - t0
    used = [(_group_cpu_seconds(p) - c) / elapsed for p, c in zip(pids, cpu0, strict=True)]
    assert max(used) < 0.15, f"idle engines used {used} CPU-s/s (P, D)"


def _group_cpu_seconds(pgid: int) -> float:
    """utime + stime of every process in a process group (psutil, no forking)."""
    return sum(group_cpu(pgid).values())


def test_decode_waiting_for_a_push_sleeps_and_abort_releases(cluster: Cluster) -> None:
    """A D request waiting for KV must not spin D's engine loop; aborting it frees everything.

    vLLM steps an engine continuously while a request waits for remote KV; kvbridge's idle wait
    turns those empty steps into sleeps. A busy loop burns >= 1 CPU-second per second here; the
    bound below is 3x looser than what the idle wait measures, so it is not a timing test.
    """
    prompt = random_prompts(1, 100, seed=91)[0]
    d_params = params.push_decode_request(probe(cluster.p.url), "never-1")
    assert cluster.d.pid is not None
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, cluster.d.url, prompt, 4, d_params, False, None, timeout=8)
        time.sleep(2.0)  # the request is parked, waiting for a push that never comes
        cpu0, t0 = _group_cpu_seconds(cluster.d.pid), time.monotonic()
        time.sleep(4.0)
        used = (_group_cpu_seconds(cluster.d.pid) - cpu0) / (time.monotonic() - t0)
        with pytest.raises(EngineError):
            fut.result(timeout=30)  # the client gives up: vLLM aborts the request
    assert used < 0.35, f"decode engine used {used:.2f} CPU-s/s while only waiting"
    _wait_idle(cluster, cluster.d_ctl)
    assert cluster.stats(cluster.d_ctl).pending == 0


def _wait_idle(cluster: Cluster, address: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.stats(address).pending and time.monotonic() < deadline:
        time.sleep(0.2)


def test_zz_decode_killed_mid_request_leaves_nothing_pinned(cluster: Cluster) -> None:
    """Runs last: kills D. P must end with no pinned blocks once the lease passes."""
    prompt = random_prompts(1, 300, seed=71)[0]
    d_params = params.push_decode_request(probe(cluster.p.url), "killed-1")
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, cluster.d.url, prompt, 64, d_params, False, _GREEDY)
        time.sleep(1.0)  # D has registered (or is about to)
        cluster.d.stop(grace=0)
        with pytest.raises(EngineError):
            fut.result(timeout=60)
    complete(cluster.p.url, prompt, 1, params.prefill_request("killed-1", TransferMode.PUSH))
    deadline = time.monotonic() + LEASE_S + 30
    while time.monotonic() < deadline and cluster.stats(cluster.p_ctl).pending:
        time.sleep(0.5)
    assert cluster.stats(cluster.p_ctl).pending == 0

"""Faults on real vLLM engines (core v2, items 1–5): hostile requests, forged hand-offs, engines
killed and restarted under load. One P and one D over ``shm`` (the semantics tested here live
in the core, not in a transport), with the HTTP guard in front of each engine.

Two tests start engines of their own: a P with other weights and a D declaring the same model
identity as that P (the refusal of other weights, and the negative control), and a D whose
transport stalls (issue 33: the test-only ``faulty`` backend, registered on that
engine's path only).

Every test ends with the same three checks the fault matrix (docs/operations.md) promises:
no engine crashed (both still serve), no wrong output (every answer that is HTTP 200 equals
the single-engine reference), and no blocks still held one lease later.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbridge.messages import (
    Ack,
    PushRegister,
    StatsQuery,
    StatsReply,
    TransferQuery,
    TransferReply,
)
from kvbridge.params import push_decode_request
from kvbridge.testing.clients import engine_client
from kvbridge.tools.client import complete, output_token_ids, probe
from kvbridge.tools.engines import EngineError, VllmServer, free_port, start_servers
from kvbridge.tools.proxies import ProxyThread
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
LEASE_S = 6.0
GREEDY = {"ignore_eos": True}


def _connector(role: str, engine_id: str, port: int) -> dict[str, Any]:
    return {
        "kv_connector": "KVBridgeConnector", "kv_role": role, "engine_id": engine_id,
        "kv_connector_extra_config": {
            "backend": "shm", "lease_s": LEASE_S, "heartbeat_s": 1, "push_timeout_s": 30,
            "prefill_wait_s": 3, "control_timeout_s": 5, "side_channel_port": port},
    }


@dataclass
class Cluster:
    model: str
    logs: Any
    p_http: int
    d_http: int
    p_ctl_port: int
    d_ctl_port: int
    p: VllmServer | None = None
    d: VllmServer | None = None
    proxies: ProxyThread | None = None
    refs: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    @property
    def p_ctl(self) -> str:
        return f"tcp://127.0.0.1:{self.p_ctl_port}"

    @property
    def d_ctl(self) -> str:
        return f"tcp://127.0.0.1:{self.d_ctl_port}"

    def engine(self, role: str) -> VllmServer:
        env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"}
        if role == "prefill":
            kv = _connector("kv_producer", "faults-P", self.p_ctl_port)
            port, cpu = self.p_http, "0"
        else:
            kv = _connector("kv_consumer", "faults-D", self.d_ctl_port)
            port, cpu = self.d_http, "1"
        return VllmServer(self.model, name=role, port=port, kv_transfer_config=kv, cpu_bind=cpu,
                          env=env, extra_args=["--block-size", "32"],
                          log_path=self.logs / f"{role}-{time.monotonic_ns()}.log")

    def stats(self, address: str) -> StatsReply:
        client = engine_client(30.0)
        try:
            reply = client.request(address, StatsQuery())
        finally:
            client.close()
        assert isinstance(reply, StatsReply)
        return reply

    def outcome(self, address: str, tid: str) -> str | None:
        client = engine_client(10.0)
        try:
            reply = client.request(address, TransferQuery(transfer_ids=[tid]))
        finally:
            client.close()
        assert isinstance(reply, TransferReply)
        return reply.outcomes.get(tid)

    def reference(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (max_tokens, *prompt)
        if key not in self.refs:
            assert self.d is not None
            out = output_token_ids(complete(self.d.url, prompt, max_tokens, extra=GREEDY))
            assert out is not None
            self.refs[key] = out
        return self.refs[key]

    def wait_idle(self, address: str, timeout: float = LEASE_S + 20) -> int:
        deadline = time.monotonic() + timeout
        pending = self.stats(address).pending
        while pending and time.monotonic() < deadline:
            time.sleep(0.5)
            pending = self.stats(address).pending
        return pending


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(str(build_tiny_model()), tmp_path_factory.mktemp("faults"), free_port(),
                free_port(), free_port(), free_port())
    try:
        c.p, c.d = c.engine("prefill"), c.engine("decode")
        start_servers([c.p, c.d], timeout=600)
        c.proxies = ProxyThread([c.p.url], [c.d.url], push_headroom=8).start()
        yield c
    finally:
        if c.proxies is not None:
            c.proxies.close()
        for e in (c.p, c.d):
            if e is not None:
                e.stop()


def _post(url: str, prompt: list[int], params: dict[str, Any] | None = None,
          max_tokens: int = MAX_TOKENS, **extra: Any) -> tuple[int, Any]:
    """(status, token ids or error text) of one completion."""
    try:
        resp = complete(url, prompt, max_tokens, params, extra={**GREEDY, **extra}, timeout=120)
    except EngineError as exc:
        return exc.status or 0, exc.body or str(exc)
    return 200, output_token_ids(resp)


def _healthy(c: Cluster, seed: int) -> None:
    """The three closing checks: both engines serve, hand-offs are right, nothing is held."""
    assert c.proxies is not None
    prompt = random_prompts(1, 120, seed=seed)[0]
    for mode in ("pull", "push"):
        status, out = _post(c.proxies.urls[mode], prompt)
        assert status == 200 and out == c.reference(prompt), (mode, status, out)
    assert c.wait_idle(c.p_ctl) == 0
    assert c.wait_idle(c.d_ctl) == 0


BAD_PARAMS = [
    ({"do_remote_prefill": True, "remote_block_ids": "abc"}, "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "port"},
     "remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": 5}, "remote_engine_id"),
    ({"do_remote_prefill": True, "transfer_mode": "sideways"}, "transfer_mode"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
      "remote_block_ids": list(range(200000))}, "remote_block_ids"),
]


def test_malformed_params_straight_to_decode_are_400_naming_the_key(cluster: Cluster) -> None:
    """Item 1: these used to kill D's EngineCore."""
    assert cluster.d is not None
    prompt = random_prompts(1, 100, seed=1)[0]
    for params, key in BAD_PARAMS:
        status, body = _post(cluster.d.url, prompt, params)
        assert status == 400, (params, status, body)
        assert key in str(body)
    _healthy(cluster, 2)


def test_malformed_requests_through_the_proxy_are_400(cluster: Cluster) -> None:
    """Item 15: batched prompts and n > 1 would share one hand-off."""
    assert cluster.proxies is not None
    url = cluster.proxies.urls["push"]
    prompt = random_prompts(2, 40, seed=3)
    for extra, key in (({"n": 2}, "n"), ({"kv_transfer_params": {"x": 1}}, "kv_transfer_params")):
        status, body = _post(url, prompt[0], **extra)
        assert status == 400 and key in str(body), (extra, status, body)
    try:
        complete(url, prompt, 4, extra=GREEDY)  # type: ignore[arg-type]
        raise AssertionError("a batched prompt was accepted")
    except EngineError as exc:
        assert exc.status == 400 and "prompt" in exc.body


def test_forged_hand_offs_never_produce_wrong_tokens(cluster: Cluster) -> None:
    """Item 2: D reads only blocks P leased to that transfer, for that prompt."""
    assert cluster.p is not None and cluster.d is not None
    a, b = random_prompts(2, 150, seed=5)
    ref_b = cluster.reference(b)
    pa = complete(cluster.p.url, a, 1, {"do_remote_decode": True, "transfer_id": "forge-a"})
    pb = complete(cluster.p.url, b, 1, {"do_remote_decode": True, "transfer_id": "forge-b"})
    params_a, params_b = pa["kv_transfer_params"], pb["kv_transfer_params"]
    forged = [
        {**params_b, "remote_block_ids": params_a["remote_block_ids"]},  # another's blocks
        {**params_b, "transfer_id": "forge-a"},  # another's transfer for our prompt
        {**params_b, "transfer_id": "never-staged"},  # a transfer P never leased
        {**params_b, "remote_block_ids": list(range(len(params_b["remote_block_ids"])))},
    ]
    for params in forged:
        status, out = _post(cluster.d.url, b, params)
        assert status != 200 or out == ref_b, (params, status, out)  # never 200 + wrong tokens
    # the rightful decodes still get their KV, and nothing stays pinned
    status, out = _post(cluster.d.url, b, params_b)
    assert status == 200 and out == ref_b
    _post(cluster.d.url, a, params_a)
    _healthy(cluster, 6)


def _probe_info() -> Any:
    """Some engine's info for the rogue's own Hellos (a transfer loop in this process)."""
    from kvbridge.testing.agents import LocalAgent

    agent = LocalAgent("relay-probe")
    try:
        return agent.loop.info
    finally:
        agent.close()


def test_a_relayed_prefill_identity_is_refused_and_tokens_stay_right(cluster: Cluster) -> None:
    """Issue 25 on real engines (../shared/security-pocs/poc_relay_metadata.py, pull): D is
    sent to a "prefill engine" that is a rogue holding the user's secret and presenting the
    real P. D refuses the forged peer and counts it; its answer is never 200 with wrong tokens;
    the rightful decode then gets P's KV, and nothing stays pinned."""
    from kvbridge.testing.clients import engine_codec
    from kvbridge.testing.rogue import MODES, Rogue

    assert cluster.p is not None and cluster.d is not None
    prompt = random_prompts(1, 150, seed=30)[0]
    ref = cluster.reference(prompt)
    staged = complete(cluster.p.url, prompt, 1, {"do_remote_decode": True,
                                                 "transfer_id": "relay-pull"})
    params = staged["kv_transfer_params"]
    me = _probe_info()
    before = cluster.stats(cluster.d_ctl).stats.get("peer_forged", 0)
    for mode in MODES:
        rogue = Rogue(cluster.p_ctl, me, engine_codec(), mode)
        try:
            port = int(rogue.address.rsplit(":", 1)[1])
            forged = {**params, "remote_port": port, "kvbridge_peers": [
                {"address": rogue.address, "generation": peer["generation"]}
                for peer in params["kvbridge_peers"]]}
            status, out = _post(cluster.d.url, prompt, forged)
            assert status != 200 or out == ref, (mode, status, out)
            assert "PullClaim" not in rogue.seen, mode
        finally:
            rogue.close()
    after = cluster.stats(cluster.d_ctl).stats.get("peer_forged", 0)
    assert after - before >= len(MODES)
    assert _post(cluster.d.url, prompt, params) == (200, ref)  # the real hand-off still works
    _healthy(cluster, 31)


def test_a_relayed_decode_identity_gets_no_push_from_prefill(cluster: Cluster) -> None:
    """The push half: a rogue registers a push at P in the real D's name, at its own address.
    P refuses the forged peer before writing a byte (push_sent does not move) and counts it;
    D serves right answers afterwards."""
    from kvbridge.scheduling.planner import prompt_digest
    from kvbridge.testing.clients import engine_client, engine_codec
    from kvbridge.testing.rogue import Rogue

    assert cluster.p is not None and cluster.d is not None
    prompt = random_prompts(1, 150, seed=32)[0]
    me = _probe_info()
    stats = cluster.stats(cluster.p_ctl).stats
    forged_before, sent_before = stats.get("peer_forged", 0), stats.get("push_sent", 0)
    for i, mode in enumerate(("rewrite", "relay-rewrite")):
        rogue = Rogue(cluster.d_ctl, me, engine_codec(), mode)
        client = engine_client(10.0)
        tid = f"relay-push-{i}"
        try:
            ack = client.request(cluster.p_ctl, PushRegister(
                transfer_id=tid, generation="*", engine_id=rogue.info.engine_id,
                sender_generation=rogue.info.generation, control_address=rogue.address,
                block_ids=[1, 2, 3, 4, 5], num_tokens=len(prompt),
                prompt_digest=prompt_digest(prompt),
                layout_fingerprint=rogue.info.layout_fingerprint))
            assert isinstance(ack, Ack) and ack.ok, ack
            status, _ = _post(cluster.p.url, prompt, {"do_remote_decode": True,
                                                      "transfer_id": tid,
                                                      "transfer_mode": "push"}, max_tokens=1)
            assert status == 200
            assert "PushConfirm" not in rogue.seen
        finally:
            client.close()
            rogue.close()
    stats = cluster.stats(cluster.p_ctl).stats
    assert stats.get("peer_forged", 0) - forged_before >= 2
    assert stats.get("push_sent", 0) == sent_before
    _healthy(cluster, 33)


def _outcome_settled(c: Cluster, address: str, tid: str, timeout: float) -> str:
    """``tid``'s outcome at ``address`` once it is no longer in progress (or after
    ``timeout``)."""
    deadline = time.monotonic() + timeout
    why = c.outcome(address, tid) or ""
    while why.startswith("in progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        why = c.outcome(address, tid) or ""
    return why


def test_vllm_cleanup_of_a_rejected_decode_leg_releases_and_is_not_a_rejection(
        cluster: Cluster) -> None:
    """Issue 33 item 2: a decode leg vLLM's server refuses before its engine sees it (a token id
    outside the vocabulary) makes vLLM send its clean-up request to D (prompt ``[0]``, the
    leg's ``kv_transfer_params``, aborted at once). D recognises it: P's staged blocks are
    released at once (not one lease later), ``cleanup_requests`` counts it and
    ``params_rejected`` does not move. A decode leg that fails on D (a transfer P never
    staged) is followed by a clean-up too: counted, and left to the leg's own hand-off."""
    assert cluster.p is not None and cluster.d is not None
    prompt = random_prompts(1, 150, seed=34)[0]
    tid = "cleanup-pull"
    staged = complete(cluster.p.url, prompt, 1, {"do_remote_decode": True, "transfer_id": tid})
    params = staged["kv_transfer_params"]
    before = cluster.stats(cluster.d_ctl).stats
    t0 = time.monotonic()
    status, body = _post(cluster.d.url, [*prompt[:-1], 10**6], params)  # out of vocabulary
    assert status == 400, (status, body)
    why = _outcome_settled(cluster, cluster.p_ctl, tid, LEASE_S + 5)
    assert "cancelled by decode" in why and time.monotonic() - t0 < LEASE_S, why
    status, _ = _post(cluster.d.url, prompt, {**params, "transfer_id": "cleanup-never-staged"})
    assert status >= 500
    deadline = time.monotonic() + 10
    while (cluster.stats(cluster.d_ctl).stats.get("cleanup_requests", 0)
           < before.get("cleanup_requests", 0) + 2 and time.monotonic() < deadline):
        time.sleep(0.1)
    after = cluster.stats(cluster.d_ctl).stats
    assert after.get("params_rejected", 0) == before.get("params_rejected", 0)
    assert after.get("cleanup_requests", 0) == before.get("cleanup_requests", 0) + 2
    assert after.get("cleanup_ignored", 0) == before.get("cleanup_ignored", 0) + 1
    _healthy(cluster, 35)


def test_a_forged_push_register_fails_alone_and_the_real_push_is_served(
        cluster: Cluster) -> None:
    """Issue 33 item 5: P prefilled a push and waits for D's registration; strangers that read
    the live transfer id (``kvbridge stats``) register it first: in D's name with other blocks,
    in D's name for another prompt, and at an address nobody listens on. Each forged
    registration is refused on its own; D's registration then still gets the push, and the
    client HTTP 200 with the reference tokens."""
    import os

    from kvbridge.messages import Hello
    from kvbridge.scheduling.planner import prompt_digest

    assert cluster.p is not None and cluster.d is not None
    prompt = random_prompts(1, 150, seed=36)[0]
    ref = cluster.reference(prompt)
    tid = "forged-register-live"
    hello = engine_client(10.0)
    try:
        reply = hello.request(cluster.d_ctl, Hello(info=_probe_info(), challenge=os.urandom(16)))
    finally:
        hello.close()
    d_info = reply.info  # type: ignore[attr-defined]
    decode = push_decode_request(probe(cluster.p.url), tid)
    stats = cluster.stats(cluster.p_ctl).stats
    sent_before, refused_before = stats.get("push_sent", 0), stats.get("register_refused", 0)

    def forged(address: str, tokens: list[int]) -> PushRegister:
        return PushRegister(transfer_id=tid, generation="*", engine_id=d_info.engine_id,
                            sender_generation=d_info.generation, control_address=address,
                            block_ids=[1, 2, 3, 4, 5][:-(-len(tokens) // 32)],
                            num_tokens=len(tokens), prompt_digest=prompt_digest(tokens),
                            layout_fingerprint=d_info.layout_fingerprint)

    forgeries = [forged(cluster.d_ctl, prompt), forged(cluster.d_ctl, prompt[:-40]),
                 forged(f"tcp://127.0.0.1:{free_port()}", prompt)]
    clients = [engine_client(10.0) for _ in forgeries]
    try:
        status, _ = _post(cluster.p.url, prompt, {"do_remote_decode": True, "transfer_id": tid,
                                                  "transfer_mode": "push"}, max_tokens=1)
        assert status == 200
        assert tid in cluster.stats(cluster.p_ctl).held.get("pushing", [])  # live, readable
        for client, reg in zip(clients, forgeries, strict=True):
            client.request(cluster.p_ctl, reg)
        time.sleep(0.5)  # P dialled, was refused, or could not connect
        assert _post(cluster.d.url, prompt, decode) == (200, ref)
    finally:
        for client in clients:
            client.close()
    deadline = time.monotonic() + 15  # the unreachable address is refused within a dial
    while (cluster.stats(cluster.p_ctl).stats.get("register_refused", 0) - refused_before
           < len(forgeries) and time.monotonic() < deadline):
        time.sleep(0.2)
    stats = cluster.stats(cluster.p_ctl).stats
    assert stats.get("push_sent", 0) == sent_before + 1
    assert stats.get("register_refused", 0) - refused_before == len(forgeries)
    _healthy(cluster, 37)


def test_decode_leg_for_another_prompt_is_prefilled_locally(cluster: Cluster) -> None:
    """D checks remote_num_tokens and tp_size against its own request: a mismatch is computed
    here (correct tokens, a WARNING and a counter), never loaded."""
    assert cluster.p is not None and cluster.d is not None
    a = random_prompts(1, 150, seed=7)[0]
    b = random_prompts(1, 140, seed=8)[0]  # same block count (5), other length
    pa = complete(cluster.p.url, a, 1, {"do_remote_decode": True, "transfer_id": "local-a"})
    params = pa["kv_transfer_params"]
    before = cluster.stats(cluster.d_ctl).stats.get("params_rejected", 0)
    for bad in (params, {**params, "tp_size": 2}):
        status, out = _post(cluster.d.url, b, bad)
        assert status == 200 and out == cluster.reference(b)
    after = cluster.stats(cluster.d_ctl).stats.get("params_rejected", 0)
    assert after - before == 2
    _post(cluster.d.url, a, params)  # hand it over so P releases
    _healthy(cluster, 9)


def test_a_push_whose_prefill_leg_never_comes_fails_soon_and_says_why(cluster: Cluster) -> None:
    """Item 5: it took the full 120 s; now P tells D within prefill_wait_s (3 s here)."""
    assert cluster.d is not None and cluster.p is not None
    params = push_decode_request(probe(cluster.p.url), "orphan-d")
    t0 = time.monotonic()
    status, _ = _post(cluster.d.url, random_prompts(1, 100, seed=10)[0], params)
    assert status >= 500 and time.monotonic() - t0 < 20
    why = cluster.outcome(cluster.d_ctl, "orphan-d") or ""
    assert "never received" in why, why
    _healthy(cluster, 11)


def test_client_disconnect_mid_request_releases_everything(cluster: Cluster) -> None:
    """Clients that hang up (1 s timeout, 200 tokens to decode): the proxy closes both legs,
    vLLM aborts, and every pinned or registered block comes back."""
    assert cluster.proxies is not None
    prompts = random_prompts(4, 300, seed=12)

    def impatient(url: str, prompt: list[int]) -> None:
        try:
            complete(url, prompt, 200, extra=GREEDY, timeout=1.0)
        except EngineError:
            pass

    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(impatient, [cluster.proxies.urls[m] for m in ("push", "pull") * 2], prompts))
    _healthy(cluster, 13)


def test_prefill_killed_under_push_load_then_restarted(cluster: Cluster) -> None:
    """Items 3 and 4: D holds nothing after P died, and a restarted P (new generation, same
    address) is recognised: the first push after the restart neither hangs nor fails."""
    assert cluster.p is not None and cluster.proxies is not None
    prompts = random_prompts(6, 200, seed=14)
    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(_post, cluster.proxies.urls["push"], p, None, 32) for p in prompts]
        time.sleep(1.0)
        cluster.p.stop(grace=0)  # SIGKILL mid-load
        results = [f.result(timeout=120) for f in futs]
    for prompt, (status, out) in zip(prompts, results, strict=True):
        assert status != 200 or out == cluster.reference(prompt, 32)
    assert cluster.wait_idle(cluster.d_ctl) == 0  # no request deferred, no blocks held
    assert cluster.d is not None
    alone = random_prompts(1, 50, seed=15)[0]
    assert _post(cluster.d.url, alone) == (200, cluster.reference(alone))  # D still serves
    cluster.p = cluster.engine("prefill")
    start_servers([cluster.p], timeout=600)
    t0 = time.monotonic()
    prompt = random_prompts(1, 120, seed=16)[0]
    status, out = _post(cluster.proxies.urls["push"], prompt)
    assert status == 200 and out == cluster.reference(prompt)
    assert time.monotonic() - t0 < 15, "the first push after a restart took too long"
    _healthy(cluster, 17)


def test_decode_restarted_at_the_same_address(cluster: Cluster) -> None:
    """Item 4: P notices D's new generation at once (its registration names it)."""
    assert cluster.d is not None and cluster.proxies is not None
    cluster.d.stop(grace=0)
    cluster.d = cluster.engine("decode")
    start_servers([cluster.d], timeout=600)
    t0 = time.monotonic()
    prompt = random_prompts(1, 120, seed=18)[0]
    status, out = _post(cluster.proxies.urls["push"], prompt)
    assert status == 200 and out == cluster.reference(prompt)
    assert time.monotonic() - t0 < 15
    _healthy(cluster, 19)


def _faulty_backend_path(where: Path) -> str:
    """A directory that, on an engine's ``PYTHONPATH``, registers the test-only backend
    ``faulty`` (:class:`kvbridge.testing.faults.FaultyBackend`): an entry point of a
    distribution that exists only there, so no production install knows the name."""
    dist = where / "kvbridge_faulty_test-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbridge-faulty-test\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(
        "[kvbridge.backends]\nfaulty = kvbridge.testing.faults:FaultyBackend\n")
    return os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH", "")) if p)


def test_a_pull_that_stalls_is_recomputed_within_stall_s(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    """Issue 33: D's first connection set-up to P never finishes (a transport whose first
    ``add_peer`` blocks, as NIXL's ``add_remote_agent`` did on a shared core). D gives the
    hand-off up after ``stall_s`` (2 s), not ``push_timeout_s`` (30 s here), and with
    ``kv_load_failure_policy: recompute`` the client gets HTTP 200 and the reference tokens,
    within seconds; P is told and holds nothing."""
    assert cluster.p is not None
    stall_s, ctl = 2.0, free_port()
    kv = _connector("kv_consumer", "faults-D-stall", ctl)
    kv["kv_load_failure_policy"] = "recompute"
    kv["kv_connector_extra_config"].update(
        backend="faulty", stall_s=stall_s,
        backend_options={"inner": "shm", "faults": {"stall_add_peer": [1]}})
    stalling = VllmServer(cluster.model, name="decode-stall", port=free_port(),
                          kv_transfer_config=kv, cpu_bind="1",
                          env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2",
                               "PYTHONPATH": _faulty_backend_path(tmp_path / "plugin")},
                          extra_args=["--block-size", "32"],
                          log_path=cluster.logs / "decode-stall.log")
    address = f"tcp://127.0.0.1:{ctl}"
    try:
        start_servers([stalling], timeout=600)
        prompt = random_prompts(1, 150, seed=40)[0]
        ref = cluster.reference(prompt)
        staged = complete(cluster.p.url, prompt, 1, {"do_remote_decode": True,
                                                     "transfer_id": "stalled-pull"})
        t0 = time.monotonic()
        status, out = _post(stalling.url, prompt, staged["kv_transfer_params"])
        took = time.monotonic() - t0
        assert (status, out) == (200, ref)
        assert took < stall_s + 8, f"the stalled pull took {took:.1f} s"
        why = cluster.outcome(address, "stalled-pull") or ""
        assert "no progress within 2.0 s" in why and "handshake" in why, why
        assert cluster.stats(address).stats.get("handoff_stalled", 0) == 1
        assert cluster.wait_idle(cluster.p_ctl, timeout=5) == 0  # released at D's word
        assert "cancelled by decode" in (cluster.outcome(cluster.p_ctl, "stalled-pull") or "")
    finally:
        stalling.stop()
    _healthy(cluster, 41)


def test_a_byte_flipped_in_a_pull_is_recomputed_right(cluster: Cluster, tmp_path: Path) -> None:
    """Issue 27: D's first READ lands with one byte wrong (the test-only ``faulty`` backend).
    D's digests of what landed differ from P's (on by default): the receive fails naming the
    chunk, ``kv_load_failure_policy: recompute`` computes the prompt on D, the client gets the
    reference tokens, and P holds nothing. The next, clean pull is used (``recv_ok``)."""
    assert cluster.p is not None
    ctl = free_port()
    kv = _connector("kv_consumer", "faults-D-flip", ctl)
    kv["kv_load_failure_policy"] = "recompute"
    kv["kv_connector_extra_config"].update(
        backend="faulty",
        backend_options={"inner": "shm", "faults": {"corrupt": [1], "corrupt_offset": 777}})
    flipping = VllmServer(cluster.model, name="decode-flip", port=free_port(),
                          kv_transfer_config=kv, cpu_bind="1",
                          env={"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2",
                               "PYTHONPATH": _faulty_backend_path(tmp_path / "plugin")},
                          extra_args=["--block-size", "32"],
                          log_path=cluster.logs / "decode-flip.log")
    address = f"tcp://127.0.0.1:{ctl}"
    try:
        start_servers([flipping], timeout=600)
        for n, tid in enumerate(("flipped-pull", "clean-pull")):
            prompt = random_prompts(1, 150, seed=50 + n)[0]
            ref = cluster.reference(prompt)
            staged = complete(cluster.p.url, prompt, 1, {"do_remote_decode": True,
                                                         "transfer_id": tid})
            status, out = _post(flipping.url, prompt, staged["kv_transfer_params"])
            assert (status, out) == (200, ref)
        stats = cluster.stats(address).stats
        assert stats.get("checksum_mismatch", 0) == 1 and stats.get("recv_ok", 0) == 1, stats
        why = cluster.outcome(address, "flipped-pull") or ""
        assert "not what prefill computed: digest mismatch in 1 of" in why, why
        assert cluster.wait_idle(cluster.p_ctl, timeout=10) == 0
    finally:
        flipping.stop()
    _healthy(cluster, 52)


def _connector_as(role: str, engine_id: str, port: int, identity: str) -> dict[str, Any]:
    kv = _connector(role, engine_id, port)
    kv["kv_connector_extra_config"]["model_identity"] = identity
    return kv


def test_kv_from_other_weights_is_refused_and_the_check_has_teeth(cluster: Cluster) -> None:
    """Two checkpoints of one architecture (other seeds: every layout check passes).

    1. A P with other weights (here declaring an identity of its own) is refused at the
       handshake by the cluster's D, whose identity is its checkpoint's content: the receive
       fails naming both identities, and no wrong token is served.
    2. The negative control: a D that declares the same identity as that P (an operator who
       says "these are one model") takes its KV, and the output changes. If D silently
       recomputed instead of using the KV it received, this would fail.
    """
    assert cluster.d is not None
    env = {"VLLM_TARGET_DEVICE": "cpu", "KVBRIDGE_ENGINE_SPIN_MS": "2"}
    p2_ctl, d2_ctl = free_port(), free_port()
    other = VllmServer(str(build_tiny_model(seed=1)), name="prefill-other", port=free_port(),
                       kv_transfer_config=_connector_as("kv_producer", "faults-P2", p2_ctl,
                                                        "declared-one-model"),
                       cpu_bind="0", env=env, extra_args=["--block-size", "32"],
                       log_path=cluster.logs / "prefill-other.log")
    believer = VllmServer(cluster.model, name="decode-declared", port=free_port(),
                          kv_transfer_config=_connector_as("kv_consumer", "faults-D2", d2_ctl,
                                                           "declared-one-model"),
                          cpu_bind="1", env=env, extra_args=["--block-size", "32"],
                          log_path=cluster.logs / "decode-declared.log")
    try:
        start_servers([other, believer], timeout=600)
        prompt = random_prompts(1, 150, seed=20)[0]
        ref = cluster.reference(prompt)

        # P's answer names its identity: D refuses before it claims anything, computes the
        # prompt itself and tells P to release
        answer = complete(other.url, prompt, 1, {"do_remote_decode": True,
                                                 "transfer_id": "other-weights"})
        before = cluster.stats(cluster.d_ctl).stats
        status, out = _post(cluster.d.url, prompt, answer["kv_transfer_params"])
        assert status == 200 and out == ref  # computed on D: the reference tokens
        after = cluster.stats(cluster.d_ctl).stats
        assert after.get("recv_ok", 0) == before.get("recv_ok", 0)
        assert after.get("identity_refused", 0) == before.get("identity_refused", 0) + 1
        # params that do not name it (an older engine, a hand-made router): the handshake
        # compares the identities and refuses, naming both
        answer = complete(other.url, prompt, 1, {"do_remote_decode": True,
                                                 "transfer_id": "other-weights-2"})
        unnamed = {k: v for k, v in answer["kv_transfer_params"].items()
                   if k != "kvbridge_identity"}
        status, out = _post(cluster.d.url, prompt, unnamed)
        assert status != 200 or out == ref  # refused: never a wrong token
        assert cluster.stats(cluster.d_ctl).stats.get("recv_ok", 0) == before.get("recv_ok", 0)
        why = cluster.outcome(cluster.d_ctl, "other-weights-2") or ""
        assert "model_identity differs" in why, why

        answer = complete(other.url, prompt, 1, {"do_remote_decode": True,
                                                 "transfer_id": "declared-same"})
        status, out = _post(believer.url, prompt, answer["kv_transfer_params"])
        assert status == 200
        assert out != ref  # the KV of the other weights moved, and was used
    finally:
        other.stop()
        believer.stop()

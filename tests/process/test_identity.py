"""A peer is who it was dialled as, proven (kvbridge.identity; issue 25, part 1).

The rogue of ../shared/security-pocs/poc_relay_metadata.py answers a Hello at its own address
with ANOTHER engine's EngineInfo, so the dialler's data plane would move KV with that other
engine while the rogue says yes on the control plane. Here the rogue is made as strong as it
can be: it holds the fleet's secret (an insider), and it may forward the Hello — challenge
included — to the victim and hand back the victim's genuine answer. Every variant must be
refused and counted, with the victim's KV untouched, over shm (a real second process) and, in
insecure mode, without any secret at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge import identity
from kvbridge.control import ControlClient
from kvbridge.errors import MessageError, PeerForged
from kvbridge.messages import (
    Ack,
    Codec,
    EngineInfo,
    PushRegister,
)
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.testing.agents import AgentProcess, LocalAgent
from kvbridge.testing.clients import engine_codec
from kvbridge.testing.handoffs import FAST, pull, send, tokens
from kvbridge.testing.rogue import MODES, Rogue

pytestmark = pytest.mark.timeout(120)

SHM = {**FAST, "backend": "shm"}
INSECURE = {**SHM, "allow_insecure_control": True}


@pytest.fixture(scope="module")
def victim_d() -> Iterator[AgentProcess]:
    v = AgentProcess("victim-decode", extra=SHM)
    try:
        v.fill(7)
        yield v
    finally:
        v.close()


@pytest.fixture(scope="module")
def victim_p() -> Iterator[AgentProcess]:
    v = AgentProcess("victim-prefill", extra=SHM)
    try:
        v.fill(9)
        yield v
    finally:
        v.close()


def _push_attack(p: LocalAgent, victim: AgentProcess, codec: Codec, mode: str,
                 tid: str) -> tuple[dict[str, Any], Rogue]:
    rogue = Rogue(victim.address, p.loop.info, codec, mode)
    client = ControlClient(codec, 5.0)
    try:
        ack = client.request(p.address, PushRegister(
            transfer_id=tid, generation="*", engine_id=rogue.info.engine_id if mode != "impersonate"
            else "rogue", sender_generation=rogue.info.generation,
            control_address=rogue.address, block_ids=[40, 41], num_tokens=32,
            prompt_digest=prompt_digest(tokens(2)),
            layout_fingerprint=rogue.info.layout_fingerprint))
        assert isinstance(ack, Ack) and ack.ok, ack  # registered: P now dials the rogue
        p.ready(send("p", tid, [1, 2]))
        return p.drain({"p"}, timeout=10), rogue
    finally:
        client.close()


@pytest.mark.parametrize("mode", MODES)
def test_push_relay_writes_nothing_into_another_engine(victim_d: AgentProcess, mode: str) -> None:
    """P, registered by a rogue that presents victim D, refuses the forged peer and writes
    nothing: D's blocks stay as they were (fails on 84a1d95: they became P's)."""
    p = LocalAgent("prefill", extra=SHM)
    try:
        p.fill(1)
        before = victim_d.blocks([40, 41])
        result, rogue = _push_attack(p, victim_d, engine_codec(), mode, f"atk-{mode}")
        rogue.close()
        assert result["results"]["finished_sending"] == {"p"}
        stats = result["stats"]
        assert stats.get("push_sent", 0) == 0, stats
        assert "PushConfirm" not in rogue.seen  # refused before asking the rogue to confirm
        np.testing.assert_array_equal(victim_d.blocks([40, 41]), before)
        assert p.loop.peers.forged >= 1
        assert len(p.loop.peers) == 0
    finally:
        p.close()


@pytest.mark.parametrize("mode", MODES)
def test_pull_relay_reads_nothing_of_another_engine(victim_p: AgentProcess, mode: str) -> None:
    """D, sent to a "prefill engine" that is a rogue presenting victim P, refuses the forged
    peer: the request fails and D's blocks never hold the victim's KV (fails on 84a1d95)."""
    d = LocalAgent("decode", extra=SHM)
    try:
        d.fill(2)
        secret_kv = victim_p.blocks([5, 6])
        rogue = Rogue(victim_p.address, d.loop.info, engine_codec(), mode)

        class AtRogue:
            address, generation = rogue.address, rogue.info.generation

        d.pull(pull("d", f"leak-{mode}", AtRogue, [10, 11], [5, 6]))
        result = d.drain({"d"}, timeout=10)
        rogue.close()
        assert result["results"]["failed_recving"] == {"d"}, result
        assert not np.array_equal(d.blocks([10, 11]), secret_kv)
        assert "PullClaim" not in rogue.seen
        assert d.loop.peers.forged >= 1
        assert d.loop.snapshot()["stats"]["peer_forged"] >= 1  # what kvbridge stats shows
    finally:
        d.close()


def test_without_any_secret_a_rogue_is_still_refused() -> None:
    """allow_insecure_control on every engine (no secret at all: a rogue of ANY user can speak
    the protocol): the rewritten relay is still refused, by the data-plane proof alone."""
    victim = AgentProcess("victim-decode-insecure", extra=INSECURE)
    p = LocalAgent("prefill-insecure", extra=INSECURE)
    try:
        victim.fill(7)
        p.fill(1)
        assert not p.loop.codec.authenticated
        before = victim.blocks([40, 41])
        for mode in ("rewrite", "relay-rewrite"):
            result, rogue = _push_attack(p, victim, Codec(), mode, f"atk-insecure-{mode}")
            rogue.close()
            assert result["stats"].get("push_sent", 0) == 0
            np.testing.assert_array_equal(victim.blocks([40, 41]), before)
        assert p.loop.peers.forged >= 2
    finally:
        p.close()
        victim.close()


def test_a_proven_peer_still_works_after_a_forged_one(victim_d: AgentProcess) -> None:
    """Refusing the rogue poisons nothing: the victim, dialled at its own address, is a peer."""
    p = LocalAgent("prefill", extra=SHM)
    try:
        p.fill(3)
        _, rogue = _push_attack(p, victim_d, engine_codec(), "rewrite", "atk-then-legit")
        rogue.close()
        from kvbridge.testing.handoffs import expect

        victim_d.expect(expect("d", "legit", p, [30, 31]))
        p.ready(send("p", "legit", [3, 4]))
        rd = victim_d.drain({"d"})
        assert rd["results"]["finished_recving"] == {"d"}, rd
        np.testing.assert_array_equal(victim_d.blocks([30, 31]), p.blocks([3, 4]))
    finally:
        p.close()


# -- the core's half, unit by unit -------------------------------------------------------------


def test_proof_binds_challenge_address_and_identity() -> None:
    c = identity.challenge()
    base = identity.proof(c, "tcp://127.0.0.1:1", "e", "g", 0, "a")
    assert len(base) == identity.PROOF_BYTES
    assert base == identity.proof(c, "tcp://127.0.0.1:1", "e", "g", 0, "a")
    for other in (identity.proof(identity.challenge(), "tcp://127.0.0.1:1", "e", "g", 0, "a"),
                  identity.proof(c, "tcp://127.0.0.1:2", "e", "g", 0, "a"),
                  identity.proof(c, "tcp://127.0.0.1:1", "f", "g", 0, "a"),
                  identity.proof(c, "tcp://127.0.0.1:1", "e", "h", 0, "a"),
                  identity.proof(c, "tcp://127.0.0.1:1", "e", "g", 1, "a"),
                  identity.proof(c, "tcp://127.0.0.1:1", "e", "g", 0, "b"),
                  identity.proof(c, "tcp://127.0.0.1:1e", "", "g", 0, "a")):  # no ambiguity
        assert other != base


def test_hello_without_a_challenge_is_malformed() -> None:
    codec, info = Codec(), _some_info()
    body = msgspec.msgpack.encode({"type": "Hello", "info": info})
    with pytest.raises(MessageError, match="challenge"):
        codec.decode(b"\x01" + b"\0" * 24 + body)
    for bad in (b"", b"x" * 15, b"x" * 65):
        raw = msgspec.msgpack.encode({"type": "Hello", "info": info, "challenge": bad})
        with pytest.raises(MessageError, match="challenge"):
            codec.decode(b"\x01" + b"\0" * 24 + raw)


def _some_info() -> EngineInfo:
    a = LocalAgent("info-only", extra=FAST)
    try:
        return a.loop.info
    finally:
        a.close()


def test_a_reply_naming_another_address_is_forged_and_counted() -> None:
    """The cheapest check: the answer at the dialled address says it is elsewhere."""
    d = LocalAgent("decode-addr", extra=FAST)
    other = LocalAgent("other-addr", extra=FAST)
    try:
        rogue = Rogue(other.address, d.loop.info, engine_codec(), "relay")
        got: list[Any] = []
        d.loop.submit(d.loop.peers.ensure, rogue.address, "*", got.append)
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        rogue.close()
        assert got and isinstance(got[0], PeerForged), got
        assert "control address" in str(got[0])
        assert d.loop.peers.forged == 1
    finally:
        d.close()
        other.close()

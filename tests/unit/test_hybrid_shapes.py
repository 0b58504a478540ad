"""A hybrid model (KV-cache groups) between engines of another TP size or block size: every
refusal says the model is hybrid and names both values (issue 33, item 4).

What happens where (docs/usage.md#hybrid-models): a pull whose block size differs is refused by
D's scheduler (served locally, ``params_rejected``); another TP size (pull or push) fails D's
receive, and a push with another block size fails the handshake, naming both shapes."""

from __future__ import annotations

import pytest

from kvbridge.errors import ParamsError
from kvbridge.groups import GroupKind, KVGroup
from kvbridge.params import PeerRef, parse
from kvbridge.scheduling.planner import prompt_digest
from kvbridge.scheduling.rank import RankSide
from kvbridge.scheduling.specs import PullSpec, SendPlan
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import FAST


def _groups(block: int) -> tuple[KVGroup, ...]:
    return (KVGroup(GroupKind.SLIDING, block, 40, planes=(0,)),
            KVGroup(GroupKind.SLIDING, block, 40, planes=(1,)),
            KVGroup(GroupKind.FULL, block, planes=(2,)))


def _agent(name: str, block: int) -> LocalAgent:
    return LocalAgent(name, (3, 40, block, 64), FAST, groups=_groups(block))


def test_another_block_size_fails_the_handshake_saying_the_model_is_hybrid() -> None:
    p, d = _agent("hybrid-P16", 16), _agent("hybrid-D32", 32)
    try:
        prompt = list(range(64))
        digest = prompt_digest(prompt)
        p.stage(SendPlan("p", "t-b", (0, 1, 2), 64, digest))
        d.pull(PullSpec("d", "t-b", p.address, (3, 4, 5), (0, 1, 2), 0, 64, digest,
                        p.generation))
        assert d.drain({"d"})["results"]["failed_recving"] == {"d"}
        why = d.outcome("t-b") or ""
        assert "hybrid model" in why, why
        assert "block_size 32 here, 1 and 16 at hybrid-P16" in why, why
        assert "does not describe its KV heads" not in why
    finally:
        p.close()
        d.close()


def test_another_tp_size_fails_the_receive_saying_the_model_is_hybrid() -> None:
    d = _agent("hybrid-D", 16)
    try:
        peers = (PeerRef("tcp://127.0.0.1:1", "g"), PeerRef("tcp://127.0.0.1:2", "g"))
        why = RankSide(d.loop)._sources(peers)
        assert isinstance(why, str)
        assert "tensor-parallel 2, this engine 1" in why and "hybrid model" in why, why
        assert "does not describe its KV heads" not in why
    finally:
        d.close()


def test_a_pull_from_a_hybrid_prefill_of_another_block_size_names_both() -> None:
    params = parse({"remote_block_ids": [[1, 2], [3, 4], [5, 6]], "kvbridge_block_size": 32})
    with pytest.raises(ParamsError, match=r"kvbridge_block_size.*prefill's block size is 32, "
                                          r"this engine's 16: this is a hybrid model"):
        params.check_block_groups(64, [16, 16, 16])
    params.check_block_groups(64, [32, 32, 32])  # the same block size: accepted
    same = parse({"remote_block_ids": [[1, 2], [3, 4], [5, 6]], "kvbridge_block_size": 16})
    with pytest.raises(ParamsError, match="group 0 names 2 blocks"):  # a short table stays that
        same.check_block_groups(64, [16, 16, 16])

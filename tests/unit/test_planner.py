"""kvbridge.scheduling.planner: the block arithmetic of one hand-off and the prompt's identity."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.scheduling.planner import (
    ReceivePlan,
    blocks_for,
    load_source,
    plan_receive,
    prompt_blocks,
    prompt_digest,
    tier_share,
)

B = 16
ALLOC = [100, 101, 102, 103, 104, 105]  # the request's blocks, prompt first, then decode room
REMOTE = [7, 3, 9, 1]  # the prefill engine's blocks of a 4-block prompt


def _plan(prompt: int, external: int, allocated: list[int] | None = None,
          remote: list[int] | None = REMOTE) -> ReceivePlan:
    return plan_receive(prompt_tokens=prompt, block_size=B, external_tokens=external,
                        allocated=ALLOC if allocated is None else allocated, remote_ids=remote)


# -- blocks_for / prompt_blocks ------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "size", "blocks"), [
    (0, 16, 0), (1, 16, 1), (15, 16, 1), (16, 16, 1), (17, 16, 2), (64, 16, 4), (65, 16, 5),
    (1, 1, 1), (1000, 1, 1000), ((1 << 20) + 1, 16, (1 << 16) + 1), (5, 1 << 20, 1),
])
def test_blocks_for(tokens: int, size: int, blocks: int) -> None:
    assert blocks_for(tokens, size) == blocks


@pytest.mark.parametrize("size", [0, -1, -16])
def test_blocks_for_refuses_a_block_size_below_one(size: int) -> None:
    with pytest.raises(LayoutError, match="block_size"):
        blocks_for(16, size)


def test_prompt_blocks_takes_the_leading_blocks() -> None:
    assert prompt_blocks(ALLOC, 64, B) == [100, 101, 102, 103]
    assert prompt_blocks(ALLOC, 65, B) == [100, 101, 102, 103, 104]
    assert prompt_blocks(ALLOC, 1, B) == [100]
    assert prompt_blocks(ALLOC, 0, B) == []
    assert prompt_blocks((5, 6), 64, B) == [5, 6]  # never invents blocks
    assert isinstance(prompt_blocks((5, 6), 16, B), list)


# -- plan_receive --------------------------------------------------------------------------------


def test_no_local_hit_receives_every_prompt_block() -> None:
    plan = _plan(64, 64)
    assert plan == ReceivePlan(0, (100, 101, 102, 103), (7, 3, 9, 1))
    assert not plan.empty


def test_partial_hit_skips_whole_blocks() -> None:
    plan = _plan(64, 32)
    assert plan == ReceivePlan(2, (102, 103), (9, 1), 2)
    assert _plan(64, 48) == ReceivePlan(1, (101, 102, 103), (3, 9, 1), 1)
    assert _plan(64, 16) == ReceivePlan(3, (103,), (1,), 3)


def test_full_hit_is_an_empty_plan() -> None:
    plan = _plan(64, 0)
    assert plan.empty and plan.local_ids == () and plan.remote_ids == ()
    assert plan.skip_blocks == 4
    # nothing is checked when nothing moves (vLLM passes no blocks then)
    assert _plan(64, 0, allocated=[], remote=[1]).empty


@pytest.mark.parametrize("external", [1, 15, 17, 31, 56, 63])
def test_hit_not_block_aligned_is_a_layout_error(external: int) -> None:
    with pytest.raises(LayoutError, match="whole blocks"):
        _plan(64, external)


def test_fewer_allocated_blocks_than_the_prompt() -> None:
    with pytest.raises(LayoutError, match="allocated"):
        _plan(64, 64, allocated=[100, 101, 102])
    with pytest.raises(LayoutError, match="allocated"):
        _plan(65, 65, allocated=[100, 101, 102, 103], remote=[1, 2, 3, 4, 5])
    with pytest.raises(LayoutError, match="allocated"):  # even when the hit covers the gap
        _plan(64, 16, allocated=[103])


@pytest.mark.parametrize("remote", [[7, 3, 9], [7, 3, 9, 1, 2], []], ids=len)
def test_remote_id_count_mismatch(remote: list[int]) -> None:
    with pytest.raises(LayoutError, match="prefill names"):
        _plan(64, 64, remote=remote)
    with pytest.raises(LayoutError, match="prefill names"):
        _plan(64, 32, remote=remote)


def test_last_partial_block() -> None:
    # 40 tokens: two full blocks and one of 8 tokens
    assert _plan(40, 40, remote=[7, 3, 9]) == ReceivePlan(0, (100, 101, 102), (7, 3, 9))
    assert _plan(40, 24, remote=[7, 3, 9]) == ReceivePlan(1, (101, 102), (3, 9), 1)
    assert _plan(40, 8, remote=[7, 3, 9]) == ReceivePlan(2, (102,), (9,), 2)
    assert _plan(1, 1, remote=[5]) == ReceivePlan(0, (100,), (5,))
    with pytest.raises(LayoutError):  # a hit of 24 tokens is not whole blocks
        _plan(40, 16, remote=[7, 3, 9])


def test_push_has_no_remote_ids() -> None:
    assert _plan(64, 32, remote=None) == ReceivePlan(2, (102, 103), (), 2)
    assert _plan(64, 64, remote=None) == ReceivePlan(0, (100, 101, 102, 103), ())


def test_remote_ids_in_prefills_block_size() -> None:
    # D blocks of 16, P blocks of 32 (heterogeneous block size): 64 tokens are 2 P blocks; a
    # local hit of 2 D blocks (32 tokens) is P's block 1 on
    plan = plan_receive(prompt_tokens=64, block_size=B, external_tokens=32,
                        allocated=[100, 101, 102, 103], remote_ids=[7, 3], remote_block_size=32)
    assert plan == ReceivePlan(2, (102, 103), (3,), 1)
    # P blocks of 8: a hit of 1 D block is 2 P blocks
    plan = plan_receive(prompt_tokens=40, block_size=B, external_tokens=24,
                        allocated=[100, 101, 102], remote_ids=[1, 2, 3, 4, 5], remote_block_size=8)
    assert plan == ReceivePlan(1, (101, 102), (3, 4, 5), 2)
    with pytest.raises(LayoutError, match="prefill names 3 blocks for a prompt of 2"):
        plan_receive(prompt_tokens=64, block_size=B, external_tokens=64,
                     allocated=[100, 101, 102, 103], remote_ids=[7, 3, 1], remote_block_size=32)


@pytest.mark.parametrize("external", [-1, 65, 1000])
def test_external_tokens_outside_the_prompt(external: int) -> None:
    with pytest.raises(LayoutError, match="outside"):
        _plan(64, external)


def test_numpy_ids_become_python_ints() -> None:
    plan = plan_receive(prompt_tokens=32, block_size=B, external_tokens=32,
                        allocated=cast(Sequence[int], np.array([4, 5, 6], dtype=np.int32)),
                        remote_ids=cast(Sequence[int], np.array([8, 9], dtype=np.int64)))
    assert plan == ReceivePlan(0, (4, 5), (8, 9))
    assert all(type(i) is int for i in plan.local_ids + plan.remote_ids)


def test_decode_room_beyond_the_prompt_is_not_received() -> None:
    plan = _plan(33, 33, remote=[7, 3, 9])
    assert plan.local_ids == (100, 101, 102)  # 104 and 105 are decode room


# -- prompt_digest ------------------------------------------------------------------------------


def test_prompt_digest_known_values() -> None:
    # computed once from the definition (blake2b-128, person "kvbridge-prompt", int64 LE);
    # a change here breaks every mixed-version fleet: P and D would refuse each other's claims
    assert prompt_digest(list(range(32))) == "022bc74b41ab1875063f950fe38036ce"
    assert prompt_digest([1, 2, 3]) == "921b8527550cbd3eaa640c127a64fbf5"
    assert prompt_digest([]) == "2f05bc84a08531294a9040a39a77c26a"


def test_prompt_digest_is_the_documented_hash() -> None:
    tokens = [0, 1, 151_643, 2**31 - 1, 2**40]
    data = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    want = hashlib.blake2b(data, digest_size=16, person=b"kvbridge-prompt").hexdigest()
    assert prompt_digest(tokens) == want
    assert len(want) == 32


def test_prompt_digest_is_stable_across_sequence_types() -> None:
    tokens = [5, 9, 12, 40_000]
    want = prompt_digest(tokens)
    assert prompt_digest(tuple(tokens)) == want
    assert prompt_digest(cast(Sequence[int], np.array(tokens, dtype=np.int32))) == want
    assert prompt_digest(cast(Sequence[int], np.array(tokens, dtype=np.int64))) == want
    assert prompt_digest(list(tokens)) == want  # and repeatable


def test_prompt_digest_tells_prompts_apart() -> None:
    base = [11, 22, 33, 44]
    seen = {prompt_digest(base)}
    for other in ([11, 22, 33, 45], [22, 11, 33, 44], [11, 22, 33], [11, 22, 33, 44, 0],
                  [0, 11, 22, 33, 44], [], [0], [11 + (1 << 32), 22, 33, 44]):
        digest = prompt_digest(other)
        assert digest not in seen, other
        seen.add(digest)


def test_prompt_digest_of_a_salted_prompt_is_its_tenants_only() -> None:
    tokens = [11, 22, 33, 44]
    a, b = prompt_digest(tokens, "tenant-A"), prompt_digest(tokens, "tenant-B")
    assert prompt_digest(tokens, None) == prompt_digest(tokens, "") == prompt_digest(tokens)
    assert len({a, b, prompt_digest(tokens)}) == 3  # a hand-off never crosses tenants
    assert a == prompt_digest(tuple(tokens), "tenant-A")


@pytest.mark.parametrize(("tier", "receive", "want"), [
    (None, (0, False), (None, False)),  # tier lookup in flight: ask again
    (None, (32, True), (None, False)),  # ... even when a receive is known
    (16, (0, False), (16, False)),  # tier hit: loaded before the forward
    (0, (0, False), (0, False)),  # nothing anywhere
    (16, (48, True), (48, True)),  # a receive wins; the tier part is loaded with it
])
def test_load_source(tier: int | None, receive: tuple[int, bool],
                     want: tuple[int | None, bool]) -> None:
    assert load_source(tier, *receive) == want


@pytest.mark.parametrize(("external", "tier", "receiving", "want"), [
    (0, 16, True, 0), (0, 16, False, 0),  # nothing allocated: nothing loaded
    (48, 16, True, 16),  # the tiers' prefix, the rest from prefill
    (16, 48, True, 16),  # never more than vLLM allocated
    (32, 0, False, 32),  # no receive: every external token is a tier hit
])
def test_tier_share(external: int, tier: int, receiving: bool, want: int) -> None:
    assert tier_share(external, tier, receiving) == want

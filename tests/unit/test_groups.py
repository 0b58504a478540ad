"""Hybrid models without vLLM: KV-cache groups, block refs, per-group planning and hand-offs.

A hybrid model (Gemma 3: sliding-window and full-attention layers) has one block table per
KV-cache group. These tests drive the vLLM-free parts the connector uses for it: the group
description and its handshake check, block refs through layouts and descriptors, what each side
holds and asks for per group (a sliding window's dropped blocks are vLLM's null block), the
scheduler-side book with its last-token backoff, and real pulls and pushes of refs between two
transfer loops over the ``memory`` transport (with the layers aliased as vLLM lays them out, and
separate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.config import Config
from kvbridge.errors import LayoutError, LayoutMismatch, ParamsError
from kvbridge.groups import (
    GroupKind,
    GroupWire,
    KVGroup,
    check_groups,
    group_counts,
    split_refs,
    suffix_of,
    to_refs,
)
from kvbridge.layout import KVLayout, LayoutWire, descriptor_pair
from kvbridge.params import parse
from kvbridge.scheduling.handoff import HandoffBook
from kvbridge.scheduling.planner import (
    held_refs,
    plan_group_receive,
    prompt_digest,
    sources_for,
)
from kvbridge.testing.agents import LocalAgent, make_caches
from kvbridge.testing.handoffs import FAST

B = 16  # block size of the agents' caches
W = 40  # sliding window (tokens)
NULL = 0  # vLLM's null block
SW = KVGroup(GroupKind.SLIDING, B, W)
FULL = KVGroup(GroupKind.FULL, B)
#: Gemma-3-like: two sliding-window groups and one full-attention group, one layer each
GROUPS = (dataclasses.replace(SW, planes=(0,)), dataclasses.replace(SW, planes=(1,)),
          dataclasses.replace(FULL, planes=(2,)))
SHAPE = (3, 80, B, 64)  # layers, blocks, block size, heads*head_dim
BLOCK_BYTES = 2 * B * 64 * 4  # one layer's K and V of one block, float32


# -- groups and refs -----------------------------------------------------------------------------


def test_refs_name_a_block_of_a_group_and_are_block_ids_without_groups() -> None:
    refs = to_refs(2, [5, 6], 3)
    assert refs == (17, 20)
    groups, blocks = split_refs(refs, 3)
    assert groups.tolist() == [2, 2] and blocks.tolist() == [5, 6]
    assert to_refs(0, [5, 6], 1) == (5, 6)  # one group: a ref is the block id
    assert split_refs([5, 6], 1)[1].tolist() == [5, 6]
    with pytest.raises(LayoutError, match="group 3"):
        to_refs(3, [1], 3)


def test_suffix_of_pairs_each_group_from_the_prompts_end() -> None:
    held = to_refs(0, [7, 8], 3) + to_refs(1, [9], 3) + to_refs(2, [1, 2, 3, 4], 3)
    assert group_counts(held, 3) == [2, 1, 4]
    assert suffix_of(held, [1, 1, 2], 3) == to_refs(0, [8], 3) + to_refs(1, [9], 3) + to_refs(
        2, [3, 4], 3)
    assert suffix_of(held, [0, 0, 0], 3) == ()
    with pytest.raises(LayoutError, match="group 1: 2 blocks asked, 1 held"):
        suffix_of(held, [0, 2, 0], 3)


def test_a_group_is_consistent_and_survives_the_wire() -> None:
    with pytest.raises(LayoutError, match="window"):
        KVGroup(GroupKind.SLIDING, B)
    with pytest.raises(LayoutError, match="window"):
        KVGroup(GroupKind.FULL, B, 40)
    with pytest.raises(LayoutError, match="block_size"):
        KVGroup(GroupKind.FULL, 0)
    for g in GROUPS:
        assert KVGroup.from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(g.to_wire()),
                                                        type=GroupWire)) == g
    with pytest.raises(LayoutError, match="unknown KV-cache group kind 'mamba'"):
        KVGroup.from_wire(GroupWire("mamba", B, 0, [0]))
    assert SW.describe() == f"sliding window {W}, block size {B}"


@pytest.mark.parametrize(("theirs", "words"), [
    ((), "KV-cache groups differ: 3 (sliding window 40"),
    (GROUPS[:2], "KV-cache groups differ: 3"),
    ((GROUPS[0], GROUPS[1], dataclasses.replace(GROUPS[0], planes=(2,))),
     "group 2 differs in kind"),
    ((GROUPS[0], dataclasses.replace(GROUPS[1], window=64), GROUPS[2]),
     "group 1 differs in sliding window: sliding window 40, block size 16 here, sliding window "
     "64, block size 16 at the peer"),
    ((dataclasses.replace(GROUPS[0], block_size=32), *GROUPS[1:]), "group 0 differs in block size"),
    ((GROUPS[0], GROUPS[1], dataclasses.replace(GROUPS[2], planes=(0,))), "differs in layers"),
], ids=["none", "count", "kind", "window", "block", "planes"])
def test_handshake_check_names_the_first_difference(theirs: tuple[KVGroup, ...],
                                                    words: str) -> None:
    check_groups(GROUPS, GROUPS)
    with pytest.raises(LayoutMismatch) as e:
        check_groups(GROUPS, theirs)
    assert words in str(e.value)
    if len(theirs) != len(GROUPS):  # the count message says how to fix it
        assert "hybrid KV-cache manager on both sides" in str(e.value)


# -- layouts with groups ----------------------------------------------------------------------


def _layout(aliased: bool = False, groups: tuple[KVGroup, ...] = GROUPS) -> KVLayout:
    return make_caches(SHAPE, groups, aliased)[1]


def test_a_layout_without_groups_keeps_its_fingerprint() -> None:
    plain = _layout(groups=())
    assert "groups" not in plain.geometry()
    hybrid = _layout()
    assert hybrid.fingerprint() != plain.fingerprint()
    assert hybrid.num_groups == 3 and plain.num_groups == 1
    for wire in (KVLayout.from_wire(hybrid.to_wire()), KVLayout.from_dict(hybrid.to_dict())):
        assert wire == hybrid
    with pytest.raises(LayoutMismatch, match="KV-cache groups differ"):
        hybrid.check_compatible(plain)


def test_hostile_groups_in_a_peers_layout_are_refused() -> None:
    wire = _layout().to_wire()
    bad = msgspec.structs.replace(wire, groups=[GroupWire("full", B, 0, [7])])
    with pytest.raises(LayoutError, match="names planes"):
        KVLayout.from_wire(bad)
    many = msgspec.msgpack.encode(msgspec.structs.replace(
        wire, groups=[GroupWire("full", B, 0, [0])] * 65))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(many, type=LayoutWire)
    with pytest.raises(LayoutError, match="window"):
        KVLayout.from_wire(msgspec.structs.replace(wire, groups=[GroupWire("sliding", B, 0, [0])]))


def test_refs_move_only_their_groups_planes() -> None:
    layout = _layout()
    planes = layout.planes
    refs = to_refs(0, [5], 3) + to_refs(2, [7, 8], 3)
    descs = layout.descriptors(refs).tolist()
    assert descs == [[planes[0].base + 5 * planes[0].block_stride, BLOCK_BYTES, 0],
                     [planes[2].base + 7 * planes[2].block_stride, 2 * BLOCK_BYTES, 0]]
    assert layout.nbytes(refs) == 3 * BLOCK_BYTES == sum(d[1] for d in descs)
    assert layout.block_ids(refs) == [5, 7, 8]
    # one layer's planes (layer-wise push): the other groups' refs move nothing
    only = layout.select([2])
    assert [g.planes for g in only.groups] == [(), (), (0,)]
    assert only.descriptors(to_refs(0, [5], 3)).shape == (0, 3)
    assert only.descriptors(to_refs(2, [7], 3)).tolist() == [
        [planes[2].base + 7 * planes[2].block_stride, BLOCK_BYTES, 0]]


def test_descriptor_pairs_refuse_refs_that_disagree() -> None:
    a, b = _layout(), _layout()
    with pytest.raises(LayoutError, match="different KV-cache groups"):
        descriptor_pair(a, to_refs(0, [1], 3), b, to_refs(1, [1], 3))
    with pytest.raises(LayoutError, match="duplicates"):  # one pool: a block has one group
        descriptor_pair(a, to_refs(0, [1], 3) + to_refs(2, [1], 3), b,
                        to_refs(0, [2], 3) + to_refs(2, [3], 3))
    with pytest.raises(LayoutError, match="out of range"):
        descriptor_pair(a, to_refs(0, [80], 3), b, to_refs(0, [1], 3))


# -- planning ------------------------------------------------------------------------------------


def _table(nulls: int, first: int, n: int) -> list[int]:
    """A group's block table of ``n`` blocks as vLLM gives it: ``nulls`` null blocks (where the
    window dropped them), then block ``first + i`` at index ``i``."""
    return [NULL] * nulls + list(range(first + nulls, first + n))


def test_prefill_holds_each_groups_blocks_after_its_window_dropped_some() -> None:
    # 150 tokens of 16: 10 blocks; each window dropped the first 6 (vLLM: (150-40+1)//16)
    tables = [_table(6, 10, 10), _table(6, 20, 10), _table(0, 30, 10)]
    held = held_refs(tables, GROUPS, 150, NULL)
    assert group_counts(held, 3) == [4, 4, 10]
    assert split_refs(held, 3)[1].tolist() == [16, 17, 18, 19, 26, 27, 28, 29, *range(30, 40)]
    # a full-attention group never drops a block, whatever its ids
    assert held_refs([[0, 1, 2]], (FULL,), 40, NULL) == (0, 1, 2)


def test_decode_asks_each_group_for_what_it_lacks() -> None:
    p_tables = [_table(6, 10, 10), _table(6, 20, 10), _table(0, 30, 10)]
    d_tables = [_table(6, 40, 11), _table(6, 52, 11), _table(0, 64, 11)]
    plan = plan_group_receive(prompt_tokens=150, groups=GROUPS, external_tokens=150,
                              allocated=d_tables, remote=p_tables, null_block=NULL)
    assert group_counts(plan.local_ids, 3) == [4, 4, 10]
    assert split_refs(plan.local_ids, 3)[1].tolist()[:4] == [46, 47, 48, 49]
    # P pairs them the same way from what it holds: the pull claim and the push sources agree
    held = held_refs(p_tables, GROUPS, 150, NULL)
    assert sources_for(held, plan.local_ids, plan.skip_blocks, 3) == plan.remote_ids
    assert sources_for(held, plan.remote_ids, plan.skip_blocks, 3) == plan.remote_ids


def test_a_local_prefix_hit_is_not_received_again() -> None:
    # D had 128 tokens cached (8 blocks): its windows kept blocks 6-7 of the hit, full kept all
    d_tables = [_table(6, 40, 11), _table(6, 52, 11), _table(0, 64, 11)]
    p_tables = [_table(6, 10, 10), _table(6, 20, 10), _table(0, 30, 10)]
    plan = plan_group_receive(prompt_tokens=150, groups=GROUPS, external_tokens=22,
                              allocated=d_tables, remote=p_tables, null_block=NULL)
    assert plan.skip_blocks == 8
    assert split_refs(plan.local_ids, 3)[1].tolist() == [48, 49, 60, 61, 72, 73]
    assert split_refs(plan.remote_ids, 3)[1].tolist() == [18, 19, 28, 29, 38, 39]
    # a hit covering everything: nothing to receive
    full = plan_group_receive(prompt_tokens=150, groups=GROUPS, external_tokens=0,
                              allocated=d_tables, remote=p_tables, null_block=NULL)
    assert full.empty


def test_a_block_decode_needs_but_prefill_dropped_fails_the_plan_naming_it() -> None:
    p_tables = [_table(7, 10, 10), _table(6, 20, 10), _table(0, 30, 10)]
    d_tables = [_table(6, 40, 11), _table(6, 52, 11), _table(0, 64, 11)]
    with pytest.raises(LayoutError, match=r"group 0 \(sliding window 40.*no longer holds "
                                          "block 6"):
        plan_group_receive(prompt_tokens=150, groups=GROUPS, external_tokens=150,
                           allocated=d_tables, remote=p_tables, null_block=NULL)
    # and P refuses to pair it (a push registration, a forged claim)
    held = held_refs(p_tables, GROUPS, 150, NULL)
    wanted = to_refs(0, [46, 47, 48, 49], 3)
    with pytest.raises(LayoutError, match="group 0: 4 blocks asked, 3 held"):
        sources_for(held, wanted, 0, 3)


@pytest.mark.parametrize(("d0", "why"), [
    ([1, 2, NULL, 3, 4, 5, 6, 7, 8, 9], "a block before the null block"),
    (list(range(1, 9)), "8 blocks allocated for a prompt of 10"),
])
def test_malformed_decode_tables_fail_the_plan(d0: list[int], why: str) -> None:
    d_tables = [d0, _table(6, 52, 11), _table(0, 64, 11)]
    with pytest.raises(LayoutError, match=why):
        plan_group_receive(prompt_tokens=150, groups=GROUPS, external_tokens=150,
                           allocated=d_tables, remote=None, null_block=NULL)


def test_an_engine_without_groups_keeps_the_skip_rule() -> None:
    with pytest.raises(LayoutError, match="3 blocks after 2 asked, the prompt has 4"):
        sources_for((1, 2, 3, 4), (7, 8, 9), 2, 0)
    assert sources_for((1, 2, 3, 4), (8, 9), 2, 0) == (3, 4)
    # one sliding-window group (all layers windowed): what D lacks after its own window and a
    # 2-block hit pairs from the end; the skip does not count what either window dropped
    assert sources_for((16, 17, 18, 19), (48, 49), 2, 1) == (18, 19)


# -- the scheduler-side book ------------------------------------------------------------------

PROMPT = list(range(1000, 1150))  # 150 tokens
P_TABLES = [_table(6, 10, 10), _table(6, 20, 10), _table(0, 30, 10)]  # P computed 149
D_TABLES = [_table(6, 40, 10), _table(6, 52, 10), _table(0, 64, 10)]


def _book(engine: str, groups: tuple[KVGroup, ...] = GROUPS) -> HandoffBook:
    return HandoffBook(Config.load({"backend": "memory"}, env={}), engine, block_size=B,
                       groups=groups, null_block=NULL if groups else None)


def test_a_hybrid_pull_hands_off_all_but_the_last_token_per_group() -> None:
    p, d = _book("P"), _book("D")
    p.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    assert p.prefill_cut("r1") == 1  # the connector drops P's last prompt token
    keep, answer = p.finished("r1", True, P_TABLES, 149)
    assert keep and answer is not None
    assert answer["remote_num_tokens"] == 149
    assert answer["remote_block_ids"] == [t[:10] for t in P_TABLES]  # vLLM's per-group form
    stage = p.take_plan().stages[0]
    assert stage.num_tokens == 149 and stage.prompt_digest == prompt_digest(PROMPT[:149])
    assert stage.block_ids == held_refs(P_TABLES, GROUPS, 149, NULL)

    params = {**answer, "remote_host": "127.0.0.1", "remote_port": 5000}
    d.on_new_request("d1", params, PROMPT)
    assert d.prefill_cut("d1") == 0
    assert d.matched_tokens("d1", 150, 0) == (149, True)  # D computes the last token itself
    assert d.matched_tokens("d1", 150, 128) == (21, True)
    d.after_alloc("d1", D_TABLES, 149, 150)
    order = d.take_plan().recvs[0]
    assert order.error is None and order.num_tokens == 149
    assert order.prompt_digest == stage.prompt_digest
    assert order.remote_ids == sources_for(stage.block_ids, order.remote_ids, 0, 3)
    assert split_refs(order.local_ids, 3)[1].tolist()[:4] == [46, 47, 48, 49]


def test_groups_that_cannot_match_refuse_the_pull_and_say_why(
        caplog: pytest.LogCaptureFixture) -> None:
    p = _book("P")
    p.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    _, answer = p.finished("r1", True, P_TABLES, 149)
    assert answer is not None
    params = {**answer, "remote_host": "127.0.0.1", "remote_port": 5000}
    plain = _book("D", groups=())
    plain.on_new_request("d1", params, PROMPT)
    assert plain.matched_tokens("d1", 150, 0) == (0, False)  # served locally
    assert plain.take_plan().counters["params_rejected"] == 1
    assert "names 3 KV-cache group(s), this engine has 1" in caplog.text
    # and the other way round: a hybrid D refuses a non-hybrid P's flat ids
    hybrid = _book("D2")
    hybrid.on_new_request("d2", {**params, "remote_block_ids": list(range(10))}, PROMPT)
    assert hybrid.matched_tokens("d2", 150, 0) == (0, False)
    assert "names 1 KV-cache group(s), this engine has 3" in caplog.text


def test_check_block_groups_names_a_wrong_table_length() -> None:
    params = parse({"remote_block_ids": [[1] * 10, [2] * 10, [3] * 9]})
    with pytest.raises(ParamsError, match="group 2 names 9 blocks, the prompt .* has 10"):
        params.check_block_groups(149, [B, B, B])


def test_full_attention_groups_hand_off_the_whole_prompt() -> None:
    groups = (dataclasses.replace(FULL, planes=(0,)), dataclasses.replace(FULL, planes=(1,)))
    book = _book("P", groups)
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    assert book.prefill_cut("r1") == 0
    _, answer = book.finished("r1", True, [list(range(10)), list(range(10, 20))], 150)
    assert answer is not None and answer["remote_num_tokens"] == 150


def test_a_table_per_group_is_required(caplog: pytest.LogCaptureFixture) -> None:
    book = _book("P")
    book.on_new_request("r1", {"do_remote_decode": True, "transfer_id": "t1"}, PROMPT)
    keep, answer = book.finished("r1", True, [list(range(10))], 149)  # one table, 3 groups
    assert keep is False and answer is not None
    assert "1 block tables for 3 KV-cache groups" in answer["kvbridge_error"]


# -- real transfers of refs ------------------------------------------------------------------


@pytest.fixture(params=[True, False], ids=["aliased", "separate"])
def hybrid_pd(request: pytest.FixtureRequest) -> Iterator[tuple[LocalAgent, LocalAgent, bool]]:
    aliased = bool(request.param)
    p = LocalAgent("hybrid-P", SHAPE, FAST, groups=GROUPS, aliased=aliased)
    d = LocalAgent("hybrid-D", SHAPE, FAST, groups=GROUPS, aliased=aliased)
    p.fill(7)
    try:
        yield p, d, aliased
    finally:
        p.close()
        d.close()


def _layer(agent: LocalAgent, layer: int, ids: list[int]) -> Any:
    return agent.caches[f"layer.{layer}"][ids]


def _handoff(p: LocalAgent, d: LocalAgent, mode: str, tid: str) -> tuple[Any, Any]:
    """P held 149 tokens of PROMPT in P_TABLES; D allocated D_TABLES: run the hand-off."""
    from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan

    plan = plan_group_receive(prompt_tokens=149, groups=GROUPS, external_tokens=149,
                              allocated=D_TABLES, remote=P_TABLES, null_block=NULL)
    digest = prompt_digest(PROMPT[:149])
    send = SendPlan("p", tid, held_refs(P_TABLES, GROUPS, 149, NULL), 149, digest)
    if mode == "pull":
        p.stage(send)
        d.pull(PullSpec("d", tid, p.address, plan.local_ids, plan.remote_ids, plan.skip_blocks,
                        149, digest, p.generation))
    else:
        d.expect(PushSpec("d", tid, p.address, plan.local_ids, plan.skip_blocks, 149, digest,
                          p.generation))
        p.ready(send)
    return plan, d.drain({"d"})


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_every_groups_blocks_land_in_their_own_layer(hybrid_pd: tuple[LocalAgent, LocalAgent,
                                                                        bool], mode: str) -> None:
    p, d, aliased = hybrid_pd
    plan, rd = _handoff(p, d, mode, f"t-{mode}")
    assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
    key = "pull_bytes" if mode == "pull" else "push_received_bytes"
    assert rd["stats"][key] == (4 + 4 + 10) * BLOCK_BYTES  # what D lacked, nothing more
    lg, lb = split_refs(plan.local_ids, 3)
    rg, rb = split_refs(plan.remote_ids, 3)
    for g in range(3):
        mine, theirs = lb[lg == g].tolist(), rb[rg == g].tolist()
        np.testing.assert_array_equal(_layer(d, g, mine), _layer(p, g, theirs))
        if not aliased:  # the other layers' blocks were not touched
            for other in {0, 1, 2} - {g}:
                assert not _layer(d, other, mine).any()
    assert p.drain({"p"})["results"]["finished_sending"] == {"p"}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_checksums_cover_every_groups_blocks(mode: str) -> None:
    """Checksum mode digests the refs' bytes in the same order on both sides."""
    extra = {**FAST, "checksum": True}
    p = LocalAgent("hybrid-P", SHAPE, extra, groups=GROUPS, aliased=True)
    d = LocalAgent("hybrid-D", SHAPE, extra, groups=GROUPS, aliased=True)
    try:
        p.fill(11)
        _, rd = _handoff(p, d, mode, f"t-sum-{mode}")
        assert rd["results"]["finished_recving"] == {"d"}
        assert not rd["results"]["failed_recving"]
        assert rd["stats"].get("checksum_mismatch", 0) == 0
    finally:
        p.close()
        d.close()


def test_a_forged_claim_for_a_dropped_block_is_refused(
        hybrid_pd: tuple[LocalAgent, LocalAgent, bool]) -> None:
    from kvbridge.scheduling.specs import PullSpec, SendPlan

    p, d, _ = hybrid_pd
    digest = prompt_digest(PROMPT[:149])
    p.stage(SendPlan("p", "t-forged", held_refs(P_TABLES, GROUPS, 149, NULL), 149, digest))
    # claim P's null block (and one before the window) for group 0
    forged = to_refs(0, [NULL, 15], 3)
    d.pull(PullSpec("d", "t-forged", p.address, to_refs(0, [40, 41], 3), forged, 0, 149,
                    digest, p.generation))
    rd = d.drain({"d"})
    assert rd["results"]["failed_recving"] == {"d"}
    assert rd["stats"].get("claim_refused", 0) == 1


def test_a_hybrid_prefill_and_a_plain_decode_refuse_each_other() -> None:
    from kvbridge.scheduling.specs import PullSpec, SendPlan

    p = LocalAgent("hybrid-P", SHAPE, FAST, groups=GROUPS)
    d = LocalAgent("plain-D", SHAPE, FAST)
    try:
        digest = prompt_digest(PROMPT[:149])
        p.stage(SendPlan("p", "t-mix", held_refs(P_TABLES, GROUPS, 149, NULL), 149, digest))
        d.pull(PullSpec("d", "t-mix", p.address, (1, 2), (3, 4), 0, 149, digest,
                        p.generation))
        rd = d.drain({"d"})
        assert rd["results"]["failed_recving"] == {"d"}
        assert "KV-cache groups differ" in (d.outcome("t-mix") or "")
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_one_sliding_window_group_with_a_prefix_hit(mode: str) -> None:
    """A model whose every layer has the window (Mistral-style): one group, refs are block ids,
    and a hit on D beyond what the windows dropped still pairs from the prompt's end."""
    from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan

    groups = (dataclasses.replace(SW, planes=(0,)),)
    p = LocalAgent("sw-P", (1, 80, B, 64), FAST, groups=groups)
    d = LocalAgent("sw-D", (1, 80, B, 64), FAST, groups=groups)
    try:
        p.fill(3)
        plan = plan_group_receive(prompt_tokens=149, groups=groups, external_tokens=149 - 128,
                                  allocated=D_TABLES[:1], remote=P_TABLES[:1], null_block=NULL)
        assert plan.local_ids == (48, 49) and plan.remote_ids == (18, 19)
        digest = prompt_digest(PROMPT[:149])
        send = SendPlan("p", "t-sw", held_refs(P_TABLES[:1], groups, 149, NULL), 149, digest)
        if mode == "pull":
            p.stage(send)
            d.pull(PullSpec("d", "t-sw", p.address, plan.local_ids, plan.remote_ids,
                            plan.skip_blocks, 149, digest, p.generation))
        else:
            d.expect(PushSpec("d", "t-sw", p.address, plan.local_ids, plan.skip_blocks, 149,
                              digest, p.generation))
            p.ready(send)
        rd = d.drain({"d"})
        assert rd["results"]["finished_recving"] == {"d"} and not rd["results"]["failed_recving"]
        np.testing.assert_array_equal(d.blocks([48, 49]), p.blocks([18, 19]))
    finally:
        p.close()
        d.close()

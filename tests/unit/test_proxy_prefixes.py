"""The proxy's approximate prefix index (kvbridge.proxy.prefixes): what each engine was sent."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.proxy.prefixes import MAX_UNITS, UNIT_BYTES, UNIT_TOKENS, PrefixIndex, prompt_of


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def body(prompt: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, **kw}


def test_a_recorded_prompt_is_held_up_to_its_last_token() -> None:
    index = PrefixIndex()
    p = prompt_of(body(ids(100)), chat=False)
    assert p.tokens == 100 and len(p.units) == 100 // UNIT_TOKENS
    assert index.held("http://d", p) == 0
    index.record("http://d", p)
    assert index.held("http://d", p) == 96  # whole units only
    assert index.held("http://other", p) == 0
    whole = prompt_of(body(ids(64)), chat=False)
    index.record("http://d", whole)
    assert index.held("http://d", whole) == 63  # vLLM always computes the last token


def test_a_shared_prefix_counts_up_to_the_first_unit_that_differs() -> None:
    index = PrefixIndex()
    index.record("d", prompt_of(body(ids(200)), chat=False))
    other = ids(70) + [999_999] + ids(129, start=71)
    assert index.held("d", prompt_of(body(other), chat=False)) == 64  # units 0-3 shared
    # a unit that matches after one that differs does not count: names chain the whole prefix
    changed_first = [7] + ids(199, start=1)
    assert index.held("d", prompt_of(body(changed_first), chat=False)) == 0


def test_tenants_and_models_never_share_a_prefix() -> None:
    index = PrefixIndex()
    index.record("d", prompt_of(body(ids(128), cache_salt="tenant-a"), chat=False))
    assert index.held("d", prompt_of(body(ids(128), cache_salt="tenant-a"), chat=False)) == 127
    assert index.held("d", prompt_of(body(ids(128), cache_salt="tenant-b"), chat=False)) == 0
    assert index.held("d", prompt_of(body(ids(128)), chat=False)) == 0
    other_model = {"model": "m2", "prompt": ids(128), "cache_salt": "tenant-a"}
    assert index.held("d", prompt_of(other_model, chat=False)) == 0


def test_text_and_chat_prompts_are_indexed_by_bytes() -> None:
    index = PrefixIndex()
    text = "x" * (UNIT_BYTES * 10 + 5)
    p = prompt_of(body(text), chat=False)
    assert len(p.units) == 10 and p.tokens == pytest.approx(len(text) / 4)
    index.record("d", p)
    longer = prompt_of(body([text + " and more words here"]), chat=False)  # a list of one
    assert index.held("d", longer) == pytest.approx(10 * UNIT_BYTES / 4)
    chat = {"model": "m", "messages": [{"role": "user", "content": "y" * 500}]}
    c = prompt_of(chat, chat=True)
    index.record("d", c)
    turn2 = {"model": "m", "messages": chat["messages"] + [{"role": "assistant", "content": "z"}]}
    assert index.held("d", prompt_of(turn2, chat=True)) > 0


def test_each_engine_keeps_only_its_capacity_freshest_units() -> None:
    index = PrefixIndex(capacity=8)
    a = prompt_of(body(ids(8 * UNIT_TOKENS)), chat=False)
    b = prompt_of(body(ids(8 * UNIT_TOKENS, start=10_000)), chat=False)
    index.record("d", a)
    index.record("d", b)
    assert index.size("d") == 8
    assert index.held("d", a) == 0 and index.held("d", b) > 0
    index.forget("d")
    assert index.size("d") == 0 and index.held("d", b) == 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


@pytest.mark.parametrize("prompt", [
    None, 17, {"a": 1}, [], [[1, 2], [3]], [None], [1.5, "x"], [2**80, -(2**70), True],
])
def test_hostile_prompts_give_a_prompt_and_never_raise(prompt: Any) -> None:
    p = prompt_of(body(prompt), chat=False)
    assert p.tokens >= 0 and len(p.units) <= MAX_UNITS
    index = PrefixIndex()
    index.record("d", p)
    assert index.held("d", p) >= 0
    assert prompt_of({"messages": object()}, chat=True).units == ()


def test_a_huge_prompt_hashes_at_most_max_units() -> None:
    p = prompt_of(body(ids(MAX_UNITS * UNIT_TOKENS + 5000)), chat=False)
    assert len(p.units) == MAX_UNITS and p.tokens == MAX_UNITS * UNIT_TOKENS + 5000
    t = prompt_of(body("a" * (MAX_UNITS * UNIT_BYTES * 2)), chat=False)
    assert len(t.units) == MAX_UNITS

"""Admission by KV credit (kvbridge.proxy.credit): needs, capacities, claims, queue and release."""

from __future__ import annotations

import asyncio

import pytest

from kvbridge.errors import ConfigError
from kvbridge.proxy.credit import (
    Capacity,
    KvAdmission,
    KvCredit,
    NoCredit,
    need_tokens,
    read_capacity,
)
from kvbridge.proxy.members import Admission, Pool, Role

METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="40"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


MODELS = {"object": "list", "data": [{"id": "tiny", "max_model_len": 1024}]}


def test_need_is_the_prompt_and_every_token_it_may_generate() -> None:
    assert need_tokens({"prompt": list(range(100)), "max_tokens": 50}, 1024) == 150
    assert need_tokens({"prompt": [list(range(100))], "max_tokens": 50}, 1024) == 150
    assert need_tokens({"prompt": "héllo", "max_tokens": 10}, 1024) == 16  # UTF-8 bytes
    # no max_tokens: vLLM generates up to max_model_len
    assert need_tokens({"prompt": list(range(100))}, 1024) == 1024
    assert need_tokens({"prompt": list(range(2000)), "max_tokens": 9}, 1024) == 1024
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": None}],
            "max_completion_tokens": 8}
    assert need_tokens(chat, 1024) == 2 + 16 + 16 + 8
    for hostile in ({"prompt": {"x": 1}}, {"prompt": None}, {"messages": "nope"},
                    {"max_tokens": "7", "prompt": "ab"}, {"prompt": [None, 3]}):
        assert 0 < need_tokens(hostile, 1024) <= 1024


def test_capacity_comes_from_vllms_metrics_and_models() -> None:
    cap = read_capacity(METRICS, MODELS)
    assert cap == Capacity(40, 32, 1024)
    assert cap.blocks_for(150) == 5 and cap.blocks_for(0) == 1 and cap.blocks_for(10**9) == 32
    for text, models in ((METRICS, {}), ("", MODELS), ("garbage{{{", MODELS),
                         (METRICS.replace('"40"', '"x"'), MODELS),
                         (METRICS, {"data": [{"max_model_len": "?"}]}), (METRICS, None)):
        assert read_capacity(text, models) is None


def credit(mode: KvAdmission, blocks: tuple[int, ...] = (10, 10), **kw: object) -> KvCredit:
    pool = Pool(Role.DECODE, [f"http://d{i}:1" for i in range(len(blocks))])
    c = KvCredit(pool, mode, **kw)  # type: ignore[arg-type]
    for e, b in zip(pool.engines, blocks, strict=True):
        c.set_capacity(e.url, Capacity(b, 32, 1024))
    return c


def body(tokens: int) -> dict[str, object]:
    return {"prompt": list(range(tokens - 10)), "max_tokens": 10}


async def test_each_request_goes_to_the_engine_with_most_credit_until_none_fits() -> None:
    c = credit(KvAdmission.REJECT)
    a = await c.admit(body(192))  # 6 blocks
    b = await c.admit(body(192))
    assert a.engine is not b.engine and {c.credit(e) for e in c.decodes.engines} == {4}
    small = await c.admit(body(128))  # 4 blocks: fits either
    with pytest.raises(NoCredit, match="no decode engine has KV for this request"):
        await c.admit(body(192))
    small.release()
    small.release()  # idempotent
    with pytest.raises(NoCredit):  # 4 free on each: still no room for 6
        await c.admit(body(192))
    a.release()
    r = await c.admit(body(192))
    assert r.engine is not None
    for x in (b, r):
        x.release()
    assert c.reserved == {}


async def test_a_claim_follows_its_request_to_another_engine() -> None:
    c = credit(KvAdmission.REJECT)
    r = await c.admit(body(192))
    other = next(e for e in c.decodes.engines if e is not r.engine)
    assert c.fits(other, r)
    r.move(other)
    assert c.credit(other) == 4 and r.engine is other
    assert sum(c.reserved.values()) == 6
    r.release()
    assert c.reserved == {}


async def test_queue_waits_for_a_release_and_is_bounded() -> None:
    c = credit(KvAdmission.QUEUE, (10,), queue=1, queue_s=5.0)
    first = await c.admit(body(320))
    waiter = asyncio.ensure_future(c.admit(body(320)))
    await asyncio.sleep(0.05)
    assert not waiter.done() and c.queued() == 1
    with pytest.raises(NoCredit):  # the queue holds one
        await c.admit(body(32))
    first.release()
    second = await asyncio.wait_for(waiter, 2)
    assert second.engine is not None and c.queued() == 0
    quick = credit(KvAdmission.QUEUE, (10,), queue_s=0.2)
    held = await quick.admit(body(320))
    with pytest.raises(NoCredit, match="after waiting 0.2s"):
        await quick.admit(body(32))
    held.release()


async def test_a_request_bigger_than_any_engine_runs_alone_and_unknown_capacity_is_unlimited(
) -> None:
    c = credit(KvAdmission.REJECT, (4,))
    huge = await c.admit(body(1000))  # 32 blocks > 4: admitted on the idle engine
    with pytest.raises(NoCredit):
        await c.admit(body(32))
    huge.release()
    c.set_capacity(c.decodes.engines[0].url, None)
    r = await c.admit(body(1000))
    assert r.engine is None  # nothing known: nothing limited


async def test_off_admits_everything_and_draining_engines_get_no_claims() -> None:
    off = credit(KvAdmission.OFF, (1,))
    assert (await off.admit(body(1000))).engine is None
    c = credit(KvAdmission.REJECT)
    c.decodes.engines[0].admit(Admission.DRAINING)
    r = await c.admit(body(32))
    assert r.engine is c.decodes.engines[1]


def test_bad_settings_are_refused() -> None:
    pool = Pool(Role.DECODE, ["http://d:1"])
    for kw in ({"fraction": 0}, {"fraction": 17}, {"queue": -1}, {"queue_s": -1}):
        with pytest.raises(ConfigError):
            KvCredit(pool, KvAdmission.QUEUE, **kw)  # type: ignore[arg-type]

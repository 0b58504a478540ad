"""kvbridge.proxy.pool.read_capped: a body that arrives in pieces is read whole (up to a cap).

``StreamReader.read(n)`` returns what has arrived; the proxy read an engine's /metrics that way
and, when the text came in several pieces, missed ``vllm:cache_config_info`` further down (CI:
"reports no KV capacity"). In-process only: a StreamReader fed by the test."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest

from kvbridge.proxy.pool import read_capped


def _stream(pieces: list[bytes], gap_s: float = 0.01) -> aiohttp.StreamReader:
    loop = asyncio.get_running_loop()
    stream = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)
    for i, piece in enumerate(pieces):
        loop.call_later(gap_s * (i + 1), stream.feed_data, piece)
    loop.call_later(gap_s * (len(pieces) + 1), stream.feed_eof)
    return stream


@pytest.mark.parametrize(("pieces", "limit", "want"), [
    ([b"# a\n", b"x 1\n", b"vllm:cache_config_info{} 1\n"], 1 << 20,
     b"# a\nx 1\nvllm:cache_config_info{} 1\n"),
    ([b"abc", b"def"], 4, b"abcde"),  # over the limit: limit + 1 bytes, no more
    ([b"abcd"], 4, b"abcd"),
    ([], 4, b""),
])
def test_every_piece_is_read_up_to_the_cap(pieces: list[bytes], limit: int, want: bytes) -> None:
    async def main() -> bytes:
        return await read_capped(_stream(pieces), limit)

    assert asyncio.run(main()) == want

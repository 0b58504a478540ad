"""What to move: block arithmetic of one hand-off, with no vLLM and no I/O.

The connector asks this module which blocks a request needs from its prefill engine, given the
prompt length, the block size, how many prompt tokens this engine already holds (a local prefix
hit), the blocks vLLM allocated and, for a pull, the prefill engine's block ids. A partial hit
on the decode side moves exactly the missing blocks; a full hit moves none.

It also fixes the identity of a prompt on both sides: :func:`prompt_digest` is what a decode
engine sends with its claim or registration and what the prefill engine compares with its own
request, so KV is only ever handed to the same prompt.

Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import LayoutError

__all__ = ["ReceivePlan", "blocks_for", "prompt_digest", "plan_receive", "prompt_blocks"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (the last one may be partial)."""
    if block_size <= 0:
        raise LayoutError(f"block_size must be > 0, got {block_size}")
    return -(-num_tokens // block_size)


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short stable digest of a prompt's token ids (blake2b-128 over int64 little-endian)."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16, person=b"kvbridge-prompt").hexdigest()


def prompt_blocks(block_ids: Sequence[int], num_prompt_tokens: int, block_size: int) -> list[int]:
    """The leading blocks of ``block_ids`` that hold the prompt."""
    return list(block_ids[: blocks_for(num_prompt_tokens, block_size)])


@dataclass(frozen=True)
class ReceivePlan:
    """One decode-side hand-off: fill ``local_ids`` with the prompt's blocks from
    ``skip_blocks`` on (``remote_ids``: the prefill engine's ids of those tokens, for a pull,
    from its block ``remote_skip`` on: its blocks may be of another size)."""

    skip_blocks: int
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    remote_skip: int = 0

    @property
    def empty(self) -> bool:
        return not self.local_ids


def plan_receive(*, prompt_tokens: int, block_size: int, external_tokens: int,
                 allocated: Sequence[int], remote_ids: Sequence[int] | None,
                 remote_block_size: int | None = None) -> ReceivePlan:
    """The blocks a decode request must receive.

    ``external_tokens`` is what the connector asked vLLM to load (the prompt minus the local
    prefix hit); the hit is whole blocks. ``allocated`` are the request's blocks in prompt order
    (at least the prompt's); ``remote_ids`` the prefill engine's prompt blocks (pull) or None
    (push), in blocks of ``remote_block_size`` tokens (default ``block_size``). Raises
    :class:`LayoutError` if the numbers cannot describe one prompt.
    """
    if not 0 <= external_tokens <= prompt_tokens:
        raise LayoutError(f"external_tokens {external_tokens} outside [0, {prompt_tokens}]")
    n_blocks = blocks_for(prompt_tokens, block_size)
    if external_tokens == 0:
        return ReceivePlan(n_blocks, (), ())
    hit = prompt_tokens - external_tokens
    if hit % block_size:
        raise LayoutError(f"a local prefix hit of {hit} tokens is not whole blocks of "
                          f"{block_size}")
    skip = hit // block_size
    if len(allocated) < n_blocks:
        raise LayoutError(f"{len(allocated)} blocks allocated for a prompt of {n_blocks}")
    local = tuple(int(b) for b in allocated[skip:n_blocks])
    remote: tuple[int, ...] = ()
    size = remote_block_size or block_size
    remote_skip = hit // size
    if remote_ids is not None:
        n_remote = blocks_for(prompt_tokens, size)
        if len(remote_ids) != n_remote:
            raise LayoutError(f"prefill names {len(remote_ids)} blocks for a prompt of "
                              f"{n_remote}")
        remote = tuple(int(b) for b in remote_ids[remote_skip:n_remote])
    return ReceivePlan(skip, local, remote, remote_skip)

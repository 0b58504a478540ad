"""What to move: block arithmetic of one hand-off, with no vLLM and no I/O.

The connector asks this module which blocks a request needs from its prefill engine, given the
prompt length, the block size, how many prompt tokens this engine already holds (a local prefix
hit), the blocks vLLM allocated and, for a pull, the prefill engine's block ids. A partial hit
on the decode side moves exactly the missing blocks; a full hit moves none.

For a hybrid model (several KV-cache groups, :mod:`kvbridge.groups`) the same arithmetic runs per
group on the group's own block table: :func:`plan_group_receive` asks, per group, for the blocks
D allocated and lacks, and :func:`held_refs` is what P still holds; a sliding-window group's
table starts with vLLM's null block where the window dropped blocks, and those are neither sent
nor received. Both sides name blocks by block refs, so everything downstream is one flat list.

It also decides, for a decode request, where its missing tokens come from: a P/D receive, this
engine's offload tiers, or both (:func:`load_source`, :func:`tier_share`); the connector passes
what each side offers and tells vLLM the answer.

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
from kvbridge.groups import GroupKind, KVGroup, group_counts, suffix_of, to_refs

__all__ = ["ReceivePlan", "blocks_for", "prompt_digest", "plan_receive", "prompt_blocks",
           "plan_group_receive", "held_refs", "kept_suffix", "sources_for", "load_source",
           "tier_share"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens (the last one may be partial)."""
    if block_size <= 0:
        raise LayoutError(f"block_size must be > 0, got {block_size}")
    return -(-num_tokens // block_size)


def prompt_digest(token_ids: Sequence[int], salt: str | None = None) -> str:
    """A short stable digest of a prompt's token ids (blake2b-128 over int64 little-endian),
    and of its ``cache_salt`` when it has one (a hand-off never crosses tenants)."""
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    if not salt:
        return hashlib.blake2b(data, digest_size=16, person=b"kvbridge-prompt").hexdigest()
    key = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=32).digest()
    return hashlib.blake2b(data, digest_size=16, key=key, person=b"kvbridge-psalt").hexdigest()


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


# -- KV-cache groups ----------------------------------------------------------------------------


def kept_suffix(table: Sequence[int], group: KVGroup, null_block: int | None) -> int:
    """Index of the first block of ``table`` after the last ``null_block`` (vLLM's placeholder
    for a block a sliding window dropped): the group holds ``table[start:]``. 0 for a
    full-attention group, which never drops blocks."""
    if group.kind is not GroupKind.SLIDING or null_block is None:
        return 0
    nulls = [i for i, b in enumerate(table) if b == null_block]
    return nulls[-1] + 1 if nulls else 0


def held_refs(tables: Sequence[Sequence[int]], groups: Sequence[KVGroup], prompt_tokens: int,
              null_block: int | None) -> tuple[int, ...]:
    """P: refs of the prompt blocks every group still holds (group-major, prompt order): each
    group's prompt blocks after the ones its window dropped."""
    if len(tables) != len(groups):
        raise LayoutError(f"{len(tables)} block tables for {len(groups)} KV-cache groups")
    out: list[int] = []
    for g, (table, group) in enumerate(zip(tables, groups, strict=True)):
        prompt = prompt_blocks(table, prompt_tokens, group.block_size)
        out.extend(to_refs(g, prompt[kept_suffix(prompt, group, null_block):], len(groups)))
    return tuple(out)


def plan_group_receive(*, prompt_tokens: int, groups: Sequence[KVGroup], external_tokens: int,
                       allocated: Sequence[Sequence[int]],
                       remote: Sequence[Sequence[int]] | None,
                       null_block: int | None) -> ReceivePlan:
    """:func:`plan_receive` for an engine with KV-cache groups; the plan's ids are block refs.

    Per group: the prompt's blocks from the local prefix hit on, less the leading ones D's own
    sliding window already dropped (vLLM allocated the null block there: nothing to receive).
    ``allocated`` is D's block table per group, ``remote`` P's (pull; positional, null block
    where P's window dropped one) or None (push). ``skip_blocks`` is the hit in blocks of group
    0 (the groups' suffixes are what P checks). Raises :class:`LayoutError` naming the group.
    """
    if not 0 <= external_tokens <= prompt_tokens:
        raise LayoutError(f"external_tokens {external_tokens} outside [0, {prompt_tokens}]")
    if len(allocated) != len(groups) or (remote is not None and len(remote) != len(groups)):
        raise LayoutError(f"{len(allocated)} local and "
                          f"{'no' if remote is None else len(remote)} remote block tables for "
                          f"{len(groups)} KV-cache groups")
    hit = prompt_tokens - external_tokens
    local: list[int] = []
    theirs: list[int] = []
    n_groups = len(groups)
    for g, group in enumerate(groups):
        size = group.block_size
        n_blocks = blocks_for(prompt_tokens, size)
        if external_tokens == 0:
            continue
        if hit % size:
            raise LayoutError(f"group {g}: a local prefix hit of {hit} tokens is not whole "
                              f"blocks of {size}")
        if len(allocated[g]) < n_blocks:
            raise LayoutError(f"group {g}: {len(allocated[g])} blocks allocated for a prompt "
                              f"of {n_blocks}")
        want = list(allocated[g][hit // size:n_blocks])
        start = kept_suffix(want, group, null_block)
        if any(b != null_block for b in want[:start]):
            raise LayoutError(f"group {g}: a block before the null block in the blocks to "
                              "receive (a window drops only a prefix)")
        want = want[start:]
        start += hit // size
        local.extend(to_refs(g, want, n_groups))
        if remote is None:
            continue
        if len(remote[g]) != n_blocks:
            raise LayoutError(f"group {g}: prefill names {len(remote[g])} blocks for a prompt "
                              f"of {n_blocks}")
        src = list(remote[g][start:n_blocks])
        if null_block is not None and null_block in src:
            raise LayoutError(f"group {g} ({group.describe()}): prefill no longer holds block "
                              f"{start + src.index(null_block)} of the prompt, which this "
                              "engine needs (its window dropped it)")
        theirs.extend(to_refs(g, src, n_groups))
    skip = hit // groups[0].block_size if groups else 0
    return ReceivePlan(skip, tuple(local), tuple(theirs), skip)


def sources_for(held: Sequence[int], wanted: Sequence[int], skip_blocks: int,
                groups: int) -> tuple[int, ...]:
    """P: the refs of its own that pair with ``wanted`` (the blocks a decode engine asks for,
    ``skip_blocks`` after the prompt's first): per group, the same number of blocks from the end
    of what P ``held`` for the prompt. ``groups`` is the engine's number of KV-cache groups, 0
    for an engine without (then ``skip_blocks`` and ``wanted`` must make up the prompt). Raises
    :class:`LayoutError` when P holds fewer blocks than asked."""
    if not groups and skip_blocks + len(wanted) != len(held):
        raise LayoutError(f"{len(wanted)} blocks after {skip_blocks} asked, the prompt has "
                          f"{len(held)}")
    n = max(groups, 1)
    return suffix_of(held, group_counts(wanted, n), n)


# -- where a decode request's missing tokens come from -----------------------------------------


def load_source(tier_tokens: int | None, receive_tokens: int,
                receive_async: bool) -> tuple[int | None, bool]:
    """vLLM's ``get_num_new_matched_tokens``: ``(tokens to load, asynchronously?)``.

    ``tier_tokens`` is what this engine's offload tiers hold beyond what vLLM computed (None:
    the lookup is still in flight), ``receive_tokens``/``receive_async`` what the P/D receive
    brings. While the tier lookup is in flight the answer is ``(None, False)``: vLLM asks again
    next step. A receive wins (the tier part is loaded with it, before it, see
    :func:`tier_share`); else a tier hit, copied in before this step's forward."""
    if tier_tokens is None:
        return None, False
    if receive_tokens or receive_async:
        return receive_tokens, receive_async
    return tier_tokens, False


def tier_share(external_tokens: int, tier_tokens: int, receiving: bool) -> int:
    """vLLM's ``update_state_after_alloc``: of the ``external_tokens`` vLLM allocated for a
    request, how many the offload tiers load (``tier_tokens``: what they hold). With a P/D
    receive (``receiving``) the tiers load the leading part they hold and the prefill engine
    sends the rest; without, every external token came from the tiers."""
    if not external_tokens:
        return 0
    return min(tier_tokens, external_tokens) if receiving else external_tokens

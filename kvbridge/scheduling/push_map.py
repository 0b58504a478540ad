"""What one decode rank's push moves, from P's side (:mod:`kvbridge.scheduling.push`): the
tokens it receives, P's blocks that pair with the ones it registered, the WRITE's
sub-transfers in some planes, P's side of the part's stream, and whether a registration
matches P's plan at all.

Pure functions of the loop's context and one push's state (:mod:`~kvbridge.scheduling.
push_state`); called on the transfer loop's thread. They raise :class:`~kvbridge.errors.
LayoutError` / :class:`~kvbridge.errors.LayoutMismatch` for ids or shapes that cannot be mapped.
"""

from __future__ import annotations

from kvbridge.errors import KVBridgeError
from kvbridge.layout import DescriptorArray
from kvbridge.scheduling import mapping
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.planner import sources_for
from kvbridge.scheduling.push_state import Out, Target

__all__ = ["mismatch", "side", "source", "span", "subs"]


def mismatch(core: LoopContext, out: Out, t: Target) -> str | None:
    """Why ``t``'s registration cannot be served from ``out``'s plan (its prompt or its
    blocks differ from P's), or None (also while the plan is not known)."""
    plan, reg = out.plan, t.reg
    if plan is None:
        return None
    if reg.num_tokens != plan.num_tokens:
        return f"prefill computed {plan.num_tokens} tokens, decode expects {reg.num_tokens}"
    if reg.prompt_digest != plan.prompt_digest:
        return "decode's prompt differs from the prompt prefilled here"
    if core.layout.groups:  # a hybrid model: P's blocks pair with D's per group
        try:
            source(core, out, t)
        except KVBridgeError as exc:
            return (f"decode wants {len(reg.block_ids)} blocks after {reg.skip_blocks}, the "
                    f"prompt has {len(plan.block_ids)} here ({exc})")
        return None
    blocks = (len(plan.block_ids) if t.shape is None
              else -(-plan.num_tokens // t.shape.block_size))
    if t.shape is not None or core.heads is None:
        if reg.skip_blocks + len(reg.block_ids) != blocks:
            return (f"decode wants {len(reg.block_ids)} blocks after {reg.skip_blocks}, the "
                    f"prompt has {blocks}")
    return None


def source(core: LoopContext, out: Out, t: Target) -> tuple[tuple[int, ...], int]:
    """P's blocks that pair with the ones ``t`` registered, and the prompt block they start
    at: per KV-cache group for a hybrid model (equal shapes only), else from the first of D's
    missing tokens (in this rank's block size)."""
    assert out.plan is not None
    if core.layout.groups:
        return (sources_for(out.plan.block_ids, t.reg.block_ids, t.reg.skip_blocks,
                            len(core.layout.groups)), t.reg.skip_blocks)
    _, first = span(core, out, t)
    return out.plan.block_ids[first:], first


def span(core: LoopContext, out: Out, t: Target) -> tuple[mapping.Span, int]:
    """The tokens ``t`` receives and this rank's first prompt block of them."""
    assert out.plan is not None and t.shape is not None
    first = t.reg.skip_blocks * t.shape.block_size
    return mapping.Span(first, out.plan.num_tokens), first // core.layout.block_size


def subs(core: LoopContext, out: Out, t: Target, planes: list[int]) -> list[mapping.SubTransfer]:
    """The sub-transfers of ``t``'s WRITE in ``planes``."""
    assert out.plan is not None and t.peer is not None and t.shape is not None
    tokens, _ = span(core, out, t)
    src, first = source(core, out, t)
    return mapping.pair(core.layout.select(planes), core.shape, src, first,
                        t.peer.layout.select(planes), t.shape, t.reg.block_ids,
                        t.reg.skip_blocks, t.share, tokens)


def side(core: LoopContext, out: Out, t: Target) -> DescriptorArray:
    """This rank's side of ``t``'s part (every plane), as its digests cover it."""
    assert out.plan is not None and t.shape is not None
    tokens, _ = span(core, out, t)
    src, first = source(core, out, t)
    return mapping.side_descriptors(mapping.side(core.layout, core.shape, t.shape, t.share, src,
                                                 first, tokens))

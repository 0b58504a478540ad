"""vLLM's KV-cache groups → kvbridge's :class:`~kvbridge.groups.KVGroup` (hybrid models).

With vLLM's hybrid KV-cache manager on, a model with several attention types (Gemma 3's
sliding-window and full-attention layers) gets one KV-cache group per type (split further so
that every group has as many layers), each with its own block table per request. kvbridge moves
full-attention and sliding-window groups; anything else is refused at start-up with a message
naming the group, because its blocks are not "the KV of the prompt's tokens" and moving them
blindly would produce wrong tokens with HTTP 200:

- Mamba / SSM state (``MambaSpec``): a recurrent state per request, not per-token KV;
- chunked local attention, circular buffers, R-SWA, attention sinks, cross-attention,
  encoder-only layers, HiSparse host groups, EAGLE/MTP draft groups and groups vLLM marks as
  not transferable;
- mixed page sizes packed into one block (``UniformTypeKVCacheSpecs``).

A model with one group (every non-hybrid model, and a hybrid one started with
``--disable-hybrid-kv-cache-manager``) has no groups here: ``()``, exactly as before. A model
whose only group is a sliding window (Mistral-style, hybrid manager on) has one group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvbridge.errors import ConfigError
from kvbridge.groups import GroupKind, KVGroup
from kvbridge.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["NULL_BLOCK", "kv_groups", "group_layers", "with_groups", "shorten_prompt"]

#: The id of vLLM's null block (``BlockPool`` reserves block 0): where a sliding-window group's
#: table has it, the window dropped that block.
NULL_BLOCK = 0


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The engine's groups without planes (the scheduler's view); ``()`` for one full-attention
    group. :class:`ConfigError` naming the group for a kind kvbridge cannot move."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    specs = kv_cache_config.kv_cache_groups
    out: list[KVGroup] = []
    for i, group in enumerate(specs):
        spec = group.kv_cache_spec
        where = f"KV-cache group {i} ({len(group.layer_names)} layer(s), e.g. " \
                f"{group.layer_names[0] if group.layer_names else '-'})"
        if group.host_resident or not group.enable_kv_transfer or group.is_eagle_group:
            raise ConfigError(f"{where} is a host-resident, draft or non-transferable group; "
                              "kvbridge cannot move it: start vLLM with "
                              "--disable-hybrid-kv-cache-manager")
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            out.append(KVGroup(GroupKind.FULL, int(spec.block_size)))
        elif type(spec) is SlidingWindowSpec and not spec.extra_retained_tokens:
            out.append(KVGroup(GroupKind.SLIDING, int(spec.block_size),
                               int(spec.sliding_window)))
        else:
            kind = type(spec).__name__
            why = (" (Mamba/SSM state is not per-token KV)" if "Mamba" in kind else "")
            raise ConfigError(f"{where} is {kind}{why}: kvbridge moves full-attention and "
                              "sliding-window KV only. Start vLLM with "
                              "--disable-hybrid-kv-cache-manager if the model allows it")
    if len(out) == 1 and out[0].kind is GroupKind.FULL:
        return ()
    return tuple(out)


def group_layers(kv_cache_config: KVCacheConfig) -> tuple[tuple[str, ...], ...]:
    """Each group's layer names (the keys of the KV caches vLLM registers)."""
    return tuple(tuple(g.layer_names) for g in kv_cache_config.kv_cache_groups)


def with_groups(layout: KVLayout, groups: Sequence[KVGroup],
                layers: Sequence[Sequence[str]], kv_caches: Mapping[str, object]) -> KVLayout:
    """``layout`` with ``groups`` naming the planes of their layers. :class:`ConfigError` when
    a group's layer has no KV cache on this rank (pipeline parallelism is refused earlier)."""
    if not groups:
        return layout
    named: list[KVGroup] = []
    for i, (group, names) in enumerate(zip(groups, layers, strict=True)):
        planes: list[int] = []
        for name in names:
            found = layout.plane_indices(name) if name in kv_caches else []
            if not found:
                raise ConfigError(f"KV-cache group {i}: layer {name!r} has no KV cache here")
            planes.extend(found)
        named.append(dataclasses.replace(group, planes=tuple(planes)))
    return dataclasses.replace(layout, groups=tuple(named))


def shorten_prompt(request: Request, cut: int) -> None:
    """P, before ``request`` is first scheduled: drop its last ``cut`` prompt tokens, so it
    prefills only what it hands off (:attr:`kvbridge.scheduling.handoff.HandoffBook.backoff`).

    vLLM's ``Request`` has no API for this; the fields are the ones vLLM itself derives from the
    prompt (NIXL does the same for Mamba models). The block hashes of the original prompt stay:
    a full block hashed with a dropped token is never computed here, so never cached."""
    if cut <= 0 or request.num_computed_tokens or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-cut:]
    del request._all_token_ids[-cut:]
    request.num_prompt_tokens -= cut

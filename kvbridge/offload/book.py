"""The scheduler side of offload: which prompts to look up, what a hit is worth, what to store.

:class:`OffloadBook` answers vLLM's scheduler from plain values (request id, prompt token ids,
block-aligned local hit, block ids) and collects, per step, an
:class:`~kvbridge.offload.orders.OffloadPlan` for the worker ranks. It is vLLM-free and
single-threaded (vLLM's engine-core thread).

A request's life with offload:

1. ``matched`` (from ``get_num_new_matched_tokens``): the first call computes the prompt's block
   keys and asks every rank to look up and *stage* the prefix; until every rank has answered it
   returns ``None`` (vLLM asks again next step). The hit is the smallest answer over the ranks
   (each holds its own shard), capped so at least one prompt token is left to compute. A lookup
   that gets no answer within ``LOOKUP_TIMEOUT_S`` counts as a miss.
2. ``committed`` (from ``update_state_after_alloc``): the tier blocks vLLM accepted become a
   :class:`LoadOrder` (the worker copies the staged chunks before the step's forward), or the
   staging is released.
3. ``finished`` (from ``request_finished``): a request that ended normally stores its full
   prompt blocks; the book asks vLLM to hold them until every rank has copied them out.

Because the worker has verified the chunks *before* the hit is reported, a chunk that is
corrupted or missing shortens the hit (vLLM computes the rest) instead of failing the load.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.offload.config import OffloadConfig
from kvbridge.offload.keys import block_keys, salted
from kvbridge.offload.orders import LoadOrder, LookupOrder, OffloadPlan, StoreOrder

__all__ = ["OffloadBook", "LOOKUP_TIMEOUT_S"]

log = logging.getLogger("kvbridge.offload")

#: a lookup unanswered for this long is a miss (a rank stuck on a slow remote tier)
LOOKUP_TIMEOUT_S = 5.0


@dataclass
class _Req:
    keys: list[str]  # every full prompt block
    lookup_id: str = ""
    start: int = 0  # first block looked up (the local hit when the lookup started)
    answers: dict[int, int] = field(default_factory=dict)
    asked: float = 0.0
    hit_blocks: int | None = None  # staged on every rank, from ``start``
    num_computed: int = 0  # the local hit vLLM reported last
    settled: bool = False  # load ordered or staging released


class OffloadBook:
    """See the module docstring. ``seed`` from :func:`kvbridge.offload.keys.seed_key`."""

    def __init__(self, config: OffloadConfig, seed: bytes, *, block_size: int,
                 tp_size: int = 1) -> None:
        self.config = config
        self.seed = seed
        self.block_size = block_size
        self.tp_size = tp_size
        self.stats: Counter[str] = Counter()
        self._reqs: dict[str, _Req] = {}
        self._plan = OffloadPlan()
        self._ids = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def _req(self, req_id: str, prompt: Sequence[int] | None, salt: str | None) -> _Req | None:
        req = self._reqs.get(req_id)
        if req is None and prompt is not None:
            try:
                keys = block_keys(salted(self.seed, salt), prompt, self.block_size)
            except ValueError:
                keys = []
            req = self._reqs[req_id] = _Req(keys)
        return req

    # -- lookups ---------------------------------------------------------------------------------

    def matched(self, req_id: str, prompt: Sequence[int] | None, num_computed: int,
                salt: str | None = None) -> int | None:
        """Tokens beyond ``num_computed`` the tiers can supply; ``None`` = not known yet.
        ``salt``: the request's ``cache_salt`` (its keys are only its tenant's)."""
        if not (self.enabled and self.config.load) or prompt is None:
            return 0
        req = self._req(req_id, prompt, salt)
        if req is None:
            return 0
        if req.settled and req.lookup_id:  # preempted after its load: look up afresh
            req.lookup_id, req.answers, req.hit_blocks, req.settled = "", {}, None, False
        req.num_computed = num_computed
        usable = (len(prompt) - 1) // self.block_size  # leave >= 1 token to compute
        if req.hit_blocks is None:
            if not req.lookup_id:
                start = num_computed // self.block_size
                want = req.keys[start:usable]
                if len(want) < self.config.min_blocks:
                    req.hit_blocks, req.settled = 0, True
                    return 0
                req.lookup_id = f"{req_id}#{next(self._ids)}"
                req.start, req.asked = start, time.monotonic()
                self._plan.lookups.append(LookupOrder(req.lookup_id, tuple(want)))
                self.stats["offload_lookups"] += 1
                return None
            if len(req.answers) < self.tp_size:
                if time.monotonic() - req.asked < LOOKUP_TIMEOUT_S:
                    return None
                self.stats["offload_lookup_timeouts"] += 1
                log.warning("offload lookup %s: %d of %d rank(s) answered within %.0f s; "
                            "computed instead", req.lookup_id, len(req.answers), self.tp_size,
                            LOOKUP_TIMEOUT_S)
                req.hit_blocks = 0
            else:
                req.hit_blocks = min(req.answers.values())
        end = req.start + req.hit_blocks
        if req.hit_blocks == 0 or req.start * self.block_size > num_computed:
            return 0  # no hit, or the local hit shrank below where the lookup began
        return max(0, end * self.block_size - num_computed)

    def answered(self, answers: Mapping[str, Mapping[int, int]]) -> None:
        """Workers' lookup answers (lookup id → rank → blocks staged)."""
        by_lid = {r.lookup_id: r for r in self._reqs.values() if r.lookup_id}
        for lid, ranks in answers.items():
            req = by_lid.get(lid)
            if req is None or req.hit_blocks is not None:
                if req is None:
                    self._plan.releases.append(lid)  # a lookup nobody waits for
                continue
            for rank, n in ranks.items():
                if 0 <= rank < self.tp_size:
                    req.answers[rank] = max(0, int(n))

    def waiting(self) -> bool:
        """A lookup is unanswered (the engine should wake up for its answer)."""
        return any(r.lookup_id and r.hit_blocks is None for r in self._reqs.values())

    def committed(self, req_id: str, block_ids: Sequence[int], tier_tokens: int) -> None:
        """vLLM allocated the request and accepted ``tier_tokens`` from the tiers (0 = none)."""
        req = self._reqs.get(req_id)
        if req is None or req.settled or not req.lookup_id:
            return
        req.settled = True
        if tier_tokens <= 0:
            self._plan.releases.append(req.lookup_id)
            return
        first_block = req.num_computed // self.block_size
        n = tier_tokens // self.block_size
        self._plan.loads.append(LoadOrder(req.lookup_id, first_block - req.start,
                                          tuple(int(b) for b in
                                                block_ids[first_block:first_block + n])))
        self.stats["offload_hit_requests"] += 1
        self.stats["offload_hit_tokens"] += tier_tokens

    def tier_tokens(self, req_id: str) -> int:
        """What :meth:`matched` last said for ``req_id`` (0 when unknown)."""
        req = self._reqs.get(req_id)
        if req is None or not req.hit_blocks or req.start * self.block_size > req.num_computed:
            return 0
        return max(0, (req.start + req.hit_blocks) * self.block_size - req.num_computed)

    # -- stores ----------------------------------------------------------------------------------

    def finished(self, req_id: str, ok: bool, prompt: Sequence[int] | None,
                 block_ids: Sequence[int], salt: str | None = None,
                 hashes: Sequence[bytes] = ()) -> bool:
        """``request_finished``: True if the blocks must be held for a store (under the keys
        of ``salt``, the request's ``cache_salt``; ``hashes``: vLLM's block hashes of its
        blocks, which the tiers' KV events name)."""
        req = self._reqs.pop(req_id, None)
        if req is not None and req.lookup_id and not req.settled:
            self._plan.releases.append(req.lookup_id)
        if not (self.enabled and self.config.store and ok) or prompt is None:
            return False
        if req is None:
            req = _Req(block_keys(salted(self.seed, salt), prompt, self.block_size))
        n = min(len(req.keys), len(block_ids))
        if n < self.config.min_blocks:
            return False
        self._plan.stores.append(StoreOrder(req_id, tuple(req.keys[:n]),
                                            tuple(int(b) for b in block_ids[:n]),
                                            tuple(hashes[:n]) if len(hashes) >= n else ()))
        self.stats["offload_store_requests"] += 1
        return True

    def has_pending(self) -> bool:
        """Orders wait for the next step (the engine should take one)."""
        return bool(self._plan)

    def take_plan(self) -> OffloadPlan:
        plan, self._plan = self._plan, OffloadPlan()
        return plan

    def take_stats(self) -> dict[str, int]:
        out = dict(self.stats)
        self.stats.clear()
        return out

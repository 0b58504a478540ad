"""The scheduler side of hand-offs: per-request decisions, vLLM-free.

vLLM's scheduler calls the connector once per request event (new request, matched tokens,
allocation, step, finish). :class:`HandoffBook` answers those calls from plain values (request
id, prompt token ids, counts, block ids, the raw ``kv_transfer_params``) and collects, per step,
one :class:`StepPlan` for the worker ranks. Everything from the client is parsed here, once, by
:func:`kvbridge.params.parse`; a malformed request never raises into vLLM's scheduler: it is
served without a hand-off (the prompt is computed locally) with a WARNING naming the key, and a
prefill leg answers ``kvbridge_error`` so the router can tell its client.

A hybrid model's engine (several KV-cache groups, :mod:`kvbridge.groups`) gives the book one
block table per group wherever a non-hybrid one gives a list of block ids; plans then carry
block refs (every group's blocks in one list) and a pull answer names P's table per group.

**The last prompt token with a sliding window.** When vLLM loads a whole prompt of ``T`` tokens
from a connector it recomputes the last one, but it sized the sliding-window groups for ``T``
computed tokens: when ``T - window + 1`` is a multiple of the block size, the block holding
position ``T - window`` — which that recomputation attends — is already the null block, on D
and (freed by vLLM before ``request_finished``) on P. So an engine with a sliding-window group
hands off all but the last prompt token (:attr:`HandoffBook.backoff`): P prefills ``T - 1``
tokens (the connector shortens P's request, :meth:`HandoffBook.prefill_cut`; P's one sampled
token is not the answer, the decode engine's is) and D receives those and computes the last
token itself, with every block of its window present.

**vLLM's clean-up request.** When vLLM's server refuses a decode leg before its engine saw
it (or the leg failed), it submits a request that is aborted at once, with prompt ``[0]`` and
the leg's ``kv_transfer_params``, only so that the connector can free what the hand-off holds
(``AsyncLLM.notify_kv_transfer_request_rejected``). The book recognises it (``cleanup``: the
request's ``abort_immediately``, which only vLLM sets) and counts it in ``cleanup_requests``
(not ``params_rejected``). The clean-up can do no more than the failed leg could have: a
transfer that a request of this engine named (live, or among the last
:data:`REMEMBERED_TRANSFERS`) is left to that request's own hand-off, which already released
it or chose not to (a refused claim cancels nothing) (``cleanup_ignored``). Only for a leg
that never reached this engine is the prefill engine asked to release the transfer — a
Cancel, as a decode leg sends when it gives up, so P releases only what a decode may: a staged
pull no decode rank claimed yet, a push no decode rank confirmed.

Single-threaded: vLLM drives it from the engine-core thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge import __version__
from kvbridge.config import Config, TransferMode
from kvbridge.errors import KVBridgeError, LayoutError, ParamsError
from kvbridge.groups import GroupKind, KVGroup
from kvbridge.lookup import InvalidKey, LookupBuffer, Overflow
from kvbridge.offload.orders import OffloadPlan
from kvbridge.params import PeerRef, TransferParams, parse, to_wire
from kvbridge.scheduling.planner import (
    ReceivePlan,
    held_refs,
    plan_group_receive,
    plan_receive,
    prompt_blocks,
    prompt_digest,
)
from kvbridge.scheduling.specs import SendPlan

__all__ = ["RecvOrder", "StepPlan", "HandoffBook", "RankAddress", "Blocks", "REMEMBERED_TRANSFERS"]

#: A request's blocks as vLLM gives them: a list of block ids, or (an engine with KV-cache
#: groups) one list per group.
Blocks = Sequence[int] | Sequence[Sequence[int]]

log = logging.getLogger("kvbridge.connector")

#: transfer ids of requests this engine saw that a clean-up request may not release
REMEMBERED_TRANSFERS = 4096


@dataclass(frozen=True)
class RankAddress:
    """Where one worker rank's transfer loop listens (from vLLM's handshake metadata)."""

    address: str
    generation: str


@dataclass(frozen=True)
class RecvOrder:
    """A decode request's receive, for every worker rank (each picks its own peer)."""

    req_id: str
    transfer_id: str
    mode: TransferMode
    peers: tuple[PeerRef, ...]
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    skip_blocks: int
    num_tokens: int
    prompt_digest: str
    error: str | None = None  # planning failed after vLLM committed: report it failed
    remote_skip: int | None = None  # prefill's first block of remote_ids (its block size)


@dataclass
class StepPlan:
    """Scheduler → worker ranks, once per step (pickled by vLLM)."""

    watches: list[tuple[str, tuple[PeerRef, ...]]] = field(default_factory=list)
    #: P: push transfers whose prefill request arrived (registrations for them may wait long)
    announces: list[str] = field(default_factory=list)
    unwatches: list[tuple[str, tuple[PeerRef, ...]]] = field(default_factory=list)
    releases: list[tuple[str, tuple[PeerRef, ...], str]] = field(default_factory=list)
    recvs: list[RecvOrder] = field(default_factory=list)
    stages: list[SendPlan] = field(default_factory=list)
    push_ready: list[SendPlan] = field(default_factory=list)
    cancel_recvs: list[str] = field(default_factory=list)
    cancel_sends: list[str] = field(default_factory=list)
    #: transfer ids whose prompt KV is complete after this step's forward (timing only)
    prefill_done: list[str] = field(default_factory=list)
    #: (transfer_id, event, wall time) the scheduler side observed (timing only): on D
    #: ``recv_seen`` (vLLM's scheduler learned the receive finished) and ``first_step``
    marks: list[tuple[str, str, float]] = field(default_factory=list)
    #: (transfer_id, traceparent) of hand-offs to trace (vLLM traces: kvbridge.scheduling.spans)
    traces: list[tuple[str, str]] = field(default_factory=list)
    #: transfer ids the ranks keep no flight record of (``kvbridge_record: false``)
    unrecorded: list[str] = field(default_factory=list)
    #: scheduler-side counters since the last plan (rank 0 adds them to its loop's stats)
    counters: dict[str, int] = field(default_factory=dict)
    #: tier lookups, loads, releases and stores (kvbridge.offload)
    offload: OffloadPlan = field(default_factory=OffloadPlan)

    def __bool__(self) -> bool:
        return bool(self.watches or self.announces or self.unwatches or self.releases
                    or self.recvs or self.stages or self.push_ready or self.cancel_recvs
                    or self.cancel_sends or self.offload)


@dataclass
class _Request:
    """What the book knows about one request with ``kv_transfer_params``."""

    params: TransferParams | None
    error: KVBridgeError | None = None
    transfer_id: str = ""
    mode: TransferMode = TransferMode.PULL
    recv: bool = False  # a decode leg we will serve
    send: bool = False  # a prefill leg we will hand off
    planned: bool = False
    handed: bool = False  # P: blocks handed to the worker (finished_sending will come)
    kv_done: bool = False  # P: the forward that completes the prompt's KV is scheduled
    recving: bool = False  # D: a transfer into its blocks is in progress
    digest: str = ""
    #: prompt tokens at the end that are not handed off (D computes them; P does not prefill)
    backoff: int = 0
    tokens: int = 0  # prompt tokens handed off


class HandoffBook:
    """See the module docstring. ``tp_size`` and ``block_size`` are this engine's; ``groups``
    its KV-cache groups (``()``: one block table) and ``null_block`` the id vLLM puts where a
    sliding window dropped a block."""

    def __init__(self, config: Config, engine_id: str, *, block_size: int,
                 tp_size: int = 1, groups: Sequence[KVGroup] = (),
                 null_block: int | None = None) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.groups = tuple(groups)
        self.null_block = null_block
        #: see the module docstring: 1 with a sliding-window group, else 0
        #: this engine's model identity digest (weight reloads included), named in its
        #: answers and compared with a prefill engine's before a receive (None: not compared)
        self.identity: str | None = None
        self.backoff = int(any(g.kind is GroupKind.SLIDING for g in self.groups))
        self.ranks: list[RankAddress] = []
        self.stats: Counter[str] = Counter()
        self._reqs: dict[str, _Request] = {}
        self._active_tids: dict[str, str] = {}  # transfer_id -> req_id (duplicates refused)
        #: req_id -> transfer_id of hand-offs the worker still runs (kept past request_finished)
        self._busy: dict[str, str] = {}
        #: transfer ids named by requests this engine saw (the newest REMEMBERED_TRANSFERS)
        self._named: LookupBuffer[str, None] = LookupBuffer(
            "named transfers", REMEMBERED_TRANSFERS, overflow=Overflow.EVICT_LRU)
        self._plan = StepPlan()
        #: ``(port, topic)`` of the engine's KV-events PUB socket, reported in probe answers
        #: (``kvbridge_kv_events``) on the host the ranks advertise; None: none to report
        self.kv_events: tuple[int, str] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def set_ranks(self, ranks: Sequence[RankAddress]) -> None:
        self.ranks = list(ranks)

    def address_params(self) -> dict[str, Any]:
        """The keys that tell a router and a decode engine where this engine listens."""
        if not self.ranks:
            return {}
        rank0 = self.ranks[0].address.removeprefix("tcp://")
        host, port = rank0.rsplit(":", 1)
        params = TransferParams(
            remote_engine_id=self.engine_id, remote_host=host.strip("[]"), remote_port=int(port),
            tp_size=self.tp_size, kvbridge_generation=self.ranks[0].generation,
            kvbridge_peers=[PeerRef(r.address, r.generation) for r in self.ranks],
            kvbridge_block_size=self.block_size, kvbridge_version=__version__,
            kvbridge_identity=self.identity)
        return to_wire(params)

    def probe_params(self) -> dict[str, Any]:
        """A probe's answer: :meth:`address_params`, plus where this engine publishes its KV
        events (``kvbridge_kv_events`` = ``tcp://HOST:PORT`` with HOST rank 0's advertised
        host, and ``kvbridge_kv_events_topic``) when it does."""
        params = self.address_params()
        if params and self.kv_events is not None:
            host = self.ranks[0].address.removeprefix("tcp://").rsplit(":", 1)[0]
            port, topic = self.kv_events
            params["kvbridge_kv_events"] = f"tcp://{host}:{port}"
            if topic:
                params["kvbridge_kv_events_topic"] = topic
        return params

    # -- requests ------------------------------------------------------------------------------

    def _refuse(self, req_id: str, raw: Any, err: ParamsError) -> _Request:
        self.stats["params_rejected"] += 1
        log.warning("request %s: %s; served without a hand-off (its prompt is computed here)",
                    req_id, str(err)[:600])
        # a prefill leg answers why, so the router can tell its client
        send = isinstance(raw, dict) and bool(raw.get("do_remote_decode"))
        return _Request(None, err, send=send)

    def uses_tiers(self, req_id: str) -> bool:
        """Whether this engine's offload tiers may serve ``req_id`` (its D leg's
        ``kvbridge_tiers`` is not ``false``)."""
        req = self._reqs.get(req_id)
        return req is None or req.params is None or req.params.kvbridge_tiers is not False

    def on_new_request(self, req_id: str, raw: Any, prompt: Sequence[int] | None, *,
                       cleanup: bool = False, salt: str | None = None) -> None:
        """Parse the request's ``kv_transfer_params`` (once). ``cleanup``: vLLM's clean-up
        request (see the module docstring), answered by :meth:`_cleanup`. ``salt``: the
        request's ``cache_salt``, part of the prompt digest both sides compare."""
        if raw is None or req_id in self._reqs:
            return
        if cleanup:
            self._reqs[req_id] = self._cleanup(req_id, raw)
            return
        named = raw.get("transfer_id") if isinstance(raw, dict) else None
        # parsed or not: a clean-up after it may not release it (an id too long to remember
        # is refused by the parser below, and no transfer can have it)
        if isinstance(named, str) and not self._named.touch((named,)):
            with contextlib.suppress(InvalidKey):
                self._named.insert(named, None)
        try:
            params = parse(raw)
        except ParamsError as err:
            self._reqs[req_id] = self._refuse(req_id, raw, err)
            return
        req = _Request(params)
        if params.kvbridge_probe or not (params.do_remote_prefill or params.do_remote_decode):
            self._reqs[req_id] = req
            return
        req.transfer_id = params.transfer_id or f"{self.engine_id}-{req_id}"
        req.mode = params.mode(self.config.mode)
        n_prompt = len(prompt or ())
        req.backoff = self.backoff if n_prompt > self.backoff else 0
        handed = req.tokens = n_prompt - req.backoff
        try:
            if prompt is None:
                raise ParamsError("prompt", "a hand-off needs token-id prompts")
            owner = self._active_tids.get(req.transfer_id)
            if owner is not None:
                raise ParamsError("kv_transfer_params.transfer_id",
                                  f"{req.transfer_id} is already used by request {owner} "
                                  "(n > 1 or a batched prompt shares one hand-off)")
            if params.do_remote_prefill:
                if req.mode is TransferMode.PULL:
                    params.check_block_groups(handed, [g.block_size for g in self.groups])
                params.check_decode_leg(req.mode, handed, self.block_size)
        except ParamsError as err:
            self._reqs[req_id] = self._refuse(req_id, raw, err)
            return
        theirs = params.kvbridge_identity
        if params.do_remote_prefill and theirs and self.identity and theirs != self.identity:
            other = ParamsError("kv_transfer_params.kvbridge_identity",
                                f"the prefill engine's model identity {theirs} is not this "
                                f"engine's {self.identity} (other weights, or weights "
                                "reloaded on one side only)")
            self.stats["identity_refused"] += 1
            self._reqs[req_id] = self._refuse(req_id, raw, other)
            # P released at once (a Cancel), not after its lease
            self._plan.releases.append((req.transfer_id, self._peers(params), str(other)))
            return
        assert prompt is not None
        req.digest = prompt_digest(prompt[:handed], salt)
        self._active_tids[req.transfer_id] = req_id
        if params.do_remote_prefill:
            req.recv = True
            self._plan.watches.append((req.transfer_id, self._peers(params)))
        else:
            req.send = True
            if req.mode is TransferMode.PUSH:
                self._plan.announces.append(req.transfer_id)
        self._reqs[req_id] = req

    def _cleanup(self, req_id: str, raw: Any) -> _Request:
        """vLLM's clean-up of a rejected decode leg: release at the prefill engine the transfer
        its params name, unless a request of this engine named it (see the module docstring).
        The request itself is inert (no receive, no send, nothing kept)."""
        self.stats["cleanup_requests"] += 1
        try:
            params = parse(raw)
        except ParamsError as err:
            log.info("request %s: vLLM's clean-up of a rejected request; nothing to release "
                     "(%s)", req_id, str(err)[:300])
            return _Request(None, err)
        tid, peers = params.transfer_id, self._peers(params)
        if not (params.do_remote_prefill and tid and peers):
            log.info("request %s: vLLM's clean-up of a rejected request; it names no transfer "
                     "to release", req_id)
        elif tid in self._named or tid in self._active_tids or tid in self._busy.values():
            self.stats["cleanup_ignored"] += 1
            log.info("request %s: vLLM's clean-up names transfer %s, which a request here "
                     "used; left to that request's hand-off", req_id, tid)
        else:
            log.info("request %s: vLLM's clean-up of a rejected decode leg; asking prefill to "
                     "release transfer %s", req_id, tid)
            self._plan.releases.append((tid, peers, "the decode leg was rejected (vLLM's "
                                                    "clean-up request)"))
        return _Request(params)

    def _peers(self, params: TransferParams) -> tuple[PeerRef, ...]:
        """Every prefill rank's address, in rank order (prefill's TP size, not this engine's:
        each worker rank picks the ranks it exchanges KV with)."""
        refs = [params.peer(r) for r in range(params.tp_size)]
        return tuple(r for r in refs if r is not None)

    def matched_tokens(self, req_id: str, prompt_tokens: int,
                       num_computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens``: tokens to load from the prefill engine (async)."""
        req = self._reqs.get(req_id)
        if req is None or not req.recv or req.planned:
            return 0, False
        count = req.tokens - num_computed
        return (count, True) if count > 0 else (0, False)

    def receives(self, req_id: str) -> bool:
        """``req_id`` is a decode leg whose receive is not planned yet."""
        req = self._reqs.get(req_id)
        return req is not None and req.recv and not req.planned

    def _tables(self, block_ids: Blocks) -> list[list[int]]:
        """``block_ids`` as one table per KV-cache group (LayoutError if they are not)."""
        if not self.groups:
            return [[int(b) for b in block_ids]]  # type: ignore[arg-type]
        tables = [[int(b) for b in t] for t in block_ids]  # type: ignore[union-attr]
        if len(tables) != len(self.groups):
            raise LayoutError(f"{len(tables)} block tables for {len(self.groups)} KV-cache "
                              "groups")
        return tables

    def _plan_receive(self, req: _Request, tables: list[list[int]], external_tokens: int,
                      prompt_tokens: int) -> ReceivePlan:
        assert req.params is not None
        pull = req.mode is TransferMode.PULL
        if not self.groups:
            return plan_receive(prompt_tokens=prompt_tokens, block_size=self.block_size,
                                external_tokens=external_tokens, allocated=tables[0],
                                remote_ids=req.params.remote_block_ids if pull else None,
                                remote_block_size=req.params.kvbridge_block_size)
        remote: list[list[int]] | None = None
        if pull:
            remote = (req.params.remote_block_groups
                      or [list(req.params.remote_block_ids or ())])
        return plan_group_receive(prompt_tokens=prompt_tokens, groups=self.groups,
                                  external_tokens=external_tokens, allocated=tables,
                                  remote=remote, null_block=self.null_block)

    def after_alloc(self, req_id: str, block_ids: Blocks, external_tokens: int,
                    prompt_tokens: int, tier_tokens: int = 0) -> None:
        """``update_state_after_alloc``: plan the receive (once). ``tier_tokens`` of the
        ``external_tokens`` come from this engine's offload tiers (loaded before the receive):
        only the rest is asked of the prefill engine."""
        req = self._reqs.get(req_id)
        if req is None or not req.recv or req.planned:
            return
        prompt_tokens = req.tokens  # the prompt less its backoff
        req.planned = True
        assert req.params is not None
        peers = self._peers(req.params)
        self._plan.unwatches.append((req.transfer_id, peers))
        error = None
        try:
            plan = self._plan_receive(req, self._tables(block_ids), external_tokens - tier_tokens,
                                      prompt_tokens)
        except LayoutError as exc:
            if not external_tokens:
                raise
            error, plan = f"cannot plan the receive: {exc}", None
        if plan is not None and plan.empty:  # the whole prompt was cached here
            self.stats["recv_full_local_hit"] += 1
            self._plan.releases.append((req.transfer_id, peers, "decode had the prompt cached"))
            return
        self._plan.recvs.append(RecvOrder(
            req_id, req.transfer_id, req.mode, peers,
            plan.local_ids if plan else (), plan.remote_ids if plan else (),
            plan.skip_blocks if plan else 0, prompt_tokens, req.digest, error,
            plan.remote_skip if plan else None))
        req.recving = True
        self._busy[req_id] = req.transfer_id

    def prefill_complete(self, req_id: str, block_ids: Blocks, prompt_tokens: int) -> None:
        """P: this step's forward writes the last of the prompt's KV (push: WRITE after it)."""
        req = self._reqs.get(req_id)
        if req is None or not req.send or req.kv_done or req.error is not None:
            return
        req.kv_done = True
        self._plan.prefill_done.append(req.transfer_id)
        if req.mode is TransferMode.PUSH:
            try:
                plan = self._send_plan(req_id, req, block_ids, prompt_tokens)
            except LayoutError as exc:  # never raise into vLLM; finished() answers why
                log.error("request %s: cannot hand off: %s", req_id, exc)
                req.error = exc
                self._plan.cancel_sends.append(req.transfer_id)
                return
            self._plan.push_ready.append(plan)
            req.handed = True
            self._busy[req_id] = req.transfer_id

    def _send_plan(self, req_id: str, req: _Request, block_ids: Blocks,
                   prompt_tokens: int) -> SendPlan:
        """Raises :class:`LayoutError` only for block tables that do not fit this engine.
        ``prompt_tokens`` is P's prompt (after :meth:`prefill_cut`); the hand-off covers
        ``req.tokens`` of them."""
        prompt_tokens = min(prompt_tokens, req.tokens)
        layerwise = self.config.layerwise
        if req.params is not None and req.params.kvbridge_layerwise is not None:
            layerwise = req.params.kvbridge_layerwise
        tables = self._tables(block_ids)
        if self.groups:
            blocks = held_refs(tables, self.groups, prompt_tokens, self.null_block)
        else:
            blocks = tuple(prompt_blocks(tables[0], prompt_tokens, self.block_size))
        return SendPlan(req_id, req.transfer_id, blocks, prompt_tokens, req.digest, layerwise)

    def _remote_ids(self, block_ids: Blocks, prompt_tokens: int) -> dict[str, Any]:
        """A pull answer's ``remote_block_ids``: the prompt's blocks, one list per group (with
        the null block where a window dropped one) on an engine with groups."""
        tables = self._tables(block_ids)
        if not self.groups:
            return {"remote_block_ids": prompt_blocks(tables[0], prompt_tokens,
                                                      self.block_size)}
        return {"remote_block_ids": [prompt_blocks(t, prompt_tokens, g.block_size)
                                     for t, g in zip(tables, self.groups, strict=True)]}

    def prefill_cut(self, req_id: str) -> int:
        """P: how many trailing prompt tokens the connector must drop from ``req_id`` before it
        is scheduled (see the module docstring); 0 for anything but a hand-off's prefill leg."""
        req = self._reqs.get(req_id)
        return req.backoff if req is not None and req.send and req.error is None else 0

    def producers(self) -> list[str]:
        """P requests whose prompt KV is not complete yet (the adapter checks their progress:
        a push is handed over then, a pull only marks ``kv_ready`` for the timings)."""
        return [r for r, q in self._reqs.items() if q.send and not q.kv_done
                and q.error is None]

    def finished(self, req_id: str, ok: bool, block_ids: Blocks,
                 prompt_tokens: int) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (keep the blocks, params for the response)."""
        req = self._reqs.pop(req_id, None)
        if req is None:
            return False, None
        if req.transfer_id and self._active_tids.get(req.transfer_id) == req_id:
            del self._active_tids[req.transfer_id]
        if req.error is not None:
            return False, ({"kvbridge_error": str(req.error)[:2000]} if req.send else None)
        params = req.params
        assert params is not None
        if params.kvbridge_probe:
            return False, self.probe_params() or None
        if req.recv:
            if req.recving:
                self._plan.cancel_recvs.append(req.transfer_id)
                return True, None  # blocks come back with finished_recving
            if not req.planned:
                self._plan.unwatches.append((req.transfer_id, self._peers(params)))
            return False, None
        if not req.send:
            return False, None
        answer = {**self.address_params(), "transfer_id": req.transfer_id,
                  "transfer_mode": req.mode.value}
        if req.handed:  # push already handed over: let the WRITE finish
            return True, answer
        if not ok:
            if req.mode is TransferMode.PUSH:
                self._plan.cancel_sends.append(req.transfer_id)
            return False, None
        try:
            plan = self._send_plan(req_id, req, block_ids, prompt_tokens)
        except LayoutError as exc:  # never raise into vLLM: answer why, pin nothing
            log.error("request %s: cannot hand off: %s", req_id, exc)
            if req.mode is TransferMode.PUSH:
                self._plan.cancel_sends.append(req.transfer_id)
            return False, {"kvbridge_error": f"cannot hand off: {exc}"[:2000]}
        req.handed = True
        self._busy[req_id] = req.transfer_id
        if req.mode is TransferMode.PUSH:
            self._plan.push_ready.append(plan)
            return True, answer
        self._plan.stages.append(plan)
        self.stats["pull_staged"] += 1
        return True, {**answer, "do_remote_prefill": True, "do_remote_decode": False,
                      **self._remote_ids(block_ids, plan.num_tokens), "remote_request_id": req_id,
                      "remote_num_tokens": plan.num_tokens}

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        if self.stats:
            plan.counters, self.stats = dict(self.stats), Counter()
        return plan

    def has_pending(self) -> bool:
        return bool(self._plan)

    def add_offload(self, plan: OffloadPlan, counters: dict[str, int]) -> None:
        """Merge the offload book's orders and counters into this step's plan."""
        self._plan.offload = plan
        self.stats.update(counters)

    def transfer_done(self, req_id: str) -> str | None:
        """The worker reported ``req_id`` finished sending or receiving; its transfer id."""
        tid = self._busy.pop(req_id, None)
        req = self._reqs.get(req_id)
        if req is not None:
            req.recving = False
        return tid

    def recorded(self, req_id: str) -> bool:
        """False when ``req_id``'s params asked for no flight record (``kvbridge_record``)."""
        req = self._reqs.get(req_id)
        return req is None or req.params is None or req.params.kvbridge_record is not False

    def transfer_of(self, req_id: str) -> str | None:
        """The transfer id of hand-off request ``req_id`` (None: not one, or not known)."""
        req = self._reqs.get(req_id)
        return req.transfer_id or None if req is not None else None

    def receiving(self, req_id: str) -> str | None:
        """The transfer id of ``req_id``'s receive while it is in progress (planned, not yet
        reported done nor given up), else None."""
        req = self._reqs.get(req_id)
        if req is None or not req.recving:
            return None
        return req.transfer_id

    def transfers_in_progress(self) -> int:
        return len(self._busy)

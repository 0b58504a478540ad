"""The worker side of hand-offs: one engine rank applying the scheduler's plans, vLLM-free.

:class:`RankSide` owns the rank's :class:`~kvbridge.scheduling.loop.TransferLoop`. Each step it
applies the scheduler's :class:`~kvbridge.scheduling.handoff.StepPlan` (each order names every
prefill rank; this rank picks the ones it receives its KV heads from with
:func:`~kvbridge.scheduling.mapping.sources`: with equal TP, rank r of D talks to rank r of P;
with heterogeneous TP it may read from several, and it releases at once the prefill ranks that
nobody reads from, :func:`~kvbridge.scheduling.mapping.idle`), releases push-ready KV after the
forward (behind a device fence on GPUs), and turns the
loop's results into what vLLM expects: a sender's blocks are reported free only once vLLM has
finished that request and every hold on them is over (a pull being served, a push being
written, an offload store being copied out); a receive that failed while a transfer might
still land reports its blocks as load errors now and its request only when the transfer
stopped.

Called from the worker's model-runner thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvbridge.config import TransferMode
from kvbridge.errors import LayoutMismatch
from kvbridge.offload.events import TierEvent
from kvbridge.offload.manager import OffloadManager
from kvbridge.params import PeerRef
from kvbridge.scheduling import mapping
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.handoff import StepPlan
from kvbridge.scheduling.layer_stream import LayerStream
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.specs import PullSpec, PushSpec, SendPlan, Source

__all__ = ["RankSide"]

log = logging.getLogger("kvbridge.connector")

POST_WAIT_S = 0.005
"""Longest the worker waits, after handing over push-ready KV, for the transfer loop to take it
(post the WRITE, or park it until D confirmed / the device fence passed)."""

FenceFactory = Callable[[], Fence | None]


class RankSide:
    """See the module docstring. ``fence`` makes a fence after the current device work."""

    def __init__(self, loop: TransferLoop, fence: FenceFactory | None = None,
                 offload: OffloadManager | None = None) -> None:
        self.loop = loop
        self.offload = offload
        if offload is not None:  # a DrainNotice (the proxy's drain) starts its write-out
            loop.on_drain = offload.drain
        self.rank = loop.rank
        self._fence = fence or (lambda: None)
        self._ready: list[SendPlan] = []  # whole-request pushes the forward writes
        self._stream: LayerStream | None = None  # this step's layer-wise pushes
        self._prefill_done: list[str] = []
        self._finished: set[str] = set()  # requests vLLM finished that we hold blocks for
        self._sending: set[str] = set()  # requests whose blocks the loop holds for sending
        self._sent: set[str] = set()  # released by the loop, not yet finished by vLLM
        self._storing: set[str] = set()  # blocks held until the offload store copied them
        self._stored: set[str] = set()  # copied out, not yet finished by vLLM
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()

    def _sources(self, peers: tuple[PeerRef, ...]) -> list[Source] | str:
        """The prefill ranks (of ``len(peers)``) this rank receives from, or why none."""
        loop, p_tp = self.loop, len(peers)
        if loop.heads is None:  # no head split: only the rank of the same number, same TP
            if p_tp != loop.tp_size and loop.layout.groups:
                return (f"prefill runs tensor-parallel {p_tp}, this engine {loop.tp_size}: this "
                        f"is a hybrid model ({len(loop.layout.groups)} KV-cache groups), whose "
                        "KV moves only between engines of one TP size and block size "
                        "(docs/usage.md#hybrid-models)")
            if p_tp != loop.tp_size:
                return (f"prefill runs tensor-parallel {p_tp}, this engine {loop.tp_size}, and "
                        "this engine does not describe its KV heads (a head-major KV layout is "
                        "needed to map them)")
            ref = peers[self.rank]
            return [Source(ref.address, ref.generation, self.rank, p_tp)]
        try:
            shares = mapping.sources(loop.heads.total_heads, p_tp, loop.tp_size, self.rank)
        except LayoutMismatch as exc:
            return str(exc)
        return [Source(peers[s.rank].address, peers[s.rank].generation, s.rank, p_tp)
                for s in shares]

    def _idle(self, peers: tuple[PeerRef, ...]) -> list[PeerRef]:
        """Prefill ranks nobody reads from that this rank releases (replicated heads)."""
        heads = self.loop.heads
        if heads is None or len(peers) <= heads.total_heads:
            return []
        try:
            return [peers[p] for p in mapping.idle(heads.total_heads, len(peers),
                                                   self.loop.tp_size, self.rank)]
        except LayoutMismatch:
            return []

    def _involved(self, peers: tuple[PeerRef, ...]) -> list[PeerRef]:
        """Every prefill rank this rank must tell about a transfer (sources and idle)."""
        srcs = self._sources(peers)
        if isinstance(srcs, str):
            return [peers[self.rank]] if self.rank < len(peers) else []
        return [PeerRef(s.address, s.generation) for s in srcs] + self._idle(peers)

    def apply(self, plan: StepPlan) -> None:
        """Start what the scheduler decided this step (non-blocking, except that tier loads
        are copied into their blocks here, before the step's forward)."""
        loop = self.loop
        for tid in plan.unrecorded:  # before anything of this step can mark it
            loop.recorder.mute(tid)
        if plan.offload:
            if self.offload is None:
                log.error("offload orders for a rank without offload tiers: ignored")
            else:
                self._storing.update(s.req_id for s in plan.offload.stores)
                self._load_errors |= self.offload.apply(plan.offload)
        for tid, peers in plan.watches:
            srcs = self._sources(peers)
            for src in [] if isinstance(srcs, str) else srcs:
                loop.watch(tid, src.address, src.generation)
            for ref in self._idle(peers):
                loop.release_remote(ref.address, tid, "not needed: its KV heads are read from "
                                                      "another rank holding them too")
        for tid in plan.announces:
            loop.announce(tid)
        for tid, peers in plan.unwatches:
            srcs = self._sources(peers)
            for src in [] if isinstance(srcs, str) else srcs:
                loop.unwatch(tid, src.address)
        for tid, peers, reason in plan.releases:
            for ref in self._involved(peers):
                loop.release_remote(ref.address, tid, reason)
        for order in plan.recvs:
            self._recving.add(order.req_id)
            srcs = self._sources(order.peers)
            if order.error is not None or isinstance(srcs, str) or not srcs:
                why = order.error or (srcs if isinstance(srcs, str) else "no prefill rank")
                loop.fail_recv(order.req_id, order.transfer_id, order.local_ids, why)
                for ref in self._involved(order.peers):  # every failure is sent to the other side
                    loop.release_remote(ref.address, order.transfer_id, why)
            elif order.mode is TransferMode.PUSH:
                loop.expect_push(PushSpec(order.req_id, order.transfer_id, srcs[0].address,
                                          order.local_ids, order.skip_blocks, order.num_tokens,
                                          order.prompt_digest, srcs[0].generation,
                                          sources=tuple(srcs)))
            else:
                loop.start_pull(PullSpec(order.req_id, order.transfer_id, srcs[0].address,
                                         order.local_ids, order.remote_ids, order.skip_blocks,
                                         order.num_tokens, order.prompt_digest,
                                         srcs[0].generation, remote_skip=order.remote_skip,
                                         sources=tuple(srcs)))
        for send in plan.stages:
            self._sending.add(send.req_id)
            loop.stage_pull(send)
        for tid in plan.cancel_recvs:
            loop.cancel_recv(tid)
        for tid in plan.cancel_sends:
            loop.cancel_send(tid)
        # push-ready KV is released after this step's forward wrote it (see after_forward);
        # meanwhile the loop builds the WRITEs. Layer-wise pushes go layer by layer through
        # one pipe the forward fills (kvbridge.scheduling.layer_stream).
        for send in plan.push_ready:
            self._sending.add(send.req_id)
            loop.push_prepare(send)
        self._ready.extend(p for p in plan.push_ready if not p.layerwise)
        layerwise = [p for p in plan.push_ready if p.layerwise]
        if layerwise:
            if self._stream is not None:  # a step that never ran its forward: end it now
                self._end_stream()
            self._stream = LayerStream(layerwise, loop.wake)
            loop.push_layers(self._stream)
        self._prefill_done.extend(plan.prefill_done)
        if plan.traces and loop.spans is not None:
            for tid, parent in plan.traces:
                loop.spans.want(tid, parent)
        for tid, event, when in plan.marks:
            loop.mark(tid, event, when)
        if plan.counters and self.rank == 0:
            loop.add_counters(plan.counters)

    def layer_saved(self, layer: str) -> None:
        """Layer-wise push: ``layer``'s KV of the requests finishing prefill is written."""
        if self._stream is not None:
            self._stream.written(layer, self._fence())

    def _end_stream(self) -> bool:
        """End this step's layer-wise push stream (the rest of its KV is written); False if
        there was none."""
        stream, self._stream = self._stream, None
        if stream is None:
            return False
        stream.end(self._fence())
        if self.loop.dead:  # nobody drains it: the blocks are free to go
            for plan in stream.plans:
                self.loop.results.sent(plan.req_id)
        return True

    def wait_layer(self, layer: str) -> None:
        """The forward is about to read ``layer``'s KV: wait for this step's layer-wise tier
        load to put it in place (no-op otherwise)."""
        if self.offload is not None:
            self.offload.wait_layer(layer)

    def after_forward(self) -> None:
        """The step's forward has been issued: end its layer-wise tier load (its failures
        become load errors) and release push-ready KV behind a fence."""
        if self.offload is not None:
            self._load_errors |= self.offload.finish_loads()
        for tid in self._prefill_done:
            self.loop.mark(tid, "kv_ready")
        self._prefill_done.clear()
        handed = self._end_stream()
        if self._ready:
            handed = True
            fence = self._fence()
            for plan in self._ready:
                self.loop.push_ready(plan, fence)
            self._ready.clear()
        if handed and self.loop.config.wake_on_arrival:
            self.loop.flush(POST_WAIT_S)  # the loop posts now, not when it gets the GIL

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` for vLLM this step."""
        self.after_forward()  # steps without a forward skip wait_for_save: never strand a push
        res = self.loop.drain()
        self._finished |= finished_req_ids & (self._sending | self._storing)
        self._sent |= res.finished_sending
        if self.offload is not None:
            self._stored |= self.offload.take_stored()
            counters = self.offload.take_counters()
            if counters:
                self.loop.add_counters(counters)
        # vLLM frees a sender's blocks on finished_sending: only for requests it finished,
        # once nothing holds them any more.
        sending = {r for r in self._finished
                   if (r not in self._sending or r in self._sent)
                   and (r not in self._storing or r in self._stored)}
        self._sent -= sending
        self._stored -= sending
        self._finished -= sending
        self._sending -= sending
        self._storing -= sending
        self._load_errors |= res.invalid_blocks
        recving = res.finished_recving & self._recving
        self._recving -= recving
        return sending, recving, res.failed_recving & recving

    def take_offload_answers(self) -> dict[str, int]:
        """Tier lookups this rank answered since the last call (lookup id → blocks staged)."""
        return {} if self.offload is None else self.offload.take_answers()

    def take_tier_events(self) -> list[TierEvent]:
        """The offload tiers' KV events since the last call (rank 0; empty otherwise)."""
        return [] if self.offload is None else self.offload.take_events()

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        self.loop.close()

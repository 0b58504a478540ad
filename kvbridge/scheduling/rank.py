"""The worker side of hand-offs: one engine rank applying the scheduler's plans, vLLM-free.

:class:`RankSide` owns the rank's :class:`~kvbridge.scheduling.loop.TransferLoop`. Each step it
applies the scheduler's :class:`~kvbridge.scheduling.handoff.StepPlan` (each order names every
rank's peer; this rank takes its own, so with tensor parallelism rank r of D talks to rank r
of P), releases push-ready KV after the forward (behind a device fence on GPUs), and turns the
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
from kvbridge.offload.manager import OffloadManager
from kvbridge.params import PeerRef
from kvbridge.scheduling.handoff import StepPlan
from kvbridge.scheduling.loop import TransferLoop
from kvbridge.scheduling.pull import PullSpec, SendPlan
from kvbridge.scheduling.push import Fence, PushSpec

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
        self.rank = loop.rank
        self._fence = fence or (lambda: None)
        self._ready: list[SendPlan] = []
        self._prefill_done: list[str] = []
        self._finished: set[str] = set()  # requests vLLM finished that we hold blocks for
        self._sending: set[str] = set()  # requests whose blocks the loop holds for sending
        self._sent: set[str] = set()  # released by the loop, not yet finished by vLLM
        self._storing: set[str] = set()  # blocks held until the offload store copied them
        self._stored: set[str] = set()  # copied out, not yet finished by vLLM
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()

    def _mine(self, peers: tuple[PeerRef, ...]) -> PeerRef | None:
        return peers[self.rank] if self.rank < len(peers) else None

    def apply(self, plan: StepPlan) -> None:
        """Start what the scheduler decided this step (non-blocking, except that tier loads
        are copied into their blocks here, before the step's forward)."""
        loop = self.loop
        if plan.offload:
            if self.offload is None:
                log.error("offload orders for a rank without offload tiers: ignored")
            else:
                self._storing.update(s.req_id for s in plan.offload.stores)
                self._load_errors |= self.offload.apply(plan.offload)
        for tid, peers in plan.watches:
            if (ref := self._mine(peers)) is not None:
                loop.watch(tid, ref.address, ref.generation)
        for tid in plan.announces:
            loop.announce(tid)
        for tid, peers in plan.unwatches:
            if (ref := self._mine(peers)) is not None:
                loop.unwatch(tid, ref.address)
        for tid, peers, reason in plan.releases:
            if (ref := self._mine(peers)) is not None:
                loop.release_remote(ref.address, tid, reason)
        for order in plan.recvs:
            self._recving.add(order.req_id)
            ref = self._mine(order.peers)
            if order.error is not None or ref is None:
                why = order.error or f"no prefill address for tensor-parallel rank {self.rank}"
                loop.fail_recv(order.req_id, order.transfer_id, order.local_ids, why)
                if ref is not None:  # every failure is sent to the other side
                    loop.release_remote(ref.address, order.transfer_id, why)
            elif order.mode is TransferMode.PUSH:
                loop.expect_push(PushSpec(order.req_id, order.transfer_id, ref.address,
                                          order.local_ids, order.skip_blocks, order.num_tokens,
                                          order.prompt_digest, ref.generation))
            else:
                loop.start_pull(PullSpec(order.req_id, order.transfer_id, ref.address,
                                         order.local_ids, order.remote_ids, order.skip_blocks,
                                         order.num_tokens, order.prompt_digest, ref.generation))
        for send in plan.stages:
            self._sending.add(send.req_id)
            loop.stage_pull(send)
        for tid in plan.cancel_recvs:
            loop.cancel_recv(tid)
        for tid in plan.cancel_sends:
            loop.cancel_send(tid)
        for send in plan.push_ready:
            self._sending.add(send.req_id)
        # push-ready KV is released after this step's forward wrote it: see after_forward
        self._ready.extend(plan.push_ready)
        self._prefill_done.extend(plan.prefill_done)
        for tid, event, when in plan.marks:
            loop.mark(tid, event, when)
        if plan.counters and self.rank == 0:
            loop.add_counters(plan.counters)

    def layer_saved(self, layer: str) -> None:
        """Layer-wise push: ``layer``'s KV of the requests finishing prefill is written."""
        plans = [p for p in self._ready if p.layerwise]
        if plans:
            fence = self._fence()
            for plan in plans:
                self.loop.push_layer(plan, layer, fence)

    def after_forward(self) -> None:
        """The step's forward has been issued: release push-ready KV behind a fence."""
        for tid in self._prefill_done:
            self.loop.mark(tid, "kv_ready")
        self._prefill_done.clear()
        if self._ready:
            fence = self._fence()
            for plan in self._ready:
                self.loop.push_ready(plan, fence)
            self._ready.clear()
            if self.loop.config.wake_on_arrival:
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

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        self.loop.close()

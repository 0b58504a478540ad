"""The decode side of a receive, what pull and push share: one part per prefill rank.

A receive names every prefill rank it takes KV from (:class:`Source`; several with
heterogeneous TP). Each becomes a :class:`Part`; the parts report to the loop's result box, or,
when there are several, to a :class:`~kvbridge.scheduling.fanin.FanIn` that reports the whole
receive once. :class:`Receiver` keeps the parts (``jobs``: transfer id → its parts), opens a
receive (:meth:`Receiver._open`: refuses a second one of the same id, bounds the whole
hand-off by ``push_timeout_s``, keeps each prefill rank's lease alive with heartbeats and dials
it), watches each part for progress (:meth:`Receiver._expect`: a part that does not reach its
next step within ``stall_s``, or the bound its step names, is given up through
:meth:`Receiver._stalled_part`; the dial starts it) and forgets a part that ended
(:meth:`Receiver._drop`). What happens between the dial and the end is the subclass's:
:class:`~kvbridge.scheduling.pull.PullSink` (claim, READ, DONE) and
:class:`~kvbridge.scheduling.push_wait.PushSink` (register, confirm, wait for the WRITE).

Loop thread only.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kvbridge.errors import KVBridgeError, PeerError
from kvbridge.layout import KVLayout
from kvbridge.lookup import LookupBuffer
from kvbridge.scheduling import mapping
from kvbridge.scheduling.context import LoopContext
from kvbridge.scheduling.fanin import Box, FanIn
from kvbridge.scheduling.peers import Peer
from kvbridge.scheduling.specs import Source

__all__ = ["Half", "check_source", "Part", "Receiver", "MAX_RECEIVES", "receive_table"]

#: one side of a part: per layout (a plane selection), the block ids it covers
Half = list[tuple[KVLayout, mapping.Ids]]


def check_source(core: LoopContext, src: Source, peer: Peer) -> mapping.Shape:
    """The shape of prefill rank ``peer``, after checking it is the rank ``src`` names (the
    request's ``kvbridge_peers`` order); raises :class:`PeerError` otherwise."""
    info = peer.info
    want = (core.rank if src.rank is None else src.rank,
            core.tp_size if src.tp_size is None else src.tp_size)
    if (info.rank, info.tp_size) != want and (src.rank is not None or core.heads is not None):
        raise PeerError(f"it is rank {info.rank} of tensor-parallel {info.tp_size}; the "
                        f"request names rank {want[0]} of {want[1]}")
    return mapping.Shape(info.tp_size, info.rank, peer.layout.block_size, info.heads)


class ReceiveSpec(Protocol):
    """What a pull or push spec says about the receive as a whole."""

    @property
    def req_id(self) -> str: ...

    @property
    def transfer_id(self) -> str: ...

    @property
    def local_ids(self) -> tuple[int, ...]: ...

    def parts(self) -> tuple[Source, ...]: ...


S = TypeVar("S", bound=ReceiveSpec)


@dataclass
class Part(Generic[S]):
    """What one prefill rank sends of a receive ``spec``; reports to ``box``."""

    spec: S
    source: Source
    box: Box  # where the part reports: the loop's results, or the transfer's FanIn
    peer: Peer | None = None
    failure: str | None = None  # reported already; blocks held until nothing can land
    started: float = field(default_factory=time.perf_counter)

    @property
    def address(self) -> str:
        return self.source.address

    @property
    def tid(self) -> str:
        return self.spec.transfer_id


P = TypeVar("P", bound=Part[Any])


#: receives one decode rank runs at once (each holds blocks vLLM allocated for it)
MAX_RECEIVES = 65536


def receive_table(capacity: int = MAX_RECEIVES,
                  clock: Callable[[], float] = time.monotonic) -> LookupBuffer[str, Any]:
    """D's receives: transfer id → the parts of the receive (a LookupBuffer home, no lease);
    full is full (a receive is failed at once, safely: nothing was posted)."""
    return LookupBuffer("receives", capacity, clock=clock)


class Receiver(Generic[P]):
    """See the module docstring. ``kind`` names the hand-off timer ``(kind, transfer id)``."""

    kind: ClassVar[str]

    def __init__(self, core: LoopContext) -> None:
        self.core = core
        #: transfer id → its parts; no lease (the hand-off timer and the parts' own bounds end
        #: a receive, and a failed part stays until its transfer handle stopped)
        self.jobs: LookupBuffer[str, list[P]] = receive_table(clock=core.timers.clock)

    def __len__(self) -> int:
        return len(self.jobs)

    def parts(self) -> list[P]:
        return [part for parts in self.jobs.values() for part in parts]

    def _live(self, part: P) -> bool:
        return part in self.jobs.get(part.tid, ()) and part.failure is None

    def _open(self, spec: ReceiveSpec, make: Callable[[Source, Box], P], busy: str,
              stalled: Callable[[str], None]) -> None:
        """Start receiving ``spec``: one part per source (``make``), ``stalled(tid)`` after
        ``push_timeout_s``, each source dialled (:meth:`_handshaken` follows); a transfer id
        already here is refused (``busy`` says how)."""
        core, tid = self.core, spec.transfer_id
        if tid in self.jobs:  # (its outcome is the running receive's)
            core.results.fail(spec.req_id, spec.local_ids, f"transfer {tid} is {busy}",
                              safe=True)
            return
        if not self.jobs.free:
            core.results.fail(spec.req_id, spec.local_ids, f"this decode rank receives "
                              f"{self.jobs.capacity} transfers already", safe=True,
                              transfer_id=tid)
            return
        sources = spec.parts()
        box: Box = core.results
        if len(sources) > 1:
            box = FanIn(core.results, spec.req_id, tid, spec.local_ids, len(sources),
                        lambda why: self.cancel(tid, why))
        parts = [make(src, box) for src in sources]
        self.jobs.insert(tid, parts)
        core.mark(tid, "recv_start")
        core.timers.set((self.kind, tid), core.config.push_timeout_s, lambda: stalled(tid))
        for part in parts:
            core.heartbeats.watch(tid, part.address, part.source.generation)
            self._expect(part, core.config.stall_s,
                         f"the handshake with prefill {part.address} did not finish")
        for part in parts:
            if self._live(part):  # an earlier part's failure may have given it up already
                core.peers.ensure(part.address, part.source.generation,
                                  functools.partial(self._handshaken, part))

    def _expect(self, part: P, bound: float, what: str) -> None:
        """``part`` must make its next step within ``bound`` seconds (replacing the step it
        waited for before): else it is counted (``handoff_stalled``) and given up, the reason
        saying ``what`` did not happen."""
        self.core.timers.set(("stall", part.tid, part.address), bound,
                             lambda: self._no_progress(part, bound, what))

    def _progressed(self, part: P) -> None:
        """``part`` waits for nothing that ``stall_s`` bounds (any more)."""
        self.core.timers.cancel(("stall", part.tid, part.address))

    def _no_progress(self, part: P, bound: float, what: str) -> None:
        if self._live(part):
            self.core.count("handoff_stalled", self.kind, part.peer)
            self._stalled_part(part, f"no progress within {bound:.1f} s: {what}")

    def _stalled_part(self, part: P, why: str) -> None:
        """Give ``part`` up: it made no progress (``why``)."""
        raise NotImplementedError

    def _handshaken(self, part: P, result: Peer | KVBridgeError) -> None:
        """The dial of ``part``'s prefill rank ended (the peer, or why not)."""
        raise NotImplementedError

    def cancel(self, tid: str, reason: str) -> bool:
        """Give up every part of ``tid`` still running; False if no such receive is here."""
        raise NotImplementedError

    def _drop(self, part: P) -> None:
        """``part`` ended: forget it (the last part of its receive ends the hand-off timer)
        and stop keeping its prefill rank's lease alive."""
        tid = part.tid
        self._progressed(part)
        parts = self.jobs.get(tid)
        if parts is not None and part in parts:
            parts.remove(part)
            if not parts:
                self.jobs.discard(tid)
                self.core.timers.cancel((self.kind, tid))
        self.core.heartbeats.unwatch(tid, part.address)


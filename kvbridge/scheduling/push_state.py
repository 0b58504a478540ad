"""The state of one push on P (:mod:`kvbridge.scheduling.push`): the push of one transfer
(:class:`Out`) and each decode rank's registration of it (:class:`Target`). Plain data; the
loop's thread owns it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.blocks import PreparedRequest
from kvbridge.control import RequestContext
from kvbridge.layout import DescriptorArray
from kvbridge.lookup import LookupBuffer
from kvbridge.messages import PushRegister
from kvbridge.scheduling import mapping
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.peers import Peer
from kvbridge.scheduling.specs import SendPlan
from kvbridge.transport import TransferHandle

__all__ = ["Stage", "Target", "Out", "MAX_PUSHES", "push_table"]


class Stage(enum.Enum):
    CONFIRMING = "confirming"  # dialling the registering decode rank, asking it to confirm
    CONFIRMED = "confirmed"


@dataclass
class Target:
    """One decode rank's registration of a push."""

    reg: PushRegister
    ctx: RequestContext
    stage: Stage = Stage.CONFIRMING
    peer: Peer | None = None
    shape: mapping.Shape | None = None  # the decode rank's, from its handshake
    share: mapping.Share | None = None  # the heads this rank writes it
    expected: frozenset[int] = frozenset()  # the decode ranks this rank writes, by its shape
    posted: set[int] = field(default_factory=set)
    #: the whole-request WRITE built ahead (posted when every plane is ready)
    prepared: PreparedRequest | None = None
    handles: list[TransferHandle] = field(default_factory=list)
    nbytes: int = 0
    #: this rank's side of the part as its digests cover it (built ahead), and the digests
    stream: DescriptorArray | None = None
    digests: bytes | None = None
    error: str | None = None


@dataclass
class Out:
    """The push of one transfer from this rank, to every decode rank it writes."""

    tid: str
    plan: SendPlan | None = None
    final: bool = False  # the whole prompt's KV is written
    fences: list[tuple[list[int], Fence | None]] = field(default_factory=list)  # not passed yet
    ready: list[list[int]] = field(default_factory=list)  # plane groups whose fence passed
    targets: list[Target] = field(default_factory=list)
    expected: frozenset[int] | None = None  # decode ranks this rank writes to
    decode_tp: int | None = None
    served: set[int] = field(default_factory=set)  # decode ranks whose push ended
    error: str | None = None  # the push failed for every decode rank

    def registered(self) -> set[int]:
        """Decode ranks whose registration was confirmed (or already served)."""
        return {t.shape.rank for t in self.targets
                if t.shape is not None and t.stage is Stage.CONFIRMED} | self.served

    def complete(self) -> bool:
        """Every decode rank this rank writes to has registered (and was confirmed)."""
        return self.expected is not None and self.expected <= self.registered()


#: pushes one prefill rank serves at once (registrations are bounded far below this by the
#: fair limits, :mod:`~kvbridge.scheduling.push_limits`; plans by vLLM's running requests)
MAX_PUSHES = 65536


def push_table(capacity: int = MAX_PUSHES,
               clock: Callable[[], float] = time.monotonic) -> LookupBuffer[str, Out]:
    """P's pushes: transfer id → the push (its plan when known, the registrations of the decode
    ranks it writes). No lease of its own: its timers (registration, readiness, WRITEs) end
    it; full is full (a registration is refused BUSY, a plan is not pushed)."""
    return LookupBuffer("push-table", capacity, clock=clock)

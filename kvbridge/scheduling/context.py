"""What the transfer state machines use of the loop that runs them: a narrow context.

The state machines (:mod:`~kvbridge.scheduling.pull`, :mod:`~kvbridge.scheduling.push`,
:mod:`~kvbridge.scheduling.push_wait`, the answers of :mod:`~kvbridge.scheduling.dispatch`)
run on the thread of a :class:`~kvbridge.scheduling.loop.TransferLoop`, which owns the
sockets, the transport and the timers. They reach it only through :class:`LoopContext`: this
rank's identity and geometry, the transport, the control channel (replies, calls, peers,
heartbeats), the timers, counters and observations, and the results vLLM takes. So they import
only downward (never the loop), and a test can drive one with a small fake context instead of
a running loop (``tests/unit/test_scheduling_context.py``).

The loop implements the protocol; every member is used on the loop thread only.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from kvbridge.config import Config
from kvbridge.control import ReplyCallback, RequestContext
from kvbridge.heads import HeadSplit
from kvbridge.layout import KVLayout
from kvbridge.messages import EngineInfo, Message
from kvbridge.scheduling.fences import Fence
from kvbridge.scheduling.follow import Board
from kvbridge.scheduling.leases import Timers
from kvbridge.scheduling.mapping import Shape
from kvbridge.scheduling.observations import Observations
from kvbridge.scheduling.peers import Peer, PeerCallback
from kvbridge.scheduling.results import Outcomes, ResultBox
from kvbridge.transport import TransferHandle, Transport

__all__ = ["LoopContext", "Replier", "Caller", "Dialler", "Watcher", "FenceOwner"]


class Replier(Protocol):
    """Answers control requests later (the loop's control server)."""

    def reply(self, ctx: RequestContext, msg: Message) -> None: ...


class Caller(Protocol):
    """Asynchronous calls to peers (the loop's :class:`~kvbridge.control.RpcClient`):
    ``callback`` gets each reply, or the error that ended the call; it returns True to keep
    listening."""

    def call(self, address: str, msg: Message, timeout: float | None,
             callback: ReplyCallback) -> int: ...

    def cancel(self, call_id: int) -> None: ...


class Dialler(Protocol):
    """Handshaken peers (the loop's :class:`~kvbridge.scheduling.peers.PeerTable`):
    ``callback`` gets the peer at ``address`` (cached, or after a handshake), or why not."""

    def ensure(self, address: str, generation: str, callback: PeerCallback) -> None: ...


class Watcher(Protocol):
    """Heartbeats that keep remote leases alive (the loop's
    :class:`~kvbridge.scheduling.leases.HeartbeatBook`). ``sent``: heartbeat rounds sent so
    far (an answer to one numbered before an event predates it)."""

    @property
    def sent(self) -> int: ...

    def watch(self, transfer_id: str, address: str, generation: str = ...) -> None: ...

    def unwatch(self, transfer_id: str, address: str) -> None: ...


class FenceOwner(Protocol):
    """Device fences a helper thread waits on (the loop polls only the others)."""

    def owns(self, fence: Fence) -> bool: ...


class LoopContext(Protocol):
    """See the module docstring. Identity and geometry of this rank, its collaborators, and
    the few services the loop itself provides."""

    config: Config
    engine_id: str
    generation: str
    rank: int
    tp_size: int
    layout: KVLayout
    heads: HeadSplit | None
    shape: Shape
    info: EngineInfo
    transport: Transport
    stats: Counter[str]
    observe: Observations
    ended: Outcomes
    results: ResultBox
    timers: Timers
    #: the words P's copies keep for its push receives, or None (kvbridge.scheduling.follow)
    board: Board | None

    @property
    def control_address(self) -> str: ...

    @property
    def server(self) -> Replier: ...

    @property
    def rpc(self) -> Caller: ...

    @property
    def peers(self) -> Dialler: ...

    @property
    def heartbeats(self) -> Watcher: ...

    @property
    def fences(self) -> FenceOwner: ...

    def mark(self, transfer_id: str, event: str, when: float | None = None,
             mono_ns: int | None = None) -> None:
        """Record a timing event of a transfer (now, at wall time ``when``, or at
        ``time.monotonic_ns()`` value ``mono_ns``)."""

    def count(self, name: str, mode: str, peer: Peer | None = None, *,
              stats: bool = True) -> None:
        """A failure event, counted and labelled for vLLM's metrics."""

    def backend_of(self, peer_name: str) -> str:
        """The transport carrying ``peer_name``."""

    def watch_handle(self, handle: TransferHandle) -> None:
        """Poll ``handle`` until it stops (the state machines' ``poll`` sees it then)."""

    def fence_pending(self, fence: Fence) -> None:
        """A push waits for ``fence``."""

    def cancel_remote(self, address: str, transfer_id: str, reason: str) -> None:
        """Tell the prefill engine at ``address`` that this side gave up (best effort)."""

    def holds_pull(self, transfer_id: str) -> bool:
        """This rank holds ``transfer_id`` staged for a pull (so not for a push)."""

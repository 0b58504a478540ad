"""Peer table: the remote engine ranks this rank moves KV with, learnt only by dialling them.

Without a shared secret only loopback addresses are dialled (mirroring the control server's
bind policy), so a client cannot point an engine at a "prefill engine" elsewhere on the network.
A peer is added *only* from the :class:`~kvbridge.messages.HelloReply` that answered our own
:class:`~kvbridge.messages.Hello` at an address we dialled, and it is keyed by that address. An
unsolicited Hello never adds or replaces anything, so nobody can slip their memory map in under
another engine's name. Identity is ``(engine_id, generation, rank)``: when the address answers
with a new generation (the engine restarted), the old entry and its transport peer are dropped.

The identity in the reply is proven, not believed (:mod:`kvbridge.identity`): the reply must
name the dialled address as its control address; the transport loads the peer only if the
peer's data plane shows the proof of this handshake's challenge for the dialled address and the
claimed identity; and the transport's name for it must be the agent the reply claims. A reply
that fails any of these is a :class:`~kvbridge.errors.PeerForged`, counted in :attr:`forged`
and logged at WARNING (at most once a second); nothing of it is kept.

Handshakes are asynchronous (through the loop's :class:`~kvbridge.control.RpcClient`), and
loading a peer into the transport (which may itself take a round trip, e.g. shm proving the
peer's process) runs on helper threads (:data:`ADD_THREADS`), so a hung peer never stalls the
loop, and a transport stuck adding one peer (NIXL's connection set-up can livelock) does not
hold up the handshakes of others (up to ``ADD_THREADS - 1`` stuck at once). The receive that
waits on a stuck handshake gives up after ``stall_s``; the handshake itself goes on, and its
peer is kept if it ever completes. Concurrent
:meth:`PeerTable.ensure` calls for one address share one handshake. The table is
bounded (least recently used peers are forgotten first). Owned by the loop thread.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvbridge import identity
from kvbridge.control import RpcClient, is_loopback
from kvbridge.errors import (
    KVBridgeError,
    LayoutError,
    LayoutMismatch,
    PeerError,
    PeerForged,
    PeerUnreachable,
    RemoteError,
)
from kvbridge.groups import check_groups, describe_groups
from kvbridge.heads import HeadSplit
from kvbridge.host.placement import local_placement, shared_core_warning
from kvbridge.layout import KVLayout
from kvbridge.messages import PROTOCOL_VERSION, Ack, EngineInfo, Hello, HelloReply, Message
from kvbridge.scheduling.leases import Prober
from kvbridge.scheduling.mapping import check_block_sizes
from kvbridge.transport import Transport

__all__ = ["Peer", "PeerTable", "check_compatible", "ANY_GENERATION", "ADD_THREADS"]

log = logging.getLogger("kvbridge.peers")

ANY_GENERATION = "*"
#: helper threads adding peers to the transport (each address has at most one add running)
ADD_THREADS = 4


@dataclass(frozen=True)
class Peer:
    info: EngineInfo
    layout: KVLayout
    name: str  # the transport's name for it
    address: str  # the address we dialled

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.info.engine_id, self.info.generation, self.info.rank)


#: compat keys the layout itself now checks (older engines still send them)
_LAYOUT_KEYS = frozenset({"block_size"})


def check_compatible(mine: EngineInfo, theirs: EngineInfo) -> KVLayout:
    """Raise :class:`LayoutMismatch` naming the first incompatible field; return their layout.

    Engines of equal TP size and block size exchange whole blocks, rank r with rank r, as
    always. Other shapes (heterogeneous TP, block sizes dividing one another) need both
    engines to describe their KV heads (:class:`~kvbridge.heads.HeadSplit`, checked against
    the peer's TP size, rank and layout, so a forged head offset is refused here); what cannot
    be mapped is refused with both values named.
    """
    if theirs.protocol != mine.protocol:
        raise LayoutMismatch(f"kvbridge protocol version differs: {mine.protocol} here, "
                             f"{theirs.protocol} at {theirs.engine_id}")
    if theirs.backend != mine.backend:
        raise LayoutMismatch(f"backend differs: {mine.backend!r} here, {theirs.backend!r} at "
                             f"{theirs.engine_id}")
    for key in sorted((set(mine.compat) | set(theirs.compat)) - _LAYOUT_KEYS):
        a, b = mine.compat.get(key), theirs.compat.get(key)
        if a != b:
            raise LayoutMismatch(f"{key} differs: {a!r} here, {b!r} at {theirs.engine_id}")
    try:
        layout = KVLayout.from_wire(theirs.layout)
    except LayoutError as exc:
        raise LayoutMismatch(f"unusable layout from {theirs.engine_id}: {exc}") from None
    if layout.fingerprint() != theirs.layout_fingerprint:
        raise LayoutMismatch(f"layout fingerprint of {theirs.engine_id} does not match its layout")
    if theirs.rank >= theirs.tp_size:
        raise LayoutMismatch(f"{theirs.engine_id} says it is rank {theirs.rank} of "
                             f"tensor-parallel {theirs.tp_size}")
    own = KVLayout.from_wire(mine.layout)
    if theirs.heads is not None:
        theirs.heads.check(layout, theirs.tp_size, theirs.rank, theirs.engine_id)
    same = theirs.tp_size == mine.tp_size and layout.block_size == own.block_size
    if same and (mine.heads is None or theirs.heads is None):
        if theirs.rank != mine.rank:
            raise LayoutMismatch(f"rank {mine.rank} here reached rank {theirs.rank} of "
                                 f"{theirs.engine_id}: each rank must talk to the matching rank")
        own.check_compatible(layout)
        return layout
    if not same and (own.groups or layout.groups):
        raise LayoutMismatch(
            f"tensor-parallel {mine.tp_size} and block_size {own.block_size} here, "
            f"{theirs.tp_size} and {layout.block_size} at {theirs.engine_id}: this is a hybrid "
            f"model (KV-cache groups: {describe_groups(own.groups)} here, "
            f"{describe_groups(layout.groups)} there), whose KV moves only between engines of "
            "one TP size and block size (docs/usage.md#hybrid-models)")
    if mine.heads is None or theirs.heads is None:
        who = "this engine" if mine.heads is None else theirs.engine_id
        raise LayoutMismatch(
            f"tensor-parallel {mine.tp_size} and block_size {own.block_size} here, "
            f"{theirs.tp_size} and {layout.block_size} at {theirs.engine_id}: mapping KV heads "
            f"and blocks between them needs a head-major KV layout on both, and {who} does not "
            "describe its KV heads (heterogeneous TP and block size: docs/concepts.md)")
    _check_heads(mine.heads, own, theirs.heads, layout, theirs.engine_id)
    return layout


def _check_heads(mine: HeadSplit, own: KVLayout, theirs: HeadSplit, layout: KVLayout,
                 engine: str) -> None:
    """Both head-major rank geometries can be mapped onto each other."""
    if own.dtype != layout.dtype:
        raise LayoutMismatch(f"dtype differs: {own.dtype} here, {layout.dtype} at {engine}")
    check_groups(own.groups, layout.groups)
    if len(own.planes) != len(layout.planes):
        raise LayoutMismatch(f"number of KV planes differs: {len(own.planes)} here, "
                             f"{len(layout.planes)} at {engine} (different model, layer count "
                             "or K/V split)")
    for name in ("total_heads", "head_dim", "outer", "inner", "order", "interior"):
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            raise LayoutMismatch(f"KV {name} differs: {a!r} here, {b!r} at {engine}")
    if mine.itemsize(own) != theirs.itemsize(layout):
        raise LayoutMismatch(f"bytes per KV element differ: {mine.itemsize(own)} here, "
                             f"{theirs.itemsize(layout)} at {engine}")
    check_block_sizes(own.block_size, layout.block_size)
    if own.block_size != layout.block_size and not mine.order:
        raise LayoutMismatch(f"block_size {own.block_size} here and {layout.block_size} at "
                             f"{engine}: blocks of {mine.interior or 'this'} format are opaque "
                             "inside a head, so only equal block sizes can be exchanged")


PeerCallback = Callable[[Peer | KVBridgeError], None]


class PeerTable:
    """See the module docstring."""

    def __init__(self, me: EngineInfo, transport: Transport, rpc: RpcClient,
                 submit: Callable[..., None], *, timeout: float, capacity: int = 1024,
                 prober: Prober | None = None, loopback_only: bool = False) -> None:
        self.me = me
        self._loopback_only = loopback_only
        self._submit = submit
        self._pool = ThreadPoolExecutor(max_workers=ADD_THREADS,
                                        thread_name_prefix="kvbridge-peers")
        self._prober = prober
        self._transport = transport
        self._rpc = rpc
        self._timeout = timeout
        self._capacity = capacity
        self._by_address: OrderedDict[str, Peer] = OrderedDict()
        self._waiting: dict[str, list[tuple[str, PeerCallback]]] = {}
        self._challenges: dict[str, bytes] = {}  # address -> challenge of its handshake
        self.handshakes = 0
        #: replies refused as forged: another address, an unproven data plane, another name
        self.forged = 0
        #: called with the engine id of each proven peer (the metrics label only those)
        self.on_proven: Callable[[str], None] | None = None
        #: called for each refused forged peer (the loop counts ``peer_forged``)
        self.on_forged: Callable[[], None] | None = None
        self._last_warning = float("-inf")

    def cached(self, address: str) -> Peer | None:
        return self._by_address.get(address)

    def __len__(self) -> int:
        return len(self._by_address)

    def ensure(self, address: str, generation: str, callback: PeerCallback) -> None:
        """Call ``callback`` with the peer at ``address`` (handshaking if needed), or with the
        error. ``generation`` is the generation the caller expects there (``*``: any): a cached
        peer of another generation is re-handshaken, and an answer of another generation is a
        :class:`PeerError` naming both."""
        if self._loopback_only and not is_loopback(_host_of(address)):
            callback(PeerError(
                f"refusing to dial {address} without a shared secret: anyone on the network "
                "could pose as a prefill engine there. Set KVBRIDGE_SECRET on every engine (or, "
                "on a trusted network, KVBRIDGE_ALLOW_INSECURE_CONTROL=1)"))
            return
        peer = self._by_address.get(address)
        if peer is not None and generation in (ANY_GENERATION, peer.info.generation):
            self._by_address.move_to_end(address)
            callback(peer)
            return
        waiters = self._waiting.setdefault(address, [])
        waiters.append((generation, callback))
        if len(waiters) == 1:
            nonce = self._challenges[address] = identity.challenge()
            call = self._rpc.call(address, Hello(info=self.me, challenge=nonce), self._timeout,
                                  lambda reply: self._answered(address, reply))
            if self._prober is not None:  # a dead address fails now, not after the timeout
                self._prober.check(address, lambda refused: self._refused(address, call, refused))

    def _refused(self, address: str, call: int, refused: bool) -> None:
        if refused and address in self._waiting and self._rpc.is_pending(call):
            self._rpc.cancel(call)
            self._notify(address, PeerUnreachable(
                f"handshake with {address} failed: nothing listens there (connection refused: "
                "the engine is gone)"))

    def _answered(self, address: str, reply: Message | KVBridgeError) -> bool:
        if address not in self._waiting:
            return False  # already failed (connection refused)
        try:
            info, layout = self._check(address, reply)
        except KVBridgeError as exc:
            self._notify(address, exc)
            return False
        old = self._by_address.get(address)
        if old is not None and old.key == (info.engine_id, info.generation, info.rank):
            self._notify(address, old)
            return False
        nonce = self._challenges.get(address, b"")
        proof = identity.proof(nonce, address, info.engine_id, info.generation, info.rank,
                               info.agent)
        expected = info.agent

        def add() -> None:  # on the helper thread: a transport may need a round trip here
            started = time.perf_counter()
            try:
                name: str | KVBridgeError = self._transport.add_peer(info.transport_metadata,
                                                                     proof)
            except KVBridgeError as exc:
                name = exc
            except Exception as exc:  # noqa: BLE001 - a backend bug must not lose the waiters
                name = PeerError(f"{type(exc).__name__}: {exc}")
            if isinstance(name, str) and name != expected:
                self._transport.remove_peer(name)
                name = PeerForged(f"the transport peer at {address} is {name!r}, the handshake "
                                  f"answer claims {expected!r}")
            self._submit(self._added, address, info, layout, name,
                         time.perf_counter() - started)

        try:
            self._pool.submit(add)
        except RuntimeError:  # shutting down
            self._notify(address, PeerError("engine shutting down"))
        return False

    def _check(self, address: str, reply: Message | KVBridgeError) -> tuple[EngineInfo, KVLayout]:
        if isinstance(reply, KVBridgeError):
            raise PeerError(f"handshake with {address} failed: {reply}")
        if isinstance(reply, Ack):
            raise RemoteError(str(reply.kind or "refused"),
                              f"handshake with {address} refused: {reply.error}")
        if not isinstance(reply, HelloReply):
            raise PeerError(f"unexpected handshake reply {type(reply).__name__} from {address}")
        if reply.info.control_address != address:
            raise self._forged(address, PeerForged(
                f"the engine answering at {address} says its control address is "
                f"{reply.info.control_address}: a relayed handshake (or an engine reached "
                "through an address it does not advertise); refused"))
        return reply.info, check_compatible(self.me, reply.info)

    def _forged(self, address: str, exc: PeerForged) -> PeerForged:
        """Count and log (at most once a second) a refused, forged peer."""
        self.forged += 1
        if self.on_forged is not None:
            self.on_forged()
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            log.warning("refused the peer at %s (%d so far): %s", address, self.forged, exc)
        return exc

    def _added(self, address: str, info: EngineInfo, layout: KVLayout,
               name: str | KVBridgeError, seconds: float = 0.0) -> None:
        if isinstance(name, PeerForged):
            self._notify(address, self._forged(address, PeerForged(
                f"cannot add the peer at {address}: {name}")))
            return
        if isinstance(name, KVBridgeError):
            self._notify(address, PeerError(f"cannot add the peer at {address}: {name}"))
            return
        peer = Peer(info, layout, name, address)
        old = self._by_address.get(address)
        if old is not None:
            log.info("peer at %s restarted (generation %s -> %s); re-handshaken", address,
                     old.info.generation, info.generation)
            if old.name != name:
                self._transport.remove_peer(old.name)
        self._by_address[address] = peer
        self._by_address.move_to_end(address)
        self.handshakes += 1
        log.info("handshake with %s (%s gen %s rank %d) done, proven in %.1f ms", address,
                 info.engine_id, info.generation, info.rank, seconds * 1e3)
        if self.on_proven is not None:
            self.on_proven(info.engine_id)
        warning = shared_core_warning(self.me, info, self._transport.name,
                                      self._transport.capabilities)
        if warning:
            log.warning("%s", warning)
        while len(self._by_address) > self._capacity:
            _, evicted = self._by_address.popitem(last=False)
            self._transport.remove_peer(evicted.name)
        self._notify(address, peer)

    def _notify(self, address: str, result: Peer | KVBridgeError) -> None:
        self._challenges.pop(address, None)
        for generation, callback in self._waiting.pop(address, []):
            outcome = result
            if isinstance(result, Peer) and generation not in (ANY_GENERATION,
                                                               result.info.generation):
                outcome = PeerError(
                    f"engine at {address} answers as generation {result.info.generation}, "
                    f"the transfer belongs to generation {generation} (it restarted, or it is "
                    "not the engine the request names)")
            try:
                callback(outcome)
            except Exception:  # noqa: BLE001 - one caller's bug must not starve the others
                log.exception("peer callback failed")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def forget(self, address: str) -> None:
        peer = self._by_address.pop(address, None)
        if peer is not None:
            self._transport.remove_peer(peer.name)

    def address_of(self, name: str) -> str | None:
        """The dialled address of the peer the transport calls ``name`` (None: unknown)."""
        for address, peer in self._by_address.items():
            if peer.name == name:
                return address
        return None


def _host_of(address: str) -> str:
    return address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")


def make_info(*, engine_id: str, generation: str, rank: int, tp_size: int, backend: str,
              agent: str, transport_metadata: bytes, layout: KVLayout, control_address: str,
              compat: dict[str, str], checksum: bool,
              heads: HeadSplit | None = None) -> EngineInfo:
    """Build this rank's :class:`EngineInfo`."""
    return EngineInfo(
        engine_id=engine_id, generation=generation, rank=rank, tp_size=tp_size,
        protocol=PROTOCOL_VERSION, backend=backend, agent=agent,
        transport_metadata=transport_metadata,
        layout=layout.to_wire(), layout_fingerprint=layout.fingerprint(),
        control_address=control_address, compat=compat, checksum=checksum, heads=heads,
        placement=local_placement(),
    )

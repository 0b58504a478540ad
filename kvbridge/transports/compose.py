"""The composer: one transport made of an ordered list of member transports.

``compose`` lets one engine reach each peer by the best path it has: ``shm`` to a process on the
same host, ``nixl`` (UCX or LIBFABRIC) across hosts, ``mooncake`` where that is deployed. Offload
tiers named among the members (``lmcache``, ``disk`` …) are not transports: the configuration
hands them to the offload layer (:meth:`kvbridge.config.Config.offload_config`), where stores go
to every tier and loads come from the first hit. Configuration::

    {"backend": "compose",
     "backend_options": {"members": ["shm", {"name": "nixl", "backends": ["UCX"]}, "lmcache"]}}

or ``KVBRIDGE_BACKEND=compose`` and ``KVBRIDGE_BACKEND_OPTIONS='{"members": [...]}'``. Every
other key of ``backend_options`` (``secret`` included, which the core adds) is given to every
member; a member object's own keys win.

Contract (on top of :mod:`kvbridge.transport`):

* **Members.** Each member transport is created with this transport's agent name, so a peer's
  name is the same through every member. A member that cannot load fails construction with its
  name and the install hint (the fleet asked for it; silently serving without it would hide a
  broken deployment).
* **Metadata** is a strict, bounded msgpack envelope: this agent's name and one blob per member
  (:class:`~kvbridge.transports.compose_spec.ComposeMetadata`, with the parsing of ``members``
  in :mod:`kvbridge.transports.compose_spec`). A malformed envelope is a :class:`MessageError`.
* **Choosing a member per peer** happens in :meth:`add_peer`, from both sides' metadata: the peer
  is loaded into *every* member it shares with us, in our order, and the first member that
  accepts it carries its transfers (``shm`` refuses another host, PID namespace or user with
  :class:`PeerUnreachable`; ``memory`` refuses another process). A member that refuses is logged
  with its reason. No member accepting raises :class:`PeerUnreachable` listing every member's
  reason (:class:`MessageError` when every member found its blob malformed). Loading into all
  shared members at handshake time means a later fallback never blocks the data path on a
  handshake.
* **Member failure.** A member whose ``submit`` raises (anything but :class:`DescriptorError`,
  which is the caller's fault and re-raised) has posted nothing, so the transfer is tried on the
  next member that holds the peer, and that member carries the peer's transfers from then on
  (WARNING naming both). A READ whose handle FAILED is re-posted on the next member too (reading
  again overwrites the same local bytes). A WRITE whose handle FAILED is never retried — some of
  its bytes may have landed in the peer's memory — and its handle ends FAILED with the member's
  name in the error; later transfers move to the next member. Notifications follow the peer's
  current member; a ``send_notification`` that raises is retried on the next one. Compose offers
  notifications (:class:`~kvbridge.transport.Notifying`) and requires them of its members when
  they are used.
* **Transfers by block id** (:class:`~kvbridge.blocks.BlockTransport`): a member prepares the
  pair the first time a transfer of it is posted there (a member failing to prepare is passed
  over like one failing to submit; a layout outside registered memory raises
  :class:`DescriptorError`); requests are validated once here and handed to the carrying
  member's own block path (or, for a member without one, its ``submit`` with descriptors).
* **Handles** are wrappers (:class:`ComposeHandle`) around the member's handle. ``poll`` drives
  the member's ``poll`` and the READ retry on the calling thread; the member's completion
  callbacks are forwarded as wake-ups.
* **Capabilities** are derived: ``read``, ``write``, ``notifications`` and ``device_memory`` when
  every member has them (any member may end up carrying a peer), ``cross_host`` when any has.
* **Memory** is registered with every member. At the first registration, before any peer, a
  member that refuses the memory (``shm`` and device memory, say) is dropped with a WARNING as
  long as another remains; later, a refusal raises.
* Thread safety: every method may be called from any thread (one lock guards the peer routes;
  members serialise themselves). ``close`` closes every member within one overall ``timeout``
  and is idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvbridge import registry
from kvbridge.blocks import BlockPair, BlockRequest, BlockTransport, prepare_blocks, submit_request
from kvbridge.errors import (
    ConfigError,
    DescriptorError,
    KVBridgeError,
    MessageError,
    PeerForged,
    PeerUnreachable,
    TransportClosed,
    TransportError,
    UnknownPeer,
)
from kvbridge.transport import (
    Capabilities,
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Op,
    TransferHandle,
    Transport,
    as_descriptors,
    notifying,
)
from kvbridge.transports.compose_spec import (
    MemberSpec,
    decode_metadata,
    encode_metadata,
    parse_members,
)

#: Posts a transfer on member ``index`` and returns the member's handle.
Poster = Callable[[int], TransferHandle]

__all__ = ["ComposeTransport", "ComposeHandle"]

log = logging.getLogger("kvbridge.transport.compose")

@dataclass
class _Member:
    name: str
    transport: Transport
    metadata: bytes | None = None


@dataclass
class _Route:
    """How this transport reaches one peer: the members that accepted it, in order."""

    agent: str
    names: dict[int, str]  # member index -> the member's name for the peer
    active: int  # the member index carrying the peer now

    def after(self, index: int) -> int | None:
        later = [i for i in sorted(self.names) if i > index]
        return later[0] if later else None


@dataclass(eq=False)
class ComposeHandle(TransferHandle):
    """A transfer posted through one member (``member``), re-posted on the next for a READ."""

    inner: TransferHandle | None = None
    member: int = 0
    post: Poster | None = None
    attempts: list[str] = field(default_factory=list)

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Wake-ups: ``fn`` runs when this handle or its member handle becomes terminal."""
        self._callbacks.append(fn)
        inner = self.inner
        if self.done_event.is_set() or (inner is not None and inner.done_event.is_set()):
            fn()

    def _wake(self) -> None:
        for fn in list(self._callbacks):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a waker must never break a member's thread
                pass


@dataclass
class _Pairs:
    """Native state of a compose block pair: the route it was prepared for and the pair each
    member prepared (filled in as members come to carry the peer)."""

    route: _Route
    members: dict[int, BlockPair]


class ComposeTransport(BlockTransport):
    """See the module docstring."""

    name = "compose"
    capabilities: ClassVar[Capabilities] = Capabilities()  # replaced per instance from members

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None,
                 *, members: Sequence[tuple[str, Transport]] | None = None) -> None:
        """Create every member of ``options["members"]`` (see :func:`parse_members`); tier
        members are skipped here. ``members`` instead takes ready transports as ``(name,
        transport)`` pairs, which this transport then owns (tests and embedding)."""
        super().__init__(agent_name, options)
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._members: list[_Member] = []
        if members is not None:
            self._members = [_Member(n, t) for n, t in members]
        else:
            shared = {k: v for k, v in self.options.items() if k != "members"}
            try:
                for spec in parse_members(self.options.get("members")):
                    if spec.kind == "transport":
                        self._members.append(_Member(spec.name, self._create(spec, shared)))
            except BaseException:
                for m in self._members:
                    m.transport.close(timeout=1.0)
                raise
        if not self._members:
            raise ConfigError("compose: no transport member")
        for m in self._members:
            m.transport.on_peer_lost(self._member_lost)
        setattr(self, "capabilities", self._derive())  # noqa: B010 - per instance, not class
        log.info("compose %r: members %s", agent_name, ", ".join(self.member_names))

    def _create(self, spec: MemberSpec, shared: Mapping[str, Any]) -> Transport:
        try:
            t: Transport = registry.create(spec.name, self.agent_name, {**shared, **spec.options})
        except KVBridgeError as exc:
            raise type(exc)(f"compose member {spec.name!r}: {exc}") from exc
        return t

    def _derive(self) -> Capabilities:
        caps = [m.transport.capabilities for m in self._members]
        return Capabilities(
            read=all(c.read for c in caps), write=all(c.write for c in caps),
            notifications=all(c.notifications for c in caps),
            device_memory=all(c.device_memory for c in caps),
            cross_host=any(c.cross_host for c in caps),
            shared_core_safe=all(c.shared_core_safe for c in caps))

    @classmethod
    def probe(cls) -> str:
        return "ok (members from backend_options.members)"

    @property
    def member_names(self) -> list[str]:
        return [m.name for m in self._members]

    def member_for(self, peer: str) -> str:
        """The member carrying ``peer``'s transfers now; :class:`UnknownPeer` if none."""
        route = self._route(peer)
        return self._members[route.active].name

    def members_for(self, peer: str) -> list[str]:
        """Every member that accepted ``peer``, in order (the fallbacks after the first)."""
        route = self._route(peer)
        return [self._members[i].name for i in sorted(route.names)]

    # -- memory and peers -----------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register ``regions`` with every member; return the envelope of their metadata."""
        self._check_open()
        with self._lock:
            first = all(m.metadata is None for m in self._members) and not self._routes
        kept: list[_Member] = []
        for m in self._members:
            try:
                m.metadata = m.transport.register_memory(regions)
                kept.append(m)
            except KVBridgeError as exc:
                if not first:
                    raise type(exc)(f"compose member {m.name!r}: {exc}") from exc
                log.warning("compose %r: member %s cannot register this memory (%s); it is not "
                            "used", self.agent_name, m.name, exc)
                m.transport.close(timeout=1.0)
        if not kept:
            raise DescriptorError(f"compose {self.agent_name!r}: no member can register this "
                                  "memory")
        with self._lock:
            self._members = kept
        setattr(self, "capabilities", self._derive())  # noqa: B010
        return encode_metadata(self.agent_name,
                               [(m.name, m.metadata) for m in kept if m.metadata is not None])

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Attest ``proof`` in every member, each with the dialler's blob for it (metadata that
        is not a compose envelope gives each member an empty blob: admits no one there)."""
        blobs: dict[str, bytes] = {}
        if peer_metadata is not None:
            try:
                blobs = dict(decode_metadata(peer_metadata).members)
            except MessageError:
                blobs = {}
        for m in self._members:
            m.transport.attest(proof, None if peer_metadata is None else blobs.get(m.name, b""))

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load the peer into every member it shares with us; the first one carries it. A
        member whose peer does not show ``proof`` refuses the whole peer (:class:`PeerForged`):
        its metadata was tampered with."""
        self._check_open()
        meta = decode_metadata(metadata)
        theirs = dict(meta.members)
        names: dict[int, str] = {}
        reasons: list[str] = []
        malformed = 0
        forged: PeerForged | None = None
        for i, m in enumerate(self._members):
            blob = theirs.get(m.name)
            if blob is None:
                reasons.append(f"{m.name}: the peer has no such member")
                continue
            try:
                names[i] = m.transport.add_peer(blob, proof)
            except PeerForged as exc:
                forged = exc
                reasons.append(f"{m.name}: {exc}")
                break
            except MessageError as exc:
                malformed += 1
                reasons.append(f"{m.name}: {exc}")
            except TransportError as exc:
                reasons.append(f"{m.name}: {exc}")
        if forged is not None:  # nothing of this peer stays loaded, an older route included
            self.remove_peer(meta.agent)
            for i, pname in names.items():
                self._members[i].transport.remove_peer(pname)
            raise PeerForged(f"compose peer {meta.agent!r}: {'; '.join(reasons)}") from forged
        if not names:
            detail = "; ".join(reasons)
            if malformed and malformed == len([m for m in self._members if m.name in theirs]):
                raise MessageError(f"compose peer {meta.agent!r}: {detail}")
            raise PeerUnreachable(f"compose: no member reaches peer {meta.agent!r} ({detail})")
        route = _Route(meta.agent, names, min(names))
        with self._lock:
            old = self._routes.get(meta.agent)
            self._routes[meta.agent] = route
        self._forget_blocks(meta.agent)
        if old is not None:
            for i, pname in old.names.items():
                if i not in names and i < len(self._members):
                    self._members[i].transport.remove_peer(pname)
        chosen = self._members[route.active].name
        if reasons:
            log.info("compose %r reaches %r through %s (%s)", self.agent_name, meta.agent,
                     chosen, "; ".join(reasons))
        else:
            log.info("compose %r reaches %r through %s", self.agent_name, meta.agent, chosen)
        return meta.agent

    def _member_lost(self, name: str) -> None:
        """A member found the peer's process gone: it is gone for every member."""
        with self._lock:
            known = name in self._routes
        if known:
            self.remove_peer(name)
            self._peer_lost(name)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            route = self._routes.pop(peer, None)
        self._forget_blocks(peer)
        if route is not None:
            for i, pname in route.names.items():
                self._members[i].transport.remove_peer(pname)

    def _route(self, peer: str) -> _Route:
        with self._lock:
            route = self._routes.get(peer)
        if route is None:
            raise UnknownPeer(f"compose {self.agent_name!r} has no peer {peer!r}")
        return route

    def _demote(self, route: _Route, failed: int, reason: str) -> int | None:
        """Move ``route`` past member ``failed``; the next member's index, or None."""
        nxt = route.after(failed)
        with self._lock:
            if nxt is not None and route.active == failed:
                route.active = nxt
        if nxt is None:
            log.warning("compose %r: member %s failed for peer %r (%s); no other member reaches "
                        "it", self.agent_name, self._members[failed].name, route.agent, reason)
        else:
            log.warning("compose %r: member %s failed for peer %r (%s); %s carries it from now "
                        "on", self.agent_name, self._members[failed].name, route.agent, reason,
                        self._members[nxt].name)
        return nxt

    # -- data path ------------------------------------------------------------------------------

    def submit(self, op: Op, peer: str, local: Any, remote: Any,
               notification: bytes | None = None) -> TransferHandle:
        """Post through the peer's current member (which validates the descriptors)."""
        if self._closed:
            raise TransportClosed(f"compose transport {self.agent_name!r} is closed")
        route = self._route(peer)
        loc = as_descriptors(local, "local")
        rem = as_descriptors(remote, "remote")
        nbytes = int(loc[:, 1].sum()) if loc.shape[0] else 0

        def post(index: int) -> TransferHandle:
            m = self._members[index]
            return m.transport.submit(op, route.names[index], loc, rem, notification)

        handle = ComposeHandle(op=op, peer=peer, nbytes=nbytes, count=int(loc.shape[0]),
                               post=post)
        self._post(route, route.active, handle)
        return handle

    def _submit(self, op: Op, peer: str, local: DescriptorArray, remote: DescriptorArray,
                notification: bytes | None) -> TransferHandle:
        return self.submit(op, peer, local, remote, notification)

    def _prepare_blocks(self, pair: BlockPair) -> _Pairs:
        """Members prepare lazily, when a transfer is posted on them, so that a member that
        fails to prepare is passed over like one that fails to submit."""
        return _Pairs(self._route(pair.peer), {})

    def _member_pair(self, pair: BlockPair, native: _Pairs, index: int) -> BlockPair:
        """Member ``index``'s pair for ``pair`` (prepared now if that member has not carried
        it yet, or dropped it)."""
        with self._lock:
            mine = native.members.get(index)
        if mine is None or not mine.live:
            mine = prepare_blocks(self._members[index].transport, native.route.names[index],
                                  pair.local, pair.remote)
            with self._lock:
                native.members[index] = mine
        return mine

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        native: _Pairs = pair.native
        route = self._route(pair.peer)
        if route is not native.route:
            raise UnknownPeer(f"compose {self.agent_name!r}: peer {pair.peer!r} was re-added")

        def post(index: int) -> TransferHandle:
            mine = self._member_pair(pair, native, index)
            return submit_request(self._members[index].transport, op, mine, req, notification)

        handle = ComposeHandle(op=op, peer=pair.peer, nbytes=req.nbytes,
                               count=req.count, post=post)
        self._post(route, route.active, handle)
        return handle

    def _post(self, route: _Route, index: int | None, handle: ComposeHandle) -> None:
        """Post ``handle`` on member ``index`` or, when a member raises, the next ones."""
        assert handle.post is not None
        while index is not None:
            m = self._members[index]
            try:
                inner = handle.post(index)
            except DescriptorError:
                raise
            except TransportError as exc:
                if self._closed:
                    raise TransportClosed(f"compose transport {self.agent_name!r} is closed"
                                          ) from exc
                handle.attempts.append(f"{m.name}: {exc}")
                index = self._demote(route, index, str(exc))
                continue
            handle.inner, handle.member = inner, index
            inner.add_done_callback(handle._wake)
            return
        raise PeerUnreachable(f"compose: every member failed to post to {route.agent!r} ("
                              f"{'; '.join(handle.attempts)})")

    def poll(self, handle: TransferHandle) -> HandleState:
        """Progress ``handle`` (a READ that failed is re-posted on the next member here)."""
        if not isinstance(handle, ComposeHandle) or handle.inner is None:
            return handle.state
        if handle.state.terminal:
            return handle.state
        m = self._members[handle.member]
        state = m.transport.poll(handle.inner)
        if state is HandleState.PENDING:
            return state
        if state is HandleState.DONE:
            handle.succeed()
            return handle.state
        error = f"{m.name}: {handle.inner.error or 'failed'}"
        handle.attempts.append(error)
        with self._lock:
            route = self._routes.get(handle.peer)
        nxt = None if route is None else self._demote(route, handle.member, error)
        if handle.op is Op.READ and nxt is not None and route is not None and not self._closed:
            try:
                self._post(route, nxt, handle)
                return HandleState.PENDING
            except KVBridgeError as exc:
                handle.attempts.append(str(exc))
        handle.fail("; ".join(handle.attempts))
        return handle.state

    def _event_of(self, handle: TransferHandle) -> threading.Event:
        """:meth:`wait` sleeps on the member handle's event (set by the member's thread)."""
        inner = handle.inner if isinstance(handle, ComposeHandle) else None
        return (inner or handle).done_event

    # -- notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        """Notify through the peer's current member, then the next ones (:class:`ConfigError`
        when a member carries no notifications)."""
        self._check_open()
        route = self._route(peer)
        index: int | None = route.active
        errors: list[str] = []
        while index is not None:
            m = self._members[index]
            try:
                notifying(m.transport).send_notification(route.names[index], message)
                return
            except (DescriptorError, UnknownPeer):
                raise
            except TransportError as exc:
                errors.append(f"{m.name}: {exc}")
                index = self._demote(route, index, str(exc))
        raise PeerUnreachable(f"compose: no member could notify {peer!r} ({'; '.join(errors)})")

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Every member's notifications (per-peer order holds within a member)."""
        out: list[tuple[str, bytes]] = []
        for m in list(self._members):
            out.extend(notifying(m.transport).get_notifications())
        return out

    # -- lifecycle ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"compose transport {self.agent_name!r} is closed")

    def close(self, timeout: float = 5.0) -> None:
        """Close every member within ``timeout`` overall. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._routes.clear()
        self._forget_blocks(None)
        deadline = time.monotonic() + timeout
        for m in self._members:
            try:
                m.transport.close(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - one member must not keep the others open
                log.exception("compose %r: closing member %s failed", self.agent_name, m.name)
        log.info("compose transport %r closed", self.agent_name)

"""NixlTransport: kvbridge's Transport over NIXL (UCX by default, LIBFABRIC for AWS EFA).

Contract (on top of :mod:`kvbridge.transport`'s):

* Construction imports nixl (missing → :class:`BackendUnavailable` naming what to install),
  creates one ``nixl_agent`` with the configured NIXL backends and no listen thread, and fails
  with :class:`BackendUnavailable` (one line) if any configured backend cannot load. It blocks for
  plugin loading (~0.3–2 s, longer on a loaded host).
* Metadata is exchanged by kvbridge's control channel: :meth:`register_memory` returns
  msgpack bytes holding the NIXL agent metadata, the registered regions, the memory kind and
  the address of the agent's proof board; :meth:`add_peer` decodes them (:class:`MessageError`
  if malformed), calls ``add_remote_agent`` and READs the peer's proof board
  (:class:`~kvbridge.transports.proofs.ProofBoard`, 16 KiB of host DRAM registered at
  construction, never part of the KV regions): a peer whose board does not hold the handshake's
  proof (:meth:`attest` writes it there) is unloaded and refused with :class:`PeerForged`. The
  READ also makes UCX connect at handshake time rather than on the first transfer.
* Block path (:class:`~kvbridge.blocks.BlockTransport`, what the core uses): a local layout is
  prepared once (``prep_xfer_dlist`` of a strided list: one row per plane covering every block,
  cached by the layout's key) and a peer's layout once per pair (cached with the peer, released
  when it is removed or re-added). A transfer is then two int32 index arrays (plane ×
  ``num_blocks`` + block id) given to ``make_prepped_xfer``; NIXL merges consecutive entries.
  When the ids form long runs (at most one run per 4 blocks), the coalesced ranges are posted
  with ``initialize_xfer`` instead, which is cheaper for a few long ranges.
* Descriptor path (``submit``): descriptors are checked against both sides' registered regions
  before anything is posted. In ``xfer_mode`` ``auto``/``prepped`` the transfer indexes
  *prepared* descriptor lists (one "grid" per side and granule, cached per peer, see
  :mod:`kvbridge_nixl._grid`), else it is posted with ``initialize_xfer``.
* A transfer's notification is the NIXL ``notif_msg``, which NIXL delivers only after the bytes
  landed and only on success.
* Thread safety: NIXL is not guaranteed thread-safe; every agent call holds one lock.
  NIXL completes a transfer (and sends its notification) only when the initiator checks its
  state, so a kvbridge progress thread polls in-flight handles (interval 1/32 of their age,
  20 µs – 1 ms; asleep when nothing is in flight) and settles each handle; :meth:`wait`
  sleeps on its event.
* Notifications (:class:`~kvbridge.transport.Notifying`) are NIXL's own ``send_notif`` /
  ``get_new_notifs``.

Modules, by job: this one (construction, memory, the handshake, the entry points of both data
paths, notifications, close); :mod:`kvbridge_nixl._peer` (metadata, peer state, error mapping);
:mod:`kvbridge_nixl._requests` (building NIXL requests, the descriptor lists they index);
:mod:`kvbridge_nixl._progress` (posting, the progress thread, poll and wait);
:mod:`kvbridge_nixl._agent` (options and the agent), :mod:`kvbridge_nixl._grid`,
:mod:`kvbridge_nixl._efa`.
* :meth:`close` refuses new work, waits up to ``timeout`` for posted handles, fails and
  abandons the rest (posted RDMA cannot be aborted), then releases prepared lists, memory
  registrations, remote agents and the agent. Idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar

import msgspec
import numpy as np

from kvbridge.blocks import (
    BlockPair,
    BlockRequest,
    BlockTransport,
    PreparedRequest,
    check_in_regions,
)
from kvbridge.errors import (
    DescriptorError,
    KVBridgeError,
    MessageError,
    PeerForged,
    PeerUnreachable,
    TransportClosed,
    TransportError,
    UnknownPeer,
)
from kvbridge.layout import LayoutKey
from kvbridge.transport import (
    Capabilities,
    DescriptorArray,
    MemoryRegion,
    Op,
    TransferHandle,
    check_within,
)
from kvbridge.transports.proofs import ProofBoard, check_proof
from kvbridge_nixl._agent import NixlOptions, create_agent, import_nixl
from kvbridge_nixl._efa import detect_efa_devices, efa_advice
from kvbridge_nixl._peer import (
    METADATA_VERSION,
    NixlPeerInfo,
    PeerState,
    PreparedPair,
    info_decoder,
    info_encoder,
    translate,
)
from kvbridge_nixl._progress import Progress
from kvbridge_nixl._requests import I32

NIXL_INIT = "NIXL_INIT_AGENT"

__all__ = ["NixlTransport", "NixlPeerInfo"]

log = logging.getLogger("kvbridge.transport.nixl")

_MAX_LAYOUT_DLISTS = 16
#: bound of the proof-board READ of a handshake (UCX connects on the first transfer)
_BOARD_TIMEOUT_S = 10.0


class NixlTransport(Progress, BlockTransport):
    """kvbridge Transport over NIXL; see the module docstring for the contract."""

    name: ClassVar[str] = "nixl"
    #: what to install when nixl is missing (kvbridge.registry.install_hint)
    install_hint: ClassVar[str] = ("pip install 'kvbridge[nixl]'  (nixl==1.5.1 nixl-cu13==1.5.1 "
                                   "--no-deps on CPU hosts)")
    capabilities: ClassVar[Capabilities] = Capabilities(
        read=True, write=True, notifications=True, device_memory=True, cross_host=True,
        shared_core_safe=False,  # UCX's connection set-up livelocks there (docs/backends/nixl.md)
    )

    def __init__(self, agent_name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(agent_name, options)
        self.settings = NixlOptions.parse(self.options)
        self._lock = threading.RLock()
        self._agent, self.agent_config = create_agent(agent_name, self.settings)
        self._regions: list[tuple[int, int, int]] = []
        self._reg_descs: list[Any] = []
        self._board = ProofBoard()
        try:
            self._reg_descs.append(self._agent.register_memory(
                [(r.address, r.length, 0, "") for r in self._board.regions()], "DRAM"))
        except Exception as exc:
            raise TransportError(f"NIXL could not register the proof board: {exc!r}") from exc
        self._mem_type: str | None = None
        self._peers: dict[str, PeerState] = {}
        self._retired_peers: list[PeerState] = []
        self._local_grids: OrderedDict[int, Any] = OrderedDict()
        self._layout_dlists: OrderedDict[LayoutKey, Any] = OrderedDict()
        self._scratch: I32 = np.empty(0, dtype=np.int32)  # index arrays, see _block_args
        self._retired_dlists: list[Any] = []
        self._inflight: dict[int, tuple[TransferHandle, PeerState]] = {}
        self._ahead = 0  # requests made ahead (prepare_request), not yet posted or discarded
        self._closing = False
        self._cv = threading.Condition(self._lock)
        self._progress: threading.Thread | None = None
        self.stats = {"prepped": 0, "direct": 0, "grids": 0, "block_prepped": 0,
                      "block_direct": 0, "block_dlists": 0,
                      "block_prepared_ahead": 0}
        log.info(
            "nixl agent %r started: backends=%s progress_thread=%s progress_delay_us=%d "
            "num_threads=%d xfer_mode=%s UCX_TLS=%r UCX_NET_DEVICES=%r",
            agent_name, ",".join(self.settings.backends), self.settings.progress_thread,
            self.agent_config["progress_delay_us"], self.settings.num_threads,
            self.settings.xfer_mode, self.agent_config["UCX_TLS"],
            self.agent_config["UCX_NET_DEVICES"],
        )
        if self.settings.efa_check:
            advice = efa_advice(self.settings.backends, self.efa_devices())
            if advice:
                log.warning("%s", advice)

    # -- discovery ------------------------------------------------------------------------------

    @staticmethod
    def efa_devices() -> list[str]:
        """EFA devices of this host (override or monkeypatch in tests)."""
        return detect_efa_devices()

    @classmethod
    def probe(cls) -> str:
        """Short status for ``kvbridge backends``; raises :class:`BackendUnavailable`."""
        api = import_nixl()

        try:
            ver = version("nixl")
        except PackageNotFoundError:
            ver = "?"
        impl = api.__name__.split(".")[0]
        efa = detect_efa_devices(fi_info=None)
        return f"nixl {ver} ({impl}); EFA devices: {', '.join(efa) if efa else 'none'}"

    # -- memory and peers -----------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        """Register ``regions`` with every configured NIXL backend; return the metadata.

        All regions of one transport share one memory kind (``DRAM`` or ``VRAM``). Blocking.
        """
        new = [(int(r.address), int(r.length), int(r.device)) for r in regions]
        kinds = {r.kind.upper() for r in regions}
        with self._lock:
            self._check_open()
            kind = self._mem_type or (kinds.pop() if len(kinds) == 1 else "DRAM")
            if new and (kind not in ("DRAM", "VRAM")
                        or any(r.kind.upper() != kind for r in regions)):
                raise DescriptorError(
                    f"nixl transport registers one memory kind (DRAM or VRAM), got "
                    f"{sorted({r.kind for r in regions})} after {self._mem_type or 'none'}"
                )
            if any(length <= 0 or addr <= 0 for addr, length, _ in new):
                raise DescriptorError("a memory region needs a positive address and length")
            if new:
                try:
                    # a list of (addr, len, dev, name) tuples: NIXL reads numpy arrays as Nx3
                    # descriptor lists, never as buffers
                    descs = self._agent.register_memory([(*r, "") for r in new], kind)
                except Exception as exc:
                    raise TransportError(f"NIXL register_memory failed: {exc!r}") from exc
                self._reg_descs.append(descs)
                self._mem_type = kind
                self._regions.extend(new)
                self._retire(self._local_grids)
            info = NixlPeerInfo(
                version=METADATA_VERSION,
                agent=self.agent_name,
                mem_type=self._mem_type or "DRAM",
                regions=list(self._regions),
                nixl=bytes(self._agent.get_agent_metadata()),
                board=self._board.board,
            )
        log.debug("nixl %r registered %d region(s), %d total", self.agent_name, len(new),
                  len(self._regions))
        return info_encoder.encode(info)

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        """Write ``proof`` on this agent's proof board, where the dialler READs it."""
        self._board.attest(proof)

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        """Load the peer's agent, READ its proof board and keep it only if ``proof`` is there
        (else :class:`PeerForged`; the agent is unloaded, with any earlier peer of that name)."""
        proof = check_proof(proof)
        try:
            info = info_decoder.decode(metadata)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
            raise MessageError(f"malformed nixl peer metadata: {exc}") from exc
        if info.version != METADATA_VERSION:
            raise MessageError(
                f"nixl peer metadata version {info.version}, this side speaks {METADATA_VERSION}"
            )
        with self._lock:
            self._check_open()
            try:
                raw = self._agent.add_remote_agent(info.nixl)
            except Exception as exc:
                if type(exc).__name__ in ("nixlBackendError", "nixlRemoteDisconnectError"):
                    raise PeerUnreachable(f"NIXL cannot connect to the agent of {info.agent!r} "
                                          f"(gone, or unreachable from here): {exc!r}") from exc
                raise MessageError(f"NIXL rejected peer metadata of {info.agent!r}: {exc!r}") \
                    from exc
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name != info.agent:
                raise MessageError(f"peer metadata names {info.agent!r} but NIXL says {name!r}")
        try:
            self._board.verify(lambda loc, rem, n: self._read_board(name, loc, rem, n),
                               info.board, proof, f"nixl peer {name!r}")
        except KVBridgeError:
            self.remove_peer(name)
            with self._lock:
                if name not in self._peers and not any(p.name == name
                                                       for p in self._retired_peers):
                    self._unload(name)
            raise
        with self._lock:
            self._check_open()
            old = self._peers.get(name)
            if old is not None:
                self._retire(old.grids)
                old.removed = True
            for retired in self._retired_peers:
                if retired.name == name:
                    retired.removed = False  # re-added before its deferred removal ran
                    self._retire(retired.grids)
            self._retired_peers = [p for p in self._retired_peers if p.name != name]
            self._peers[name] = PeerState(name, list(info.regions), info.mem_type)
        self._forget_blocks(name)
        log.info("nixl %r added peer %r (%d region(s))", self.agent_name, name, len(info.regions))
        return name

    def _read_board(self, peer: str, local: int, remote: int, nbytes: int) -> None:
        """READ ``nbytes`` of the peer's proof board into our scratch area (blocking, at most
        ``_BOARD_TIMEOUT_S``); raises :class:`PeerForged` when it cannot be read."""
        what = f"READ of the proof board of {peer!r}"
        with self._lock:
            self._check_open()
            agent = self._agent
            try:
                native = agent.initialize_xfer(
                    "READ", agent.get_xfer_descs([(local, nbytes, 0)], "DRAM"),
                    agent.get_xfer_descs([(remote, nbytes, 0)], "DRAM"), peer, b"")
            except Exception as exc:
                raise PeerForged(f"{what}: NIXL refused it ({exc!r}): the advertised board is "
                                 "not memory that agent registered") from exc
        deadline = time.monotonic() + _BOARD_TIMEOUT_S
        delay = 20e-6
        try:
            step = agent.transfer  # posts it; then check_xfer_state until it stopped
            while True:
                with self._lock:
                    if self._agent is None:
                        raise TransportClosed(f"nixl transport {self.agent_name!r} is closed")
                    try:
                        status = step(native)
                    except Exception as exc:
                        raise PeerForged(f"{what} failed: {exc!r}") from exc
                step = agent.check_xfer_state
                if status == "DONE":
                    return
                if status == "ERR":
                    raise PeerForged(f"{what} failed (NIXL state ERR)")
                if time.monotonic() >= deadline:
                    raise PeerUnreachable(f"{what} did not finish in {_BOARD_TIMEOUT_S} s")
                time.sleep(delay)
                delay = min(delay * 2, 5e-3)
        finally:
            with self._lock:
                if self._agent is not None:
                    self._release(native)

    def _unload(self, name: str) -> None:
        """Drop a remote agent that never became a peer (its proof failed)."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("nixl: remove_remote_agent(%r) failed: %r", name, exc)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            state = self._peers.pop(peer, None)
            if state is None:
                return
            state.removed = True
            self._retired_peers.append(state)
        self._forget_blocks(peer)
        with self._lock:
            self._reap_peers()
        log.info("nixl %r removed peer %r", self.agent_name, peer)

    # -- data path ------------------------------------------------------------------------------

    def _submit(
        self,
        op: Op,
        peer: str,
        local: DescriptorArray,
        remote: DescriptorArray,
        notification: bytes | None,
    ) -> TransferHandle:
        nbytes = int(local[:, 1].sum())
        handle = TransferHandle(op, peer, nbytes, int(local.shape[0]))
        with self._lock:
            self._check_open()
            state = self._peers.get(peer)
            if state is None:
                raise UnknownPeer(f"nixl {self.agent_name!r}: unknown peer {peer!r}")
            check_within(local, [(a, n) for a, n, _ in self._regions], "local")
            check_within(remote, [(a, n) for a, n, _ in state.regions], "remote")
            if local.shape[0] == 0:
                if notification is not None:
                    self._notify(peer, notification)
                handle.succeed()
                return handle
            self._track(handle, state, *self._post(op, state, local, remote,
                                                   notification or b""))
        return handle

    # -- block path -----------------------------------------------------------------------------

    def _prepare_blocks(self, pair: BlockPair) -> PreparedPair:
        """Check both layouts against registered memory; prepare the remote layout's list (and
        the local one's, unless cached). Blocking (one or two ``prep_xfer_dlist``)."""
        for layout in (pair.local, pair.remote):
            if len(layout.planes) * layout.num_blocks >= 2**31:
                raise DescriptorError(f"nixl: {len(layout.planes)} planes x {layout.num_blocks} "
                                      "blocks exceed NIXL's int32 indices")
        with self._lock:
            self._check_open()
            state = self._peers.get(pair.peer)
            if state is None:
                raise UnknownPeer(f"nixl {self.agent_name!r}: unknown peer {pair.peer!r}")
            check_in_regions(pair.local, [(a, n) for a, n, _ in self._regions], "local")
            check_in_regions(pair.remote, [(a, n) for a, n, _ in state.regions],
                             f"remote ({pair.peer})")
            local = self._layout_dlists.get(pair.local.key)
            try:
                if local is None:
                    local = self._prep(NIXL_INIT, pair.local, self._mem_type or "DRAM")
                    self._layout_dlists[pair.local.key] = local
                    while len(self._layout_dlists) > _MAX_LAYOUT_DLISTS:
                        self._retired_dlists.append(self._layout_dlists.popitem(last=False)[1])
                self._layout_dlists.move_to_end(pair.local.key)
                remote = self._prep(state.name, pair.remote, state.mem_type)
            except KVBridgeError:
                raise
            except Exception as exc:
                raise translate(exc, f"preparing blocks for peer {pair.peer!r}", pair.peer) \
                    from exc
        return PreparedPair(state, local, remote)

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        handle = TransferHandle(op, pair.peer, req.nbytes, req.count)
        with self._lock:
            state = self._live_peer(pair)
            if req.count == 0:  # no ids, or none with a plane to move in
                if notification is not None:
                    self._notify(pair.peer, notification)
                handle.succeed()
                return handle
            self._track(handle, state, *self._post_blocks(op, pair, req, notification or b""))
        return handle

    def _prepare_request(self, op: Op, pair: BlockPair, req: BlockRequest,
                         notification: bytes | None) -> Any:
        """The NIXL request (``make_prepped_xfer``), made now and posted later; None for an
        empty request (posted as usual). Until it is posted or discarded it counts as in
        flight on its peer, so neither the peer nor a descriptor list it uses is released
        under it."""
        if req.count == 0:
            return None
        with self._lock:
            state = self._live_peer(pair)
            native = self._make_request(op, pair, req, notification or b"")
            state.inflight += 1
            self._ahead += 1
            self.stats["block_prepared_ahead"] += 1
        return native, state, TransferHandle(op, pair.peer, req.nbytes, req.count)

    def _post_prepared(self, prep: PreparedRequest, native: Any) -> TransferHandle:
        state: PeerState
        handle: TransferHandle
        xfer, state, handle = native
        pair, req = prep.pair, prep.req
        handle.started = time.perf_counter()  # made ahead with the request: posted now
        with self._lock:
            self._unprepare(state)
            if (self._closed or state.removed or self._peers.get(pair.peer) is not state
                    or not pair.live):
                self._release(xfer)
                self._after_release()
                raise UnknownPeer(f"nixl {self.agent_name!r}: peer {pair.peer!r} was removed "
                                  "or re-added, or its blocks were prepared again")
            self._track(handle, state, xfer, self._start(xfer, prep.op, req.nbytes, pair.peer))
        return handle

    def _discard_prepared(self, native: Any) -> None:
        xfer, state, _ = native
        with self._lock:
            self._unprepare(state)
            if self._agent is not None:
                self._release(xfer)
                self._after_release()

    def _unprepare(self, state: PeerState) -> None:
        state.inflight -= 1
        self._ahead -= 1

    def _after_release(self) -> None:
        self._reap_peers()
        self._release_retired()

    def _live_peer(self, pair: BlockPair) -> PeerState:
        """The pair's peer, still the one it was prepared with (the lock is held)."""
        self._check_open()
        state = self._peers.get(pair.peer)
        if state is None or state is not pair.native.peer:
            raise UnknownPeer(f"nixl {self.agent_name!r}: peer {pair.peer!r} was removed or "
                              "re-added")
        return state

    def _make_request(self, op: Op, pair: BlockPair, req: BlockRequest, notif: bytes) -> Any:
        """The NIXL request for ``req``, not posted (the lock is held)."""
        try:
            return self._make_blocks(op, pair, self._block_args(pair, req), notif)
        except Exception as exc:
            raise translate(exc, f"{op.value} of {req.nbytes} bytes with peer {pair.peer!r}",
                             pair.peer) from exc

    def _post_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                     notif: bytes) -> tuple[Any, str]:
        """Make the request and post it: ``(request, state)``; the lock is held."""
        native = self._make_request(op, pair, req, notif)
        return native, self._start(native, op, req.nbytes, pair.peer)

    def _release_blocks(self, pair: BlockPair) -> None:
        prep: PreparedPair | None = pair.native
        if prep is None:
            return
        with self._lock:
            if self._agent is None:
                return
            self._retired_dlists.append(prep.remote)
            self._release_retired()

    # -- notifications --------------------------------------------------------------------------

    def send_notification(self, peer: str, message: bytes) -> None:
        if not isinstance(message, bytes):
            raise DescriptorError("a notification must be bytes")
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise UnknownPeer(f"nixl {self.agent_name!r}: unknown peer {peer!r}")
            self._notify(peer, message)

    def _notify(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise translate(exc, f"notification to {peer!r}", peer) from exc

    def get_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if self._agent is None:
                return []
            try:
                new = self._agent.get_new_notifs()
            except Exception as exc:
                raise translate(exc, "get_new_notifs") from exc
        out: list[tuple[str, bytes]] = []
        for name, messages in new.items():
            who = name.decode() if isinstance(name, bytes) else str(name)
            out.extend((who, bytes(m)) for m in messages)
        return out

    # -- lifecycle ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed or self._agent is None:
            raise TransportClosed(f"nixl transport {self.agent_name!r} is closed")

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._closed = True
            pending = [h for h, _ in self._inflight.values()]
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while pending and time.monotonic() < deadline:
            pending = [h for h in pending if not self.poll(h).terminal]
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        with self._lock:
            for handle, _ in list(self._inflight.values()):
                if handle.state.terminal:
                    continue
                self._settle(handle)  # tries to release (= abort); NIXL keeps stuck ones
                handle.fail(f"nixl transport {self.agent_name!r} closed "
                               f"while the transfer was in flight")
            if pending:
                log.warning("nixl %r closed with %d transfer(s) still in flight after %.1f s",
                            self.agent_name, len(pending), timeout)
            for peer in list(self._peers.values()):
                peer.removed = True
                self._retired_peers.append(peer)
            self._peers.clear()
            self._forget_blocks(None)
            self._reap_peers()
            self._retire(self._local_grids)
            self._retired_dlists.extend(self._layout_dlists.values())
            self._layout_dlists.clear()
            self._release_retired()
            for descs in self._reg_descs:
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:  # noqa: BLE001 - best effort, logged
                    log.warning("nixl: deregister_memory failed: %r", exc)
            self._reg_descs.clear()
            self._agent = None
            self._board.close()
            self._cv.notify_all()
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(timeout=5.0)
        log.info("nixl agent %r closed", self.agent_name)

    def __del__(self) -> None:  # pragma: no cover - safety net only
        try:
            if not getattr(self, "_closing", True):
                self.close(timeout=1.0)
        except Exception:  # noqa: BLE001
            pass


"""Typed control messages (msgspec/msgpack, never pickle) and their bounded, authenticated codec.

Every message is a frozen, tagged :class:`msgspec.Struct` whose every field has a type and a
bound (string lengths, list lengths, integer ranges): nothing decodes into ``Any``, so a peer
cannot make the decoder recurse or allocate beyond the frame it sent.

:class:`Codec` turns one message into one *frame* and back::

    frame = version(1) | nonce(16) | timestamp_ms(8) | body | mac(32, only with a secret)
    mac   = HMAC-SHA256(secret, context | version | nonce | timestamp | body)

``context`` binds a frame to where it travels (the control channel passes the request id, so a
reply cannot be re-attached to another request). With a secret, a frame outside the replay
window (``window_s`` either side of now) or whose nonce was already seen inside the window is
refused with :class:`~kvbridge.errors.ReplayError`; the nonce memory is bounded (it fails closed
when full). Without a secret the header is still present (nonce and time are informational).

Thread safety: :class:`Codec` may be shared by threads (the replay memory has a lock).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Union

import msgspec

from kvbridge.errors import AuthError, MessageError, MessageTooLarge, ReplayError
from kvbridge.heads import HeadSplit
from kvbridge.layout import LayoutWire, PlaneWire
from kvbridge.params import MAX_BLOCK_IDS, MAX_TP, Address, BlockIds, Ident, TransferId

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_IDS_PER_MESSAGE",
    "MAX_DIGEST_BYTES",
    "ErrorKind",
    "PlaneWire",
    "LayoutWire",
    "EngineInfo",
    "Placement",
    "HeadSplit",
    "ClaimPart",
    "Hello",
    "HelloReply",
    "Heartbeat",
    "HeartbeatReply",
    "PullClaim",
    "PullDone",
    "PullServed",
    "PushRegister",
    "PushConfirm",
    "PushResult",
    "PushLanded",
    "Cancel",
    "CancelReply",
    "StatsQuery",
    "StatsReply",
    "TransferQuery",
    "TransferReply",
    "DrainNotice",
    "Ack",
    "PipeFrame",
    "Message",
    "Codec",
    "encode_info",
    "decode_info",
]

#: 4: per-chunk hand-off digests sent by the prefill side (``PullServed``, ``PushResult``);
#: ``DrainNotice``; ``TransferQuery.timings``
PROTOCOL_VERSION = 4
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
#: Most transfer ids one heartbeat or query may carry.
MAX_IDS_PER_MESSAGE = 4096
#: Most bytes of hand-off digests one message may carry (kvbridge.scheduling.digests).
MAX_DIGEST_BYTES = 1 << 16

_FRAME_PLAIN = 1
_FRAME_SIGNED = 2
_HEADER = struct.Struct("<B16sq")  # version, nonce, timestamp (ms since the epoch)
_MAC_BYTES = 32

Short = Annotated[str, msgspec.Meta(max_length=256)]
Reason = Annotated[str, msgspec.Meta(max_length=4096)]
Digest = Annotated[str, msgspec.Meta(max_length=128)]
Digests = Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)]
Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
SmallInt = Annotated[int, msgspec.Meta(ge=0, le=MAX_TP)]
TransferIds = Annotated[list[TransferId], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


class ErrorKind(enum.StrEnum):
    """Why a peer refused a request, in a word the caller can branch on."""

    UNKNOWN_TRANSFER = "unknown_transfer"
    """No such transfer here (never staged, already ended, lease expired)."""
    STALE_GENERATION = "stale_generation"
    """The request names another generation of this engine (it restarted)."""
    MISMATCH = "mismatch"
    """Block ids, token count, prompt digest, byte count or layout do not match."""
    FORBIDDEN = "forbidden"
    """The sender is not the party this transfer belongs to."""
    BUSY = "busy"
    """A bound was reached (pending registrations, peers); try later or elsewhere."""
    CHECKSUM = "checksum"
    """The bytes changed in transit."""
    MALFORMED = "malformed"
    """The request could not be parsed."""
    INTERNAL = "internal"
    """An unexpected error on the peer; it was logged there."""


# -- engine identity --------------------------------------------------------------------------


MAX_PLACEMENT_CORES = 4096


_Cores = Annotated[tuple[Annotated[int, msgspec.Meta(ge=0, le=1 << 20)], ...],
                   msgspec.Meta(max_length=MAX_PLACEMENT_CORES)]


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where an engine rank runs: its host's boot id, the cores its transfer threads may use
    (``cores``: those of the thread that made the rank, which every thread started after it
    inherits), and the cores any thread of its process may use (``process_cores``, empty
    where unknown or sent by an older engine; wider than ``cores`` where vLLM pinned the
    worker's main thread to one core of the engine's list).

    Only compared, never trusted: a peer that lies about it can at most cause or hide a
    warning (:func:`kvbridge.host.placement.shared_core_warning`)."""

    host: Annotated[str, msgspec.Meta(max_length=64)]
    cores: _Cores
    process_cores: _Cores = ()


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who an engine rank is and how to reach its memory; exchanged in handshakes."""

    engine_id: Ident
    generation: Ident
    rank: SmallInt = 0
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)] = 1
    protocol: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] = PROTOCOL_VERSION
    backend: Annotated[str, msgspec.Meta(max_length=64)]
    #: the rank's transport agent name (what ``add_peer`` of its metadata returns); proven
    #: with the rest of the identity (kvbridge.identity)
    agent: Ident
    transport_metadata: Annotated[bytes, msgspec.Meta(max_length=2 << 20)]
    layout: LayoutWire
    layout_fingerprint: Digest
    control_address: Address
    compat: Annotated[dict[Short, Short], msgspec.Meta(max_length=64)] = {}
    #: this rank checks hand-off digests; a prefill peer must send them to it
    checksum: bool = False
    #: this rank's KV heads and block interior (None: not head-major; such an engine only
    #: exchanges KV with engines of its own TP size and block size)
    heads: HeadSplit | None = None
    #: host and cores of this rank (None: unknown, or an older engine)
    placement: Placement | None = None


class Hello(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Handshake request. The receiver answers with its own info and has its transport attest
    the proof of ``challenge`` (:mod:`kvbridge.identity`); it never adds the sender as a peer
    from this (peers are only learnt from answers at addresses one dialled)."""

    info: EngineInfo
    challenge: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


class HelloReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    info: EngineInfo


# -- leases -----------------------------------------------------------------------------------


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P: I still want these transfers; extend their leases."""

    generation: Ident
    """The generation of P the sender expects (``*``: any)."""
    transfer_ids: TransferIds


class HeartbeatReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    generation: Ident
    """The answering engine's generation (a restarted engine has a new one)."""
    unknown: TransferIds = []
    """Transfers of the heartbeat this engine does not hold (ended, never staged)."""


# -- pull -------------------------------------------------------------------------------------


class ClaimPart(msgspec.Struct, frozen=True, kw_only=True):
    """Which decode rank claims, and where its need starts (heterogeneous TP / block size):
    the prefill rank derives the heads it serves that rank, and the bytes, from these."""

    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
    rank: SmallInt
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    first_token: Annotated[int, msgspec.Meta(ge=0, le=1 << 26)]
    """The first prompt token the decode rank reads (its local prefix hit)."""


class PullClaim(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P before its READ: these are the blocks you leased to this transfer, for this
    prompt. P refuses unless every field matches what it staged."""

    transfer_id: TransferId
    generation: Ident
    """P's generation as D expects it (``*``: any)."""
    skip_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_IDS)] = 0
    block_ids: BlockIds
    """P's block ids D will read: the prompt's blocks from ``skip_blocks`` on."""
    num_tokens: Count
    prompt_digest: Digest
    part: ClaimPart | None = None
    """The claiming decode rank (None: the same TP size, rank and block size as the prefill
    rank)."""


class PullDone(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P after its READ completed; P answers :class:`PullServed` if its lease still held
    (an :class:`Ack` with the reason if not)."""

    transfer_id: TransferId
    nbytes: Count
    #: D checks digests: P must send its own in the :class:`PullServed`
    want_digests: bool = False


class PullServed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """P → D, the answer to a :class:`PullDone` whose lease held: P is done with the part.
    ``digests`` (when either side digests hand-offs) are P's digests of the part's byte
    stream, computed from its own KV (:mod:`kvbridge.scheduling.digests`); D checks what it
    read against them before it uses a byte."""

    transfer_id: TransferId
    digests: Digests | None = None


# -- push -------------------------------------------------------------------------------------


class PushRegister(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P: write transfer ``transfer_id`` into these blocks of mine.

    P answers at once with :class:`Ack` (registered, or refused), and later, on the same
    request, with one :class:`PushResult` (where D asked, ``check_early``, a
    :class:`PushLanded` may come before it). ``skip_blocks`` leading prompt blocks are already on
    D and are not sent; ``block_ids`` are D's blocks for the rest, in prompt order.
    """

    transfer_id: TransferId
    generation: Ident
    """P's generation as D expects it (``*``: any)."""
    engine_id: Ident
    sender_generation: Ident
    control_address: Address
    """Where D's control channel listens: P dials it to confirm before writing."""
    block_ids: BlockIds
    skip_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_IDS)] = 0
    num_tokens: Count
    prompt_digest: Digest
    layout_fingerprint: Digest
    progress: Annotated[int, msgspec.Meta(ge=8, le=1 << 62, multiple_of=8)] | None = None
    """The address, in D's registered memory, of an 8-byte word D follows: P's copy may keep it
    at the stream bytes it wrote, and D hashes behind it (:mod:`kvbridge.scheduling.follow`);
    None: D hashes after the result. Only *when* D reads: a wrong word fails the receive."""
    check_early: bool = False
    """D checks what landed as soon as P says every WRITE stopped (:class:`PushLanded`), while
    P still digests its side; False (or a P that does not know it): at the :class:`PushResult`.
    Only *when* D reads: the result decides."""


class PushConfirm(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """P → D, on P's own connection to the address D registered: may I write these blocks?
    D answers ok only for a registration it made and has not cancelled; from then on D keeps
    the blocks until P's :class:`PushResult` arrives or P is proven gone."""

    transfer_id: TransferId
    generation: Ident
    """D's generation as named in the registration."""
    block_ids: BlockIds
    rank: SmallInt | None = None
    """The confirming prefill rank (a decode rank may register with several)."""


class PushResult(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """P → D, the final answer to a :class:`PushRegister`: every posted WRITE has stopped."""

    transfer_id: TransferId
    ok: bool
    nbytes: Count = 0
    #: P's digests of the part's byte stream (when either side digests hand-offs)
    digests: Digests | None = None
    error: Reason | None = None


class PushLanded(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """P → D, on a :class:`PushRegister` that asked for it (``check_early``), before the
    :class:`PushResult`: every WRITE stopped and succeeded (the transport copied inside its
    post), and P digests its side now. D may digest what landed meanwhile; the result, with
    P's digests, still decides."""

    transfer_id: TransferId
    nbytes: Count


# -- both -------------------------------------------------------------------------------------


class Cancel(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P: give up this transfer (the request failed or was aborted on D)."""

    transfer_id: TransferId
    reason: Reason


class CancelReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    safe: bool
    """True: no WRITE into D's blocks is in flight or will be posted. False: one is in flight;
    its :class:`PushResult` follows when it stopped."""


class StatsQuery(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Ask an engine rank for its transfer counters (``kvbridge stats``, tests)."""


class StatsReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    engine_id: Ident
    generation: Ident
    stats: Annotated[dict[Short, int], msgspec.Meta(max_length=1024)]
    pending: Count
    #: transfer_id -> {event: wall-clock time}: kv_ready, write_posted, write_done (P);
    #: recv_done, first_step (D)
    timings: Annotated[
        dict[TransferId, Annotated[dict[Short, float], msgspec.Meta(max_length=32)]],
        msgspec.Meta(max_length=4096),
    ] = {}
    #: transfer ids this rank still holds, by state (a few of each)
    held: Annotated[dict[Short, TransferIds], msgspec.Meta(max_length=64)] = {}


class TransferQuery(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """What happened to these transfers (the proxy asks after a failed request)? With
    ``timings``, also their flight records (``kvbridge why``)."""

    transfer_ids: TransferIds
    timings: bool = False


class TransferReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    #: transfer_id -> "state: reason" for those this rank remembers
    outcomes: Annotated[dict[TransferId, Reason], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]
    #: transfer_id -> {event: wall-clock time} (kvbridge.scheduling.recorder), when asked
    timings: Annotated[
        dict[TransferId, Annotated[dict[Short, float], msgspec.Meta(max_length=32)]],
        msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE),
    ] = {}


class DrainNotice(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """This engine is draining (the proxy's ``/admin/drain``): write the offload tiers' hot
    chunks out for a successor (:mod:`kvbridge.offload.warm`). Answered with an :class:`Ack`
    at once (``ok`` False: the rank has no offload tiers); the write-out runs in the
    background."""


class Ack(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    ok: bool = True
    kind: ErrorKind | None = None
    error: Reason | None = None


class PipeFrame(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One item of a FIFO pipe; ``eos`` marks end-of-stream."""

    seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
    payload: Annotated[bytes, msgspec.Meta(max_length=64 << 20)] = b""
    eos: bool = False


Message = Union[
    Hello, HelloReply, Heartbeat, HeartbeatReply, PullClaim, PullDone, PullServed, PushRegister,
    PushConfirm, PushResult, PushLanded, Cancel, CancelReply, StatsQuery, StatsReply,
    TransferQuery, TransferReply, DrainNotice, Ack, PipeFrame,
]


class _ReplayMemory:
    """Nonces seen inside the window (bounded; fails closed when full). Thread-safe."""

    def __init__(self, window_s: float, capacity: int) -> None:
        self.window_ms = int(window_s * 1000)
        self.capacity = capacity
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> expiry (ms), by arrival
        self._lock = threading.Lock()

    def check(self, nonce: bytes, ts_ms: int, now_ms: int) -> None:
        if abs(now_ms - ts_ms) > self.window_ms:
            raise ReplayError(
                f"control message timestamp is {abs(now_ms - ts_ms) / 1000:.1f} s from now, "
                f"outside the replay window of {self.window_ms / 1000:.0f} s (clocks in sync?)"
            )
        with self._lock:
            while self._seen:
                oldest, expiry = next(iter(self._seen.items()))
                if expiry > now_ms:
                    break
                del self._seen[oldest]
            if nonce in self._seen:
                raise ReplayError("control message replayed (nonce already seen)")
            if len(self._seen) >= self.capacity:
                raise ReplayError("replay memory full; refusing until the window moves on")
            self._seen[nonce] = max(now_ms, ts_ms) + self.window_ms


class Codec:
    """Encode/decode :data:`Message` values as frames (see the module docstring)."""

    def __init__(
        self,
        secret: str | bytes | None = None,
        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        window_s: float = 30.0,
        replay_capacity: int = 1 << 20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self._key = secret or None
        self.max_bytes = int(max_bytes)
        self._clock = clock
        self._replay = _ReplayMemory(window_s, replay_capacity)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def _mac(self, context: bytes, header: bytes, body: bytes) -> bytes:
        assert self._key is not None
        mac = hmac.new(self._key, context, hashlib.sha256)
        mac.update(header)
        mac.update(body)
        return mac.digest()

    def encode(self, msg: Message, context: bytes = b"") -> bytes:
        """Serialise ``msg`` into a frame; raises :class:`MessageTooLarge` above the limit."""
        body = self._encoder.encode(msg)
        version = _FRAME_SIGNED if self._key is not None else _FRAME_PLAIN
        header = _HEADER.pack(version, os.urandom(16), int(self._clock() * 1000))
        frame = header + body
        if self._key is not None:
            frame += self._mac(context, header, body)
        if len(frame) > self.max_bytes:
            raise MessageTooLarge(
                f"{type(msg).__name__} is {len(frame)} bytes, above the limit of {self.max_bytes}"
            )
        return frame

    def decode(self, data: bytes, context: bytes = b"") -> Message:
        """Parse a frame; raises a :class:`MessageError` subclass on any bad input, never
        anything else."""
        if len(data) > self.max_bytes:
            raise MessageTooLarge(f"message of {len(data)} bytes exceeds {self.max_bytes}")
        if len(data) < _HEADER.size:
            raise MessageError(f"frame of {len(data)} bytes is shorter than its header")
        version, nonce, ts_ms = _HEADER.unpack_from(data)
        header = data[: _HEADER.size]
        if self._key is not None:
            if version != _FRAME_SIGNED or len(data) < _HEADER.size + _MAC_BYTES:
                raise AuthError("control message is not authenticated (a secret is set here)")
            body = data[_HEADER.size : -_MAC_BYTES]
            if not hmac.compare_digest(data[-_MAC_BYTES:], self._mac(context, header, body)):
                raise AuthError("control message failed authentication (wrong shared secret?)")
            self._replay.check(nonce, ts_ms, int(self._clock() * 1000))
        else:
            if version == _FRAME_SIGNED:
                raise AuthError("peer authenticates its messages but no secret is set here")
            if version != _FRAME_PLAIN:
                raise MessageError(f"unknown frame version {version}")
            body = data[_HEADER.size :]
        try:
            msg: Message = self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MessageError(f"malformed control message: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - decoding hostile bytes must never escape
            raise MessageError(f"unreadable control message: {type(exc).__name__}") from None
        return msg


_info_decoder = msgspec.msgpack.Decoder(EngineInfo)


def encode_info(info: EngineInfo) -> bytes:
    """Encode standalone engine info (e.g. for vLLM's handshake-metadata path)."""
    return msgspec.msgpack.encode(info)


def decode_info(data: bytes) -> EngineInfo:
    """Inverse of :func:`encode_info`; raises :class:`MessageError`."""
    try:
        return _info_decoder.decode(data)
    except Exception as exc:  # noqa: BLE001 - hostile bytes
        raise MessageError(f"malformed engine info: {exc}") from None

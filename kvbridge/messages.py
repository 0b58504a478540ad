"""Typed control messages (msgspec/msgpack, never pickle) and their size-bounded, optionally
authenticated codec.

Every message is a frozen, tagged :class:`msgspec.Struct`; :class:`Codec` encodes one to bytes
and decodes bytes back into exactly one of the known kinds, refusing anything larger than its
limit, anything that fails the shared-secret HMAC, and anything that is not a known message.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Union

import msgspec

from kvbridge.errors import AuthError, MessageError, MessageTooLarge

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "EngineInfo",
    "Hello",
    "HelloReply",
    "PushRegister",
    "TransferDone",
    "TransferFail",
    "Heartbeat",
    "StatsQuery",
    "StatsReply",
    "Ack",
    "PipeFrame",
    "Message",
    "Codec",
]

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
_MAC_BYTES = 32


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Who an engine rank is and how to reach its memory; exchanged in handshakes."""

    engine_id: str
    generation: str
    rank: int = 0
    protocol: int = PROTOCOL_VERSION
    backend: str
    transport_metadata: bytes
    layout: dict[str, Any]
    layout_fingerprint: str
    control_address: str
    compat: dict[str, str] = {}


class Hello(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Handshake request; carries the sender's info so the receiver can add it as a peer."""

    info: EngineInfo


class HelloReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    info: EngineInfo


class PushRegister(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P: write transfer ``transfer_id`` into these blocks of mine.

    ``skip_blocks`` leading blocks of the prompt are already on D (local prefix hit) and must not
    be sent; ``block_ids`` are D's blocks for the rest, in prompt order.
    """

    transfer_id: str
    engine_id: str
    generation: str
    block_ids: list[int]
    skip_blocks: int = 0
    layout_fingerprint: str


class TransferDone(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The transfer completed (P → D after a push WRITE, D → P after a pull READ)."""

    transfer_id: str
    nbytes: int = 0
    checksum: str | None = None
    #: Pull with checksums: the sender's block ids that were read, so P can hash its side.
    source_blocks: list[int] = []


class TransferFail(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The transfer will not complete; the receiver must stop waiting for it."""

    transfer_id: str
    reason: str


class Heartbeat(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """D → P: I still want these transfers; extend their leases."""

    transfer_ids: list[str]


class StatsQuery(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Ask an engine rank for its transfer counters (``kvbridge stats``, tests)."""


class StatsReply(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    engine_id: str
    generation: str
    stats: dict[str, int]
    pending: int
    #: transfer_id -> {event: wall-clock time}: kv_ready, write_posted, write_done (P);
    #: recv_done, first_step (D)
    timings: dict[str, dict[str, float]] = {}


class Ack(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    ok: bool = True
    error: str | None = None


class PipeFrame(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One item of a FIFO pipe; ``eos`` marks end-of-stream."""

    seq: int
    payload: bytes = b""
    eos: bool = False


Message = Union[
    Hello, HelloReply, PushRegister, TransferDone, TransferFail, Heartbeat, StatsQuery,
    StatsReply, Ack, PipeFrame,
]


class Codec:
    """Encode/decode :data:`Message` values; thread-safe (no mutable state after init)."""

    def __init__(
        self, secret: str | bytes | None = None, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self._key = secret or None
        self.max_bytes = int(max_bytes)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, msg: Message) -> bytes:
        """Serialise ``msg``; raises :class:`MessageTooLarge` above the limit."""
        body = self._encoder.encode(msg)
        if self._key is not None:
            body = hmac.new(self._key, body, hashlib.sha256).digest() + body
        if len(body) > self.max_bytes:
            raise MessageTooLarge(
                f"{type(msg).__name__} is {len(body)} bytes, above the limit of {self.max_bytes}"
            )
        return body

    def decode(self, data: bytes) -> Message:
        """Parse ``data`` into a message; raises a :class:`MessageError` subclass on bad input."""
        if len(data) > self.max_bytes:
            raise MessageTooLarge(f"message of {len(data)} bytes exceeds {self.max_bytes}")
        if self._key is not None:
            mac, data = data[:_MAC_BYTES], data[_MAC_BYTES:]
            good = hmac.new(self._key, data, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, good):
                raise AuthError("control message failed authentication (wrong shared secret?)")
        try:
            msg: Message = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MessageError(f"malformed control message: {exc}") from exc
        return msg


def encode_info(info: EngineInfo) -> bytes:
    """Encode standalone engine info (e.g. for vLLM's handshake-metadata path)."""
    return msgspec.msgpack.encode(info)


def decode_info(data: bytes) -> EngineInfo:
    """Inverse of :func:`encode_info`; raises :class:`MessageError`."""
    try:
        return msgspec.msgpack.decode(data, type=EngineInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed engine info: {exc}") from exc

"""What one Mooncake transport tells its peers (the bytes ``register_memory`` returns)."""

from __future__ import annotations

import msgspec

from kvbridge.errors import MessageError

__all__ = ["METADATA_VERSION", "MooncakeMetadata", "encode_metadata", "decode_metadata"]

METADATA_VERSION = 2


class MooncakeMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge-mooncake"):
    """Agent name, Transfer Engine session (``host:rpc_port``), registered regions, the
    address of the agent's notification pipe and of its proof board."""

    agent: str
    session: str
    regions: list[tuple[int, int]]
    notify_address: str
    protocol: str = "tcp"
    version: int = METADATA_VERSION
    #: ``(address, length)`` of the agent's proof board (registered, not part of ``regions``:
    #: :class:`kvbridge.transports.proofs.ProofBoard`)
    board: tuple[int, int] = (0, 0)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(MooncakeMetadata)


def encode_metadata(meta: MooncakeMetadata) -> bytes:
    return _encoder.encode(meta)


def decode_metadata(data: bytes) -> MooncakeMetadata:
    """Parse peer metadata; raise :class:`MessageError` if it is not Mooncake metadata."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"mooncake peer metadata must be bytes, got {type(data).__name__}")
    try:
        meta = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed mooncake peer metadata: {exc}") from exc
    if meta.version != METADATA_VERSION:
        raise MessageError(
            f"mooncake peer {meta.agent!r} speaks metadata version {meta.version}, "
            f"this side {METADATA_VERSION}"
        )
    if ":" not in meta.session:
        raise MessageError(f"mooncake peer {meta.agent!r} has a malformed session {meta.session!r}")
    return meta

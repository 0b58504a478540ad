"""The shm transport's wire format: its metadata and the messages of its socket handshake.

:class:`ShmMetadata` is what ``register_memory`` returns and a peer decodes with
:func:`decode_metadata` (claims only, never believed: see the package docstring). The handshake
is one query (:class:`_Query`) from the dialler and one answer from the listener: a
:class:`_Registration`, or a :class:`_Refused` for a query it does not let in. Every message is
a tagged msgpack struct with bounded fields, so hostile bytes decode to a validation error.

Pure data and stateless (de)coders: thread-safe, never blocks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvbridge.errors import MessageError, MessageTooLarge
from kvbridge.identity import PROOF_BYTES
from kvbridge.transports.shm.memfd import MAX_FDS

__all__ = ["ShmMetadata", "MAX_METADATA_BYTES", "MAX_REGIONS", "decode_metadata"]

MAX_METADATA_BYTES = 1 << 20
MAX_REGIONS = 16384
#: addresses and lengths are kept below this so that ``address + length`` never overflows int64
_MAX_ADDR = 1 << 62
_MAX_REQUEST_BYTES = 4096
_MAX_REPLY_BYTES = MAX_METADATA_BYTES

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Pos = Annotated[int, msgspec.Meta(ge=1, le=_MAX_ADDR)]
_Version = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
_Pid = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
_Proof = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
_FdIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_FDS)]
_Offset = Annotated[int, msgspec.Meta(ge=0, le=_MAX_ADDR)]


class ShmMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.v2"):
    """Where to find a transport (nothing here is trusted; see the package docstring).

    ``pid`` and ``agent`` are *claims*, compared with what the socket proves; the regions and
    the notification address are fetched from the proven process, never read from here.
    """

    agent: _Name
    pid: _Pid
    hostname: Annotated[str, msgspec.Meta(max_length=256)]
    boot_id: Annotated[str, msgspec.Meta(max_length=512)]
    pid_ns: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    socket: Annotated[str, msgspec.Meta(pattern="^\x00kvbridge-shm-[0-9a-f]{32}$")]
    version: _Version


class _Query(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.query.v2"):
    """Handshake request: here is the proof your engine attested for this handshake; send me
    your current registration (and, with ``fds``, the memfds behind your shared memory)."""

    proof: _Proof
    fds: bool = False


class _Registration(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.reg.v2"):
    """Handshake answer: what the process behind the socket registered, as it says itself."""

    agent: _Name
    pid: _Pid
    version: _Version
    regions: Annotated[list[tuple[_Pos, _Pos]], msgspec.Meta(max_length=MAX_REGIONS)]
    notify_address: Annotated[str, msgspec.Meta(max_length=256, pattern="^tcp://")]
    proof: _Proof
    #: ``(address, length, fd index, offset)``: ranges backed by the memfds sent with the answer
    shared: Annotated[list[tuple[_Pos, _Pos, _FdIndex, _Offset]],
                      msgspec.Meta(max_length=MAX_REGIONS)] = []


class _Refused(msgspec.Struct, frozen=True, kw_only=True, tag="kvbridge.shm.refused.v1"):
    """Handshake answer to a query the listener does not let in (nothing else is sent)."""

    reason: Annotated[str, msgspec.Meta(max_length=512)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShmMetadata)
_query_decoder = msgspec.msgpack.Decoder(_Query)
_reg_decoder = msgspec.msgpack.Decoder(_Registration | _Refused)


def decode_metadata(data: object) -> ShmMetadata:
    """Parse a peer's metadata blob; raises :class:`MessageError` (never anything else)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MessageError(f"shm peer metadata must be bytes, not {type(data).__name__}")
    if len(data) > MAX_METADATA_BYTES:
        raise MessageTooLarge(
            f"shm peer metadata of {len(data)} bytes exceeds the limit of {MAX_METADATA_BYTES}"
        )
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(f"malformed shm peer metadata: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - hostile bytes must never raise anything else
        raise MessageError(f"unreadable shm peer metadata: {type(exc).__name__}") from None

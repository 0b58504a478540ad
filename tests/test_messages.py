"""kvbridge.messages: every message kind round-trips; size limit, authentication, garbage."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.errors import AuthError, KVBridgeError, MessageError, MessageTooLarge
from kvbridge.messages import (
    PROTOCOL_VERSION,
    Ack,
    Codec,
    EngineInfo,
    Heartbeat,
    Hello,
    HelloReply,
    Message,
    PipeFrame,
    PushRegister,
    StatsQuery,
    StatsReply,
    TransferDone,
    TransferFail,
    decode_info,
    encode_info,
)

INFO = EngineInfo(
    engine_id="engine-p",
    generation="gen-1",
    rank=1,
    backend="shm",
    transport_metadata=b"\x00\x01meta",
    layout={"planes": [["l0#0", 4096, 128, 128]], "num_blocks": 8, "block_size": 16,
            "dtype": "bfloat16", "device": 0},
    layout_fingerprint="0123456789abcdef",
    control_address="tcp://127.0.0.1:5555",
    compat={"model": "tiny", "dtype": "bfloat16"},
)

ALL_MESSAGES: list[Message] = [
    Hello(info=INFO),
    HelloReply(info=INFO),
    PushRegister(transfer_id="t-1", engine_id="engine-d", generation="gen-2",
                 block_ids=[5, 6, 7], skip_blocks=2, layout_fingerprint="0123456789abcdef"),
    TransferDone(transfer_id="t-1", nbytes=1 << 20, checksum="abcd"),
    TransferDone(transfer_id="t-2"),
    TransferFail(transfer_id="t-1", reason="peer went away"),
    Heartbeat(transfer_ids=["t-1", "t-2"]),
    StatsQuery(),
    StatsReply(engine_id="engine-p", generation="gen-1", stats={"transfers_done": 3}, pending=1),
    Ack(),
    Ack(ok=False, error="no such transfer"),
    PipeFrame(seq=3, payload=b"\xff" * 100),
    PipeFrame(seq=4, eos=True),
]


@pytest.mark.parametrize("secret", [None, "s3cret", b"bytes-secret"], ids=["plain", "str", "bytes"])
@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message, secret: str | bytes | None) -> None:
    codec = Codec(secret)
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    back = codec.decode(data)
    assert type(back) is type(msg)
    assert back == msg


def test_every_kind_is_covered() -> None:
    missing = set(Message.__args__) - {type(m) for m in ALL_MESSAGES}  # type: ignore[attr-defined]
    assert not missing, f"add a sample of {sorted(t.__name__ for t in missing)} to ALL_MESSAGES"


def test_defaults_and_protocol_version() -> None:
    assert INFO.protocol == PROTOCOL_VERSION
    assert Ack().ok is True
    assert PipeFrame(seq=0).payload == b"" and PipeFrame(seq=0).eos is False


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Heartbeat(transfer_ids=[]).transfer_ids = ["x"]  # type: ignore[misc]


def test_oversize_encode_rejected() -> None:
    codec = Codec(max_bytes=4096)
    with pytest.raises(MessageTooLarge, match=r"PipeFrame is \d+ bytes, above the limit of 4096"):
        codec.encode(PipeFrame(seq=0, payload=b"x" * 5000))


def test_oversize_decode_rejected() -> None:
    big = Codec().encode(PipeFrame(seq=0, payload=b"x" * 5000))
    with pytest.raises(MessageTooLarge, match="exceeds 4096"):
        Codec(max_bytes=4096).decode(big)


def test_secret_counts_towards_limit() -> None:
    body = Codec().encode(PipeFrame(seq=0, payload=b"x" * 4000))
    assert len(body) <= 4096
    with pytest.raises(MessageTooLarge):
        Codec("k", max_bytes=len(body) + 10).encode(PipeFrame(seq=0, payload=b"x" * 4000))


def test_wrong_secret_rejected() -> None:
    data = Codec("right").encode(TransferDone(transfer_id="t"))
    with pytest.raises(AuthError, match="failed authentication"):
        Codec("wrong").decode(data)


def test_unauthenticated_message_rejected_when_secret_set() -> None:
    data = Codec().encode(TransferDone(transfer_id="t"))
    with pytest.raises(AuthError):
        Codec("secret").decode(data)


def test_tampered_message_rejected() -> None:
    data = bytearray(Codec("k").encode(TransferFail(transfer_id="t", reason="r")))
    data[-1] ^= 0x01
    with pytest.raises(AuthError):
        Codec("k").decode(bytes(data))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1\xc1\xc1 not msgpack",
        msgspec.msgpack.encode({"type": "Nope", "x": 1}),
        msgspec.msgpack.encode({"type": "TransferDone", "transfer_id": 5}),
        msgspec.msgpack.encode({"type": "TransferDone"}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
    ids=["empty", "garbage", "unknown-tag", "wrong-type", "missing-field", "not-a-struct"],
)
def test_garbage_rejected(data: bytes) -> None:
    with pytest.raises(MessageError, match="malformed control message") as info:
        Codec().decode(data)
    assert isinstance(info.value, KVBridgeError)


def test_never_unpickles() -> None:
    import pickle

    with pytest.raises(MessageError):
        Codec().decode(pickle.dumps(TransferDone(transfer_id="t")))


def test_engine_info_round_trip_and_garbage() -> None:
    assert decode_info(encode_info(INFO)) == INFO
    with pytest.raises(MessageError, match="malformed engine info"):
        decode_info(b"\x93garbage")
    with pytest.raises(MessageError, match="malformed engine info"):
        decode_info(msgspec.msgpack.encode({"engine_id": "x"}))

"""kvbridge.messages: every kind round-trips; bounds, authentication, replays, garbage."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.errors import AuthError, KVBridgeError, MessageError, MessageTooLarge, ReplayError
from kvbridge.layout import LayoutWire, PlaneWire
from kvbridge.messages import (
    MAX_DIGEST_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    CancelReply,
    ClaimPart,
    Codec,
    DrainNotice,
    EngineInfo,
    ErrorKind,
    HeadSplit,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Message,
    PipeFrame,
    PullClaim,
    PullDone,
    PullServed,
    PushConfirm,
    PushLanded,
    PushRegister,
    PushResult,
    StatsQuery,
    StatsReply,
    TransferQuery,
    TransferReply,
    decode_info,
    encode_info,
)

LAYOUT = LayoutWire(planes=[PlaneWire("l0#0", 4096, 128, 128)], num_blocks=8, block_size=16,
                    dtype="bfloat16")
INFO = EngineInfo(
    engine_id="engine-p", generation="gen-1", rank=1, tp_size=2, backend="shm",
    agent="engine-p:gen-1:1", transport_metadata=b"\x00\x01meta", layout=LAYOUT,
    layout_fingerprint="0123456789abcdef",
    control_address="tcp://127.0.0.1:5555", compat={"model": "tiny", "dtype": "bfloat16"},
)

INFO_HEADS = EngineInfo(
    engine_id="engine-p", generation="gen-1", rank=1, tp_size=2, backend="shm",
    agent="engine-p:gen-1:1", transport_metadata=b"", layout=LAYOUT,
    layout_fingerprint="0123456789abcdef",
    control_address="tcp://127.0.0.1:5555",
    heads=HeadSplit(total_heads=8, first_head=4, heads=4, head_dim=128, order="dt",
                    interior="vllm-cpu:vec:auto"),
)

ALL_MESSAGES: list[Message] = [
    Hello(info=INFO, challenge=b"c" * 32),
    HelloReply(info=INFO),
    Heartbeat(generation="*", transfer_ids=["t-1", "t-2"]),
    HeartbeatReply(generation="gen-1", unknown=["t-2"]),
    PullClaim(transfer_id="t-1", generation="gen-1", skip_blocks=1, block_ids=[4, 5],
              num_tokens=48, prompt_digest="ab"),
    PullClaim(transfer_id="t-1", generation="gen-1", skip_blocks=2, block_ids=[6],
              num_tokens=48, prompt_digest="ab",
              part=ClaimPart(tp_size=2, rank=1, block_size=32, first_token=32)),
    Hello(info=INFO_HEADS, challenge=b"c" * 16),
    PullDone(transfer_id="t-1", nbytes=1 << 20, want_digests=True),
    PullServed(transfer_id="t-1", digests=b"\x01" * 32),
    PushRegister(transfer_id="t-1", generation="*", engine_id="engine-d",
                 sender_generation="gen-2", control_address="tcp://127.0.0.1:6000",
                 block_ids=[5, 6, 7], skip_blocks=2, num_tokens=80, prompt_digest="ab",
                 layout_fingerprint="0123456789abcdef"),
    PushRegister(transfer_id="t-1", generation="*", engine_id="engine-d",
                 sender_generation="gen-2", control_address="tcp://127.0.0.1:6000",
                 block_ids=[5], num_tokens=16, prompt_digest="ab",
                 layout_fingerprint="0123456789abcdef", progress=0x7F00_0000_1040),
    PushRegister(transfer_id="t-1", generation="*", engine_id="engine-d",
                 sender_generation="gen-2", control_address="tcp://127.0.0.1:6000",
                 block_ids=[5], num_tokens=16, prompt_digest="ab",
                 layout_fingerprint="0123456789abcdef", check_early=True),
    PushLanded(transfer_id="t-1", nbytes=3 << 20),
    PushConfirm(transfer_id="t-1", generation="gen-2", block_ids=[5, 6, 7]),
    PushConfirm(transfer_id="t-1", generation="gen-2", block_ids=[5, 6, 7], rank=3),
    PushResult(transfer_id="t-1", ok=True, nbytes=3 << 20),
    PushResult(transfer_id="t-1", ok=True, nbytes=3 << 20, digests=b"\x02" * 16),
    PushResult(transfer_id="t-2", ok=False, error="prefill aborted"),
    Cancel(transfer_id="t-1", reason="peer went away"),
    CancelReply(safe=False),
    StatsQuery(),
    DrainNotice(),
    StatsReply(engine_id="engine-p", generation="gen-1", stats={"transfers_done": 3}, pending=1),
    TransferQuery(transfer_ids=["t-1"]),
    TransferReply(outcomes={"t-1": "failed: lease expired"}),
    Ack(),
    Ack(ok=False, kind=ErrorKind.UNKNOWN_TRANSFER, error="no such transfer"),
    PipeFrame(seq=3, payload=b"\xff" * 100),
    PipeFrame(seq=4, eos=True),
]


@pytest.mark.parametrize("secret", [None, "s3cret", b"bytes-secret"], ids=["plain", "str", "bytes"])
@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message, secret: str | bytes | None) -> None:
    codec = Codec(secret)
    back = codec.decode(codec.encode(msg, b"ctx"), b"ctx")
    assert type(back) is type(msg) and back == msg


def test_every_kind_is_covered() -> None:
    missing = set(Message.__args__) - {type(m) for m in ALL_MESSAGES}  # type: ignore[attr-defined]
    assert not missing, f"add a sample of {sorted(t.__name__ for t in missing)} to ALL_MESSAGES"


def test_defaults_and_protocol_version() -> None:
    assert INFO.protocol == PROTOCOL_VERSION == 4
    assert Ack().ok is True
    assert PipeFrame(seq=0).payload == b"" and PipeFrame(seq=0).eos is False


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Heartbeat(generation="*", transfer_ids=[]).transfer_ids = ["x"]  # type: ignore[misc]


def test_oversize_encode_and_decode_rejected() -> None:
    with pytest.raises(MessageTooLarge, match=r"PipeFrame is \d+ bytes, above the limit of 4096"):
        Codec(max_bytes=4096).encode(PipeFrame(seq=0, payload=b"x" * 5000))
    big = Codec().encode(PipeFrame(seq=0, payload=b"x" * 5000))
    with pytest.raises(MessageTooLarge, match="exceeds 4096"):
        Codec(max_bytes=4096).decode(big)


def test_wrong_secret_missing_secret_and_tampering_rejected() -> None:
    data = Codec("right").encode(Cancel(transfer_id="t", reason="r"))
    with pytest.raises(AuthError, match="failed authentication"):
        Codec("wrong").decode(data)
    with pytest.raises(AuthError, match="not authenticated"):
        Codec("secret").decode(Codec().encode(Cancel(transfer_id="t", reason="r")))
    with pytest.raises(AuthError, match="no secret is set here"):
        Codec().decode(data)
    for i in (0, 5, 20, len(data) // 2, len(data) - 1):  # header, nonce, time, body, mac
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(MessageError):
            Codec("right").decode(bytes(bad))


def test_the_mac_binds_the_frame_to_its_context() -> None:
    data = Codec("k").encode(StatsQuery(), b"Qrequest-1")
    with pytest.raises(AuthError):
        Codec("k").decode(data, b"Qrequest-2")
    with pytest.raises(AuthError):
        Codec("k").decode(data, b"Arequest-1")  # a request cannot pass for a reply


def test_replays_are_refused_within_the_window() -> None:
    receiver = Codec("k")
    data = Codec("k").encode(StatsQuery())
    assert isinstance(receiver.decode(data), StatsQuery)
    with pytest.raises(ReplayError, match="replayed"):
        receiver.decode(data)


def test_stale_and_future_frames_are_refused() -> None:
    now = [1_000_000.0]
    receiver = Codec("k", window_s=30, clock=lambda: now[0])
    old = Codec("k", clock=lambda: now[0] - 31).encode(StatsQuery())
    future = Codec("k", clock=lambda: now[0] + 31).encode(StatsQuery())
    for frame in (old, future):
        with pytest.raises(ReplayError, match="outside the replay window"):
            receiver.decode(frame)
    fresh = Codec("k", clock=lambda: now[0] - 29).encode(StatsQuery())
    assert isinstance(receiver.decode(fresh), StatsQuery)


def test_replay_memory_is_bounded_and_fails_closed() -> None:
    receiver = Codec("k", replay_capacity=3)
    sender = Codec("k")
    for _ in range(3):
        receiver.decode(sender.encode(StatsQuery()))
    with pytest.raises(ReplayError, match="full"):
        receiver.decode(sender.encode(StatsQuery()))


_HEADER = b"\x01" + b"\0" * 24


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1\xc1\xc1 not msgpack",
        msgspec.msgpack.encode({"type": "Nope", "x": 1}),
        msgspec.msgpack.encode({"type": "PullDone", "transfer_id": 5, "nbytes": 1}),
        msgspec.msgpack.encode({"type": "PullDone"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "Heartbeat", "generation": "*",
                                "transfer_ids": ["x"] * 5000}),
        msgspec.msgpack.encode({"type": "Cancel", "transfer_id": "t" * 500, "reason": ""}),
        msgspec.msgpack.encode({"type": "PullClaim", "transfer_id": "t", "generation": "*",
                                "block_ids": [-1], "num_tokens": 1, "prompt_digest": ""}),
        msgspec.msgpack.encode({"type": "Cancel", "transfer_id": "has space", "reason": ""}),
        b"\x91" * 200_000 + b"\xc0",
        msgspec.msgpack.encode({"type": "PullServed", "transfer_id": "t",
                                "digests": b"\0" * (MAX_DIGEST_BYTES + 16)}),
        msgspec.msgpack.encode({"type": "PushResult", "transfer_id": "t", "ok": True,
                                "digests": "not bytes"}),
        msgspec.msgpack.encode({"type": "PushLanded", "transfer_id": "t", "nbytes": -1}),
        msgspec.msgpack.encode({"type": "PushLanded", "transfer_id": "t", "nbytes": 1 << 63}),
        msgspec.msgpack.encode({"type": "PushLanded", "transfer_id": "t"}),
        msgspec.msgpack.encode({"type": "PushRegister", "transfer_id": "t", "generation": "*",
                                "engine_id": "d", "sender_generation": "g",
                                "control_address": "tcp://127.0.0.1:6000", "block_ids": [1],
                                "num_tokens": 16, "prompt_digest": "ab",
                                "layout_fingerprint": "0123456789abcdef",
                                "check_early": "yes"}),
    ],
    ids=["empty", "garbage", "unknown-tag", "wrong-type", "missing-field", "not-a-struct",
         "too-many-ids", "id-too-long", "negative-block", "id-with-space", "deep-nesting",
         "digests-too-long", "digests-not-bytes", "landed-negative", "landed-oversized",
         "landed-no-bytes", "check-early-not-bool"],
)
def test_garbage_rejected(body: bytes) -> None:
    with pytest.raises(MessageError) as info:
        Codec().decode(_HEADER + body)
    assert isinstance(info.value, KVBridgeError)


@pytest.mark.parametrize("progress", [3, 0, -8, 1 << 63, "0x10", 2.5, [8]])
def test_a_push_registration_with_a_bad_progress_word_is_refused_naming_it(
        progress: object) -> None:
    """The word P's copy would keep (kvbridge.scheduling.follow): 8-byte aligned, positive,
    an address; anything else is refused before P looks at it, naming the field."""
    body = msgspec.msgpack.encode({
        "type": "PushRegister", "transfer_id": "t", "generation": "*", "engine_id": "d",
        "sender_generation": "g", "control_address": "tcp://127.0.0.1:6000", "block_ids": [1],
        "num_tokens": 16, "prompt_digest": "ab", "layout_fingerprint": "0123456789abcdef",
        "progress": progress})
    with pytest.raises(MessageError, match="progress"):
        Codec().decode(_HEADER + body)


def test_short_frames_and_unknown_versions_rejected() -> None:
    with pytest.raises(MessageError, match="shorter than its header"):
        Codec().decode(b"\x01abc")
    with pytest.raises(MessageError, match="unknown frame version"):
        Codec().decode(b"\x07" + b"\0" * 24 + msgspec.msgpack.encode({"type": "StatsQuery"}))


def test_never_unpickles() -> None:
    import pickle

    with pytest.raises(MessageError):
        Codec().decode(_HEADER + pickle.dumps(Cancel(transfer_id="t", reason="r")))


def test_engine_info_round_trip_and_garbage() -> None:
    assert decode_info(encode_info(INFO)) == INFO
    with pytest.raises(MessageError, match="malformed engine info"):
        decode_info(b"\x93garbage")
    with pytest.raises(MessageError, match="malformed engine info"):
        decode_info(msgspec.msgpack.encode({"engine_id": "x"}))
    bad = msgspec.to_builtins(INFO)
    bad["layout"]["planes"] = [["l", -5, 1, 1]]
    with pytest.raises(MessageError):
        decode_info(msgspec.msgpack.encode(bad))

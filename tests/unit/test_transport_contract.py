"""The Transport contract itself (kvbridge.transport): six required methods, notifications as
an optional protocol, and the public way a transport settles its handles."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvbridge.errors import ConfigError, DescriptorError, TransferFailed
from kvbridge.transport import (
    DescriptorArray,
    HandleState,
    MemoryRegion,
    Notifying,
    Op,
    TransferHandle,
    Transport,
    notifying,
)
from kvbridge.transports.memory import MemoryTransport


class _Minimal(Transport):
    """Only what every backend must implement; settles each transfer at once (no bytes move)."""

    name = "minimal"

    def register_memory(self, regions: Sequence[MemoryRegion]) -> bytes:
        return b"meta"

    def attest(self, proof: bytes, peer_metadata: bytes | None = None) -> None:
        self.proof = proof

    def add_peer(self, metadata: bytes, proof: bytes) -> str:
        return "peer"

    def remove_peer(self, peer: str) -> None:
        pass

    def _submit(self, op: Op, peer: str, local: DescriptorArray, remote: DescriptorArray,
                notification: bytes | None) -> TransferHandle:
        handle = TransferHandle(op, peer, int(local[:, 1].sum()), int(local.shape[0]))
        if peer == "failing":
            handle.fail("the wire broke")
        else:
            handle.succeed()
        return handle

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True


def test_six_methods_are_required() -> None:
    assert sorted(Transport.__abstractmethods__) == [
        "_submit", "add_peer", "attest", "close", "register_memory", "remove_peer"]


def test_a_transport_of_the_required_methods_works_and_has_no_notifications() -> None:
    t = _Minimal("a")
    descs = np.array([[4096, 64, 0]], dtype=np.int64)
    handle = t.transfer(Op.WRITE, "peer", descs, descs)
    assert handle.state is HandleState.DONE and t.poll(handle) is HandleState.DONE
    assert handle.finished is not None and handle.done_event.is_set()
    with pytest.raises(TransferFailed, match="the wire broke"):
        t.transfer(Op.READ, "failing", descs, descs)
    assert len(t.invite()) == len(t.proof)
    assert not isinstance(t, Notifying)
    with pytest.raises(DescriptorError, match="'minimal' carries no notifications"):
        t.submit(Op.WRITE, "peer", descs, descs, notification=b"done")
    with pytest.raises(ConfigError, match="send_notification, get_notifications"):
        notifying(t)
    t.close()


def test_builtin_transports_offer_notifications() -> None:
    with MemoryTransport("a") as t:
        assert isinstance(t, Notifying) and notifying(t) is t


def test_handle_callbacks_run_when_settled() -> None:
    calls: list[str] = []
    handle = TransferHandle(Op.READ, "p", 1, 1)
    handle.add_done_callback(lambda: calls.append("first"))
    handle.add_done_callback(lambda: 1 / 0)  # a broken waker does not stop the others
    handle.add_done_callback(lambda: calls.append("second"))
    handle.fail("gone")
    assert (handle.state, handle.error, calls) == (HandleState.FAILED, "gone", ["first", "second"])
    handle.add_done_callback(lambda: calls.append("late"))  # already terminal: at once
    assert calls[-1] == "late"

"""D checks a push's landed KV while P digests its side (``PushRegister.check_early``,
``PushLanded``): where the transport copies inside the post (NIXL over UCX's cross-memory
attach), P says every WRITE stopped before it hashes what it sent, and D hashes what landed
meanwhile; the ``PushResult`` with P's digests still decides. Two loops in this process over
the memory transport, made to copy inside the post (the real one over NIXL between processes:
tests/process/test_digest_matrix.py)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from kvbridge.blocks import BlockPair, BlockRequest
from kvbridge.messages import PushLanded
from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import FAST, expect, send
from kvbridge.transport import HandleState, Op, TransferHandle
from kvbridge.transports.memory import MemoryTransport

SHAPE = (2, 64, 16, 256)  # 32 KiB per block and plane: 8 blocks are a 512 KiB part


class _CopiesInPost(MemoryTransport):
    """A WRITE is copied before its post returns, as UCX's cross-memory attach does."""

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        handle = super()._submit_blocks(op, pair, req, notification)
        self.wait(handle, 10.0)
        return handle


class _DoneBeforeCopied(MemoryTransport):
    """Says a WRITE is DONE when its post returns and copies it 0.3 s later: a transport that
    completes early, or a P that says its WRITEs stopped before they did."""

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        threading.Timer(0.3, super()._submit_blocks, (op, pair, req, notification)).start()
        handle = TransferHandle(op, pair.peer, req.nbytes, req.count)
        handle.succeed()
        return handle


class _CopiesLater(MemoryTransport):
    """A WRITE is copied 50 ms after its post returns, and its handle is DONE then (a NIC's
    WRITE: P hashes while it moves the bytes)."""

    def _submit_blocks(self, op: Op, pair: BlockPair, req: BlockRequest,
                       notification: bytes | None) -> TransferHandle:
        outer = TransferHandle(op, pair.peer, req.nbytes, req.count)

        def post() -> None:
            inner = MemoryTransport._submit_blocks(self, op, pair, req, notification)
            inner.add_done_callback(lambda: outer.succeed() if inner.state is HandleState.DONE
                                    else outer.fail(inner.error or "failed"))

        threading.Timer(0.05, post).start()
        return outer


def _pair(p_transport: type[MemoryTransport]) -> tuple[LocalAgent, LocalAgent]:
    def make(name: str, cls: type[MemoryTransport]) -> LocalAgent:
        options: Mapping[str, Any] = {}
        return LocalAgent(name, SHAPE, FAST, transport=cls(name, options))

    p, d = make("p", p_transport), make("d", MemoryTransport)
    p.fill(1)
    d.fill(2)
    return p, d


def _push(p: LocalAgent, d: LocalAgent, n: int) -> tuple[set[str], list[int]]:
    dst = [10 * n + i for i in range(8)]
    d.expect(expect(f"d-push{n}", f"push{n}", p, dst))
    p.ready(send(f"p-push{n}", f"push{n}", list(range(1, 9))))
    return d.drain({f"d-push{n}"})["results"]["failed_recving"], dst


def test_d_checks_what_landed_while_p_digests_and_every_push_lands_equal() -> None:
    p, d = _pair(_CopiesInPost)
    try:
        for n in (1, 2, 3):
            failed, dst = _push(p, d, n)
            assert failed == set()
            np.testing.assert_array_equal(d.blocks(dst), p.blocks(list(range(1, 9))))
        stats = d.drain(set())["stats"]
        assert stats.get("push_checked_early") == 3 and not stats.get("checksum_mismatch"), stats
        assert p.drain({"p-push1", "p-push2", "p-push3"})["pending"] == 0
    finally:
        p.close()
        d.close()


def test_without_the_copy_in_the_post_d_checks_at_the_result() -> None:
    """The WRITE is still moving when its post returns: P hashes meanwhile, as before, and says
    nothing early."""
    p, d = _pair(_CopiesLater)
    try:
        failed, dst = _push(p, d, 1)
        assert failed == set()
        np.testing.assert_array_equal(d.blocks(dst), p.blocks(list(range(1, 9))))
        assert "push_checked_early" not in d.drain(set())["stats"]
    finally:
        p.close()
        d.close()


def test_a_landed_notice_before_the_bytes_fails_the_receive_and_never_passes_it_unchecked(
        ) -> None:
    """P says its WRITEs stopped 0.3 s before the bytes land: D's early digests are of what was
    there before, they differ from P's, and the receive fails naming the chunks
    (``checksum_mismatch``): the notice only says when D reads."""
    p, d = _pair(_DoneBeforeCopied)
    try:
        failed, _ = _push(p, d, 1)
        assert failed == {"d-push1"}
        assert "digest mismatch in 2 of 2 chunks" in (d.outcome("push1") or "")
        stats = d.drain(set())["stats"]
        assert stats["checksum_mismatch"] == 1 and stats["push_checked_early"] == 1, stats
    finally:
        threading.Event().wait(0.5)  # the late copies land before the loops close
        p.close()
        d.close()


def test_a_notice_that_names_other_bytes_is_ignored_and_the_result_decides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``PushLanded`` whose byte count is not the part D registered (a confused or forged
    answer on D's own call) makes D digest nothing early: it checks at the ``PushResult``, the
    push lands equal and nothing is counted as checked early."""
    from kvbridge.scheduling import push

    monkeypatch.setattr(push, "PushLanded", lambda transfer_id, nbytes: PushLanded(
        transfer_id=transfer_id, nbytes=nbytes + 1))
    p, d = _pair(_CopiesInPost)
    try:
        failed, dst = _push(p, d, 1)
        assert failed == set()
        np.testing.assert_array_equal(d.blocks(dst), p.blocks(list(range(1, 9))))
        stats = d.drain(set())["stats"]
        assert "push_checked_early" not in stats and not stats.get("checksum_mismatch"), stats
    finally:
        p.close()
        d.close()

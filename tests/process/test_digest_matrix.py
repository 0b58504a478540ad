"""Hand-off digests on every transport: a byte flipped after the transport moved it is found.

Real transfer loops in two processes (:class:`~kvbridge.testing.agents.AgentProcess`) over
shm, nixl (UCX on loopback) and mooncake (TCP), each wrapped in the fault-injecting transport:
P's WRITEs (push) and D's READs (pull) land with one byte wrong at a chosen offset, in the
first, a middle and the last 256 KiB chunk of a multi-chunk part. Digests are on by default
(no ``checksum`` key in the configuration). Every corrupted receive fails with the chunk named,
every clean one passes with the bytes equal, and P holds nothing at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.scheduling.digests import CHUNK_BYTES
from kvbridge.testing.agents import AgentProcess
from kvbridge.testing.handoffs import FAST, expect, pull, send

pytestmark = pytest.mark.timeout(240)

SHAPE = (2, 64, 16, 1024)  # 64 KiB per block and plane: 8 blocks are a 2 MiB part (8 chunks)
BLOCK_PLANE = 16 * 1024 * 4
EXTRA = {**FAST, "control_timeout_s": 10, "push_timeout_s": 20}


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


BACKENDS = [
    pytest.param("shm", id="shm"),
    pytest.param("nixl", id="nixl", marks=[
        pytest.mark.nixl, pytest.mark.skipif(not _have("nixl._api"), reason="no nixl")]),
    pytest.param("mooncake", id="mooncake", marks=[
        pytest.mark.mooncake, pytest.mark.skipif(not _have("mooncake"), reason="no mooncake")]),
]
#: byte offsets into the part's stream: the first chunk, a middle one, the last byte
OFFSETS = (7, 3 * CHUNK_BYTES + 12345, 8 * BLOCK_PLANE * 2 * 2 - 1)


@pytest.fixture
def loopback() -> Iterator[None]:
    old = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = "lo"  # read by the spawned agents
    yield
    if old is None:
        os.environ.pop("UCX_NET_DEVICES", None)
    else:
        os.environ["UCX_NET_DEVICES"] = old


def _pull_checked(p: AgentProcess, d: AgentProcess, tid: str, src: list[int], dst: list[int],
                  ok: bool) -> None:
    """D pulls ``tid`` (staged on P from ``src``) into ``dst``: the receive fails unless
    ``ok``, and when ``ok`` the bytes are P's."""
    d.pull(pull(f"d-{tid}", tid, p, dst, src))
    rd = d.drain({f"d-{tid}"})
    assert rd["results"]["failed_recving"] == (set() if ok else {f"d-{tid}"})
    if ok:
        np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))


@pytest.mark.parametrize("offset", OFFSETS, ids=["first-chunk", "middle-chunk", "last-byte"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_byte_flipped_in_transit_is_caught_on_every_transport(
        backend: str, offset: int, loopback: None) -> None:
    extra = {**EXTRA, "backend": backend}
    # P's WRITE #1 and D's READ #1 land corrupted; #2 of each is clean
    fault = {"corrupt": {1}, "corrupt_offset": offset}
    p = AgentProcess("prefill", SHAPE, extra, faults=fault)
    d = AgentProcess("decode", SHAPE, extra, faults=fault)
    try:
        p.fill(1)
        d.fill(2)
        src = list(range(1, 9))
        for n, ok in ((1, False), (2, True)):
            dst = [10 * n + i for i in range(8)]
            d.expect(expect(f"d-push{n}", f"push{n}", p, dst))
            p.ready(send(f"p-push{n}", f"push{n}", src))
            rd = d.drain({f"d-push{n}"})
            assert rd["results"]["failed_recving"] == (set() if ok else {f"d-push{n}"})
            dst = [10 * n + 30 + i for i in range(8)]
            p.stage(send(f"p-pull{n}", f"pull{n}", src))
            _pull_checked(p, d, f"pull{n}", src, dst, ok)
        stats = d.drain(set())["stats"]
        assert stats["checksum_mismatch"] == 2  # both corrupted receives, nothing else
        why = d.outcome("push1") or ""
        assert "digest mismatch in 1 of 8 chunks" in why, why
        chunk = offset // CHUNK_BYTES
        assert f"at bytes {chunk * CHUNK_BYTES}–" in why, why
        assert "digest mismatch in 1 of 8 chunks" in (d.outcome("pull1") or "")
        rp = p.drain({"p-push1", "p-push2", "p-pull1", "p-pull2"})
        assert rp["pending"] == 0
    finally:
        p.close()
        d.close()


@contextlib.contextmanager
def _mapped_pair(backend: str = "shm") -> Iterator[tuple[AgentProcess, AgentProcess]]:
    """P and D (no fault wrapper), their KV filled apart: over shm with every range mapped,
    or over ``backend``."""
    extra: dict[str, object] = {**EXTRA, "backend": backend}
    if backend == "shm":
        extra["backend_options"] = {"map_memory": True}
    p = AgentProcess("prefill", SHAPE, extra)
    d = AgentProcess("decode", SHAPE, extra)
    try:
        p.fill(1)
        d.fill(2)
        yield p, d
    finally:
        p.close()
        d.close()


def test_a_pull_digested_as_it_lands_still_finds_bytes_that_changed() -> None:
    """shm with every range mapped: D digests its READ in the pass that copies it (no fault
    wrapper, so the transport copies with the pull's copy). P's KV changes after P digested it
    when staged, so what lands is not what P digested: the receive fails naming the chunks;
    the next pull, of unchanged KV, passes with the bytes equal. Both were digested as they
    landed (``pull_digested_landing``)."""
    with _mapped_pair() as (p, d):
        src = list(range(1, 9))
        for n, ok in ((1, False), (2, True)):
            p.stage(send(f"p-pull{n}", f"pull{n}", src))
            p.drain(set(), timeout=0)  # a barrier: the stage (and P's digests) is done
            if not ok:
                p.fill(3)  # after P digested it
            _pull_checked(p, d, f"pull{n}", src, [10 * n + i for i in range(8)], ok)
        stats = d.drain(set())["stats"]
        assert stats["checksum_mismatch"] == 1 and stats["pull_digested_landing"] == 2, stats
        assert "digest mismatch in 8 of 8 chunks" in (d.outcome("pull1") or "")
        assert p.drain(set())["pending"] == 0  # released at each DONE, before its answer


@pytest.mark.parametrize(("backend", "stat"), [
    pytest.param("shm", "push_digested_behind", id="shm"),
    pytest.param("nixl", "push_checked_early", id="nixl", marks=[
        pytest.mark.nixl, pytest.mark.skipif(not _have("nixl._api"), reason="no nixl")]),
])
def test_a_push_is_checked_on_d_while_it_lands(backend: str, stat: str, loopback: None) -> None:
    """D's check of a push overlaps P's work, whether P built the WRITE ahead (while the
    forward runs) or when it posts it. shm with every range mapped (no fault wrapper): D names
    a word of its board in each ``PushRegister``, P's copy keeps it at the bytes written, and D
    hashes each chunk behind the copy (``push_digested_behind``; kvbridge.scheduling.follow).
    NIXL: UCX's cross-memory attach copies a WRITE inside its post, so P tells D every WRITE
    stopped (``PushLanded``, asked for by D's ``check_early``) before it hashes what it sent,
    and D hashes what landed meanwhile (``push_checked_early``). Every push lands equal, no
    digest differs, and P holds nothing at the end."""
    with _mapped_pair(backend) as (p, d):
        src = list(range(1, 9))
        for n in (1, 2, 3):
            dst = [10 * n + i for i in range(8)]
            d.expect(expect(f"d-push{n}", f"push{n}", p, dst))
            plan = send(f"p-push{n}", f"push{n}", src)
            if n == 1:  # built ahead, as while the forward runs; the others when posted
                p.prepare(plan)
                time.sleep(1.0)  # D registered and confirmed meanwhile
            p.ready(plan)
            rd = d.drain({f"d-push{n}"})
            assert rd["results"]["failed_recving"] == set()
            np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
        stats = d.drain(set())["stats"]
        assert stats.get(stat) == 3 and not stats.get("checksum_mismatch"), stats
        assert p.drain({"p-push1", "p-push2", "p-push3"})["pending"] == 0


_STRANGER = r"""
import ctypes, sys
pid, word = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)

class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

value = ctypes.c_uint64(1 << 40)  # "every byte landed", before P wrote any
local, remote = Iov(ctypes.addressof(value), 8), Iov(word, 8)
libc.process_vm_writev.restype = ctypes.c_ssize_t
n = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
sys.exit(0 if n == 8 else f"process_vm_writev: {ctypes.get_errno()}")
"""


def test_a_stranger_that_moves_ds_word_fails_the_push_and_never_passes_it_unchecked() -> None:
    """A process of D's uid that is not its peer writes D's progress word (shm lets any process
    of the uid attach to D's memory: cross-memory attach needs it) after D registered and before
    P's WRITE. D's follower hashes the blocks as they were; the digests differ from P's; the
    receive fails naming every chunk (``checksum_mismatch``), so no KV is used unchecked. The
    next push, left alone, lands equal."""
    with _mapped_pair() as (p, d):
        src = list(range(1, 9))
        for n, hostile in ((1, True), (2, False)):
            dst = [10 * n + i for i in range(8)]
            d.expect(expect(f"d-push{n}", f"push{n}", p, dst))
            plan = send(f"p-push{n}", f"push{n}", src)
            p.prepare(plan)
            time.sleep(1.0)  # D registered (its word taken) and confirmed
            if hostile:
                words = d.board_words()
                assert len(words) == 1, words
                subprocess.run([sys.executable, "-c", _STRANGER, str(d.proc.pid), str(words[0])],
                               check=True, timeout=30)
                time.sleep(0.3)  # D's follower looks (at most 50 ms asleep) before P writes
            p.ready(plan)
            rd = d.drain({f"d-push{n}"})
            assert rd["results"]["failed_recving"] == ({f"d-push{n}"} if hostile else set())
            if not hostile:
                np.testing.assert_array_equal(d.blocks(dst), p.blocks(src))
        assert "digest mismatch in 8 of 8 chunks" in (d.outcome("push1") or "")
        stats = d.drain(set())["stats"]
        assert stats["checksum_mismatch"] == 1 and stats["push_digested_behind"] == 2, stats
        assert d.board_words() == []  # both words given back
        assert p.drain({"p-push1", "p-push2"})["pending"] == 0

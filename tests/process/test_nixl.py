"""The nixl backend beyond the conformance suite: options, backend selection (LIBFABRIC/EFA),
the progress-thread spin default, prepared grids, a vanished peer, and the raw bench.

Pure-Python parts (options, grids, EFA detection) run without nixl; the rest is marked ``nixl``
and skipped when the package is missing. Everything talks over 127.0.0.1 / loopback UCX.
"""

from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.errors import (
    BackendUnavailable,
    ConfigError,
    MessageError,
    PeerUnreachable,
    TransferFailed,
    UnknownPeer,
)
from kvbridge.transport import HandleState, MemoryRegion, Op
from kvbridge_nixl._agent import NixlOptions, ucx_modules_setting
from kvbridge_nixl._efa import LIBFABRIC_HINT, detect_efa_devices, efa_advice
from kvbridge_nixl._grid import Grid, granule_of, region_table

try:
    import nixl._api  # noqa: F401

    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

needs_nixl = [
    pytest.mark.nixl,
    pytest.mark.skipif(not HAVE_NIXL, reason="the nixl package is not installed"),
]


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


# -- options ----------------------------------------------------------------------------------


def test_options_defaults_and_parsing() -> None:
    d = NixlOptions.parse({})
    assert d.backends == ("UCX",)
    assert d.progress_thread and d.progress_delay_us == 10_000
    o = NixlOptions.parse({"backends": "ucx, libfabric", "progress_delay_us": "500",
                           "progress_thread": "false", "backend_params": {"ucx": {"a": 1}}})
    assert o.backends == ("UCX", "LIBFABRIC")
    assert o.progress_delay_us == 500 and not o.progress_thread
    assert o.backend_params == {"UCX": {"a": "1"}}


@pytest.mark.parametrize("bad", [
    {"backends": []}, {"backends": 3}, {"progress_delay_us": -1}, {"progress_delay_us": "x"},
    {"xfer_mode": "fast"}, {"progress_thread": "maybe"}, {"backend_params": {"UCX": 1}},
    {"granule": True},
])
def test_options_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        NixlOptions.parse(bad)


def test_ucx_modules_setting(tmp_path: Path) -> None:
    d = NixlOptions.parse({})
    assert ucx_modules_setting(d, {}, tmp_path / "none") == "^ib*"  # no RDMA devices
    assert ucx_modules_setting(d, {"UCX_MODULES": "x"}, tmp_path / "none") is None  # env wins
    (tmp_path / "mlx5_0").mkdir()
    assert ucx_modules_setting(d, {}, tmp_path) is None  # RDMA host: keep UCX's defaults
    assert ucx_modules_setting(NixlOptions.parse({"ucx_modules": ""}), {}, tmp_path) is None
    assert ucx_modules_setting(NixlOptions.parse({"ucx_modules": "^cu*"}), {}, tmp_path) == "^cu*"
    assert ucx_modules_setting(NixlOptions.parse({"backends": ["POSIX"]}), {}, tmp_path) is None


# -- grids (pure numpy) -----------------------------------------------------------------------


def test_grid_indices_split_and_reject() -> None:
    regions = [(1 << 20, 64 << 10, 0), (4 << 20, 16 << 10, 0)]
    g = Grid(regions, 4096)
    assert g.size == 16 + 4
    descs = g.descriptors()
    assert descs.shape == (20, 3) and (descs[:, 1] == 4096).all()
    assert descs[16, 0] == 4 << 20
    # one 3-granule descriptor + one single granule in the second region
    d = np.array([[(1 << 20) + 8192, 3 * 4096, 0], [(4 << 20) + 4096, 4096, 0]], np.int64)
    np.testing.assert_array_equal(g.indices(d), [2, 3, 4, 17])
    assert g.indices(np.array([[(1 << 20) + 100, 4096, 0]], np.int64)) is None  # misaligned
    assert g.indices(np.array([[(2 << 20), 4096, 0]], np.int64)) is None  # unregistered
    assert g.indices(np.array([[(1 << 20), 4096, 1]], np.int64)) is None  # other device
    table = region_table(regions)
    assert granule_of(d, table) == 4096
    assert granule_of(np.array([[(1 << 20) + 8192, 16384, 0]], np.int64), table) == 8192


# -- EFA detection (injected sysfs and fi_info) -----------------------------------------------


def test_detect_efa_devices(tmp_path: Path) -> None:
    assert detect_efa_devices(tmp_path / "missing", fi_info=None) == []
    (tmp_path / "mlx5_0").mkdir()
    assert detect_efa_devices(tmp_path, fi_info=None) == []
    assert detect_efa_devices(tmp_path, fi_info=lambda: ["rdmap0s31-rdm"]) == ["rdmap0s31-rdm"]
    (tmp_path / "efa_0").mkdir()
    # rdmap* devices bound to the efa driver count too
    drv = tmp_path / "drivers" / "efa"
    drv.mkdir(parents=True)
    dev = tmp_path / "rdmap16s27" / "device"
    dev.mkdir(parents=True)
    (dev / "driver").symlink_to(drv)
    assert detect_efa_devices(tmp_path, fi_info=None) == ["efa_0", "rdmap16s27"]


def test_efa_advice() -> None:
    assert efa_advice(["UCX"], []) is None
    assert efa_advice(["LIBFABRIC"], ["efa_0"]) is None
    text = efa_advice(["UCX"], ["efa_0"])
    assert text is not None and "LIBFABRIC" in text and "efa_0" in text


# -- importing nixl without torch ---------------------------------------------------------------


@pytest.mark.parametrize(("text", "cpu"), [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n", True),
    ("cuda = None\n", True),
    ("cuda: Optional[str] = '12.8'\n", False),
    ("cuda = '13.0'\n", False),
    ("git_version = 'x'\n", False),  # says nothing: unknown
])
def test_a_torch_without_cuda_is_read_from_its_version_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, cpu: bool) -> None:
    import importlib.machinery

    from kvbridge_nixl import _agent

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(text)
    spec = importlib.machinery.ModuleSpec("torch", None, origin=str(tmp_path / "torch" /
                                                                   "__init__.py"))
    monkeypatch.setattr(_agent.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert _agent._torch_without_cuda() is cpu
    monkeypatch.setitem(sys.modules, "torch", object())  # imported already: nixl asks it
    assert _agent._torch_without_cuda() is False
    monkeypatch.delitem(sys.modules, "torch")
    (tmp_path / "torch" / "version.py").unlink()  # no file: unknown
    assert _agent._torch_without_cuda() is False


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="the nixl package is not installed")
def test_importing_nixl_picks_nixls_own_wheel_without_importing_torch() -> None:
    """In a fresh process (a test peer, a bench agent, ``kvbridge doctor``) the backend's
    import gives the module nixl's own import picks, does not import torch (nixl 1.5 does, on
    a CPU torch: ~2 s), and leaves nixl's detection as it found it, four threads importing at
    once included."""
    ours = ("import sys, nixl_meta_utils; from concurrent.futures import ThreadPoolExecutor; "
            "from kvbridge_nixl._agent import import_nixl; "
            "apis = list(ThreadPoolExecutor(4).map(lambda _: import_nixl(), range(4))); "
            "assert all(a is apis[0] for a in apis); api = apis[0]; "
            "print(api.nixl_agent.__module__, 'torch' in sys.modules, "
            "nixl_meta_utils.detect_cuda_major.__name__)")
    theirs = "import nixl._api as api; print(api.nixl_agent.__module__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).parents[2] / "backends"), os.environ.get("PYTHONPATH"))
        if p)}
    got = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True, env=env).stdout.split()
           for code in (ours, theirs)]
    assert got[0] == [got[1][0], "False", "detect_cuda_major"], got
    assert got[1][0].startswith("nixl_"), got


# -- agent creation and backend selection (real nixl) -----------------------------------------


@pytest.fixture
def transports() -> Iterator[list[object]]:
    made: list[object] = []
    yield made
    for t in made:
        t.close(timeout=5.0)  # type: ignore[attr-defined]


def _make(made: list[object], name: str, **options: object) -> object:
    from kvbridge_nixl import NixlTransport

    t = NixlTransport(name, options)
    made.append(t)
    return t


@pytest.mark.timeout(120)
class TestAgent:
    pytestmark = needs_nixl

    def test_config_reaches_agent_and_is_logged(
        self, transports: list[object], caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.INFO, logger="kvbridge.transport.nixl")
        t = _make(transports, "cfg-a", num_threads=2, progress_delay_us=2000)
        cfg = t.agent_config  # type: ignore[attr-defined]
        assert cfg["backends"] == ["UCX"] and cfg["listen_thread"] is False
        assert cfg["progress_delay_us"] == 2000
        assert cfg["backend_params"] == {"UCX": {}}
        assert "UCX" in t._agent.backends  # type: ignore[attr-defined]
        line = next(r.getMessage() for r in caplog.records if "started" in r.getMessage())
        assert "backends=UCX" in line and "progress_delay_us=2000" in line
        assert "UCX_NET_DEVICES='lo'" in line

    def test_libfabric_unavailable_fails_fast_with_hint(self) -> None:
        from kvbridge_nixl import NixlTransport

        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable) as info:
            NixlTransport("lf", {"backends": ["LIBFABRIC"]})
        assert time.monotonic() - t0 < 60
        msg = str(info.value)
        assert "\n" not in msg
        assert "LIBFABRIC" in msg and "libfabric >= 2" in msg and "EFA installer" in msg
        assert LIBFABRIC_HINT in msg

    def test_unknown_backend_name(self) -> None:
        from kvbridge_nixl import NixlTransport

        with pytest.raises(BackendUnavailable, match="NOPE"):
            NixlTransport("nope", {"backends": ["UCX", "NOPE"]})

    def test_missing_nixl_package(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvbridge_nixl import NixlTransport

        monkeypatch.setitem(sys.modules, "nixl", None)
        with pytest.raises(BackendUnavailable, match="nixl==1.5.1"):
            NixlTransport("missing", {})
        with pytest.raises(BackendUnavailable):
            NixlTransport.probe()

    def test_probe_and_registry(self) -> None:
        from kvbridge import registry
        from kvbridge_nixl import NixlTransport

        assert NixlTransport.probe().startswith("nixl ")
        assert registry.load_class("nixl") is NixlTransport

    def test_efa_host_with_ucx_logs_recommendation(
        self, transports: list[object], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        from kvbridge_nixl import NixlTransport

        caplog.set_level(logging.INFO, logger="kvbridge.transport.nixl")
        monkeypatch.setattr(NixlTransport, "efa_devices", staticmethod(lambda: ["efa_0"]))
        _make(transports, "efa-host")
        warn = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("LIBFABRIC" in r.getMessage() and "efa_0" in r.getMessage() for r in warn)
        caplog.clear()
        _make(transports, "efa-host-quiet", efa_check=False)
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]

    def test_process_exits_cleanly(self) -> None:
        """A process that used a UCX agent exits 0 (not SIGSEGV from the wheel's libnl)."""
        code = ("from kvbridge_nixl import NixlTransport\n"
                "t = NixlTransport('exit-check', {})\nt.close()\nprint('closed')\n")
        env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert "closed" in proc.stdout, proc.stderr[-2000:]
        if Path("/sys/class/infiniband").is_dir():
            pytest.skip("RDMA host: UCX_MODULES is left alone")
        assert proc.returncode == 0, proc.stderr[-2000:]

    def test_idle_pair_does_not_spin(self, transports: list[object]) -> None:
        """With the default progress delay, an idle connected pair costs ~no CPU."""
        a, b = _make(transports, "idle-a"), _make(transports, "idle-b")
        bufs = [np.ones(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)]
        ma = a.register_memory([MemoryRegion(bufs[0].ctypes.data, bufs[0].nbytes)])  # type: ignore[attr-defined]
        mb = b.register_memory([MemoryRegion(bufs[1].ctypes.data, bufs[1].nbytes)])  # type: ignore[attr-defined]
        peer_b = a.add_peer(mb, b.invite(ma))  # type: ignore[attr-defined]
        b.add_peer(ma, a.invite(mb))  # type: ignore[attr-defined]
        loc = [[bufs[0].ctypes.data, 4096, 0]]
        rem = [[bufs[1].ctypes.data, 4096, 0]]
        a.transfer(Op.WRITE, peer_b, loc, rem, b"hi", timeout=30)  # type: ignore[attr-defined]
        assert bufs[1][:4096].all()
        time.sleep(0.3)
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(2.0)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        # a busy-spinning UCX progress thread would cost ~1 CPU-s per second per agent
        assert cpu < 0.25 * (t1 - t0), f"idle agents used {cpu:.2f} CPU-s in {t1 - t0:.1f} s"


# -- in-process pair: prepared grids vs direct posting ----------------------------------------


@pytest.fixture
def pair(transports: list[object], request: pytest.FixtureRequest) -> tuple[object, ...]:
    mode = getattr(request, "param", "auto")
    a = _make(transports, f"pa-{mode}", xfer_mode=mode)
    b = _make(transports, f"pb-{mode}", xfer_mode=mode)
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, np.uint8)
    ma = a.register_memory([MemoryRegion(src.ctypes.data, src.nbytes)])  # type: ignore[attr-defined]
    mb = b.register_memory([MemoryRegion(dst.ctypes.data, dst.nbytes)])  # type: ignore[attr-defined]
    name_b = a.add_peer(mb, b.invite(ma))  # type: ignore[attr-defined]
    b.add_peer(ma, a.invite(mb))  # type: ignore[attr-defined]
    return a, b, src, dst, name_b


@pytest.mark.timeout(120)
class TestInProcess:
    pytestmark = needs_nixl

    @pytest.mark.parametrize("pair", ["auto", "prepped", "direct"], indirect=True)
    def test_scattered_write_every_mode(self, pair: tuple[object, ...]) -> None:
        a, b, src, dst, peer = pair
        blk = 16384
        perm = np.random.default_rng(1).permutation(64)
        loc = np.stack([src.ctypes.data + np.arange(64) * blk, np.full(64, blk),  # type: ignore[attr-defined]
                        np.zeros(64, np.int64)], 1)
        rem = np.stack([dst.ctypes.data + perm * blk, np.full(64, blk),  # type: ignore[attr-defined]
                        np.zeros(64, np.int64)], 1)
        for _ in range(2):
            h = a.submit(Op.WRITE, peer, loc, rem, b"w")  # type: ignore[attr-defined]
            assert a.wait(h, 30) is HandleState.DONE, h.error  # type: ignore[attr-defined]
        got = dst.reshape(64, blk)[perm]  # type: ignore[attr-defined]
        np.testing.assert_array_equal(got, src.reshape(64, blk))  # type: ignore[attr-defined]
        stats = a.stats  # type: ignore[attr-defined]
        mode = a.settings.xfer_mode  # type: ignore[attr-defined]
        if mode == "direct":
            assert stats["prepped"] == 0 and stats["direct"] == 2
        else:
            assert stats["prepped"] == 2 and stats["grids"] == 2  # one local, one remote grid

    def test_misaligned_descriptors_fall_back_to_direct(self, pair: tuple[object, ...]) -> None:
        a, b, src, dst, peer = pair
        loc = [[src.ctypes.data + 3, 1001, 0], [src.ctypes.data + 5000, 77, 0]]  # type: ignore[attr-defined]
        rem = [[dst.ctypes.data + 11, 1001, 0], [dst.ctypes.data + 9000, 77, 0]]  # type: ignore[attr-defined]
        a.transfer(Op.WRITE, peer, loc, rem, timeout=30)  # type: ignore[attr-defined]
        assert a.stats["direct"] == 1  # type: ignore[attr-defined]
        np.testing.assert_array_equal(dst[11:1012], src[3:1004])  # type: ignore[index]
        np.testing.assert_array_equal(dst[9000:9077], src[5000:5077])  # type: ignore[index]

    def test_read_with_notification_and_standalone(self, pair: tuple[object, ...]) -> None:
        from kvbridge.testing.peer import collect_notifications

        a, b, src, dst, peer = pair
        dst[:] = 7  # type: ignore[index]
        loc = [[src.ctypes.data, 65536, 0]]  # type: ignore[attr-defined]
        rem = [[dst.ctypes.data + 65536, 65536, 0]]  # type: ignore[attr-defined]
        a.transfer(Op.READ, peer, loc, rem, b"read-done", timeout=30)  # type: ignore[attr-defined]
        assert (src[:65536] == 7).all()  # type: ignore[index]
        a.send_notification(peer, b"hello")  # type: ignore[attr-defined]
        got = collect_notifications(b, 2, 30)  # type: ignore[arg-type]
        assert sorted(m for _, m in got) == [b"hello", b"read-done"]
        assert {n for n, _ in got} == {"pa-auto"}

    def test_empty_transfer_and_errors(self, pair: tuple[object, ...]) -> None:
        from kvbridge.errors import DescriptorError

        a, b, src, dst, peer = pair
        extra = np.zeros(4096, np.uint8)
        with pytest.raises(DescriptorError):
            a.register_memory([MemoryRegion(extra.ctypes.data, 4096, kind="VRAM")])  # type: ignore[attr-defined]
        h = a.submit(Op.WRITE, peer, np.zeros((0, 3), np.int64), np.zeros((0, 3), np.int64))  # type: ignore[attr-defined]
        assert h.state is HandleState.DONE
        with pytest.raises(UnknownPeer):
            a.send_notification("nobody", b"x")  # type: ignore[attr-defined]
        with pytest.raises(MessageError):
            a.add_peer(b"\x00", b.invite())  # type: ignore[attr-defined]


# -- a peer process that vanishes -------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tls", ["", "tcp"])
def test_vanished_peer_fails_not_hangs(
    transports: list[object], tls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not HAVE_NIXL:
        pytest.skip("the nixl package is not installed")
    from kvbridge.testing.peer import PeerProcess

    env = {"UCX_NET_DEVICES": "lo", **({"UCX_TLS": tls} if tls else {})}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = _make(transports, f"vanish-{tls or 'default'}")
    buf = np.zeros(1 << 20, np.uint8)
    meta = a.register_memory([MemoryRegion(buf.ctypes.data, buf.nbytes)])  # type: ignore[attr-defined]
    with PeerProcess("nixl", {}, env, timeout=60) as peer:
        mem = peer.setup(1, 16, 65536, 3)
        name = a.add_peer(mem.metadata, peer.invite(meta))  # type: ignore[attr-defined]
        peer.add_peer(meta, a.invite(mem.metadata))  # type: ignore[attr-defined]
        loc, rem = [[buf.ctypes.data, 65536, 0]], [[mem.layout.planes[0].base, 65536, 0]]
        a.transfer(Op.READ, name, loc, rem, timeout=30)  # type: ignore[attr-defined]
        peer.kill()
    t0 = time.monotonic()
    outcome: str
    try:
        h = a.submit(Op.READ, name, loc, rem)  # type: ignore[attr-defined]
        outcome = a.wait(h, 60).value  # type: ignore[attr-defined]
    except (TransferFailed, PeerUnreachable) as exc:
        outcome = f"raised {type(exc).__name__}"
    assert outcome in ("failed", "raised TransferFailed", "raised PeerUnreachable"), outcome
    assert time.monotonic() - t0 < 60


# -- raw bench ---------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_raw_bench_moves_and_checks_bytes() -> None:
    if not HAVE_NIXL:
        pytest.skip("the nixl package is not installed")
    from kvbridge_nixl.bench import raw_bench

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    for op in ("read", "WRITE"):
        gbps = raw_bench(65536, 4 << 20, op, 2)
        assert gbps > 0.01
    with pytest.raises(ConfigError):
        raw_bench(65536, 4 << 20, "copy", 1)


@pytest.mark.timeout(180)
def test_raw_session_alternates_ops_and_sizes_and_verifies() -> None:
    """The paired bench's raw column: one session, one target, any op and block size in any
    order; verify() compares both buffers and catches a wrong byte."""
    from kvbridge_nixl.bench import raw_session

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with raw_session(4 << 20, seed=5) as session:
        for op in ("read", "write", "read"):
            for block in (65536, 262144):
                session.reset(op, block)  # zeroes the destination: verify proves the copy
                assert session.run(op, block) > 0
                session.verify(op, block)
        session._mine[0] ^= 0xFF  # noqa: SLF001 - corrupt one byte on purpose
        with pytest.raises(TransferFailed, match="bytes differ"):
            session.verify("read", 262144)
        with pytest.raises(ConfigError):
            session.run("copy", 65536)
        with pytest.raises(ConfigError):
            session.run("read", 8 << 20)


@pytest.mark.timeout(180)
def test_raw_session_prepared_ahead_moves_the_bytes() -> None:
    """``--ahead``'s raw column: prepare() makes the request, run() posts that one; a request
    prepared for another op or size is released, not posted."""
    from kvbridge_nixl.bench import raw_session

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with raw_session(4 << 20, seed=6) as session:
        for op in ("read", "write"):
            session.reset(op, 65536)
            session.prepare(op, 65536)
            assert session._pending is not None  # noqa: SLF001
            assert session.run(op, 65536) > 0 and session._pending is None  # noqa: SLF001
            session.verify(op, 65536)
        session.prepare("write", 65536)
        session.reset("read", 262144)
        assert session.run("read", 262144) > 0  # not the WRITE prepared above
        session.verify("read", 262144)
        session.prepare("read", 65536)  # left pending: close() releases it


@pytest.mark.timeout(180)
def test_shared_raw_session_moves_the_callers_buffers_at_its_permutation() -> None:
    """The raw column over kvbridge's own buffers: a responder over the far buffer, the
    session over the caller's READ and WRITE buffers, blocks at the permutation given."""
    from kvbridge_nixl.bench import raw_responder, raw_session

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    total, block = 1 << 20, 65536
    rng = np.random.default_rng(3)
    far = rng.integers(0, 256, total, dtype=np.uint8)
    into, out = np.zeros(total, np.uint8), rng.integers(0, 256, total, dtype=np.uint8)
    perm = rng.permutation(total // block).astype(np.int64)
    responder = raw_responder(int(far.ctypes.data), total)
    with raw_session(total, peer=(responder.metadata, int(far.ctypes.data)),
                     local={"read": int(into.ctypes.data), "write": int(out.ctypes.data)}) as s:
        assert s.shared
        assert s.run("read", block, perm=perm) > 0
        np.testing.assert_array_equal(into.reshape(-1, block), far.reshape(-1, block)[perm])
        s.prepare("write", block, perm=perm)
        assert s.run("write", block, perm=perm) > 0
        np.testing.assert_array_equal(far.reshape(-1, block)[perm], out.reshape(-1, block))
        with pytest.raises(ConfigError, match="permutation"):
            s.run("read", 2 * block)  # a shared session has no permutation of its own
        with pytest.raises(ConfigError, match="the bench zeroes and checks"):
            s.reset("read", block)
        with pytest.raises(ConfigError, match="the bench zeroes and checks"):
            s.verify("read", block)
    assert responder.drain() == 1  # the WRITE's notification
    responder.close()
    with pytest.raises(ConfigError, match="both peer and local"):
        raw_session(total, peer=(b"x", 1))


@pytest.mark.timeout(300)
def test_transfer_bench_ahead_posts_requests_built_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvbridge bench transfer --ahead`` over NIXL: every byte checked, both columns built
    ahead, and kvbridge's timed transfers were the prepared requests."""
    if not HAVE_NIXL:
        pytest.skip("the nixl package is not installed")
    from kvbridge.tools.bench import transfer as bench
    from kvbridge_nixl.transport import NixlTransport

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    made: list[NixlTransport] = []
    real_init = NixlTransport.__init__

    def spy(self: NixlTransport, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(NixlTransport, "__init__", spy)
    report = bench.run_transfer_bench("nixl", 4 << 20, [65536], reps=3, ahead=True)
    assert report.ahead and report.raw_ahead and report.to_dict()["ahead"] is True
    assert report.raw_shared and report.to_dict()["raw_shared"] is True  # kvbridge's buffers
    assert [r.op for r in report.rows] == ["read", "write"]
    assert all(r.raw_gbps and r.kvbridge_gbps > 0 for r in report.rows)
    stats = made[0].stats  # the initiator's: one request built ahead per kvbridge transfer
    assert stats["block_prepared_ahead"] == 2 * (3 + 1)  # reps + warm-up, READ and WRITE
    assert "kvbridge and raw" in bench.format_transfer_report(report)

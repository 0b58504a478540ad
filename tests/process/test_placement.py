"""kvbridge.host.placement: where a rank runs; the warning for a P and a D on one shared core."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbridge.errors import MessageError
from kvbridge.host.placement import DOCS, fleet_cores, local_placement, shared_core_warning
from kvbridge.layout import LayoutWire, PlaneWire
from kvbridge.messages import MAX_PLACEMENT_CORES, Codec, EngineInfo, HelloReply, Placement
from kvbridge.transport import Capabilities

INFO = EngineInfo(
    engine_id="engine-p", generation="gen-1", rank=0, tp_size=1, backend="nixl",
    agent="engine-p:gen-1:0", transport_metadata=b"meta",
    layout=LayoutWire(planes=[PlaneWire("l0#0", 4096, 128, 128)],
                                                  num_blocks=8, block_size=16, dtype="bfloat16"),
    layout_fingerprint="0123456789abcdef", control_address="tcp://127.0.0.1:5555",
)


def _info(backend: str = "nixl", host: str = "boot-a", cores: tuple[int, ...] = (0,),
          engine_id: str = "engine-p") -> EngineInfo:
    import msgspec

    return msgspec.structs.replace(INFO, backend=backend, engine_id=engine_id,
                                   placement=Placement(host=host, cores=cores))


def test_local_placement_is_this_host_and_this_threads_cores() -> None:
    got = local_placement()
    assert got is not None
    assert got.host == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert got.cores == tuple(sorted(os.sched_getaffinity(0)))


def test_a_thread_pinned_to_one_core_reports_it_and_its_process_cores() -> None:
    """What a vLLM CPU worker given cores 0-1 looks like (issue 33): its main thread, and the
    transfer threads started after it, are pinned to core 0 while the process runs on both."""
    import threading

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    got: list[object] = []

    def pinned() -> None:
        os.sched_setaffinity(0, {cpus[0]})
        got.append(local_placement())

    t = threading.Thread(target=pinned)
    t.start()
    t.join(10)
    placement = got[0]
    assert isinstance(placement, Placement)
    assert placement.cores == (cpus[0],)
    assert set(cpus) <= set(placement.process_cores)


def test_local_placement_unknown_without_a_boot_id(tmp_path: Path) -> None:
    assert local_placement(str(tmp_path / "missing")) is None
    (tmp_path / "empty").write_text("")
    assert local_placement(str(tmp_path / "empty")) is None


UNSAFE, SAFE = Capabilities(shared_core_safe=False), Capabilities()


@pytest.mark.parametrize(("mine", "theirs", "caps", "warns"), [
    (_info(), _info(engine_id="engine-d"), UNSAFE, True),  # one host, both on core 0
    (_info(), _info(cores=(1,)), UNSAFE, False),  # disjoint cores
    (_info(), _info(host="boot-b"), UNSAFE, False),  # another host
    (_info(cores=(0, 1)), _info(), UNSAFE, False),  # one side may run elsewhere: no livelock seen
    (_info(), _info(cores=(0, 1)), UNSAFE, False),
    (_info(backend="shm"), _info(backend="shm"), SAFE, False),  # a transport that copes
])
def test_shared_core_warning_only_for_an_unsafe_transport_and_one_shared_core(
        mine: EngineInfo, theirs: EngineInfo, caps: Capabilities, warns: bool) -> None:
    warning = shared_core_warning(mine, theirs, "nixl", caps)
    assert bool(warning) == warns
    if warning:
        assert "core (0)" in warning and theirs.engine_id in warning and DOCS in warning
        assert "the nixl transport" in warning


def test_the_warning_says_why_a_rank_given_more_cores_is_on_one() -> None:
    import msgspec

    wide = msgspec.structs.replace(
        _info(), placement=Placement(host="boot-a", cores=(0,), process_cores=(0, 1)))
    warning = shared_core_warning(_info(engine_id="engine-d"), wide, "nixl", UNSAFE)
    assert warning is not None and "same single core (0)" in warning
    assert "its process may use cores 0-1" in warning
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in warning
    plain = shared_core_warning(_info(engine_id="engine-d"), _info(), "nixl", UNSAFE)
    assert plain is not None and "process may use" not in plain  # an older peer: nothing said


def test_only_nixl_is_not_shared_core_safe() -> None:
    from kvbridge.transports.memory import MemoryTransport
    from kvbridge.transports.shm import ShmTransport

    assert MemoryTransport.capabilities.shared_core_safe
    assert ShmTransport.capabilities.shared_core_safe
    pytest.importorskip("nixl")
    from kvbridge_nixl import NixlTransport

    assert not NixlTransport.capabilities.shared_core_safe


def test_shared_core_warning_needs_both_placements() -> None:
    import msgspec

    bare = msgspec.structs.replace(INFO, backend="nixl")  # an older engine: no placement
    assert bare.placement is None
    assert shared_core_warning(bare, _info(), "nixl", UNSAFE) is None
    assert shared_core_warning(_info(), bare, "nixl", UNSAFE) is None


def test_placement_round_trips_and_an_older_peer_without_it_decodes() -> None:
    import msgspec

    codec = Codec()
    reply = HelloReply(info=_info(cores=(2, 3)))
    assert codec.decode(codec.encode(reply)) == reply
    wide = msgspec.structs.replace(
        INFO, placement=Placement(host="b", cores=(2,), process_cores=(2, 3)))
    assert codec.decode(codec.encode(HelloReply(info=wide))).info == wide
    assert codec.decode(codec.encode(HelloReply(info=INFO))).info.placement is None


@pytest.mark.parametrize(("placement", "field"), [
    (Placement(host="x" * 65, cores=(0,)), "host"),  # oversized host
    (Placement(host="boot", cores=(-1,)), "cores"),  # forged: negative core
    (Placement(host="boot", cores=(1 << 21,)), "cores"),  # forged: absurd core number
    (Placement(host="boot", cores=tuple(range(MAX_PLACEMENT_CORES + 1))), "cores"),  # oversized
    (Placement(host=7, cores=(0,)), "host"),  # type: ignore[arg-type]  # malformed
    (Placement(host="boot", cores=(0,), process_cores=(-3,)), "process_cores"),
])
def test_hostile_placement_is_refused_naming_the_field(placement: Placement, field: str) -> None:
    import msgspec

    codec = Codec()
    data = codec.encode(HelloReply(info=msgspec.structs.replace(INFO, placement=placement)))
    with pytest.raises(MessageError, match=field):
        codec.decode(data)


def test_the_peer_table_logs_the_warning_once_per_handshake(
        caplog: pytest.LogCaptureFixture) -> None:
    from kvbridge.layout import KVLayout
    from kvbridge.scheduling.peers import PeerTable

    them = _info(engine_id="engine-p")
    nixl_like = SimpleNamespace(name="nixl", capabilities=UNSAFE)  # only these two are read
    table = PeerTable(_info(engine_id="engine-d"), nixl_like, None,  # type: ignore[arg-type]
                      lambda fn, *args: fn(*args), timeout=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge.peers"):
            table._added("tcp://127.0.0.1:1", them, KVLayout.from_wire(them.layout), "p")
            table._added("tcp://127.0.0.1:2", _info(cores=(1,)),
                         KVLayout.from_wire(them.layout), "q")
    finally:
        table.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "same single core (0)" in warnings[0], warnings


@pytest.mark.parametrize(("cpus", "prefill", "decode", "want"), [
    ([0, 1], 1, 1, ([0], [1])),
    ([0, 1], 2, 2, ([0, 0], [1, 1])),
    ([4, 5, 6, 7], 2, 2, ([4, 5], [6, 7])),
    ([0, 1, 2, 3], 3, 1, ([0, 1, 2], [3])),  # D keeps at least one core
    ([0, 1, 2, 3], 1, 3, ([0], [1, 2, 3])),  # and so does P
    ([0, 1, 2], 4, 2, ([0, 1, 0, 1], [2, 2])),
    ([3], 2, 1, ([3, 3], [3])),  # one core: no choice
])
def test_fleet_cores_never_puts_a_prefill_and_a_decode_on_one_core(
        cpus: list[int], prefill: int, decode: int, want: tuple[list[int], list[int]]) -> None:
    got = fleet_cores(cpus, prefill, decode)
    assert got == want
    if len(cpus) > 1:
        assert not set(got[0]) & set(got[1])


@pytest.mark.parametrize(("cpus", "prefill", "decode"), [([], 1, 1), ([0, 1], 0, 1),
                                                          ([0, 1], 1, 0)])
def test_fleet_cores_refuses_an_empty_host_or_role(cpus: list[int], prefill: int,
                                                    decode: int) -> None:
    with pytest.raises(ValueError, match="fleet_cores needs"):
        fleet_cores(cpus, prefill, decode)

"""The ``mooncake_store`` offload tier against a real ``mooncake_master`` on 127.0.0.1.

The conformance suite runs on real store clients (two of them in this process for the namespace
test). Beyond it: chunks cross between engines in different processes byte-exactly (and vanish
with the engine whose segment held them); short, long and corrupted objects are misses that are
logged and removed; a dead master is a clear :class:`TierError` within seconds, at start-up and
mid-session. Every master and engine process is killed by the test that started it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge import registry
from kvbridge.errors import BackendUnavailable, ConfigError
from kvbridge.offload.tier import Tier, TierContext, TierError
from kvbridge.testing.conformance import CHUNK, TierConformance, chunk_of
from kvbridge.tools.mooncake_master import (  # noqa: F401 - the fixture
    MooncakeMaster,
    free_port,
    mooncake_master,
)

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                       reason="mooncake is not installed (pip install "
                              "mooncake-transfer-engine-non-cuda)"),
]

NAME = "mooncake_store"


def _options(master: MooncakeMaster, **extra: Any) -> dict[str, Any]:
    return {"master": master.master_address, "metadata_url": master.metadata_url,
            "global_segment_bytes": 32 << 20, "local_buffer_bytes": "8MiB",
            "batch_bytes": 256 << 10, **extra}  # 62 chunks per batch: many keys span batches


def _tier(options: dict[str, Any], ns: str | None = None) -> Tier:
    cls = registry.load_tier_class(NAME)
    tier: Tier = cls(TierContext(NAME, CHUNK, ns or uuid.uuid4().hex, options))
    return tier


def _keys(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


class TestMooncakeStoreConformance(TierConformance):
    tier_name = NAME

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_master: MooncakeMaster) -> None:  # noqa: F811
        self.master = mooncake_master

    def options(self, tmp_path: Path) -> dict[str, Any]:
        return _options(self.master)

    def corrupt(self, tier: Tier, key: str) -> bool:
        client, name = tier._client, tier._key(key)  # type: ignore[attr-defined]
        blob = bytearray(client.get(name))
        blob[-100] ^= 0x5A
        assert client.upsert(name, bytes(blob)) == 0
        return True


# -- what the conformance suite does not cover ---------------------------------------------


@pytest.fixture
def tier(mooncake_master: MooncakeMaster) -> Iterator[Tier]:  # noqa: F811
    t = _tier(_options(mooncake_master))
    yield t
    t.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [10, CHUNK, CHUNK + 16 + 1, CHUNK + 4096])
def test_odd_sized_object_is_a_miss_logged_and_removed(tier: Tier, size: int,
                                                       caplog: Any) -> None:
    a, b = _keys(2)
    assert tier.store([(a, chunk_of(a)), (b, chunk_of(b))]) == [a, b]
    client, name = tier._client, tier._key(b)  # type: ignore[attr-defined]
    assert client.upsert(name, b"\x07" * size) == 0  # another writer, another format
    assert [bytes(x) for x in tier.load([a, b])] == [chunk_of(a)]
    assert "corrupted" in caplog.text and name in caplog.text
    assert tier.contains([b]) == 0  # removed


@pytest.mark.timeout(60)
def test_object_names_carry_the_namespace(tier: Tier) -> None:
    (k,) = _keys(1)
    tier.store([(k, chunk_of(k))])
    client = tier._client  # type: ignore[attr-defined]
    assert client.is_exist(f"kvb/{tier.ctx.namespace}/{k}") == 1
    assert client.is_exist(k) == 0
    assert not tier.managed and tier.blocking
    assert tier.master in tier.describe()  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_operations_after_close_raise_a_tier_error(mooncake_master: MooncakeMaster  # noqa: F811
                                                   ) -> None:
    t = _tier(_options(mooncake_master))
    t.close()
    with pytest.raises(TierError, match="closed"):
        t.contains(_keys(1))


def test_master_and_metadata_url_are_required(monkeypatch: Any) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_TE_META_DATA_SERVER", raising=False)
    with pytest.raises(ConfigError, match="'master'"):
        _tier({"metadata_url": "http://127.0.0.1:1/metadata"})
    with pytest.raises(ConfigError, match="'metadata_url'"):
        _tier({"master": "127.0.0.1:1"})
    with pytest.raises(ConfigError, match="host:port"):
        _tier({"master": "nonsense", "metadata_url": "P2PHANDSHAKE"})
    with pytest.raises(ConfigError, match="global_segment_bytes"):
        _tier({"master": "127.0.0.1:1", "metadata_url": "P2PHANDSHAKE",
               "global_segment_bytes": "lots"})


def test_missing_mooncake_is_backend_unavailable_with_the_install_hint(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if not installed
    with pytest.raises(BackendUnavailable, match="pip install mooncake-transfer-engine"):
        _tier({"master": "127.0.0.1:1", "metadata_url": "P2PHANDSHAKE"})



def test_status_says_not_loadable_when_mooncake_store_does_not_import(monkeypatch: Any) -> None:
    """``kvbridge backends`` / the doctor: loadable only where ``mooncake.store`` imports."""
    assert {r.name: r for r in registry.tier_status()}["mooncake_store"].loadable
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if not installed
    row = {r.name: r for r in registry.tier_status()}["mooncake_store"]
    assert not row.loadable and "pip install mooncake-transfer-engine" in row.detail

@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["killed", "never_started"])
def test_dead_master_is_a_clear_tier_error_within_seconds(how: str) -> None:
    if how == "killed":
        with MooncakeMaster() as m:
            options = {"master": m.master_address, "metadata_url": m.metadata_url}
    else:
        options = {"master": f"127.0.0.1:{free_port()}",
                   "metadata_url": f"http://127.0.0.1:{free_port()}/metadata"}
    started = time.monotonic()
    with pytest.raises(TierError) as info:
        _tier({**options, "connect_timeout_s": 2})
    assert time.monotonic() - started < 10
    text = str(info.value)
    assert "mooncake_store" in text and options["master"] in text and "unreachable" in text


# -- other engines: separate processes -----------------------------------------------------

ENGINE = r"""
import json, os, sys, time
from kvbridge.offload.tier import TierContext
from kvbridge.testing.conformance.tier import chunk_of
from kvbridge_mooncake.store import MooncakeStoreTier

cfg = json.loads(sys.argv[1])
tier = MooncakeStoreTier(TierContext("mooncake_store", cfg["chunk"], cfg["ns"], cfg["options"]))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd, keys = json.loads(line)
    t0 = time.monotonic()
    if cmd == "load":
        got = tier.load(keys)
        out = {"exact": sum(bytes(g) == chunk_of(k, cfg["chunk"]) for k, g in zip(keys, got)),
               "n": len(got)}
    elif cmd == "contains":
        out = {"n": tier.contains(keys)}
    elif cmd == "store":
        out = {"stored": tier.store([(k, chunk_of(k, cfg["chunk"])) for k in keys])}
    elif cmd == "exit":       # like a crash: no close
        os._exit(0)
    else:
        break
    out["s"] = time.monotonic() - t0
    print(json.dumps(out), flush=True)
tier.close()
"""


class Engine:
    """A tier instance in another process, driven over stdin/stdout (one JSON line each)."""

    def __init__(self, tmp_path: Path, ns: str, options: dict[str, Any]) -> None:
        script = tmp_path / "engine.py"
        script.write_text(ENGINE)
        self.err = tmp_path / f"engine-{uuid.uuid4().hex[:8]}.log"
        cfg = json.dumps({"chunk": CHUNK, "ns": ns, "options": options})
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(script), cfg], text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, start_new_session=True)
        assert self._reply(30).get("ready"), self.log()

    def log(self) -> str:
        return "\n".join(self.err.read_text(errors="replace").splitlines()[-15:])

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"engine process gave no answer in {timeout} s:\n{self.log()}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, cmd: str, keys: list[str] | None = None, timeout: float = 30) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([cmd, keys or []]) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout) if cmd not in ("quit", "exit") else {}

    def stop(self, timeout: float = 30) -> None:
        """Ask it to close its tier and exit; kill its group if it does not."""
        try:
            if self.proc.poll() is None:
                self.ask("quit")
                self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired, AssertionError):
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)


@pytest.mark.timeout(90)
def test_shared_by_engines_in_other_processes(tmp_path: Path,
                                              mooncake_master: MooncakeMaster  # noqa: F811
                                              ) -> None:
    ns = uuid.uuid4().hex
    options = _options(mooncake_master)
    mine, theirs = _keys(8), _keys(70)  # theirs spans two batches
    writer = _tier(options, ns)
    reader = _tier({**options, "global_segment_bytes": 0}, ns)  # contributes no memory
    other = Engine(tmp_path, ns, options)
    try:
        assert writer.store([(k, chunk_of(k)) for k in mine]) == mine
        assert other.ask("load", mine)["exact"] == 8  # this process -> the other one
        writer.close()  # from now on the other engine's segment is the only one
        assert other.ask("store", theirs)["stored"] == theirs
        assert reader.contains(theirs) == 70
        got = reader.load(theirs)  # the other process -> this one, byte-exact
        assert [bytes(g) for g in got] == [chunk_of(k) for k in theirs]
        other.stop()
        assert other.proc.returncode == 0, other.log()
        # its segment went with it: a miss, never stale bytes
        deadline = time.monotonic() + 10
        while reader.contains(theirs[:1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.contains(theirs) == 0 and reader.load(theirs) == []
    finally:
        other.stop()
        writer.close()
        reader.close()


@pytest.mark.timeout(90)
def test_master_dying_mid_session_is_a_miss_and_a_failed_store(tmp_path: Path) -> None:
    ns = uuid.uuid4().hex
    with MooncakeMaster() as m:  # its own master: this test kills it
        engine = Engine(tmp_path, ns, _options(m))
        try:
            k = _keys(3)
            assert engine.ask("store", k)["stored"] == k
            m.stop()
            contains, load = engine.ask("contains", k), engine.ask("load", k)
            assert contains["n"] == 0 and load["n"] == 0
            assert contains["s"] < 5 and load["s"] < 5
            store = engine.ask("store", _keys(1))
            assert store["stored"] == [] and store["s"] < 20
            assert "failed with -900 RPC_FAIL" in engine.log()
            engine.ask("exit")  # close() would wait ~13 s for the dead master
            engine.proc.wait(timeout=10)
        finally:
            engine.stop()

"""Warm successors on real vLLM engines: a draining engine writes its hot chunks into a shared
disk tier, and its successor's first requests for those prompts load them.

Engine A (``dram`` + a ``disk`` tier that is ``drain_only``: every store skips it, so without
the drain's write-out a successor would find nothing) serves two prompts; a hostile process of
the same user without the fleet secret sends forged and unauthenticated ``DrainNotice`` frames
(dropped: nothing is written); then the drain notice the proxy's ``/admin/drain`` sends, with a
write-out budget of one prompt's chunks: the most recent prompt is written, the other is not
(the control). A stops; B (same model, same disk directory, same secret) gets both prompts:
the written one hits the disk tier, the other is recomputed, and both outputs equal A's first,
tier-less computation (the single-engine greedy reference). B then stops on SIGTERM alone,
and its shutdown writes the older prompt out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge import trust
from kvbridge.control import ControlClient
from kvbridge.messages import Ack, Codec, DrainNotice
from kvbridge.offload.seal import sealed_size
from kvbridge.tools.client import complete, engine_stats, output_token_ids, wait_stats
from kvbridge.tools.engines import VllmServer, free_port
from kvbridge.tools.tiny_model import build_tiny_model, random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 2 * 2 * BLOCK * 2 * 32 * 4  # layers × K/V × block × kv heads × head dim × fp32
SECRET = "warm-successor-fleet-secret-0123456789"
PROMPTS = random_prompts(2, 200, seed=131)  # 6 full blocks each

HOSTILE = r"""
import sys
from kvbridge.control import ControlClient
from kvbridge.errors import PeerUnreachable
from kvbridge.messages import Codec, DrainNotice
for key in (b"not the fleet secret, same user though", None):
    try:
        ControlClient(Codec(key), 2.0).request(sys.argv[1], DrainNotice(), 2.0)
    except PeerUnreachable:
        continue
    sys.exit("the engine answered a forged DrainNotice")
"""


def start(model: str, disk: Path, logs: Path, ctl_port: int, name: str) -> VllmServer:
    offload = {"tiers": [{"name": "dram", "capacity_bytes": 24 * CHUNK},
                         {"name": "disk", "path": str(disk), "capacity_bytes": 48 * CHUNK,
                          "drain_only": True}],
               "drain_write_bytes": 6 * sealed_size(CHUNK)}
    kv = {"kv_connector": "KVBridgeConnector", "kv_role": "kv_both", "engine_id": f"warm-{name}",
          "kv_connector_extra_config": {"backend": "shm", "side_channel_port": ctl_port,
                                        "offload": offload}}
    server = VllmServer(model, name=f"warm-{name}", port=free_port(), kv_transfer_config=kv,
                        cpu_bind="0", env={"KVBRIDGE_SECRET": SECRET,
                                           "KVBRIDGE_ENGINE_SPIN_MS": "2"},
                        extra_args=["--block-size", str(BLOCK), "--shutdown-timeout", "20"],
                        log_path=logs / f"{name}.log")
    return server.start().wait_ready(600)


def run(server: VllmServer, prompt: list[int]) -> list[int]:
    out = output_token_ids(complete(server.url, prompt, 8, extra={"ignore_eos": True},
                                    timeout=120))
    assert out is not None
    return out


def test_a_drained_engines_hot_prompts_load_from_the_shared_tier_on_its_successor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_SECRET", SECRET)  # engine_stats talks with the fleet secret
    model, disk = str(build_tiny_model()), tmp_path / "shared-disk"
    disk.mkdir()
    ctl_a, ctl_b = free_port(), free_port()
    a = start(model, disk, tmp_path, ctl_a, "a")
    addr_a = f"tcp://127.0.0.1:{ctl_a}"
    try:
        old, hot = PROMPTS
        refs = {0: run(a, old), 1: run(a, hot)}  # the references: nothing in any tier yet
        stats = wait_stats(addr_a, "offload_stored_blocks_dram", 12)
        assert stats.get("offload_stored_blocks_disk", 0) == 0  # drain_only: stores skip it
        # a hostile process of this user, without the fleet secret: dropped, nothing written
        hostile = subprocess.run([sys.executable, "-c", HOSTILE, addr_a], capture_output=True,
                                 text=True, timeout=60)
        assert hostile.returncode == 0, hostile.stderr
        stats = engine_stats(addr_a)
        assert stats.get("control_dropped_auth", 0) + stats.get(
            "control_dropped_malformed", 0) >= 2
        assert stats.get("drain_notices", 0) == 0 and not list(disk.rglob("*.kvb"))
        # what the proxy's /admin/drain sends every rank
        client = ControlClient(Codec(trust.for_tools(SECRET).secret), 10.0)
        assert client.request(addr_a, DrainNotice(), 10.0) == Ack(ok=True)
        stats = wait_stats(addr_a, "offload_drain_written_blocks_disk", 6)
        assert stats["offload_drain_written_blocks_disk"] == 6  # the budget: one prompt
        assert stats.get("offload_drain_failed_disk", 0) == 0
        assert len(list(disk.rglob("*.kvb"))) == 6
        client.close()
    finally:
        a.stop()
    b = start(model, disk, tmp_path, ctl_b, "b")
    addr_b = f"tcp://127.0.0.1:{ctl_b}"
    try:
        before = engine_stats(addr_b)
        assert run(b, hot) == refs[1]
        after = engine_stats(addr_b)
        assert after.get("offload_hit_blocks_disk", 0) - before.get(
            "offload_hit_blocks_disk", 0) == 6
        assert after.get("offload_loaded_blocks", 0) - before.get("offload_loaded_blocks", 0) == 6
        # the control: the older prompt was past the write-out's budget, so B computes it
        assert run(b, old) == refs[0]
        final = engine_stats(addr_b)
        assert final.get("offload_loaded_blocks", 0) == after.get("offload_loaded_blocks", 0)
        assert final.get("offload_load_failed", 0) == 0
    finally:
        b.stop()
    # SIGTERM without a drain notice: the worker's shutdown writes out (B's dram holds the
    # older prompt now, the one its shared tier lacks)
    assert len(list(disk.rglob("*.kvb"))) == 12

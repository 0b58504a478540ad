"""kvbridge's stats in vLLM's shape, without an engine: observations on a rank, the payload
vLLM carries across processes (hostile input refused), the log line, and the Prometheus series
in a private ``prometheus_client`` registry."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from prometheus_client.utils import floatToGoString  # noqa: E402

from kvbridge.integrations import vllm as kvb_vllm  # noqa: E402
from kvbridge.integrations.vllm_stats import (  # noqa: E402
    EXPORTED,
    MAX_LABEL_SETS,
    KVBridgePromMetrics,
    KVBridgeStats,
    delta,
)
from kvbridge.scheduling.observations import MAX_PEERS, MAX_SAMPLES, OTHER, Observations  # noqa: E402,E501
from kvbridge.scheduling.recorder import Recorder  # noqa: E402

ENGINE0 = {"model_name": "tiny", "engine": "0"}


def test_observations_are_bounded() -> None:
    obs = Observations("shm")
    for i in range(MAX_PEERS + 5):
        obs.admit(f"P-{i}")  # each handshaken in turn
        obs.transfer("pull", f"P-{i}", True, 0.001, 4096, 2)
    obs.handoff("push", "P-0", 0.002, backend="nixl")
    got = obs.drain()
    peers = {s[2] for s in got["transfers"]}
    assert len(peers) == MAX_PEERS + 1 and OTHER in peers  # the 17th peer on is "other"
    assert got["handoffs"] == [["push", "nixl", "P-0", 0.002]]
    assert obs.drain() == {}
    for _ in range(MAX_SAMPLES + 10):
        obs.transfer("push", "P-0", False, -1.0, 1, 1)
    got = obs.drain()
    assert len(got["transfers"]) == MAX_SAMPLES and got["dropped"] == 10
    assert got["transfers"][0][3] == "failed" and got["transfers"][0][4] == 0.0


def test_stats_aggregate_and_refuse_junk() -> None:
    a = KVBridgeStats({"counters": {"pull_bytes": 5, "junk": "x", "neg": -1, "flag": True}})
    assert a.counters == {"pull_bytes": 5}
    b = KVBridgeStats({"counters": {"pull_bytes": 2, "recv_ok": 1},
                       "transfers": [["pull", "shm", "P", "ok", 0.002, 8192, 4]],
                       "handoffs": [["pull", "shm", "P", 0.004]]})
    merged = a.aggregate(b)
    assert isinstance(merged, KVBridgeStats)
    line = merged.reduce()
    assert line["pull_bytes"] == 7 and line["recv_ok"] == 1
    assert line["transfers"] == 1 and line["transfer_ms_p50"] == 2.0
    assert line["handoffs"] == 1 and line["handoff_ms_p50"] == 4.0
    assert KVBridgeStats(None).is_empty() and KVBridgeStats({"counters": "nope"}).is_empty()
    a.reset()
    assert a.is_empty()
    rebuilt = kvb_vllm.KVBridgeConnector.build_kv_connector_stats(b.to_dict())
    assert isinstance(rebuilt, KVBridgeStats) and rebuilt.data == b.data
    assert delta({"a": 5, "b": 1, "c": 3}, {"a": 2, "b": 1}) == {"a": 3, "c": 3}


@pytest.mark.parametrize("sample", [
    ["pull", "shm", "P", "ok", 0.1, 10],  # too short
    ["teleport", "shm", "P", "ok", 0.1, 10, 1],  # unknown mode
    ["pull", "shm", "P", "meh", 0.1, 10, 1],  # unknown outcome
    ["pull", "", "P", "ok", 0.1, 10, 1],  # empty label
    ["pull", "shm", 7, "ok", 0.1, 10, 1],  # label not a string
    ["pull", "shm", "P", "ok", float("nan"), 10, 1],
    ["pull", "shm", "P", "ok", -0.5, 10, 1],
    ["pull", "shm", "P", "ok", 0.1, -10, 1],
    ["pull", "shm", "P", "ok", 0.1, 10, True],
    "not a list",
])
def test_malformed_samples_are_dropped(sample: Any) -> None:
    stats = KVBridgeStats({"transfers": [sample, ["push", "shm", "P", "ok", 0.1, 10, 1]]})
    assert len(stats.data["transfers"]) == 1  # only the good one


def test_oversized_payload_is_cut() -> None:
    many = [["pull", "shm", "P" * 500, "ok", 0.1, 1, 1]] * 20000
    stats = KVBridgeStats({"transfers": many, "dropped": "lots"})
    assert len(stats.data["transfers"]) == 8192 and stats.data["dropped"] == 0
    assert len(stats.data["transfers"][0][2]) == 64
    stats.aggregate(KVBridgeStats({"transfers": many[:10], "dropped": 3}))
    assert len(stats.data["transfers"]) == 8192 and stats.data["dropped"] == 13


def _prom() -> tuple[KVBridgePromMetrics, CollectorRegistry]:
    reg = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=reg)
                              for cls in (Counter, Gauge, Histogram)}
    vllm_config: Any = SimpleNamespace(kv_transfer_config=None)
    prom = KVBridgePromMetrics(vllm_config, types, ["model_name", "engine"],
                               {0: ["tiny", "0"], 1: ["tiny", "1"]})
    return prom, reg


def test_prometheus_counters_per_engine() -> None:
    prom, reg = _prom()
    prom.observe({"counters": {"pull_bytes": 4096, "not_exported": 9, "recv_ok": 2}}, 0)
    prom.observe({"counters": {"pull_bytes": 1}}, 1)
    prom.observe({"counters": {"pull_bytes": 1}}, 7)  # an engine index vLLM never declared
    prom.observe({"garbage": 1}, 0)
    sample = functools.partial(reg.get_sample_value, labels=ENGINE0)
    assert sample("vllm:kvbridge_pull_bytes_total") == 4096
    assert sample("vllm:kvbridge_recv_ok_total") == 2
    assert reg.get_sample_value("vllm:kvbridge_pull_bytes_total",
                                {"model_name": "tiny", "engine": "1"}) == 1
    assert sample("vllm:kvbridge_not_exported_total") is None
    assert all(sample(f"vllm:kvbridge_{n}_total") is not None for n in EXPORTED)


def test_prometheus_histograms_by_mode_backend_peer() -> None:
    prom, reg = _prom()
    prom.observe({"transfers": [["pull", "nixl", "P-1", "ok", 0.003, 1 << 20, 64],
                                ["pull", "nixl", "P-1", "failed", 0.5, 4096, 2],
                                ["push", "shm", "P-2", "ok", 0.001, 8192, 4]],
                  "handoffs": [["pull", "nixl", "P-1", 0.01]]}, 0)
    where = {**ENGINE0, "mode": "pull", "backend": "nixl", "peer": "P-1"}
    assert reg.get_sample_value("vllm:kvbridge_transfers_total", {**where, "outcome": "ok"}) == 1
    assert reg.get_sample_value("vllm:kvbridge_transfers_total",
                                {**where, "outcome": "failed"}) == 1
    assert reg.get_sample_value("vllm:kvbridge_transfer_seconds_count", where) == 2
    assert reg.get_sample_value("vllm:kvbridge_transfer_seconds_sum", where) == pytest.approx(
        0.503)
    assert reg.get_sample_value("vllm:kvbridge_transfer_bytes_bucket",
                                {**where, "le": floatToGoString(float(1 << 20))}) == 2
    assert reg.get_sample_value("vllm:kvbridge_transfer_descriptors_sum", where) == 66
    assert reg.get_sample_value("vllm:kvbridge_handoff_seconds_count", where) == 1
    push = {**ENGINE0, "mode": "push", "backend": "shm", "peer": "P-2"}
    assert reg.get_sample_value("vllm:kvbridge_transfer_seconds_count", push) == 1


def test_label_sets_are_bounded() -> None:
    prom, reg = _prom()
    samples = [["pull", "shm", f"P-{i}", "ok", 0.001, 1, 1] for i in range(MAX_LABEL_SETS + 30)]
    prom.observe({"transfers": samples}, 0)
    other = {**ENGINE0, "mode": "pull", "backend": "shm", "peer": "other", "outcome": "ok"}
    assert reg.get_sample_value("vllm:kvbridge_transfers_total", other) == 30
    names = {s.labels.get("peer") for m in reg.collect() for s in m.samples
             if s.name == "vllm:kvbridge_transfers_total"}
    assert len(names) == MAX_LABEL_SETS + 1


def test_peer_labels_only_for_admitted_peers() -> None:
    """Issue 25 item 5: ids seen in messages before any handshake do not take the labels."""
    obs = Observations("shm")
    for i in range(MAX_PEERS + 5):  # junk ids from registrations/claims: never handshaken
        obs.transfer("push", f"junk-{i}", False, 0.001, 1, 1)
        obs.event("push_failed", "push", f"junk-{i}")
    obs.admit("P-real")
    obs.admit("P-real")  # a second handshake takes no second label
    obs.transfer("push", "P-real", True, 0.001, 4096, 2)
    got = obs.drain()
    assert {s[2] for s in got["transfers"][:-1]} == {OTHER}
    assert got["transfers"][-1][2] == "P-real"
    assert got["events"] == [["push_failed", "push", "shm", OTHER, MAX_PEERS + 5]]
    assert obs.peer_label("junk-0") == OTHER and obs.peer_label("P-real") == "P-real"
    for i in range(MAX_PEERS + 5):
        obs.admit(f"P-{i}")
    labelled = {p for p in ["P-real", *(f"P-{i}" for i in range(MAX_PEERS + 5))]
                if obs.peer_label(p) != OTHER}
    assert labelled == {"P-real", *(f"P-{i}" for i in range(MAX_PEERS - 1))}  # first 16


def test_events_are_counted_with_labels_and_refused_when_forged() -> None:
    obs = Observations("nixl")
    obs.admit("P-1")
    obs.event("lease_expired", "push")
    obs.event("lease_expired", "push")
    obs.event("checksum_mismatch", "pull", "P-1", "shm")
    obs.event("made_up_event", "pull")  # not an event kvbridge counts: ignored
    got = sorted(obs.drain()["events"])
    assert got == [["checksum_mismatch", "pull", "shm", "P-1", 1],
                   ["lease_expired", "push", "nixl", "-", 2]]
    stats = KVBridgeStats({"events": [*got, ["forged", "pull", "shm", "P", 1],
                                      ["push_timeout", "pull", "shm", "P", 0],
                                      ["push_timeout", "pull", "shm", "P", True], "x"]})
    assert stats.data["events"] == got and not stats.is_empty()
    prom, reg = _prom()
    prom.observe(stats.data, 0)
    assert reg.get_sample_value("vllm:kvbridge_events_total", {
        **ENGINE0, "mode": "push", "backend": "nixl", "peer": "-",
        "event": "lease_expired"}) == 2
    assert reg.get_sample_value("vllm:kvbridge_events_total", {
        **ENGINE0, "mode": "pull", "backend": "shm", "peer": "P-1",
        "event": "checksum_mismatch"}) == 1


def test_phase_histogram_takes_only_known_phases_from_the_recorder() -> None:
    obs = Observations("shm")
    rec = Recorder(on_phase=obs.phase)
    rec.mark("t", "arrived", when=5.0)
    rec.mark("t", "scheduled", when=5.125)
    data = obs.drain()
    assert data["phases"] == [["queue", pytest.approx(0.125, abs=1e-6)]]
    data["phases"] += [["forged", 1.0], ["wire", -1.0], ["wire", "1"], ["prefill", 0.5, 9],
                       ["prefill", 0.25]]
    stats = KVBridgeStats(data)
    assert [p[0] for p in stats.data["phases"]] == ["queue", "prefill"]
    assert not stats.is_empty()
    prom, reg = _prom()
    prom.observe(stats.data, 0)
    assert reg.get_sample_value("vllm:kvbridge_phase_seconds_count",
                                {**ENGINE0, "phase": "queue"}) == 1
    assert reg.get_sample_value("vllm:kvbridge_phase_seconds_sum",
                                {**ENGINE0, "phase": "prefill"}) == pytest.approx(0.25)
    assert reg.get_sample_value("vllm:kvbridge_phase_seconds_count",
                                {**ENGINE0, "phase": "forged"}) is None

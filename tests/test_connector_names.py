"""One vLLM connector name per backend, and kvbridge's stats in vLLM's shape (no engine needed).

The names are real classes resolved through vLLM's own connector factory; the Prometheus metrics
are real ``prometheus_client`` counters in a private registry.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from importlib.metadata import EntryPoint  # noqa: E402

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvbridge import registry  # noqa: E402
from kvbridge.config import Config  # noqa: E402
from kvbridge.errors import BackendUnavailable, ConfigError  # noqa: E402
from kvbridge.integrations import names  # noqa: E402
from kvbridge.integrations import vllm as kvb_vllm  # noqa: E402
from kvbridge.integrations.vllm_stats import (  # noqa: E402
    EXPORTED,
    KVBridgePromMetrics,
    KVBridgeStats,
    delta,
)


def test_every_builtin_backend_has_a_name() -> None:
    got = {c.name: (c.kind, c.backend) for c in names.connector_names()}
    assert got["KVBridgeNixlConnector"] == ("transport", "nixl")
    assert got["KVBridgeMooncakeConnector"] == ("transport", "mooncake")
    assert got["KVBridgeShmConnector"] == ("transport", "shm")
    assert got["KVBridgeComposeConnector"] == ("transport", "compose")
    assert got["KVBridgeLMCacheConnector"] == ("tier", "lmcache")
    assert got["KVBridgeMooncakeStoreConnector"] == ("tier", "mooncake_store")
    assert "KVBridgeMemoryConnector" not in got  # in-process only: useless as an engine
    assert names.lookup("KVBridgeConnector") is None
    assert names.connector_name("my_fast_link") == "KVBridgeMyFastLinkConnector"


def test_a_plugin_gets_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry._entry_points

    def fake(group: str = registry.GROUP) -> dict[str, Any]:
        extra = {"warp": EntryPoint("warp", "warp_pkg:Warp", group)} if (
            group == registry.GROUP) else {}
        return {**real(group), **extra}

    monkeypatch.setattr(registry, "_entry_points", fake)
    entry = names.lookup("KVBridgeWarpConnector")
    assert entry is not None and entry.backend == "warp" and entry.kind == "transport"


def test_transport_name_fixes_the_backend() -> None:
    preset = names.lookup("KVBridgeNixlConnector").preset()  # type: ignore[union-attr]
    cfg = Config.load({}, env={}, preset=preset)
    assert cfg.backend == "nixl" and cfg.sources["backend"] == "kv_connector KVBridgeNixlConnector"
    assert Config.load({"backend": "nixl"}, env={}, preset=preset).backend == "nixl"
    with pytest.raises(ConfigError, match=r"KVBridgeNixlConnector selects backend 'nixl', but "
                                          r"env KVBRIDGE_BACKEND sets backend 'shm'"):
        Config.load({}, env={"KVBRIDGE_BACKEND": "shm"}, preset=preset)
    with pytest.raises(ConfigError, match="kv_connector_extra_config sets backend 'mooncake'"):
        Config.load({"backend": "mooncake"}, env={}, preset=preset)


def test_tier_name_adds_its_tier() -> None:
    preset = names.lookup("KVBridgeLMCacheConnector").preset()  # type: ignore[union-attr]
    assert [t.name for t in Config.load({}, env={}, preset=preset).offload_config().tiers] == [
        "lmcache"]
    cfg = Config.load({"offload": {"tiers": ["dram"]}}, env={}, preset=preset)
    assert [t.name for t in cfg.offload_config().tiers] == ["dram", "lmcache"]
    assert cfg.backend == "shm"  # the transport stays configurable
    cfg = Config.load({}, env={"KVBRIDGE_OFFLOAD_TIERS": "disk",
                               "KVBRIDGE_OFFLOAD_LMCACHE_CAPACITY_BYTES": "1GiB"}, preset=preset)
    tiers = cfg.offload_config().tiers
    assert [t.name for t in tiers] == ["disk", "lmcache"]
    assert tiers[1].options["capacity_bytes"] == 1 << 30


def test_classes_resolve_through_vllms_factory() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kvb_vllm.register()
    kvb_vllm.register()  # idempotent
    for entry in names.connector_names():
        cls = KVConnectorFactory.get_connector_class_by_name(entry.name)
        assert cls.__name__ == entry.name  # MultiConnector keys child stats by this
        assert issubclass(cls, kvb_vllm.KVBridgeConnector)
        assert cls.preset == entry.preset()
        assert cls is getattr(kvb_vllm, entry.name)  # one class per name
    assert KVConnectorFactory.get_connector_class_by_name(
        "KVBridgeConnector") is kvb_vllm.KVBridgeConnector
    with pytest.raises(AttributeError, match="no kvbridge connector is called"):
        kvb_vllm.KVBridgeNopeConnector  # noqa: B018
    with pytest.raises(ConfigError):
        kvb_vllm.connector_class("KVBridgeNopeConnector")


def test_a_name_whose_backend_cannot_load_fails_with_the_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry._entry_points

    def fake(group: str = registry.GROUP) -> dict[str, Any]:
        eps = dict(real(group))
        if group == registry.GROUP:
            eps["nixl"] = EntryPoint("nixl", "kvbridge_no_such_nixl_xyz:T", group)
        return eps

    monkeypatch.setattr(registry, "_entry_points", fake)
    preset = names.lookup("KVBridgeNixlConnector").preset()  # type: ignore[union-attr]
    cfg = Config.load({}, env={}, preset=preset)
    with pytest.raises(BackendUnavailable, match=r"backend 'nixl' cannot load: .*install: pip "
                                                 r"install 'kvbridge\[nixl\]'"):
        cfg.check_loadable()
    compose = Config.load({"backend": "compose", "backend_options": {"members": ["shm", "nixl"]}},
                          env={})
    with pytest.raises(BackendUnavailable, match="'nixl'"):
        compose.check_loadable()
    Config.load({}, env={}).check_loadable()  # shm loads


# -- stats ----------------------------------------------------------------------------------------


def test_stats_aggregate_and_refuse_junk() -> None:
    a = KVBridgeStats({"counters": {"pull_bytes": 5, "junk": "x", "neg": -1, "flag": True}})
    assert a.counters == {"pull_bytes": 5}
    b = KVBridgeStats.__new__(KVBridgeStats)
    b.__init__(data={"counters": {"pull_bytes": 2, "recv_ok": 1}})  # type: ignore[misc]
    assert a.aggregate(b).reduce() == {"pull_bytes": 7, "recv_ok": 1}
    assert KVBridgeStats(None).is_empty() and KVBridgeStats({"counters": "nope"}).is_empty()
    a.reset()
    assert a.is_empty()
    rebuilt = kvb_vllm.KVBridgeConnector.build_kv_connector_stats(b.to_dict())
    assert isinstance(rebuilt, KVBridgeStats) and rebuilt.counters == b.counters
    assert delta({"a": 5, "b": 1, "c": 3}, {"a": 2, "b": 1}) == {"a": 3, "c": 3}


def test_prometheus_counters_per_engine() -> None:
    reg = CollectorRegistry()
    types: dict[type, Any] = {cls: functools.partial(cls, registry=reg)
                              for cls in (Counter, Gauge, Histogram)}
    vllm_config: Any = SimpleNamespace(kv_transfer_config=None)
    prom = KVBridgePromMetrics(vllm_config, types, ["model_name", "engine"],
                               {0: ["tiny", "0"], 1: ["tiny", "1"]})
    prom.observe({"counters": {"pull_bytes": 4096, "not_exported": 9, "recv_ok": 2}}, 0)
    prom.observe({"counters": {"pull_bytes": 1}}, 1)
    prom.observe({"counters": {"pull_bytes": 1}}, 7)  # an engine index vLLM never declared
    prom.observe({"garbage": 1}, 0)
    sample = functools.partial(reg.get_sample_value, labels={"model_name": "tiny",
                                                             "engine": "0"})
    assert sample("vllm:kvbridge_pull_bytes_total") == 4096
    assert sample("vllm:kvbridge_recv_ok_total") == 2
    assert reg.get_sample_value("vllm:kvbridge_pull_bytes_total",
                                {"model_name": "tiny", "engine": "1"}) == 1
    assert reg.get_sample_value("vllm:kvbridge_not_exported_total", {"model_name": "tiny",
                                                                     "engine": "0"}) is None
    assert all(sample(f"vllm:kvbridge_{n}_total") is not None for n in EXPORTED)

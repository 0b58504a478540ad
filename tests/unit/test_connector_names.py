"""One vLLM connector name per backend, and kvbridge's stats in vLLM's shape (no engine needed).

The names are real classes resolved through vLLM's own connector factory.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from importlib.metadata import EntryPoint  # noqa: E402

from kvbridge import registry  # noqa: E402
from kvbridge.config import Config  # noqa: E402
from kvbridge.errors import BackendUnavailable, ConfigError  # noqa: E402
from kvbridge.integrations import names  # noqa: E402
from kvbridge.integrations import vllm as kvb_vllm  # noqa: E402


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



def test_the_word_is_the_plugins_own() -> None:
    """``connector_word`` on the plugin class: LMCache's capitals; ``""`` asks for no name."""
    got = {c.backend: c.name for c in names.connector_names()}
    assert got["lmcache"] == "KVBridgeLMCacheConnector"
    assert registry.load_tier_class("lmcache").connector_word == "LMCache"
    assert "memory" not in got and registry.load_class("memory").connector_word == ""
    assert names.connector_name("lmcache", "LMCache") == "KVBridgeLMCacheConnector"


def test_a_known_backend_that_is_not_installed_keeps_a_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend of kvbridge's extras whose distribution is missing still gets a name (vLLM
    then starts the engine, which fails with the install hint instead of "unsupported")."""
    real = registry._entry_points

    def fake(group: str = registry.GROUP) -> dict[str, Any]:
        return {n: ep for n, ep in real(group).items() if n not in ("nixl", "lmcache")}

    monkeypatch.setattr(registry, "_entry_points", fake)
    got = {c.backend: c for c in names.connector_names()}
    assert got["nixl"].kind == "absent" and got["nixl"].name == "KVBridgeNixlConnector"
    assert got["lmcache"].name == "KVBridgeLmcacheConnector"  # its own word is in its package
    cfg = Config.load({}, env={}, preset=got["nixl"].preset())
    assert cfg.backend == "nixl"
    with pytest.raises(BackendUnavailable, match=r"install: pip install 'kvbridge\[nixl\]'"):
        cfg.check_loadable()

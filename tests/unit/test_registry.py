"""kvbridge.registry: entry-point discovery, did-you-mean, unavailable backends."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest

from kvbridge import registry
from kvbridge.errors import BackendNotFound, BackendUnavailable, ConfigError, KVBridgeError
from kvbridge.transport import BenchHook, BlockCostHook, RawResponderHook, Transport


def test_shm_is_listed_and_loads() -> None:
    assert "shm" in registry.available()
    cls = registry.load_class("shm")
    assert issubclass(cls, Transport)


def test_listing_imports_nothing() -> None:
    names = registry.available()
    assert names == sorted(names)
    assert {"shm", "memory", "nixl", "mooncake"} <= set(names)


def test_memory_is_registered_like_the_real_backends() -> None:
    rows = {row.name: row for row in registry.status()}
    assert rows["memory"].loadable, rows["memory"].detail
    assert rows["memory"].target == "kvbridge.transports.memory:MemoryTransport"
    transport = registry.create("memory", "test-registry-memory")
    try:
        assert isinstance(transport, Transport) and transport.name == "memory"
    finally:
        transport.close()


def test_unknown_backend_lists_installed_with_suggestion() -> None:
    with pytest.raises(BackendNotFound) as info:
        registry.load_class("shn")
    msg = str(info.value)
    assert "unknown kvbridge backend 'shn'" in msg
    assert "did you mean 'shm'?" in msg
    assert "installed: " in msg and "shm" in msg.split("installed: ")[1]
    assert isinstance(info.value, ConfigError) and isinstance(info.value, KVBridgeError)


def test_unknown_backend_without_near_match() -> None:
    with pytest.raises(BackendNotFound, match=r"'zzzz' \(installed: .*shm") as info:
        registry.create("zzzz", "agent")
    assert "did you mean" not in str(info.value)


def test_create_shm() -> None:
    transport = registry.create("shm", "test-registry-agent", {})
    try:
        assert isinstance(transport, Transport)
        assert transport.agent_name == "test-registry-agent"
    finally:
        transport.close()


def test_status_reports_shm_loadable() -> None:
    rows = {row.name: row for row in registry.status()}
    assert rows["shm"].loadable, rows["shm"].detail
    assert rows["shm"].target == "kvbridge.transports.shm:ShmTransport"
    for row in rows.values():
        assert row.loadable or row.detail  # every failure says why


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, **targets: str) -> None:
    """Install fake plugins next to the real ones, the way a third-party package would appear."""
    registry_entry_points = registry._entry_points
    real = registry_entry_points()
    fake = {n: EntryPoint(name=n, value=v, group=registry.GROUP) for n, v in targets.items()}

    def entry_points(group: str = registry.GROUP) -> dict[str, Any]:
        return {**real, **fake} if group == registry.GROUP else registry_entry_points(group)

    monkeypatch.setattr(registry, "_entry_points", entry_points)


def test_missing_module_is_unavailable_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, nixl="kvbridge_no_such_module_xyz:NixlTransport")
    with pytest.raises(BackendUnavailable, match=r"backend 'nixl' cannot load: .*"
                                                 r"kvbridge_no_such_module_xyz.*install: ") as info:
        registry.load_class("nixl")
    assert isinstance(info.value, ImportError) and isinstance(info.value, KVBridgeError)


def test_missing_attribute_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, broken="kvbridge.errors:NoSuchTransport")
    with pytest.raises(BackendUnavailable, match=r"'broken' .*NoSuchTransport"):
        registry.load_class("broken")


def test_not_a_transport_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, wrong="kvbridge.errors:KVBridgeError")
    with pytest.raises(BackendUnavailable, match="is not a kvbridge Transport"):
        registry.create("wrong", "agent")


def test_status_survives_broken_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(
        monkeypatch,
        ghost="kvbridge_no_such_module_xyz:T",
        broken="kvbridge.errors:NoSuchTransport",
    )
    rows = {row.name: row for row in registry.status()}
    assert not rows["ghost"].loadable and "kvbridge_no_such_module_xyz" in rows["ghost"].detail
    assert not rows["broken"].loadable and "NoSuchTransport" in rows["broken"].detail
    assert rows["shm"].loadable


def _fake_bench_hooks(monkeypatch: pytest.MonkeyPatch, **targets: str) -> None:
    """Bench-hook entry points (``kvbridge.bench_hooks``) of fake backends, next to the real."""
    registry_entry_points = registry._entry_points
    fake = {n: EntryPoint(name=n, value=v, group=registry.BENCH_GROUP)
            for n, v in targets.items()}

    def entry_points(group: str = registry.GROUP) -> dict[str, Any]:
        real = registry_entry_points(group)
        return {**real, **fake} if group == registry.BENCH_GROUP else real

    monkeypatch.setattr(registry, "_entry_points", entry_points)


# -- install hints: the plugin's own word, or kvbridge's extras for one not installed ------------


def _without(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make ``name`` look uninstalled (no entry point in any group)."""
    real = registry._entry_points

    def entry_points(group: str = registry.GROUP) -> dict[str, Any]:
        return {n: ep for n, ep in real(group).items() if n != name}

    monkeypatch.setattr(registry, "_entry_points", entry_points)


def test_bench_hook_of_shm_is_a_bench_hook_without_extras() -> None:
    hook = registry.bench_hook("shm")
    assert isinstance(hook, BenchHook)
    assert not isinstance(hook, RawResponderHook) and not isinstance(hook, BlockCostHook)
    assert registry.bench_hook("memory") is None  # no entry point: no raw column


def test_bench_hook_without_raw_session_names_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_bench_hooks(monkeypatch, hollow="kvbridge.errors", ghost="kvbridge_no_such_module_xyz")
    with pytest.raises(BackendUnavailable, match=r"'hollow' \(kvbridge.errors\) has no "
                                                 r"raw_session\(\).*BenchHook"):
        registry.bench_hook("hollow")
    with pytest.raises(BackendUnavailable, match="kvbridge_no_such_module_xyz"):
        registry.bench_hook("ghost")


def test_install_hint_is_the_plugin_classes_own() -> None:
    cls = registry.load_class("nixl")
    assert registry.install_hint("nixl") == cls.install_hint
    assert "kvbridge[nixl]" in cls.install_hint
    tier = registry.load_tier_class("lmcache")
    assert registry.install_hint("lmcache", registry.TIER_GROUP) == tier.install_hint
    assert registry.install_hint("shm") == ""  # built in: nothing to install
    assert registry.install_hint("zzzz") == ""


def test_known_backends_come_from_kvbridges_extras(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"nixl": "kvbridge-nixl", "mooncake": "kvbridge-mooncake",
            "mooncake_store": "kvbridge-mooncake", "lmcache": "kvbridge-lmcache"}.items() <= (
        registry.known().items())
    monkeypatch.setattr(registry.metadata, "requires", lambda dist: [
        "numpy>=1.26", 'kvbridge-warp[native]>=1; extra == "warp-drive"',
        'aiohttp>=3.9; extra == "proxy"', "kvbridge_other ; python_version >= '3'"])
    registry.known.cache_clear()
    try:
        assert registry.known() == {"warp_drive": "kvbridge-warp"}
    finally:
        registry.known.cache_clear()


def test_a_known_backend_that_is_not_installed_names_its_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "nixl")
    assert registry.install_hint("nixl") == "pip install 'kvbridge[nixl]'"
    with pytest.raises(BackendUnavailable, match=r"'nixl' is not installed here: it ships in the "
                                                 r"kvbridge-nixl distribution — install: pip "
                                                 r"install 'kvbridge\[nixl\]'"):
        registry.load_class("nixl")
    with pytest.raises(BackendUnavailable, match=r"kvbridge\[nixl\]"):
        registry.create("nixl", "agent")
    with pytest.raises(BackendNotFound):  # an installed tier is no transport
        registry.load_class("lmcache")


def test_a_backend_that_fails_to_construct_gets_its_classes_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(registry.load_class("memory")):  # type: ignore[misc]
        install_hint = "apt-get install -y libwarp"

        def __init__(self, *args: Any) -> None:
            raise ImportError("libwarp.so.1: cannot open shared object file")

    monkeypatch.setattr(registry, "load_class", lambda name: Broken)
    with pytest.raises(BackendUnavailable, match=r"backend 'warp' cannot load: libwarp\.so\.1.* "
                                                 r"— install: apt-get install -y libwarp"):
        registry.create("warp", "agent")


def test_plugin_class_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(monkeypatch, ghost="kvbridge_no_such_module_xyz:T")
    assert registry.plugin_class("ghost") is None
    assert registry.plugin_class("zzzz") is None
    assert registry.plugin_class("shm") is registry.load_class("shm")


# -- tiers: loadable means the tier's library loads, not only its class ---------------------------

_NEEDS_LIB = '''
from kvbridge.offload.tier import Tier


class NeedsLib(Tier):
    install_hint = "pip install kvbridge-no-such-lib"

    @classmethod
    def probe(cls):
        import kvbridge_no_such_lib_xyz  # the tier's own library, missing here

        return "ok"

    contains = load = store = evict = None


class NoProbe(NeedsLib):
    probe = None
'''


def test_a_tier_whose_library_does_not_import_is_not_loadable(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvbridge_fake_tier_mod.py").write_text(_NEEDS_LIB)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = registry._entry_points
    fake = {n: EntryPoint(name=n, value=f"kvbridge_fake_tier_mod:{c}", group=registry.TIER_GROUP)
            for n, c in (("needs_lib", "NeedsLib"), ("no_probe", "NoProbe"))}

    def entry_points(group: str = registry.GROUP) -> dict[str, Any]:
        return {**real(group), **fake} if group == registry.TIER_GROUP else real(group)

    monkeypatch.setattr(registry, "_entry_points", entry_points)
    rows = {row.name: row for row in registry.tier_status()}
    assert registry.load_tier_class("needs_lib")  # the class itself imports
    assert not rows["needs_lib"].loadable
    assert "offload tier 'needs_lib' cannot load" in rows["needs_lib"].detail
    assert "kvbridge_no_such_lib_xyz" in rows["needs_lib"].detail
    assert "install: pip install kvbridge-no-such-lib" in rows["needs_lib"].detail
    assert rows["no_probe"].loadable and rows["no_probe"].detail == "ok"
    assert rows["dram"].loadable

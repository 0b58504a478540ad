"""The ``lmcache`` tier configures LMCache the way LMCache users do: ``LMCACHE_CONFIG_FILE``, else
``LMCACHE_*`` variables, else kvbridge's defaults; the tier's options where kvbridge owns them,
and a clear error for a bad file, a bad variable or a setting that conflicts with the tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed (see docs/backends/lmcache.md)")

from kvbridge.errors import ConfigError  # noqa: E402
from kvbridge.offload.tier import TierContext  # noqa: E402
from kvbridge.testing.conformance import TierConformance  # noqa: E402
from kvbridge.testing.conformance.tier import CHUNK  # noqa: E402

pytestmark = [pytest.mark.lmcache]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_ambient_lmcache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: no LMCACHE_* of the machine running the tests."""
    for var in list(os.environ):
        if var.startswith("LMCACHE_"):
            monkeypatch.delenv(var)


def _build(options: dict[str, Any] | None = None) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    from kvbridge_lmcache.config import build_config

    options = options or {}
    ctx = TierContext("lmcache", CHUNK, "cfg", options)
    return build_config(ctx, LMCacheEngineConfig, int(options.get("capacity_bytes", 1 << 30)))


def _tier(options: dict[str, Any] | None = None) -> Any:
    from kvbridge import registry

    cls = registry.load_tier_class("lmcache")
    return cls(TierContext("lmcache", CHUNK, "cfg", options or {}))


def _file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    return path


def test_defaults_are_todays(tmp_path: Path) -> None:
    setup = _build()
    c = setup.config
    assert (c.chunk_size, c.local_cpu, c.max_local_cpu_size, c.local_disk) == (16, True, 1.0,
                                                                                None)
    assert setup.source == "defaults" and setup.capacity_bytes == 1 << 30
    disk = _build({"disk_path": str(tmp_path / "d"), "disk_capacity_bytes": 128 * MIB}).config
    assert disk.local_disk == str(tmp_path / "d") and disk.max_local_disk_size == 0.125


def test_config_file_settings_reach_the_engine_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings kvbridge does not set itself (a remote backend: never contacted here) are
    LMCache's, from its file; sizes the tier shares with LMCache come from it too."""
    path = _file(tmp_path, monkeypatch, "max_local_cpu_size: 0.0625\n"
                 "remote_url: lm://127.0.0.1:1\nremote_serde: naive\n"
                 "blocking_timeout_secs: 7\n")
    setup = _build()
    c = setup.config
    assert (c.remote_url, c.blocking_timeout_secs, c.max_local_cpu_size) == (
        "lm://127.0.0.1:1", 7, 0.0625)
    assert setup.capacity_bytes == 64 * MIB and str(path) in setup.source
    assert c.chunk_size == 16  # unset in the file: kvbridge's default, not LMCache's 256


def test_a_real_tier_runs_with_the_config_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _file(tmp_path, monkeypatch, "max_local_cpu_size: 0.0625\nchunk_size: 64\n")
    tier = _tier()
    try:
        assert tier.lmcache_config.max_local_cpu_size == 0.0625
        assert tier.capacity_bytes == 64 * MIB and tier.chunk_tokens == 64
        assert "lmcache.yaml" in tier.describe()
    finally:
        tier.close()


def test_lmcache_env_settings_reach_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.0625")
    monkeypatch.setenv("LMCACHE_REMOTE_URL", "lm://127.0.0.1:1")
    setup = _build()
    assert setup.config.remote_url == "lm://127.0.0.1:1"
    assert setup.capacity_bytes == 64 * MIB and setup.source == "LMCACHE_* environment"


def test_env_overrides_the_file_as_in_lmcache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _file(tmp_path, monkeypatch, "blocking_timeout_secs: 7\n")
    monkeypatch.setenv("LMCACHE_BLOCKING_TIMEOUT_SECS", "9")
    assert _build().config.blocking_timeout_secs == 9


@pytest.mark.parametrize(("text", "words"), [
    (None, "cannot read"),
    ("chunk_size: [1\n", "not valid YAML"),
    ("- a list\n", "YAML mapping"),
    ("max_local_cpu_size: lots\n", "max_local_cpu_size"),
])
def test_a_bad_config_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    text: str | None, words: str) -> None:
    path = tmp_path / "lmcache.yaml"
    if text is not None:
        path.write_text(text)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError, match=words) as info:
        _tier()
    assert "LMCACHE_CONFIG_FILE" in str(info.value) and str(path) in str(info.value)


def test_an_empty_config_file_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", "")
    with pytest.raises(ConfigError, match="LMCACHE_CONFIG_FILE is set but empty"):
        _build()


def test_a_bad_lmcache_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache would log a WARNING and quietly use its default (5 GB)."""
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "lots")
    with pytest.raises(ConfigError, match="LMCACHE_MAX_LOCAL_CPU_SIZE='lots'"):
        _build()


def test_a_tier_option_conflicting_with_lmcache_is_refused_naming_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, monkeypatch, "max_local_cpu_size: 2\n")
    with pytest.raises(ConfigError) as info:
        _tier({"capacity_bytes": 64 * MIB})
    msg = str(info.value)
    assert "capacity_bytes" in msg and "max_local_cpu_size" in msg and str(path) in msg
    assert _build({"capacity_bytes": 2 << 30}).capacity_bytes == 2 << 30  # the same: fine


def test_a_disk_path_conflicting_with_lmcache_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_LOCAL_DISK", f"file://{tmp_path / 'theirs'}")
    with pytest.raises(ConfigError, match="disk_path .* conflicts with LMCACHE_LOCAL_DISK"):
        _build({"disk_path": str(tmp_path / "ours")})
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_DISK_SIZE", "0.5")
    with pytest.raises(ConfigError, match="disk_capacity_bytes .* LMCACHE_MAX_LOCAL_DISK_SIZE"):
        _build({"disk_path": str(tmp_path / "theirs"), "disk_capacity_bytes": 64 * MIB})


@pytest.mark.parametrize("key", ["use_layerwise", "enable_blending"])
def test_settings_the_tier_cannot_honour_are_refused(
        monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    monkeypatch.setenv(f"LMCACHE_{key.upper()}", "true")
    with pytest.raises(ConfigError, match=f"LMCACHE_{key.upper()} turns on {key}"):
        _build()


class TestLMCacheFileConfigConformance(TierConformance):
    """An LMCache file as LMCache users write it (LMCache's own chunk size, 256 tokens)."""

    tier_name = "lmcache"

    @pytest.fixture(autouse=True)
    def _lmcache_file(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        _file(tmp_path, monkeypatch, "chunk_size: 256\nlocal_cpu: true\n"
              "max_local_cpu_size: 0.0625\n")
        yield

"""kvbridge.config: precedence env > extra_config > default, sources, bad values, unknown keys."""

from __future__ import annotations

from typing import Any

import pytest

from kvbridge.config import ENV_PREFIX, Config, TransferMode
from kvbridge.errors import ConfigError, KVBridgeError


def test_defaults_with_empty_inputs() -> None:
    cfg = Config.load({}, env={})
    assert cfg.backend == "shm"
    assert cfg.mode is TransferMode.PULL
    assert cfg.secret is None
    assert set(cfg.sources.values()) == {"default"}
    assert set(cfg.sources) == set(Config.keys())


def test_extra_overrides_default() -> None:
    cfg = Config.load({"backend": "nixl", "mode": "push", "lease_s": 12}, env={})
    assert (cfg.backend, cfg.mode, cfg.lease_s) == ("nixl", TransferMode.PUSH, 12.0)
    assert cfg.sources["backend"] == "kv_connector_extra_config"
    assert cfg.sources["lease_s"] == "kv_connector_extra_config"
    assert cfg.sources["heartbeat_s"] == "default"


def test_env_overrides_extra() -> None:
    cfg = Config.load(
        {"backend": "nixl", "mode": "push"},
        env={"KVBRIDGE_BACKEND": "mooncake", "KVBRIDGE_LEASE_S": "45.5", "PATH": "/bin"},
    )
    assert cfg.backend == "mooncake"
    assert cfg.sources["backend"] == "env KVBRIDGE_BACKEND"
    assert cfg.mode is TransferMode.PUSH and cfg.sources["mode"] == "kv_connector_extra_config"
    assert cfg.lease_s == 45.5 and cfg.sources["lease_s"] == "env KVBRIDGE_LEASE_S"


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(__import__("os").environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVBRIDGE_MODE", "AUTO")
    cfg = Config.load({"mode": "push"})
    assert cfg.mode is TransferMode.AUTO and cfg.sources["mode"] == "env KVBRIDGE_MODE"


@pytest.mark.parametrize(
    ("key", "raw", "value"),
    [
        ("checksum", "yes", True),
        ("checksum", "0", False),
        ("layerwise", "On", True),
        ("side_channel_port", "5600", 5600),
        ("max_message_bytes", "65536", 65536),
        ("idle_wait_ms", "2.5", 2.5),
        ("backend_options", '{"backends": ["LIBFABRIC"]}', {"backends": ["LIBFABRIC"]}),
        ("secret", "", None),
        ("secret", "s3cret", "s3cret"),
        ("log_level", "debug", "DEBUG"),
        ("mode", "PULL", TransferMode.PULL),
    ],
)
def test_env_strings_are_coerced(key: str, raw: str, value: Any) -> None:
    cfg = Config.load({}, env={ENV_PREFIX + key.upper(): raw})
    assert getattr(cfg, key) == value


def test_extra_accepts_json_values() -> None:
    cfg = Config.load({"checksum": True, "backend_options": {"a": 1}, "side_channel_port": 7000},
                      env={})
    assert cfg.checksum is True and cfg.backend_options == {"a": 1}
    assert cfg.side_channel_port == 7000


@pytest.mark.parametrize(
    ("extra", "env", "match"),
    [
        ({}, {"KVBRIDGE_LEASE_S": "soon"}, r"bad value for lease_s: 'soon'"),
        ({}, {"KVBRIDGE_CHECKSUM": "maybe"}, r"bad value for checksum: 'maybe'"),
        ({"mode": "sideways"}, {}, r"bad value for mode: 'sideways'"),
        ({"backend_options": "[1, 2]"}, {}, r"bad value for backend_options"),
        ({}, {"KVBRIDGE_BACKEND_OPTIONS": "{not json"}, r"bad value for backend_options"),
        ({"side_channel_port": "x"}, {}, r"bad value for side_channel_port"),
        ({"lease_s": 0}, {}, r"lease_s must be > 0"),
        ({"transfer_timeout_s": -1}, {}, r"transfer_timeout_s must be > 0"),
        ({"heartbeat_s": 30, "lease_s": 10}, {}, r"heartbeat_s \(30.0\) must be shorter"),
        ({"side_channel_port": 70000}, {}, r"side_channel_port out of range: 70000"),
        ({"max_message_bytes": 10}, {}, r"max_message_bytes must be at least 65536"),
    ],
)
def test_bad_values_name_the_key(extra: dict[str, Any], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        Config.load(extra, env=env)
    assert isinstance(info.value, KVBridgeError) and isinstance(info.value, ValueError)


def test_unknown_extra_key_suggests() -> None:
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config key 'bakend'; "
                                          r"did you mean 'backend'\?"):
        Config.load({"bakend": "nixl"}, env={})


def test_unknown_env_key_is_a_warning_with_suggestion() -> None:
    cfg = Config.load({}, env={"KVBRIDGE_LEASE": "3"})
    assert cfg.lease_s == 30.0
    assert len(cfg.warnings) == 1
    assert "environment variable KVBRIDGE_LEASE" in cfg.warnings[0]
    assert "did you mean 'lease_s'?" in cfg.warnings[0]


def test_unknown_key_without_near_match_lists_known() -> None:
    with pytest.raises(ConfigError, match=r"'zzzzzz' \(known: backend, ") as info:
        Config.load({"zzzzzz": 1}, env={})
    assert "did you mean" not in str(info.value)


def test_describe_masks_secret_and_reports_sources() -> None:
    cfg = Config.load({"secret": "hunter2"}, env={"KVBRIDGE_MODE": "push"})
    rows = {key: (value, source) for key, value, source in cfg.describe()}
    assert rows["secret"] == ("***", "kv_connector_extra_config")
    assert rows["mode"] == ("push", "env KVBRIDGE_MODE")
    assert rows["backend"] == ("shm", "default")
    assert "hunter2" not in cfg.summary()
    assert "mode=push (env KVBRIDGE_MODE)" in cfg.summary()


def test_with_overrides() -> None:
    cfg = Config.load({}, env={}).with_overrides(mode="push", lease_s="9")
    assert cfg.mode is TransferMode.PUSH and cfg.lease_s == 9.0
    assert cfg.sources["mode"] == cfg.sources["lease_s"] == "override"
    with pytest.raises(ConfigError, match="lease_s must be > 0"):
        cfg.with_overrides(lease_s=0)


def test_config_is_frozen() -> None:
    cfg = Config.load({}, env={})
    with pytest.raises(AttributeError):
        cfg.backend = "nixl"  # type: ignore[misc]


# -- issue 31: variables read elsewhere, enum errors, settings read from the environment only -----


def test_variables_kvbridge_reads_elsewhere_are_no_warning() -> None:
    from kvbridge.config import OTHER_ENV

    cfg = Config.load({}, env=dict.fromkeys(OTHER_ENV, "x"))
    assert cfg.warnings == ()
    assert {"KVBRIDGE_CACHE_DIR", "KVBRIDGE_MOONCAKE_MASTER"} <= set(OTHER_ENV)


def test_every_kvbridge_variable_in_code_and_docs_is_a_key_or_declared() -> None:
    """A KVBRIDGE_* name the code reads or the docs name is a Config key's variable, an offload
    variable, or one of OTHER_ENV (so Config.load warns about none of them)."""
    import re
    from pathlib import Path

    from kvbridge.config import OTHER_ENV

    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("kvbridge/**/*.py"), *root.glob("backends/*/*.py"),
             *root.glob("docs/**/*.md"), root / "README.md"]
    keys = {ENV_PREFIX + k.upper() for k in Config.keys()}
    python_names = {"KVBRIDGE_GROUP"}  # a constant of kvbridge.tools.bench, not a variable
    unknown = {}
    for path in files:
        for name in re.findall(r"\bKVBRIDGE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            if not (name in keys or name in OTHER_ENV or name in python_names
                    or name.startswith("KVBRIDGE_OFFLOAD")):
                unknown[name] = str(path.relative_to(root))
    assert not unknown, unknown


@pytest.mark.parametrize(("extra", "env", "where"), [
    ({"mode": "pushh"}, {}, "kv_connector_extra_config"),
    ({}, {"KVBRIDGE_MODE": "pushh"}, "env KVBRIDGE_MODE"),
])
def test_a_bad_enum_value_names_the_key_and_the_choices(
        extra: dict[str, Any], env: dict[str, str], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(extra, env=env)
    text = str(info.value)
    assert text.startswith("bad value for mode: 'pushh'")
    assert where in text and "expected one of pull, push, auto" in text
    assert "did you mean 'push'?" in text and "TransferMode" not in text


def test_engine_spin_ms_from_extra_config_is_not_applied_and_says_so() -> None:
    cfg = Config.load({"engine_spin_ms": 2}, env={})
    assert cfg.engine_spin_ms == -1.0  # what the engine will do: vLLM's default
    assert "not applied" in cfg.sources["engine_spin_ms"]
    assert len(cfg.warnings) == 1 and "KVBRIDGE_ENGINE_SPIN_MS" in cfg.warnings[0]
    with pytest.raises(ConfigError, match="bad value for engine_spin_ms"):
        Config.load({"engine_spin_ms": "soon"}, env={})  # accepted means checked, still
    env = Config.load({"engine_spin_ms": 2}, env={"KVBRIDGE_ENGINE_SPIN_MS": "5"})
    assert env.engine_spin_ms == 5.0 and env.sources["engine_spin_ms"] == (
        "env KVBRIDGE_ENGINE_SPIN_MS") and env.warnings == ()

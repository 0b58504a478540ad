"""The LMCache engine config of the ``lmcache`` tier, built the way LMCache builds its own.

LMCache's vLLM integration (``lmcache.integration.vllm.utils.lmcache_get_or_create_config``)
reads ``LMCACHE_CONFIG_FILE`` when it is set (a YAML file; ``LMCACHE_*`` variables then
override it), else the ``LMCACHE_*`` environment variables alone. :func:`build_config` does the
same, so an existing LMCache set-up (remote backends, sizes, chunking, …) works unchanged. It
then fills in kvbridge's own defaults only for what the user's LMCache configuration leaves
unset, and applies the tier's options where kvbridge owns them:

- ``capacity_bytes`` ↔ ``max_local_cpu_size``, ``disk_path`` ↔ ``local_disk``,
  ``disk_capacity_bytes`` ↔ ``max_local_disk_size``: one setting, two spellings. Either side
  may set it; both setting it differently is a :class:`ConfigError` naming both (kvbridge's
  defaults, 1 GiB CPU and 10 GiB disk, apply when neither does).
- ``chunk_size``: one kvbridge chunk is one LMCache chunk of ``chunk_size`` tokens, whatever
  that is (kvbridge's default: 16); the tier follows the user's value.
- ``use_layerwise`` and ``enable_blending`` cannot work here (the tier moves whole chunks of
  made-up tokens, not layers of a real prompt): setting either is a :class:`ConfigError`.

What LMCache's vLLM integration does beyond that (fetching ``remote_config_url``, vLLM's
``lmcache.*`` extra-config keys) is not done here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.offload.config import parse_size
from kvbridge.offload.tier import TierContext

__all__ = ["CONFIG_FILE_VAR", "DEFAULT_CHUNK_TOKENS", "LMCacheSetup", "build_config"]

CONFIG_FILE_VAR = "LMCACHE_CONFIG_FILE"
DEFAULT_CHUNK_TOKENS = 16
_GIB = 1 << 30
#: LMCache settings the tier cannot honour, and why
_REFUSED = {
    "use_layerwise": "the tier stores whole chunks; kvbridge's connector has no layer-wise path",
    "enable_blending": "CacheBlend recomputes from the real prompt; the tier hashes made-up "
                       "tokens derived from kvbridge's keys",
}


@dataclass(frozen=True)
class LMCacheSetup:
    """What :func:`build_config` returns."""

    #: the ``LMCacheEngineConfig`` to start the engine with
    config: Any
    #: where it came from, for logs: ``LMCACHE_CONFIG_FILE /etc/lmcache.yaml``, ``LMCACHE_*
    #: environment`` or ``defaults``
    source: str
    #: LMCache's local CPU size in bytes (the tier's ``capacity_bytes``)
    capacity_bytes: int
    #: tokens per LMCache chunk (one kvbridge chunk each)
    chunk_tokens: int


def build_config(ctx: TierContext, config_cls: Any, capacity_bytes: int) -> LMCacheSetup:
    """The tier's ``LMCacheEngineConfig``: see the module docstring. ``capacity_bytes`` is the
    tier's (its option, or the default when unset). Raises :class:`ConfigError` naming the
    file, variable or option at fault."""
    defs: dict[str, dict[str, Any]] = config_cls._config_definitions
    _check_env(defs)
    path = os.environ.get(CONFIG_FILE_VAR)
    if path is not None:
        _check_file(path, defs)
        config = config_cls.from_file(path)
        config.update_config_from_env()  # as LMCache's vLLM integration: variables win
        source = f"{CONFIG_FILE_VAR} {path}"
    else:
        config = config_cls.from_env()
        source = "LMCACHE_* environment"
    user: set[str] = set(getattr(config, "_user_set_keys", ()))
    if not user and path is None:
        source = "defaults"

    def where(key: str) -> str:
        var = f"LMCACHE_{key.upper()}"
        return var if var in os.environ else f"{key} in {CONFIG_FILE_VAR} {path}"

    for key, why in _REFUSED.items():
        if key in user and getattr(config, key):
            raise ConfigError(f"offload tier {ctx.name!r}: {where(key)} turns on {key}, which "
                              f"the lmcache tier cannot honour ({why}): turn it off")
    if "chunk_size" not in user:
        config.chunk_size = DEFAULT_CHUNK_TOKENS
    if not isinstance(config.chunk_size, int) or config.chunk_size < 1:
        raise ConfigError(f"offload tier {ctx.name!r}: {where('chunk_size')} must be a "
                          f"positive number of tokens, not {config.chunk_size!r}")

    capacity = _own_size(ctx, config, user, where, "capacity_bytes", "max_local_cpu_size",
                         capacity_bytes)
    disk = ctx.options.get("disk_path")
    if disk is not None and "local_disk" in user:
        theirs = str(config.local_disk or "")
        if [os.path.abspath(p) for p in theirs.split(",")] != [os.path.abspath(str(disk))]:
            raise ConfigError(f"offload tier {ctx.name!r}: disk_path {str(disk)!r} conflicts "
                              f"with {where('local_disk')} ({theirs!r}): set one of them")
    if disk is not None:
        os.makedirs(str(disk), mode=0o700, exist_ok=True)
        config.local_disk = str(disk)
    if config.local_disk:
        default_disk = parse_size(ctx.options.get("disk_capacity_bytes", 10 * _GIB),
                                  f"offload tier {ctx.name!r}: disk_capacity_bytes")
        _own_size(ctx, config, user, where, "disk_capacity_bytes", "max_local_disk_size",
                  default_disk)
    try:
        config.validate()
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"offload tier {ctx.name!r}: LMCache rejects the configuration from "
                          f"{source}: {exc or type(exc).__name__}") from exc
    return LMCacheSetup(config, source, capacity, config.chunk_size)


def _own_size(ctx: TierContext, config: Any, user: set[str], where: Any, option: str,
              key: str, default: int) -> int:
    """A size both a tier option (bytes) and an LMCache key (GiB) may set: the one that is set,
    kvbridge's ``default`` when neither is; both, differently: :class:`ConfigError`."""
    if key not in user:
        setattr(config, key, default / _GIB)
        return default
    theirs = int(float(getattr(config, key)) * _GIB)
    if option in ctx.options and theirs != default:
        raise ConfigError(f"offload tier {ctx.name!r}: {option} ({default} bytes) conflicts "
                          f"with {where(key)} ({getattr(config, key)} GiB = {theirs} bytes): "
                          "set one of them")
    return theirs


def _check_env(defs: dict[str, dict[str, Any]]) -> None:
    """LMCache logs a WARNING and uses its default for an ``LMCACHE_*`` value it cannot parse;
    the tier refuses it instead, naming the variable."""
    from lmcache.v1.config_base import _parse_quoted_string

    for key, spec in defs.items():
        var = f"LMCACHE_{key.upper()}"
        raw = os.environ.get(var)
        if raw is None or spec.get("env_converter") is None:
            continue
        try:
            spec["env_converter"](_parse_quoted_string(raw))
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ConfigError(f"{var}={raw!r}: LMCache cannot parse it ({exc})") from exc


def _check_file(path: str, defs: dict[str, dict[str, Any]]) -> None:
    """``path`` reads as a YAML mapping whose known keys LMCache can convert (it logs a WARNING
    and uses None for one it cannot); else :class:`ConfigError` naming the file."""
    import yaml

    what = f"{CONFIG_FILE_VAR} {path!r}"
    if not path:
        raise ConfigError(f"{CONFIG_FILE_VAR} is set but empty: name LMCache's YAML config "
                          "file, or unset it to configure LMCache through LMCACHE_* variables")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read it: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: not valid YAML: {exc}") from exc
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: must be a YAML mapping of LMCache settings "
                          f"(key: value), not a {type(data).__name__}")
    for key, raw in data.items():
        spec = defs.get(key)
        if spec is None or raw is None or spec.get("env_converter") is None:
            continue  # LMCache warns about unknown keys itself
        try:
            spec["env_converter"](raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{what}: bad value for {key}: {raw!r} ({exc})") from exc

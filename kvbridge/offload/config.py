"""The ``offload`` configuration: tiers in order with their options, plus a few knobs.

In ``kv_connector_extra_config``::

    "offload": {"tiers": ["dram", {"name": "disk", "path": "/var/cache/kvbridge",
                                   "capacity_bytes": "20GiB"}],
                "store": true, "max_staged_bytes": "2GiB"}

Environment overrides (applied on top, highest precedence):

- ``KVBRIDGE_OFFLOAD`` — the whole object as JSON (replaces extra_config's);
- ``KVBRIDGE_OFFLOAD_TIERS=dram,disk`` — the tier list by name (options of tiers of the same
  name in the configuration are kept);
- ``KVBRIDGE_OFFLOAD_<TIER>_<OPTION>=value`` — one tier option, e.g.
  ``KVBRIDGE_OFFLOAD_DISK_PATH=/mnt/nvme/kv``, ``KVBRIDGE_OFFLOAD_DRAM_CAPACITY_BYTES=4GiB``;
- ``KVBRIDGE_OFFLOAD_<KNOB>=value`` for ``store``, ``load``, ``max_staged_bytes``,
  ``max_backlog_bytes``, ``min_blocks``, ``layerwise_load``, ``drain_write_bytes``,
  ``drain_write_s``.

A tier option every tier accepts: ``drain_only`` (bool) — a blocking tier (disk, remote) that
is written only when the engine drains (:mod:`kvbridge.offload.warm`), not by every store.

Sizes accept integers or ``KiB/MiB/GiB/TiB`` (and ``KB/MB/GB/TB``, powers of ten) suffixes.
Every error is a :class:`~kvbridge.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.values import parse_bool

__all__ = ["OffloadConfig", "TierSpec", "parse_size", "parse_bool", "apply_env", "ENV_OFFLOAD"]

ENV_OFFLOAD = "KVBRIDGE_OFFLOAD"
_KNOBS = {"store": "bool", "load": "bool", "max_staged_bytes": "size",
          "max_backlog_bytes": "size", "min_blocks": "int", "layerwise_load": "bool",
          "drain_write_bytes": "size", "drain_write_s": "seconds"}
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def parse_size(raw: Any, what: str) -> int:
    """``raw`` (int or ``"4GiB"``) in bytes; :class:`ConfigError` naming ``what``."""
    if isinstance(raw, bool):
        raise ConfigError(f"{what}: expected a size, got {raw!r}")
    if isinstance(raw, int):
        value = raw
    else:
        m = _SIZE.match(str(raw))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{what}: expected a size like 1073741824 or '1GiB', got {raw!r}")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 0:
        raise ConfigError(f"{what}: must be >= 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class TierSpec:
    """One tier: its entry-point name in ``kvbridge.tiers`` and its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}


@dataclass(frozen=True)
class OffloadConfig:
    """The parsed ``offload`` object (see the module docstring)."""

    tiers: tuple[TierSpec, ...] = ()
    #: store the full prompt blocks of every request that finished normally
    store: bool = True
    #: look prompts up in the tiers (false: write-only, e.g. to warm a shared store)
    load: bool = True
    #: most bytes of looked-up chunks held for requests not yet allocated (per worker rank)
    max_staged_bytes: int = 1 << 30
    #: most bytes of chunks waiting to be written to the slower tiers; beyond, stores are skipped
    max_backlog_bytes: int = 1 << 30
    #: prompts with fewer full blocks are neither looked up nor stored
    min_blocks: int = 1
    #: copy tier hits into their blocks layer by layer while the forward runs
    #: (:mod:`kvbridge.offload.layerwise`) instead of all before it
    layerwise_load: bool = False
    #: on drain (and shutdown) write at most this many bytes of the local tiers' most recently
    #: used chunks into each lasting tier that lacks them (:mod:`kvbridge.offload.warm`); 0: off
    drain_write_bytes: int = 1 << 30
    #: ... and spend at most this long doing so (seconds)
    drain_write_s: float = 10.0
    #: store chunks sealed with their digest and check it on every load
    #: (:mod:`kvbridge.offload.seal`): the top-level ``checksum`` setting, not an ``offload`` key
    sealed: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> OffloadConfig:
        if not raw:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"offload: expected an object, got {type(raw).__name__}")
        known = {"tiers", *_KNOBS}
        for key in raw:
            if key not in known:
                raise ConfigError(f"offload: unknown key {key!r} (known: "
                                  f"{', '.join(sorted(known))})")
        tiers_raw = raw.get("tiers", [])
        if not isinstance(tiers_raw, list):
            raise ConfigError("offload.tiers: expected a list of tier names or objects")
        tiers: list[TierSpec] = []
        for i, item in enumerate(tiers_raw):
            what = f"offload.tiers[{i}]"
            if isinstance(item, str):
                item = {"name": item}
            if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
                raise ConfigError(f"{what}: expected a name or an object with a 'name'")
            name = item["name"]
            if not _NAME.match(name):
                raise ConfigError(f"{what}.name: bad tier name {name!r}")
            if any(t.name == name for t in tiers):
                raise ConfigError(f"{what}.name: tier {name!r} listed twice")
            options = {k: v for k, v in item.items() if k != "name"}
            if "capacity_bytes" in options:
                options["capacity_bytes"] = parse_size(options["capacity_bytes"],
                                                       f"{what}.capacity_bytes")
            if "drain_only" in options:
                options["drain_only"] = parse_bool(options["drain_only"], f"{what}.drain_only")
            tiers.append(TierSpec(name, options))
        values: dict[str, Any] = {}
        for key, kind in _KNOBS.items():
            if key not in raw:
                continue
            what = f"offload.{key}"
            if kind == "bool":
                values[key] = parse_bool(raw[key], what)
            elif kind == "size":
                values[key] = parse_size(raw[key], what)
            elif kind == "seconds":
                values[key] = _seconds(raw[key], what)
            else:
                try:
                    values[key] = int(raw[key])
                except (TypeError, ValueError) as exc:
                    raise ConfigError(f"{what}: expected an integer, got {raw[key]!r}") from exc
                if values[key] < 1:
                    raise ConfigError(f"{what}: must be >= 1")
        return cls(tuple(tiers), **values)

    def to_json(self) -> dict[str, Any]:
        if not self.tiers:
            return {}
        return {"tiers": [t.to_json() for t in self.tiers], "store": self.store,
                "load": self.load, "max_staged_bytes": self.max_staged_bytes,
                "max_backlog_bytes": self.max_backlog_bytes, "min_blocks": self.min_blocks,
                "layerwise_load": self.layerwise_load,
                "drain_write_bytes": self.drain_write_bytes, "drain_write_s": self.drain_write_s}

    def drain_only(self, tier: str) -> bool:
        """Tier ``tier`` is written only on drain (its ``drain_only`` option)."""
        return any(s.name == tier and bool(s.options.get("drain_only")) for s in self.tiers)


def _seconds(raw: Any, what: str) -> float:
    if isinstance(raw, bool):
        raise ConfigError(f"{what}: expected seconds, got {raw!r}")
    try:
        value = float(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: expected seconds, got {raw!r}") from exc
    if not 0 <= value <= 3600:
        raise ConfigError(f"{what}: must be between 0 and 3600 seconds, got {raw!r}")
    return value


def apply_env(raw: Mapping[str, Any] | None, env: Mapping[str, str],
              require: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """``raw`` with the ``KVBRIDGE_OFFLOAD*`` variables of ``env`` applied; (result, names used).
    Tier ``require`` (a backend-specific connector's tier) is appended to the tier list unless
    listed, before the per-tier variables are applied, so they can configure it.

    Raises :class:`ConfigError` for malformed JSON or a variable that names no tier or knob.
    """
    used: list[str] = []
    out: dict[str, Any] = dict(raw or {})
    if ENV_OFFLOAD in env:
        used.append(ENV_OFFLOAD)
        try:
            loaded = json.loads(env[ENV_OFFLOAD]) if env[ENV_OFFLOAD].strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{ENV_OFFLOAD}: not JSON ({exc})") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{ENV_OFFLOAD}: expected a JSON object")
        out = loaded
    tiers = [dict({"name": t} if isinstance(t, str) else t) for t in out.get("tiers", [])
             if isinstance(t, (str, dict))]
    prefix = ENV_OFFLOAD + "_"
    if prefix + "TIERS" in env:
        used.append(prefix + "TIERS")
        by_name = {t.get("name"): t for t in tiers}
        names = [n.strip() for n in env[prefix + "TIERS"].split(",") if n.strip()]
        tiers = [by_name.get(n, {"name": n}) for n in names]
    if require is not None and all(t.get("name") != require for t in tiers):
        tiers.append({"name": require})
    for var in sorted(env):
        if not var.startswith(prefix) or var == prefix + "TIERS":
            continue
        rest = var[len(prefix):].lower()
        if rest in _KNOBS:
            out[rest] = env[var]
            used.append(var)
            continue
        match = [t for t in tiers if rest.startswith(str(t.get("name", "")) + "_")]
        if not match:
            raise ConfigError(f"{var}: names no offload tier or option (tiers: "
                              f"{', '.join(str(t.get('name')) for t in tiers) or 'none'}; "
                              f"options: {', '.join(sorted(_KNOBS))})")
        tier = max(match, key=lambda t: len(str(t.get("name"))))
        tier[rest[len(str(tier["name"])) + 1:]] = env[var]
        used.append(var)
    if tiers or "tiers" in out:
        out["tiers"] = tiers
    return out, used

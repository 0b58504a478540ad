"""The options ``kvbridge config`` and ``kvbridge doctor`` share to name an engine's connector.

``--extra-config JSON`` and ``--connector NAME``, or instead ``--kv-transfer-config JSON``: the
very object given to ``vllm serve --kv-transfer-config`` (``kv_connector``, ``kv_role``,
``kv_connector_extra_config``; vLLM's other keys are not kvbridge's and are ignored). Contract:
:func:`connector_args` is a pure function of the parsed options except that it lists the
installed connector names (:mod:`kvbridge.integrations.names`, which imports the plugins'
modules); a bad value raises :class:`~kvbridge.errors.ConfigError` naming the option and key.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from kvbridge.config import Preset
from kvbridge.errors import ConfigError
from kvbridge.integrations import names
from kvbridge.tools.args import parse_json_object

__all__ = ["KV_ROLES", "ConnectorArgs", "add_connector_arguments", "connector_args"]

#: vLLM's ``kv_role`` values
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KTC = "--kv-transfer-config"


@dataclass(frozen=True)
class ConnectorArgs:
    """The connector name asked for (None: ``KVBridgeConnector``), its preset, the extra config."""

    connector: str | None = None
    preset: Preset | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def add_connector_arguments(p: argparse.ArgumentParser) -> None:
    """``--extra-config``, ``--connector`` and ``--kv-transfer-config``."""
    p.add_argument("--extra-config", metavar="JSON", default=None,
                   help="the engine's kv_connector_extra_config (a JSON object), e.g. "
                   "'{\"backend\": \"nixl\"}'")
    p.add_argument("--connector", metavar="NAME", default=None,
                   help="the engine's kv_connector name, e.g. KVBridgeNixlConnector (it may "
                   "preselect the backend or add a tier; default KVBridgeConnector)")
    p.add_argument(_KTC, metavar="JSON", default=None,
                   help="instead of the two above: the JSON given to vllm serve "
                   "--kv-transfer-config, e.g. '{\"kv_connector\": \"KVBridgeConnector\", "
                   "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {…}}'")


def connector_args(args: argparse.Namespace) -> ConnectorArgs:
    """What the options name (see the module docstring)."""
    if args.kv_transfer_config is None:
        return ConnectorArgs(args.connector, names.preset_for(args.connector),
                             parse_json_object(args.extra_config, "--extra-config"))
    if args.extra_config is not None or args.connector is not None:
        raise ConfigError(f"{_KTC} already names the connector and its extra config: drop "
                          "--connector and --extra-config")
    ktc = parse_json_object(args.kv_transfer_config, _KTC)
    name = ktc.get("kv_connector")
    known = [names.GENERIC, *(c.name for c in names.connector_names())]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{_KTC}: kv_connector is missing or not a string, got {name!r} "
                          f"(kvbridge's: {', '.join(known)})")
    if name not in known:
        raise ConfigError(f"{_KTC}: kv_connector {name!r} is not a kvbridge connector, so "
                          f"kvbridge has nothing to check (kvbridge's: {', '.join(known)})")
    role = ktc.get("kv_role")
    if role is not None and role not in KV_ROLES:
        raise ConfigError(f"{_KTC}: kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
    extra = ktc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{_KTC}: kv_connector_extra_config must be a JSON object, got "
                          f"{type(extra).__name__}")
    return ConnectorArgs(name, names.preset_for(name, f"{_KTC} kv_connector"), dict(extra))

"""One vLLM connector name per installed backend (vLLM-free; the vLLM module builds the classes).

``KVBridgeConnector`` picks its backend from the configuration. Every installed transport and
offload tier also gets a name of its own, which is ``KVBridgeConnector`` with that backend
preselected, so switching transport is changing one word of ``--kv-transfer-config``:

=============================  =========================================================
``KVBridgeShmConnector``       backend ``shm`` (same host, process_vm_readv/writev)
``KVBridgeNixlConnector``      backend ``nixl`` (UCX; LIBFABRIC on EFA)
``KVBridgeMooncakeConnector``  backend ``mooncake`` (Mooncake Transfer Engine)
``KVBridgeComposeConnector``   backend ``compose`` (its members still come from the config)
``KVBridgeLMCacheConnector``   the ``lmcache`` tier added to the offload tiers
``KVBridgeMooncakeStoreConnector``, ``KVBridgeDramConnector``, ``KVBridgeDiskConnector``:
                               likewise for those tiers
=============================  =========================================================

A tier name keeps the configured transport (default ``shm``) and adds the tier (after the tiers
the configuration lists). A transport name next to a ``backend`` setting that names another
backend is a :class:`~kvbridge.errors.ConfigError` (which one was meant cannot be guessed). The
in-process ``memory`` transport gets no name: it cannot reach another engine. Third-party
plugins get ``KVBridge<CamelName>Connector``. A name whose backend cannot load (its native
library is missing) fails at engine start-up with the install hint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbridge import registry
from kvbridge.config import Preset

__all__ = ["GENERIC", "ConnectorName", "connector_name", "connector_names", "lookup",
           "preset_for"]

GENERIC = "KVBridgeConnector"
_WORDS = {"lmcache": "LMCache", "nixl": "Nixl", "shm": "Shm"}
#: Built-in names, registered even where entry-point discovery finds nothing (so a missing
#: plugin gives the install hint rather than vLLM's "unsupported connector").
_BUILTIN: tuple[tuple[str, Literal["transport", "tier"]], ...] = (
    ("shm", "transport"), ("nixl", "transport"), ("mooncake", "transport"),
    ("compose", "transport"), ("lmcache", "tier"), ("mooncake_store", "tier"),
    ("dram", "tier"), ("disk", "tier"))
_UNNAMED = {"memory"}


@dataclass(frozen=True)
class ConnectorName:
    """A vLLM connector name and the backend (transport or tier) it preselects."""

    name: str
    backend: str
    kind: Literal["transport", "tier"]

    def preset(self) -> Preset:
        source = f"kv_connector {self.name}"
        if self.kind == "transport":
            return Preset(source, backend=self.backend)
        return Preset(source, tier=self.backend)


def connector_name(backend: str) -> str:
    """``nixl`` → ``KVBridgeNixlConnector``; ``mooncake_store`` →
    ``KVBridgeMooncakeStoreConnector``."""
    camel = "".join(_WORDS.get(part, part.capitalize()) for part in backend.split("_"))
    return f"KVBridge{camel}Connector"


def connector_names() -> list[ConnectorName]:
    """Every backend-specific name: the built-in ones and those of installed plugins (a
    plugin whose name would collide with an earlier one gets none)."""
    candidates: list[tuple[str, Literal["transport", "tier"]]] = list(_BUILTIN)
    candidates += [(b, "transport") for b in registry.available()]
    candidates += [(b, "tier") for b in registry.available_tiers()]
    by_name: dict[str, ConnectorName] = {}
    for backend, kind in candidates:
        if backend not in _UNNAMED:
            by_name.setdefault(connector_name(backend), ConnectorName(
                connector_name(backend), backend, kind))
    return sorted(by_name.values(), key=lambda c: (c.kind != "transport", c.backend))


def lookup(name: str) -> ConnectorName | None:
    """The backend-specific name ``name``, or None (also for :data:`GENERIC`)."""
    for entry in connector_names():
        if entry.name == name:
            return entry
    return None


def preset_for(name: str | None, what: str = "--connector") -> Preset | None:
    """The preset of connector ``name`` (None for :data:`GENERIC` or no name);
    :class:`~kvbridge.errors.ConfigError` naming ``what`` for a name that is neither."""
    if not name or name == GENERIC:
        return None
    entry = lookup(name)
    if entry is None:
        from kvbridge.errors import ConfigError

        raise ConfigError(f"{what}: no kvbridge connector is called {name!r} (known: {GENERIC}, "
                          f"{', '.join(c.name for c in connector_names())})")
    return entry.preset()

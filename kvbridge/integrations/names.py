"""One vLLM connector name per installed backend (vLLM-free; the vLLM module builds the classes).

``KVBridgeConnector`` picks its backend from the configuration. Every installed transport and
offload tier also gets a name of its own, which is ``KVBridgeConnector`` with that backend
preselected, so switching transport is changing one word of ``--kv-transfer-config``:
``KVBridgeShmConnector`` (backend ``shm``), ``KVBridgeNixlConnector`` (backend ``nixl``),
``KVBridgeLMCacheConnector`` (the ``lmcache`` tier added to the offload tiers), and so on for
every name ``kvbridge backends`` lists.

The word between ``KVBridge`` and ``Connector`` is the plugin's own: the ``connector_word``
class attribute of its Transport or Tier class (``"LMCache"``), else the entry-point name in
CamelCase (``mooncake_store`` → ``MooncakeStore``). A class whose ``connector_word`` is ``""``
gets no name: the in-process transports (``memory``) cannot reach another engine.

A tier name keeps the configured transport (default ``shm``) and adds the tier (after the tiers
the configuration lists). A transport name next to a ``backend`` setting that names another
backend is a :class:`~kvbridge.errors.ConfigError` (which one was meant cannot be guessed). A
backend kvbridge's extras ship but that is not installed (:func:`kvbridge.registry.known`) still
gets a name (CamelCase of its name, kind ``"absent"``): an engine started with it fails at
start-up with the install hint instead of vLLM's "unsupported connector"; so does a name whose
backend cannot load (its native library is missing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvbridge import registry
from kvbridge.config import Preset
from kvbridge.errors import ConfigError

__all__ = ["GENERIC", "ConnectorName", "connector_name", "connector_names", "lookup",
           "preset_for"]

GENERIC = "KVBridgeConnector"
Kind = Literal["transport", "tier", "absent"]


@dataclass(frozen=True)
class ConnectorName:
    """A vLLM connector name and the backend it preselects: a transport, a tier, or (kind
    ``"absent"``) one kvbridge's extras ship that is not installed here."""

    name: str
    backend: str
    kind: Kind

    def preset(self) -> Preset:
        """The transport, or the tier, this name fixes; an absent backend is preset as the
        transport, so loading the configuration fails with its install hint."""
        source = f"kv_connector {self.name}"
        if self.kind == "tier":
            return Preset(source, tier=self.backend)
        return Preset(source, backend=self.backend)


def connector_name(backend: str, word: str | None = None) -> str:
    """``KVBridge<word>Connector``; without ``word``, the CamelCase of ``backend``: ``nixl`` →
    ``KVBridgeNixlConnector``, ``mooncake_store`` → ``KVBridgeMooncakeStoreConnector``."""
    if word is None:
        word = "".join(part.capitalize() for part in backend.split("_"))
    return f"KVBridge{word}Connector"


def _word(backend: str, group: str) -> str | None:
    """The plugin class's ``connector_word`` (None: none given, or the class does not import)."""
    word = getattr(registry.plugin_class(backend, group), "connector_word", None)
    return word if isinstance(word, str) else None


def connector_names() -> list[ConnectorName]:
    """Every backend-specific name: one per installed transport and tier, then one per backend
    kvbridge's extras ship that is not installed (a name that would collide with an earlier one
    is not given twice). Imports each plugin's module to read its ``connector_word``."""
    candidates: list[tuple[str, Kind, str | None]] = []
    candidates += [(b, "transport", _word(b, registry.GROUP)) for b in registry.available()]
    candidates += [(b, "tier", _word(b, registry.TIER_GROUP)) for b in registry.available_tiers()]
    installed = {b for b, _, _ in candidates}
    candidates += [(b, "absent", None) for b in sorted(registry.known()) if b not in installed]
    by_name: dict[str, ConnectorName] = {}
    for backend, kind, word in candidates:
        if word != "":
            name = connector_name(backend, word)
            by_name.setdefault(name, ConnectorName(name, backend, kind))
    order = {"transport": 0, "tier": 1, "absent": 2}
    return sorted(by_name.values(), key=lambda c: (order[c.kind], c.backend))


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

        raise ConfigError(f"{what}: no kvbridge connector is called {name!r} (known: {GENERIC}, "
                          f"{', '.join(c.name for c in connector_names())})")
    return entry.preset()

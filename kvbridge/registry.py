"""Plugin discovery through stevedore: transports (``kvbridge.backends``), offload tiers
(``kvbridge.tiers``) and what a backend offers the benches (``kvbridge.bench_hooks``).

The core never imports a backend by name: every backend, the built-in ``shm`` included, is an
entry point exactly as a third-party plugin would be. Listing is cheap (no backend module is
imported until one is loaded); heavy native imports happen in the backend's constructor.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbridge.errors import BackendNotFound, BackendUnavailable, KVBridgeError
from kvbridge.transport import BenchHook, Transport

__all__ = ["GROUP", "TIER_GROUP", "BENCH_GROUP", "BackendStatus", "available", "load_class",
           "create", "status", "available_tiers", "load_tier_class", "tier_status", "bench_hook",
           "BENCH_HOOK_REQUIRED"]

GROUP = "kvbridge.backends"
TIER_GROUP = "kvbridge.tiers"
#: modules a backend offers the benches (raw-library sessions and costs), by backend name
BENCH_GROUP = "kvbridge.bench_hooks"
#: what every such module defines (:class:`kvbridge.transport.BenchHook`)
BENCH_HOOK_REQUIRED = ("raw_session",)
log = logging.getLogger("kvbridge.registry")

#: What to install when a backend's native dependency is missing.
INSTALL_HINTS: dict[str, str] = {
    "nixl": "pip install 'kvbridge[nixl]'  (nixl==1.5.1 nixl-cu13==1.5.1 --no-deps on CPU hosts)",
    "mooncake": "pip install 'kvbridge[mooncake]' and apt-get install -y libibverbs1",
    "lmcache": "pip install --no-deps lmcache==0.5.6 sortedcontainers aiofile, after the CPU "
               "torch (docs/backends/lmcache.md)",
    "mooncake_store": "pip install mooncake-transfer-engine-non-cuda and apt-get install -y "
                      "libibverbs1; run mooncake_master (docs/offload.md)",
}


def _entry_points(group: str = GROUP) -> dict[str, Any]:
    """The group's entry points as stevedore discovers them (its cached scan), not loaded."""
    from stevedore import ExtensionManager

    class _Lister(ExtensionManager[Any]):  # stevedore's discovery without loading every plugin
        def __init__(self) -> None:
            self.namespace = group

    return {ep.name: ep for ep in _Lister().list_entry_points()}


def available() -> list[str]:
    """Names of the installed backends (cheap: imports nothing)."""
    return sorted(_entry_points())


def _load(group: str, name: str, base: type[Any], what: str) -> type[Any]:
    """Import entry point ``name`` of ``group`` and check it subclasses ``base``."""
    eps = _entry_points(group)
    ep = eps.get(name)
    if ep is None:
        near = difflib.get_close_matches(name, list(eps), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        installed = ", ".join(sorted(eps)) or "none"
        raise BackendNotFound(f"unknown {what} {name!r}{hint} (installed: {installed})")
    try:
        cls = ep.load()
    except ImportError as exc:
        raise BackendUnavailable(_unavailable(name, exc)) from exc
    except Exception as exc:  # a broken plugin (e.g. missing attribute) must not crash listing
        raise BackendUnavailable(
            f"{what} {name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise BackendUnavailable(f"{what} {name!r} ({ep.value}) is not a kvbridge {base.__name__}")
    return cls


def load_class(name: str) -> type[Any]:
    """Import backend ``name`` and return its Transport class.

    Raises :class:`BackendNotFound` (with the installed names and a "did you mean") or
    :class:`BackendUnavailable` (with the import error and what to install).
    """
    return _load(GROUP, name, Transport, "kvbridge backend")


def create(name: str, agent_name: str, options: Mapping[str, Any] | None = None) -> Any:
    """Load backend ``name`` and construct it for ``agent_name`` with ``options``."""
    cls = load_class(name)
    try:
        return cls(agent_name, options or {})
    except KVBridgeError:
        raise
    except ImportError as exc:
        raise BackendUnavailable(_unavailable(name, exc)) from exc


def bench_hook(name: str) -> BenchHook | None:
    """What backend ``name`` offers the benches — the module its ``kvbridge.bench_hooks`` entry
    point names, checked against :class:`~kvbridge.transport.BenchHook` — or None when it has
    no entry point there. Its optional extras are told apart with ``isinstance`` against
    :class:`~kvbridge.transport.RawResponderHook` and :class:`~kvbridge.transport.BlockCostHook`.

    Raises :class:`BackendUnavailable` when the module cannot be imported, or when it lacks a
    required function (the error names it)."""
    ep = _entry_points(BENCH_GROUP).get(name)
    if ep is None:
        return None
    try:
        module = ep.load()
    except ImportError as exc:
        raise BackendUnavailable(_unavailable(name, exc)) from exc
    missing = [attr for attr in BENCH_HOOK_REQUIRED if not callable(getattr(module, attr, None))]
    if missing or not isinstance(module, BenchHook):
        raise BackendUnavailable(
            f"bench hook of backend {name!r} ({ep.value}) has no {', '.join(missing)}(), which "
            f"the {BENCH_GROUP} entry points must offer (kvbridge.transport.BenchHook)")
    return module


def _unavailable(name: str, exc: BaseException) -> str:
    hint = INSTALL_HINTS.get(name)
    return f"backend {name!r} cannot load: {exc}" + (f" — install: {hint}" if hint else "")


@dataclass(frozen=True)
class BackendStatus:
    name: str
    target: str
    loadable: bool
    detail: str


def status() -> list[BackendStatus]:
    """Each installed backend, whether its module imports, and why not."""
    rows = []
    for name, ep in sorted(_entry_points().items()):
        try:
            cls = load_class(name)
            probe = getattr(cls, "probe", None)
            detail = probe() if callable(probe) else "ok"
            rows.append(BackendStatus(name, ep.value, True, str(detail)))
        except KVBridgeError as exc:
            rows.append(BackendStatus(name, ep.value, False, str(exc)))
    return rows


def available_tiers() -> list[str]:
    """Names of the installed offload tiers (cheap: imports nothing)."""
    return sorted(_entry_points(TIER_GROUP))


def load_tier_class(name: str) -> type[Any]:
    """Import offload tier ``name``; same errors as :func:`load_class`."""
    from kvbridge.offload.tier import Tier

    return _load(TIER_GROUP, name, Tier, "offload tier")


def tier_status() -> list[BackendStatus]:
    """Each installed offload tier, whether its module imports, and why not."""
    rows = []
    for name, ep in sorted(_entry_points(TIER_GROUP).items()):
        try:
            load_tier_class(name)
            rows.append(BackendStatus(name, ep.value, True, "ok"))
        except KVBridgeError as exc:
            rows.append(BackendStatus(name, ep.value, False, str(exc)))
    return rows

"""Plugin discovery through stevedore: transports (``kvbridge.backends``), offload tiers
(``kvbridge.tiers``) and what a backend offers the benches (``kvbridge.bench_hooks``).

The core never imports a backend by name: every backend, the built-in ``shm`` included, is an
entry point exactly as a third-party plugin would be. Listing is cheap (no backend module is
imported until one is loaded); heavy native imports happen in the backend's constructor.

What to install when a backend cannot load is the plugin's own word: the ``install_hint`` class
attribute of its Transport or Tier class. A backend whose distribution is not installed at all
has no class to ask; kvbridge knows it only if one of kvbridge's own extras requires a
``kvbridge-*`` distribution under that name (``pip install 'kvbridge[nixl]'``: :func:`known`),
read from kvbridge's installed metadata, so no table of backend names lives in the code
(docs/writing-a-backend.md).
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from kvbridge.errors import BackendNotFound, BackendUnavailable, KVBridgeError
from kvbridge.offload.tier import Tier
from kvbridge.transport import BenchHook, Transport

__all__ = ["GROUP", "TIER_GROUP", "BENCH_GROUP", "BackendStatus", "available", "load_class",
           "create", "status", "available_tiers", "load_tier_class", "tier_status", "bench_hook",
           "BENCH_HOOK_REQUIRED", "known",
           "install_hint", "plugin_class"]

GROUP = "kvbridge.backends"
TIER_GROUP = "kvbridge.tiers"
#: modules a backend offers the benches (raw-library sessions and costs), by backend name
BENCH_GROUP = "kvbridge.bench_hooks"
#: what every such module defines (:class:`kvbridge.transport.BenchHook`)
BENCH_HOOK_REQUIRED = ("raw_session",)
log = logging.getLogger("kvbridge.registry")

#: kvbridge's extras that ship a backend: ``kvbridge-nixl[native]; extra == "nixl"``
_EXTRA_REQUIREMENT = re.compile(
    r"^\s*(kvbridge[-_.][A-Za-z0-9._-]+)[^;]*;.*\bextra\s*==\s*[\"']([^\"']+)[\"']")


def _entry_points(group: str = GROUP) -> dict[str, Any]:
    """The group's entry points as stevedore discovers them (its cached scan), not loaded."""
    from stevedore import ExtensionManager  # only when asked: `import kvbridge` stays light

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
        absent = _absent(name)
        if absent:
            raise BackendUnavailable(absent)
        near = difflib.get_close_matches(name, list(eps), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        installed = ", ".join(sorted(eps)) or "none"
        raise BackendNotFound(f"unknown {what} {name!r}{hint} (installed: {installed})")
    try:
        cls = ep.load()
    except ImportError as exc:
        raise BackendUnavailable(_unavailable(name, exc, group=group)) from exc
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
        raise BackendUnavailable(_unavailable(name, exc, cls)) from exc


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


def _unavailable(name: str, exc: BaseException, cls: type[Any] | None = None,
                 group: str = GROUP) -> str:
    hint = (_class_hint(cls) if cls is not None else "") or install_hint(name, group)
    what = "offload tier" if group == TIER_GROUP else "backend"
    return f"{what} {name!r} cannot load: {exc}" + (f" — install: {hint}" if hint else "")


@functools.cache
def known() -> dict[str, str]:
    """Backend and tier names kvbridge's own extras ship, installed or not: name (the extra,
    ``-`` read as ``_``) → the ``kvbridge-*`` distribution it requires. From kvbridge's installed
    metadata; empty when kvbridge is not installed (a bare source tree on ``sys.path``)."""
    try:
        requires = metadata.requires("kvbridge") or []
    except metadata.PackageNotFoundError:
        return {}
    found: dict[str, str] = {}
    for line in requires:
        m = _EXTRA_REQUIREMENT.match(line)
        if m:
            found.setdefault(m.group(2).replace("-", "_").lower(), m.group(1))
    return found


def _extra_hint(name: str) -> str:
    return f"pip install 'kvbridge[{name}]'" if name in known() else ""


def _absent(name: str) -> str:
    """Why ``name`` does not load when no entry point has it: "" unless kvbridge's extras know
    it (then: which distribution ships it and how to install that)."""
    dist = known().get(name)
    if dist is None or name in _entry_points(GROUP) or name in _entry_points(TIER_GROUP):
        return ""
    return (f"{name!r} is not installed here: it ships in the {dist} distribution — install: "
            f"{_extra_hint(name)}")


def _class_hint(cls: type[Any]) -> str:
    hint = getattr(cls, "install_hint", "")
    return hint if isinstance(hint, str) else ""


def plugin_class(name: str, group: str = GROUP) -> type[Any] | None:
    """The class entry point ``name`` of ``group`` names, or None when no such entry point is
    installed or it does not import (never raises; imports the plugin's module)."""
    ep = _entry_points(group).get(name)
    if ep is None:
        return None
    try:
        cls = ep.load()
    except Exception:  # noqa: BLE001 - a broken plugin is reported by load_class, not here
        return None
    return cls if isinstance(cls, type) else None


def install_hint(name: str, group: str = GROUP) -> str:
    """What to install so that backend ``name`` (a tier with ``group=TIER_GROUP``) loads, or "":
    the plugin class's ``install_hint`` when its module imports, else ``pip install
    'kvbridge[<name>]'`` when kvbridge's extras ship that name (:func:`known`)."""
    cls = plugin_class(name, group)
    return (_class_hint(cls) if cls is not None else "") or _extra_hint(name)


@dataclass(frozen=True)
class BackendStatus:
    name: str
    target: str
    loadable: bool
    detail: str


def _probe(cls: type[Any], name: str, group: str) -> str:
    """The plugin class's ``probe()`` line ("ok" without one): a probe imports the plugin's
    native library, so a class that imports while its library does not is not loadable. A probe
    that raises :class:`ImportError` is :class:`BackendUnavailable` with the install hint."""
    probe = getattr(cls, "probe", None)
    if not callable(probe):
        return "ok"
    try:
        return str(probe())
    except KVBridgeError:
        raise
    except ImportError as exc:
        raise BackendUnavailable(_unavailable(name, exc, cls, group)) from exc


def _statuses(group: str, load: Any) -> list[BackendStatus]:
    rows = []
    for name, ep in sorted(_entry_points(group).items()):
        try:
            detail = _probe(load(name), name, group)
            rows.append(BackendStatus(name, ep.value, True, detail))
        except KVBridgeError as exc:
            rows.append(BackendStatus(name, ep.value, False, str(exc)))
    return rows


def status() -> list[BackendStatus]:
    """Each installed backend, whether it loads (its module imports and its ``probe()``, which
    imports the native library, passes), and why not."""
    return _statuses(GROUP, load_class)


def available_tiers() -> list[str]:
    """Names of the installed offload tiers (cheap: imports nothing)."""
    return sorted(_entry_points(TIER_GROUP))


def load_tier_class(name: str) -> type[Any]:
    """Import offload tier ``name``; same errors as :func:`load_class`."""

    return _load(TIER_GROUP, name, Tier, "offload tier")


def tier_status() -> list[BackendStatus]:
    """Each installed offload tier, whether it loads (as :func:`status`: a tier whose class
    imports but whose library does not is not loadable), and why not."""
    return _statuses(TIER_GROUP, load_tier_class)

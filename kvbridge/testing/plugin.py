"""pytest plugin: the markers of kvbridge's suites.

Loaded by the repository's root ``conftest.py`` (``pytest_plugins``), not by a ``pytest11`` entry
point: installing kvbridge leaves other projects' pytest runs untouched. A backend distributed
on its own whose tests use these markers loads it the same way from its own ``conftest.py``.

``vllm`` marks end-to-end tests with real vLLM engines. Every other marker is derived, not
listed: one per distribution that offers a backend or tier in ``kvbridge.backends`` /
``kvbridge.tiers`` (kvbridge itself aside), named after the distribution without its
``kvbridge-`` prefix (``kvbridge-nixl`` → ``nixl``), plus one per backend distribution kvbridge's
extras name (:func:`kvbridge.registry.known`), so a backend's own tests still collect where it is
not installed. The root configuration turns ``--strict-markers`` on: a test marked with anything
else is an error.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

from kvbridge import registry

__all__ = ["backend_markers", "marker_name"]

_STATIC = ("vllm: end-to-end tests with real vLLM engines (slow)",)


def marker_name(distribution: str) -> str:
    """``kvbridge-nixl`` → ``nixl``; ``acme-warp`` → ``acme_warp`` (PEP 503 name, ``_``)."""
    name = re.sub(r"[-_.]+", "_", distribution).lower()
    return name.removeprefix("kvbridge_") or name


def backend_markers() -> dict[str, str]:
    """Marker name → description: one per backend distribution installed here or named by
    kvbridge's extras."""
    offers: dict[str, set[str]] = {}
    for group in (registry.GROUP, registry.TIER_GROUP):
        for ep in metadata.entry_points(group=group):
            dist = ep.dist.name if ep.dist is not None else None
            if dist and marker_name(dist) != "kvbridge":
                offers.setdefault(dist, set()).add(ep.name)
    markers = {marker_name(d): f"needs the {d} distribution (backends and tiers: "
               f"{', '.join(sorted(names))})" for d, names in offers.items()}
    for dist in registry.known().values():
        markers.setdefault(marker_name(dist), f"needs the {dist} distribution (not installed)")
    return markers


def pytest_configure(config: Any) -> None:
    lines = [*_STATIC, *(f"{name}: {text}" for name, text in sorted(backend_markers().items()))]
    for line in lines:
        config.addinivalue_line("markers", line)

"""The repository's own pytest configuration: the markers of kvbridge's suites.

Loaded for every test under this root (``tests/``, ``backends/*/tests``, ``examples/*/tests``),
which run with ``--strict-markers`` (pyproject.toml). The hook lives in
:mod:`kvbridge.testing.plugin`; it is deliberately *not* a ``pytest11`` entry point, so
installing kvbridge adds nothing to the pytest runs of other projects.
"""

from __future__ import annotations

from typing import Any

from kvbridge.testing import plugin


def pytest_configure(config: Any) -> None:
    # an editable install made before the entry point was dropped still loads it as "kvbridge"
    if not config.pluginmanager.has_plugin("kvbridge"):
        plugin.pytest_configure(config)

"""Shared fixtures: a prefill and a decode transfer loop in this process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.testing.agents import LocalAgent
from kvbridge.testing.handoffs import FAST


@pytest.fixture
def local_pd(request: pytest.FixtureRequest) -> Iterator[tuple[LocalAgent, LocalAgent]]:
    """A prefill and a decode loop in this process over the ``memory`` transport (or the
    ``backend`` of an indirect parameter's config, skipped where it cannot load here)."""
    extra: dict[str, Any] = dict(FAST)
    extra.update(getattr(request, "param", {}) or {})
    backend = extra.get("backend", "memory")
    if backend != "memory":
        from kvbridge import registry

        status = {s.name: s for s in registry.status()}
        if backend not in status or not status[backend].loadable:
            pytest.skip(f"backend {backend} unavailable here")
    p = LocalAgent("prefill", extra=extra)
    d = LocalAgent("decode", extra=extra)
    try:
        p.fill(1)
        d.fill(2)
        yield p, d
    finally:
        p.close()
        d.close()

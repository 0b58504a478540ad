"""The kvbridge disaggregation proxy: routes OpenAI requests to P and D engines by push or pull.

Modules, each one job; imports point down (``cli → app → dispatch → relay → pool → failures,
settings, routing, metrics, reasons``):

- :mod:`~kvbridge.proxy.cli` — ``kvbridge proxy`` / ``python -m kvbridge.proxy``: flags, main;
- :mod:`~kvbridge.proxy.app` — :class:`ProxyServer`: the aiohttp application, its endpoints,
  start and stop, and :func:`serve`;
- :mod:`~kvbridge.proxy.dispatch` — push or pull per request, retries, explained failures;
- :mod:`~kvbridge.proxy.relay` — the legs: P's prefill, D's answer, the stream to the client;
- :mod:`~kvbridge.proxy.pool` — the engines: upstream session, probes, health, rotation;
- :mod:`~kvbridge.proxy.failures` — :class:`~kvbridge.proxy.failures.LegFailed` and its causes;
- :mod:`~kvbridge.proxy.settings` — :class:`ProxySettings` (plain data, no aiohttp);
- :mod:`~kvbridge.proxy.routing` — the policy, pure functions; :mod:`~kvbridge.proxy.metrics`,
  :mod:`~kvbridge.proxy.reasons` (why a transfer failed, asked of the engines).

See docs/proxy.md. aiohttp (the ``proxy`` extra) is only imported when :class:`ProxyServer`,
:func:`serve`, :func:`add_arguments` or :func:`main` is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvbridge.proxy.routing import ProxyMode
from kvbridge.proxy.settings import ProxySettings

__all__ = ["ProxyMode", "ProxyServer", "ProxySettings", "serve", "add_arguments", "main"]

#: Names whose modules need aiohttp, imported on first use.
_LAZY = {"ProxyServer": "app", "serve": "app", "add_arguments": "cli", "main": "cli"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # aiohttp is an optional dependency: import it only when asked for
        return getattr(importlib.import_module(f"kvbridge.proxy.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The kvbridge disaggregation proxy: routes OpenAI requests to P and D engines by push or pull.

:mod:`~kvbridge.proxy.routing` is the policy (pure functions), :mod:`~kvbridge.proxy.app` the
aiohttp server and CLI (``kvbridge proxy`` / ``python -m kvbridge.proxy``). See docs/proxy.md.
aiohttp is only imported when :class:`ProxyServer`, :func:`serve` or the CLI is used.
"""

from __future__ import annotations

from typing import Any

from kvbridge.proxy.routing import ProxyMode

__all__ = ["ProxyMode", "ProxyServer", "ProxySettings", "serve", "add_arguments", "main"]


def __getattr__(name: str) -> Any:
    if name in ("ProxyServer", "ProxySettings", "serve", "add_arguments", "main"):
        from kvbridge.proxy import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

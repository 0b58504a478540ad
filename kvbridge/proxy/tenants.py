"""Tenant isolation at the proxy: vLLM's ``cache_salt`` from an operator-chosen header.

vLLM salts its prefix-cache block hashes with a request's ``cache_salt``, and kvbridge salts
its tier keys and the hand-off's prompt digest with it (:func:`kvbridge.offload.keys.salted`):
requests under different salts never share KV. A salt the client chooses is worthless for
isolation, though — any client can send another tenant's. With ``--salt-from-header H`` the
proxy makes the salt itself:

- the client's own ``cache_salt`` is removed from every request body, always;
- a request carrying header ``H`` (a tenant name, an API key…) gets
  ``cache_salt = HMAC-SHA256(secret, value)`` (hex), the same on every proxy sharing the secret
  and on every restart, so a tenant's tier entries keep serving it;
- a request without ``H`` (or with an empty one) gets no salt: today's behaviour, shared with
  every other request without one.

The secret is the fleet's (``--control-secret`` / ``KVBRIDGE_SECRET``): without one there is
nothing a client cannot recompute, so :class:`~kvbridge.proxy.settings.ProxySettings` refuses
the flag. A header value over :data:`MAX_VALUE` bytes is a 400 naming the header.

Pure functions, no I/O; safe from any thread.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_VALUE", "TenantSalt", "SaltError"]

#: the longest tenant header value taken (bytes, UTF-8)
MAX_VALUE = 4096


class SaltError(ValueError):
    """A request whose tenant header cannot be used (the message names the header)."""


@dataclass(frozen=True)
class TenantSalt:
    """Derives ``cache_salt`` from header :attr:`header`, keyed by :attr:`secret`."""

    header: str
    secret: str

    def salt_of(self, value: str) -> str:
        """The salt of tenant header value ``value`` (non-empty)."""
        raw = value.encode("utf-8", "surrogateescape")
        if len(raw) > MAX_VALUE:
            raise SaltError(f"header {self.header} is {len(raw)} bytes, over {MAX_VALUE}")
        key = hashlib.sha256(b"kvbridge-tenant-salt\0" + self.secret.encode()).digest()
        return hmac.new(key, raw, hashlib.sha256).hexdigest()

    def apply(self, body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
        """Set (or remove) ``body["cache_salt"]`` for a request with ``headers``; returns the
        salt set, None if none. Raises :class:`SaltError` for an unusable header value."""
        body.pop("cache_salt", None)
        value = headers.get(self.header, "").strip()
        if not value:
            return None
        body["cache_salt"] = salt = self.salt_of(value)
        return salt

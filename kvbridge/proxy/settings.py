"""What one proxy is told: :class:`ProxySettings`, the one value the CLI flags map to.

Plain data, no I/O and no aiohttp, so the CLI, the deploy checks and the tests can build and check
settings without starting anything. A :class:`ProxySettings` is frozen: every part of a running
proxy reads the same value from any thread. :meth:`ProxySettings.check` raises
:class:`~kvbridge.errors.ConfigError` naming the flag of the first bad value; a proxy calls it
before it builds anything, so a bad flag never leaves a half-built proxy behind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.proxy.credit import KvAdmission
from kvbridge.proxy.routing import ProxyMode

__all__ = ["ProxySettings"]


@dataclass(frozen=True)
class ProxySettings:
    """Everything a proxy needs; the CLI flags map one to one (``--push-headroom`` …)."""

    prefill: Sequence[str]
    decode: Sequence[str]
    mode: ProxyMode = ProxyMode.AUTO
    host: str = "127.0.0.1"
    port: int = 8000
    push_headroom: int = 4
    timeout_s: float = 600.0
    connect_timeout_s: float = 3.0
    cooldown_s: float = 2.0
    probe_timeout_s: float = 30.0
    control_timeout_s: float = 1.0
    """Upper bound on one control-channel query (and on the probe that finds the address) made
    to explain a failed leg."""
    control_secret: str | None = None
    """The fleet's control-channel secret (``KVBRIDGE_SECRET``), to query engines that use one;
    None: the per-user secret engines on this host use (kvbridge.trust)."""
    max_retries: int = 1
    """How many times one client request may be dispatched again after an engine failed it
    before any byte reached the client (``--retries``; 0: never)."""
    health_interval_s: float = 2.0
    """Period of the background ``/health`` check of every engine (``--health-interval``; 0:
    none, and an engine that refused a connection is avoided for ``cooldown_s`` only)."""
    health_failures: int = 2
    """Failed checks in a row (timeouts, non-200) that take an engine out of rotation; a refused
    connection takes it out at once."""
    salt_header: str | None = None
    """``--salt-from-header``: the request header naming the tenant; the proxy then sets each
    request's ``cache_salt`` from it (HMAC with ``control_secret``) and ignores a salt in the
    client's body (:mod:`kvbridge.proxy.tenants`). None: bodies pass as they are."""

    kv_admission: KvAdmission = KvAdmission.OFF
    """``--kv-admission``: what happens to a request no decode engine has KV credit for
    (:mod:`kvbridge.proxy.credit`): ``off`` (admit all), ``reject`` (503), ``queue``."""
    kv_credit_fraction: float = 1.0
    """``--kv-credit-fraction``: the share of each D's KV cache this proxy commits (1/N with N
    proxies in front of the same engines; above 1 overcommits)."""
    kv_queue: int = 64
    """``--kv-queue``: most requests waiting for credit at once (``queue``)."""
    kv_queue_s: float = 30.0
    """``--kv-queue-s``: longest a request waits for credit before its 503 (``queue``)."""

    def check(self) -> None:
        """Raise :class:`ConfigError` for the first value no proxy can run with."""
        if self.push_headroom < 0:
            raise ConfigError(f"--push-headroom must be >= 0, got {self.push_headroom}")
        if self.max_retries < 0:
            raise ConfigError(f"--retries must be >= 0, got {self.max_retries}")
        if self.health_interval_s < 0 or not math.isfinite(self.health_interval_s):
            raise ConfigError("--health-interval must be >= 0 (0: no health checks), got "
                              f"{self.health_interval_s}")
        if self.health_failures < 1:
            raise ConfigError(f"--health-failures must be >= 1, got {self.health_failures}")
        if self.salt_header is not None:
            if not self.salt_header.strip() or not self.salt_header.isascii():
                raise ConfigError(f"--salt-from-header must name a header, got "
                                  f"{self.salt_header!r}")
            if not self.control_secret:
                raise ConfigError("--salt-from-header needs the fleet secret "
                                  "(--control-secret or KVBRIDGE_SECRET) to key the salts: "
                                  "without it any client could compute another tenant's salt")
        if not 0 < self.kv_credit_fraction <= 16:
            raise ConfigError("--kv-credit-fraction must be in (0, 16], got "
                              f"{self.kv_credit_fraction}")
        if self.kv_queue < 0:
            raise ConfigError(f"--kv-queue must be >= 0, got {self.kv_queue}")
        if not 0 <= self.kv_queue_s < math.inf:
            raise ConfigError(f"--kv-queue-s must be >= 0 and finite, got {self.kv_queue_s}")
        for name in ("timeout_s", "connect_timeout_s", "probe_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

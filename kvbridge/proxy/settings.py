"""What one proxy is told: :class:`ProxySettings`, the one value the CLI flags map to.

Plain data, no I/O and no aiohttp, so the CLI, the deploy checks and the tests can build and check
settings without starting anything. A :class:`ProxySettings` is frozen: every part of a running
proxy reads the same value from any thread. :meth:`ProxySettings.check` raises
:class:`~kvbridge.errors.ConfigError` naming the flag of the first bad value; a proxy calls it
before it builds anything, so a bad flag never leaves a half-built proxy behind.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.errors import ConfigError
from kvbridge.proxy.credit import KvAdmission
from kvbridge.proxy.planner import PlannerSettings
from kvbridge.proxy.routing import ProxyMode

__all__ = ["ProxySettings", "parse_dns_target", "DEFAULT_ENGINE_PORT"]

#: the port ``--prefill-dns NAME`` / ``--decode-dns NAME`` mean without ``:PORT`` (vLLM's)
DEFAULT_ENGINE_PORT = 8000
_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?)*\.?$")


def parse_dns_target(value: str, flag: str) -> tuple[str, int]:
    """``NAME[:PORT]`` → (name, port); :class:`ConfigError` naming ``flag`` for anything else (a
    URL, an IP literal in brackets, a bad label, a port outside 1-65535)."""
    name, sep, port_text = value.strip().rpartition(":")
    if not sep:
        name, port_text = value.strip(), str(DEFAULT_ENGINE_PORT)
    if not _DNS_NAME.match(name):
        raise ConfigError(f"{flag} must be a DNS name with an optional :PORT, such as "
                          f"kvbridge-decode.kvbridge.svc.cluster.local:8000, got {value[:100]!r}")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{flag} {value[:100]!r}: the port must be 1-65535")
    return name, int(port_text)


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
    prefill_dns: str | None = None
    """``--prefill-dns NAME[:PORT]``: prefill engines are the addresses NAME resolves to
    (:mod:`kvbridge.proxy.discovery`); None: none found by DNS."""
    decode_dns: str | None = None
    """``--decode-dns NAME[:PORT]``: as ``prefill_dns``, for decode engines."""
    engines_file: str | None = None
    """``--engines-file PATH``: a JSON file ``{"prefill": [URL…], "decode": [URL…]}`` the proxy
    re-reads when it changes (:mod:`kvbridge.proxy.discovery`)."""
    discovery_interval_s: float = 5.0
    """``--discovery-interval``: seconds between two discovery rounds (DNS re-resolved, the
    file's size and mtime checked)."""

    def discovers(self, role: str) -> bool:
        """Whether discovery may find engines of ``role`` ("prefill" or "decode")."""
        dns = self.prefill_dns if role == "prefill" else self.decode_dns
        return dns is not None or self.engines_file is not None

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
    kv_events: bool = False
    """``--kv-events``: subscribe to the KV events of every engine whose probe names a
    publisher (``kvbridge_kv_events``) and place requests by what the engines really hold
    (:mod:`kvbridge.proxy.kvfeed`); the engines are probed, decode engines too."""
    otlp_traces_endpoint: str | None = None
    """``--otlp-traces-endpoint URL`` (vLLM's flag; default
    ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): export OpenTelemetry spans of every request there
    (:mod:`kvbridge.proxy.tracing`); None: no tracing, and no OpenTelemetry import."""

    plan: PlannerSettings = PlannerSettings()
    """The planner's knobs (``--plan-ttft-slo-ms``, ``--plan-tie``, ``--plan-explore-every``):
    used by requests in ``auto`` mode, the planner (:mod:`kvbridge.proxy.planner`)."""

    def check(self) -> None:
        """Raise :class:`ConfigError` for the first value no proxy can run with."""
        for role, urls in (("prefill", self.prefill), ("decode", self.decode)):
            if not urls and not self.discovers(role):
                raise ConfigError(f"no {role} engine: give --{role} URL..., --{role}-dns "
                                  "NAME[:PORT] or --engines-file PATH")
        for flag, dns in (("--prefill-dns", self.prefill_dns), ("--decode-dns", self.decode_dns)):
            if dns is not None:
                parse_dns_target(dns, flag)
        if self.engines_file is not None and not self.engines_file.strip():
            raise ConfigError("--engines-file must name a file")
        if not 0 < self.discovery_interval_s <= 3600 or not math.isfinite(
                self.discovery_interval_s):
            raise ConfigError("--discovery-interval must be > 0 and at most 3600 seconds, got "
                              f"{self.discovery_interval_s}")
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
        ep = self.otlp_traces_endpoint
        if ep is not None and (not ep.strip() or len(ep) > 2048 or not ep.isprintable()
                               or any(c.isspace() for c in ep)):
            raise ConfigError(f"--otlp-traces-endpoint must be a URL such as "
                              f"http://otel-collector:4317, got {ep[:100]!r}")
        plan = self.plan
        if not 0 <= plan.ttft_slo_ms < math.inf:
            raise ConfigError("--plan-ttft-slo-ms must be >= 0 (0: none) and finite, got "
                              f"{plan.ttft_slo_ms}")
        if not 0 <= plan.tpot_slo_ms < math.inf:
            raise ConfigError("--plan-tpot-slo-ms must be >= 0 (0: none) and finite, got "
                              f"{plan.tpot_slo_ms}")
        if not 0 <= plan.tie <= 10:
            raise ConfigError(f"--plan-tie must be in [0, 10], got {plan.tie}")
        if not 0 <= plan.explore_every <= 1_000_000:
            raise ConfigError("--plan-explore-every must be >= 0 (0: never), got "
                              f"{plan.explore_every}")
        for name in ("timeout_s", "connect_timeout_s", "probe_timeout_s", "control_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")

"""Routing policy of the disaggregation proxy: which engine, which mode, which parameters.

Everything here is plain Python over plain data (no HTTP, no I/O, no transports), so the policy is
tested as pure functions. :mod:`kvbridge.proxy.app` calls it from one asyncio event loop; nothing
here is thread-safe and nothing needs to be, because the loop never awaits between a pick and the
matching :meth:`Engine.acquire`, so two requests cannot both see the same free engine.

The request bodies built here follow the ``kv_transfer_params`` contract of KVBridgeConnector
(docs/proxy.md): vLLM's own key names plus ``transfer_id`` and ``transfer_mode``.

- pull: P gets a one-token copy with ``do_remote_decode``; the least-loaded D is picked *after*
  prefill and gets P's returned params unchanged.
- push: D is picked *first*; P and D are dispatched concurrently with one ``transfer_id``; D's
  params name P's control address, learnt beforehand by a probe (:func:`probe_body`).
- auto: push when some D has headroom (in-flight below ``push_headroom``), else pull.
"""

from __future__ import annotations

import copy
import enum
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.config import TransferMode
from kvbridge.errors import ConfigError

__all__ = [
    "Role",
    "ProxyMode",
    "ProbeInfo",
    "Engine",
    "Pool",
    "Decision",
    "decide",
    "new_transfer_id",
    "prefill_body",
    "decode_body",
    "push_decode_params",
    "probe_body",
    "parse_probe",
    "validate_request",
    "PROBE_KEYS",
]

PROBE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
"""Keys a probe answer must carry; they are what D needs to reach P in push mode."""


class Role(enum.StrEnum):
    """What an engine does for the proxy."""

    PREFILL = "prefill"
    DECODE = "decode"


#: How the proxy hands a request from P to D: the same pull | push | auto as the connector's.
ProxyMode = TransferMode


@dataclass(frozen=True)
class ProbeInfo:
    """A prefill engine's control address, as its connector reported it to a probe."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    version: str = "?"


@dataclass
class Engine:
    """One upstream vLLM engine and its live load as the proxy sees it.

    ``in_flight`` counts the proxy's open requests to it (the routing signal). After a connection
    failure the engine is *suspect* for ``cooldown_s`` and only used when every engine of its role
    is suspect, so one dead backend does not slow every request down.
    """

    url: str
    role: Role
    in_flight: int = 0
    total: int = 0
    errors: int = 0
    down_until: float = 0.0
    last_error: str = ""
    probe: ProbeInfo | None = None

    def acquire(self) -> None:
        """Count one more open request to this engine."""
        self.in_flight += 1
        self.total += 1

    def release(self) -> None:
        """Count one request to this engine as finished (call exactly once per acquire)."""
        self.in_flight = max(0, self.in_flight - 1)

    def mark_down(self, reason: str, cooldown_s: float, now: float | None = None) -> None:
        """Record a connection-level failure; routing avoids the engine for ``cooldown_s``."""
        self.errors += 1
        self.last_error = reason
        self.down_until = (time.monotonic() if now is None else now) + cooldown_s

    def mark_up(self) -> None:
        self.down_until = 0.0

    def is_up(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.down_until


class Pool:
    """The engines of one role, with least-loaded picking and round-robin tie-breaks."""

    def __init__(self, role: Role, urls: Sequence[str]) -> None:
        if not urls:
            raise ConfigError(f"at least one {role.value} engine URL is required")
        self.role = role
        self.engines = [Engine(normalize_url(u), role) for u in urls]
        self._next = 0

    def pick(self, now: float | None = None) -> Engine:
        """The up engine with the fewest in-flight requests; ties go round-robin.

        When every engine is suspect the least-loaded suspect one is returned anyway: the caller
        then fails fast with a clear error instead of refusing without trying.
        """
        up = [e for e in self.engines if e.is_up(now)]
        candidates = up or self.engines
        n = len(self.engines)
        order = {id(e): (i - self._next) % n for i, e in enumerate(self.engines)}
        best = min(candidates, key=lambda e: (e.in_flight, order[id(e)]))
        self._next = (self.engines.index(best) + 1) % n
        return best

    def least_in_flight(self, now: float | None = None) -> int:
        """The smallest in-flight count among up engines (all engines when none is up)."""
        up = [e for e in self.engines if e.is_up(now)] or self.engines
        return min(e.in_flight for e in up)

    def by_url(self, url: str) -> Engine | None:
        url = normalize_url(url)
        return next((e for e in self.engines if e.url == url), None)


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` → ``http://host:port``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


@dataclass(frozen=True)
class Decision:
    """The mode chosen for one request and why (the reason is a metric label)."""

    mode: ProxyMode
    reason: str = field(default="configured")


def decide(mode: ProxyMode, decodes: Pool, push_headroom: int) -> Decision:
    """Choose push or pull for one request.

    ``push`` and ``pull`` are returned as configured. ``auto`` pushes when the least-loaded D has
    fewer than ``push_headroom`` requests in flight (committing D early costs nothing when D is
    idle, and push takes coordination off the critical path); when every D is that busy it pulls,
    because placing the request on whichever D frees up first after prefill then pays.
    """
    if mode is ProxyMode.PUSH:
        return Decision(ProxyMode.PUSH)
    if mode is ProxyMode.PULL:
        return Decision(ProxyMode.PULL)
    if decodes.least_in_flight() < push_headroom:
        return Decision(ProxyMode.PUSH, "headroom")
    return Decision(ProxyMode.PULL, "busy")


def new_transfer_id() -> str:
    """A fresh transfer id; one per dispatch, also on retries."""
    return "xfer-" + uuid.uuid4().hex


def validate_request(body: Any, chat: bool) -> str | None:
    """Why an OpenAI request body cannot be served, or None when it can."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    key = "messages" if chat else "prompt"
    if key not in body or body[key] is None:
        return f"missing required field {key!r}"
    if chat and not isinstance(body[key], list):
        return "'messages' must be a list"
    if not chat and not isinstance(body[key], str | list):
        return "'prompt' must be a string or a list"
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{name!r} must be an integer"
    return None


def prefill_body(body: Mapping[str, Any], transfer_id: str, mode: ProxyMode) -> dict[str, Any]:
    """The one-token, non-streaming copy of ``body`` that P prefills (the original is untouched)."""
    if mode is ProxyMode.AUTO:
        raise ValueError("prefill_body needs a concrete mode, not auto")
    out = copy.deepcopy(dict(body))
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
        "transfer_mode": mode.value,
    }
    return out


def push_decode_params(probe: ProbeInfo, transfer_id: str) -> dict[str, Any]:
    """D's ``kv_transfer_params`` in push mode: where P is, and the shared transfer id."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_mode": "push",
        "transfer_id": transfer_id,
        "remote_engine_id": probe.engine_id,
        "remote_host": probe.host,
        "remote_port": probe.port,
        "tp_size": probe.tp_size,
    }


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request as D gets it: unchanged except for ``kv_transfer_params``."""
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def probe_body(model: str) -> dict[str, Any]:
    """The request that makes a prefill engine's connector report its control address."""
    return {
        "model": model,
        "prompt": [1],
        "max_tokens": 1,
        "kv_transfer_params": {"kvbridge_probe": True},
    }


def parse_probe(params: Any) -> ProbeInfo:
    """Read a probe answer's ``kv_transfer_params``; ValueError names what is missing."""
    if not isinstance(params, dict):
        raise ValueError(
            "probe answer has no kv_transfer_params (is the engine running KVBridgeConnector?)"
        )
    missing = [k for k in PROBE_KEYS if params.get(k) is None]
    if missing:
        raise ValueError("probe answer lacks {}".format(", ".join(missing)))
    try:
        return ProbeInfo(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            tp_size=int(params["tp_size"]),
            version=str(params.get("kvbridge_version", "?")),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed probe answer: {exc}") from exc

"""What a doctor check looks at (:class:`Target`) and what it answers (:class:`Check`).

Contract: plain frozen values; :meth:`Target.of` derives the transports and tiers a
configuration uses, so that a check can tell a failure that matters (``fail``) from one that
does not (``warn``, see :func:`unused`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvbridge.config import Config

__all__ = ["Check", "Status", "Target", "unused"]


class Status(enum.StrEnum):
    """The verdict of one check."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"

    @property
    def word(self) -> str:
        """How the table shows it (``FAIL`` stands out)."""
        return "FAIL" if self is Status.FAIL else self.value


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"check": self.name, "status": self.status.value, "detail": self.detail}


@dataclass(frozen=True)
class Target:
    """What the checks look at. ``transports``: the backend and its compose transport members;
    ``tiers``: the effective offload tiers; ``connector``: the vLLM kv_connector name asked
    for (None: ``KVBridgeConnector``)."""

    config: Config
    tp: int = 1
    transports: frozenset[str] = frozenset()
    tiers: frozenset[str] = frozenset()
    connector: str | None = None

    @classmethod
    def of(cls, config: Config, tp: int = 1, connector: str | None = None) -> Target:
        members = config.compose_members()
        transports = {config.backend, *(m.name for m in members if m.kind == "transport")}
        tiers = {t.name for t in config.offload_config().tiers}
        return cls(config, tp, frozenset(transports), frozenset(tiers), connector)

    def nixl_options(self) -> dict[str, Any]:
        """The options the configuration gives the nixl backend ({} when it uses none)."""
        if self.config.backend == "nixl":
            return dict(self.config.backend_options)
        for m in self.config.compose_members():
            if m.name == "nixl" and m.kind == "transport":
                return dict(m.options)
        return {}


def unused(used: bool) -> str:
    """The note a ``warn`` line gets when the configuration does not use what failed."""
    return "" if used else " (not used by this configuration)"


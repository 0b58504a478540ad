"""Parsers of setting values shared by every configuration layer (the connector's
:mod:`kvbridge.config`, the offload tiers' :mod:`kvbridge.offload.config`, transports' options).

It sits below all of them and imports nothing of kvbridge but :mod:`kvbridge.errors`, so that
``kvbridge.config`` may import the offload configuration without a cycle. Pure functions,
thread-safe; a bad value raises :class:`~kvbridge.errors.ConfigError` naming the setting.
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError

__all__ = ["BOOL_WORDS", "LOG_LEVELS", "parse_bool"]

#: the spellings of a boolean setting (case and surrounding blanks ignored)
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
              "0": False, "false": False, "no": False, "off": False}

#: the levels every ``--log-level`` option takes (any case: the options upper-case them first)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_bool(raw: Any, what: str) -> bool:
    """``raw`` (a bool or ``on``/``off``/``1``/``0``…); :class:`ConfigError` naming ``what``."""
    if isinstance(raw, bool):
        return raw
    value = BOOL_WORDS.get(str(raw).strip().lower())
    if value is None:
        raise ConfigError(f"{what}: expected true or false, got {raw!r}")
    return value

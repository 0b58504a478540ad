"""Parsing of the command-line values every ``kvbridge`` subcommand shares.

Contract: pure functions of their text arguments; a bad value raises
:class:`~kvbridge.errors.ConfigError` naming the option, which the CLI prints as
``kvbridge: error: <message>`` (exit status 1). The CLI (:mod:`kvbridge.tools.cli`) and the
benches, the doctor and the simulator all import them from here, so no bench imports the CLI.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvbridge.errors import ConfigError

__all__ = ["DefaultsFormatter", "parse_json_object", "parse_names"]


def parse_json_object(text: str | None, what: str) -> dict[str, Any]:
    """Parse ``text`` as a JSON object; :class:`ConfigError` naming ``what`` otherwise."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def parse_names(text: str, known: Sequence[str], option: str, what: str) -> tuple[str, ...]:
    """``"a, b"`` → those of ``known``, duplicates removed, in the order given; ``all`` → every
    one. :class:`ConfigError` naming ``option`` for an unknown name or an empty list."""
    names: list[str] = []
    for part in text.split(","):
        name = part.strip()
        if name == "all":
            names.extend(known)
        elif name and name not in known:
            raise ConfigError(f"{option}: unknown {what} {name!r}; expected some of "
                              f"{', '.join(known)} (comma-separated) or all")
        elif name:
            names.append(name)
    if not names:
        raise ConfigError(f"{option} names no {what}")
    return tuple(dict.fromkeys(names))


class DefaultsFormatter(argparse.HelpFormatter):
    """``--help`` that shows each option's default: ``(default: X)`` is appended to the help of
    an option with a default to show (not None, False or empty) whose help does not already
    say its default. Set as a parser's ``formatter_class``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower()
                or action.default in (None, False, [], "", argparse.SUPPRESS)):
            return action.help
        return f"{text} (default: %(default)s)"

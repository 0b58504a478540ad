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

__all__ = ["DefaultsFormatter", "parse_control_address", "parse_json_object", "parse_names"]


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


_CONTROL_HINT = ("takes an engine's control address, tcp://HOST:PORT or HOST:PORT: the "
                 "side-channel port (side_channel_port, rank r at port + r; remote_host and "
                 "remote_port in P's kv_transfer_params), not the engine's HTTP URL")


def parse_control_address(text: str, what: str) -> str:
    """``tcp://HOST:PORT`` or ``HOST:PORT`` (``[v6]:PORT`` too) → ``tcp://HOST:PORT``.
    :class:`ConfigError` naming ``what`` for an http(s) URL, a bare host or a bad port."""
    address = text.strip()
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() != "tcp":
        kind = "an HTTP URL" if scheme.lower() in ("http", "https") else f"a {scheme} URL"
        raise ConfigError(f"{what}: {text!r} is {kind}; {what} {_CONTROL_HINT}")
    rest = rest if sep else address
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ConfigError(f"{what}: {text!r} has no port; {what} {_CONTROL_HINT}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: port {port!r} of {text!r} is not 1..65535; {what} "
                          f"{_CONTROL_HINT}")
    if "/" in host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ConfigError(f"{what}: {text!r} is not HOST:PORT (an IPv6 host goes in "
                          f"brackets, [::1]:5600); {what} {_CONTROL_HINT}")
    return f"tcp://{host}:{port}"


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

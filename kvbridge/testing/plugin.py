"""pytest plugin (entry point ``pytest11``): markers and options for kvbridge's suites."""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    for marker in (
        "vllm: end-to-end tests with real vLLM engines (slow)",
        "nixl: needs the nixl package",
        "mooncake: needs the mooncake transfer engine",
    ):
        config.addinivalue_line("markers", marker)

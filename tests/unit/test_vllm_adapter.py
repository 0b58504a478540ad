"""The vLLM adapter translates: it asks a backend's capabilities, never its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

INTEGRATIONS = Path(__file__).resolve().parents[2] / "kvbridge" / "integrations"


def _backend_name_checks(path: Path) -> list[str]:
    """``… .backend == "x"`` (or ``!=``, ``in``) comparisons in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides)
        literal = any(isinstance(s, ast.Constant | ast.Tuple | ast.List | ast.Set)
                      for s in sides)
        if named and literal:
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_adapter_never_checks_a_backend_by_name() -> None:
    found = [hit for path in sorted(INTEGRATIONS.glob("vllm*.py"))
             for hit in _backend_name_checks(path)]
    assert not found, f"ask the backend's Capabilities instead: {found}"


@pytest.mark.parametrize(("backend", "maps"), [
    ("shm", True), ("memory", False),
    ("compose", False),  # declares its capabilities only once built from its members
    ("no-such-backend", False),
])
def test_kv_cache_is_mapped_where_the_backend_can(backend: str, maps: bool) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from kvbridge.integrations.vllm_worker import maps_memory

    assert maps_memory(backend) is maps

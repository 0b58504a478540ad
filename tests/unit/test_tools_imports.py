"""The workshop's own import rules (issue 26): the CLI imports the benches, never the reverse;
no import cycle inside ``kvbridge/tools/``; no module there over 600 lines.

Every import counts, at module level or inside a function (the AST of each module is scanned),
so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "kvbridge" / "tools"
MAX_LINES = 600


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in TOOLS.rglob("*.py")}


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The ``kvbridge.tools`` modules ``path`` imports, wherever the import is."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names
                    if f"{node.module}.{a.name}" in known}
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def test_only_the_cli_entry_points_import_the_cli() -> None:
    """Benches, the doctor and the simulator share helpers through ``tools.args`` and
    ``tools.report``; importing ``tools.cli`` from them is the old ``cli`` <-> ``bench_*`` cycle."""
    bad = [name for name, deps in _graph().items() if "kvbridge.tools.cli" in deps]
    assert not bad, bad


def test_no_import_cycle_in_the_tools() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_scan_sees_a_cycle(tmp_path: Path) -> None:
    """The check has teeth: a lazy import back into an importer is found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import kvbridge.tools.b\n")
    b.write_text("def f():\n    from kvbridge.tools import a\n")
    known = {"kvbridge.tools.a": a, "kvbridge.tools.b": b}
    assert _imports(a, known) == {"kvbridge.tools.b"}
    assert _imports(b, known) == {"kvbridge.tools.a"}


def test_no_tools_module_over_600_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in TOOLS.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long

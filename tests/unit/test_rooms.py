"""The rooms of the tree (docs/concepts.md, "The tree"): the library never imports its workshop.

An engine runs ``kvbridge`` (and the backend packages); ``kvbridge/tools/`` holds the CLI,
benches, demo, doctor, simulator, deploy checks and the harness that starts engines. Nothing
outside ``kvbridge/tools/`` may import ``kvbridge.tools``, not even inside a function: the AST of
every module is scanned, so a lazy import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "kvbridge" / "tools"


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, wherever it is."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


#: ``python -m kvbridge``: the console script's twin, the one door from the package into the
#: workshop; nothing imports it (checked below), so an engine never loads the tools through it.
MAIN = ROOT / "kvbridge" / "__main__.py"


def _library() -> list[Path]:
    files = [p for p in (ROOT / "kvbridge").rglob("*.py") if TOOLS not in p.parents and p != MAIN]
    return files + list((ROOT / "backends").rglob("*.py"))


def test_nothing_imports_the_main_module() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in [*(ROOT / "kvbridge").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]
           for line, mod in _imports(p) if mod == "kvbridge.__main__"]
    assert not bad, "\n".join(bad)


def test_nothing_outside_tools_imports_tools() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in _library() for line, mod in _imports(p)
           if mod == "kvbridge.tools" or mod.startswith("kvbridge.tools.")]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_lazy_imports(tmp_path: Path) -> None:
    """The check has teeth: an import inside a function is found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from kvbridge.tools.cli import main\n    return main\n")
    assert (2, "kvbridge.tools.cli") in _imports(src)


def test_the_tools_room_is_where_the_docs_say() -> None:
    for name in ("cli.py", "report.py", "demo.py", "doctor", "engines.py", "tiny_model.py",
                 "proxies.py", "bench", "simulate", "deploycheck"):
        assert (TOOLS / name).exists(), name
    for gone in ("cli.py", "demo.py", "doctor.py", "bench.py", "bench_e2e.py", "simulate"):
        assert not (ROOT / "kvbridge" / gone).exists(), f"kvbridge/{gone} belongs in tools/"


#: the most lines one module may have: past it, a module does more than one job
MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """Every module of kvbridge, of the backends and of the example backend (tests aside)."""
    modules = [*ROOT.glob("kvbridge/**/*.py"), *ROOT.glob("backends/*/*.py"),
               *ROOT.glob("examples/*/*.py")]
    assert len(modules) > 100
    over = sorted((str(p.relative_to(ROOT)), n) for p in modules
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert over == [], f"modules over {MAX_LINES} lines: {over}"

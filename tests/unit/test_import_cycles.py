"""No import cycles: the module graph of ``kvbridge``, read from the source (nothing imported).

An edge ``a → b`` is an import statement of module ``a`` that runs (or, under
``if TYPE_CHECKING:``, is read by the type checker) when ``a`` is loaded: module-level
statements, including those inside a module-level ``if``/``try``, not those inside a function or
class body (deferred on purpose; the rule is that they are rare and say why). ``from x import y``
is an edge to ``x.y`` where that is a module, else to ``x``; relative imports are resolved. A
package's ``__init__`` run by importing a submodule is not an edge (ours import nothing heavy).

:func:`cycles` takes a module prefix and a package; the rule holds for all of ``kvbridge`` and
for each backend distribution's package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvbridge"


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name → file."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module loads: the body, and the bodies of module-level
    ``if``/``try``/``with`` blocks (``if TYPE_CHECKING:`` included), never a def or class."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _top_level(block)
            for handler in node.handlers:
                yield from _top_level(handler.body)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports at module level."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _top_level(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` of a non-module attribute path: the longest known prefix
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports at module level."""
    known = modules(root, package)
    return {name: imports(name, path, known) for name, path in known.items()}


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _one_cycle(edges: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``comp`` (for the failure message)."""
    members, first = set(comp), comp[0]
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(edges[node] & members):
                if nxt == first:
                    return [*paths[node], first]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return comp


def cycles(prefix: str, root: Path = ROOT, package: str = PACKAGE) -> list[list[str]]:
    """The import cycles of ``package`` that pass through a module named ``prefix`` or below
    it, one example cycle each (``[a, b, …, a]``)."""
    edges = graph(root, package)
    return [_one_cycle(edges, comp) for comp in _components(edges)
            if any(m == prefix or m.startswith(prefix + ".") for m in comp)]


@pytest.mark.parametrize(("root", "package"), [
    (ROOT, "kvbridge"),
    *((ROOT / "backends", p.name) for p in sorted((ROOT / "backends").glob("kvbridge_*"))),
    *((ROOT / "examples", p.name) for p in sorted((ROOT / "examples").glob("kvbridge_*"))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_no_import_cycle_in(root: Path, package: str) -> None:
    found = cycles(package, root, package)
    assert not found, "import cycles:\n" + "\n".join(" → ".join(c) for c in found)


def test_the_graph_sees_a_cycle(tmp_path: Path) -> None:
    """The checker itself: a cycle through ``if TYPE_CHECKING`` and a relative import is
    found; an import inside a function is not an edge."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.a import X\n")
    (pkg / "c.py").write_text("def f():\n    import pkg.d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    assert cycles("pkg.sub", tmp_path, "pkg") == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]]
    assert cycles("pkg.c", tmp_path, "pkg") == []

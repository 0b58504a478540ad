"""The proxy's modules (docs/proxy.md, "How it is built"): one job each, imports point down.

Each module may import only the ones below it in :data:`LAYERS`, so the package has no cycle and
the pure parts (settings, policy) never pull in aiohttp.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "kvbridge" / "proxy"

#: Top to bottom; a module imports only modules of later rows.
LAYERS = (
    ("__main__",),
    ("cli",),
    ("app",),
    ("admin", "discovery", "dispatch"),
    ("planning",),
    ("relay", "kvfeed"),
    ("pool",),
    ("failures", "metrics", "notices", "reasons", "tenants", "flight",
     "tracing"),
    ("settings",),
    ("routing", "credit", "planner", "kvevents"),
    ("members", "prefixes", "arrival"),
)


def _proxy_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[:2] == ["kvbridge", "proxy"] and len(parts) > 2:
                out.add(parts[2])
    return out


def test_every_module_is_in_a_layer() -> None:
    known = {m for row in LAYERS for m in row} | {"__init__"}
    assert {p.stem for p in PROXY.glob("*.py")} == known


def test_imports_point_down() -> None:
    rank = {m: i for i, row in enumerate(LAYERS) for m in row}
    bad = [f"{m} imports {dep}" for m in rank for dep in _proxy_imports(PROXY / f"{m}.py")
           if rank[dep] <= rank[m]]
    assert not bad, bad


def test_no_module_is_over_600_lines() -> None:
    long = {p.name: n for p in PROXY.glob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_settings_and_policy_need_no_aiohttp() -> None:
    code = ("import sys; import kvbridge.proxy as p; p.ProxySettings(prefill=['http://a:1'], "
            "decode=['http://b:2']).check(); import kvbridge.proxy.routing; "
            "assert 'aiohttp' not in sys.modules, 'aiohttp imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_proxy_imports_no_opentelemetry_without_an_endpoint() -> None:
    code = ("import sys; from kvbridge.proxy.app import ProxyServer; "
            "from kvbridge.proxy.settings import ProxySettings; "
            "s = ProxyServer(ProxySettings(['http://a:1'], ['http://b:2'])); "
            "assert s.tracing is None; "
            "bad = [m for m in sys.modules if m.startswith('opentelemetry')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

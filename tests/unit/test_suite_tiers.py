"""The test suite's tiers stay what their names say (docs/concepts.md, "The tree").

* ``tests/unit``: in one process; no vLLM engine, no peer process, no server. ``scripts/test
  --fast`` runs it, in under a minute on two cores.
* ``tests/process``: real processes, sockets, transports and tiers on 127.0.0.1.
* ``tests/engines``: real vLLM engines (marked ``vllm``).

A file that starts an engine but sits in another tier, or a unit test that starts processes,
fails here; so does a test file left at the top of ``tests/``.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "process", "engines")
#: what a unit test may not do: start an engine, a peer process, a proxy or a server
_PROCESS = re.compile(r"\b(subprocess\.(Popen|run|check_output)|PeerProcess|multiprocessing|"
                      r"start_servers|VllmServer|ProxyThread|MooncakeMaster)\b")
#: unit files that run one short ``python -c`` to see what a bare import loads
_IMPORT_CHECKS = {"test_exports.py", "test_proxy_layout.py"}
_SELF = Path(__file__).name
_ENGINE = re.compile(r"pytest\.mark\.vllm\b")


def _files(tier: str) -> list[Path]:
    return sorted((TESTS / tier).glob("test_*.py"))


def test_every_test_file_is_in_a_tier() -> None:
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []
    assert all(_files(t) for t in TIERS)


def test_engine_tests_live_in_the_engines_tier() -> None:
    misplaced = [f"{t}/{p.name}" for t in ("unit", "process") for p in _files(t)
                 if _ENGINE.search(p.read_text())]
    assert misplaced == [], f"tests marked vllm outside tests/engines: {misplaced}"


def test_unit_tests_start_no_process() -> None:
    """The files of ``_IMPORT_CHECKS`` run one short ``python -c`` each to see what a bare
    import loads: the named exceptions."""
    found = [(p.name, m.group(0)) for p in _files("unit") if p.name not in _IMPORT_CHECKS | {_SELF}
             for m in [_PROCESS.search(p.read_text())] if m]
    assert found == [], f"unit tests that start processes or servers: {found}"

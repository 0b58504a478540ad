"""The docs site (mkdocs.yml, mkdocs_hooks.py; issue 31, "docs people can browse"): it builds
with ``mkdocs build --strict``, so a broken link or anchor, or a page under docs/ left out of
the nav, fails here. tests/unit/test_docs.py checks the same links as GitHub shows them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (.ci/install-steps installs them)")


def _hooks():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    home = (site / "index.html").read_text()
    assert "Measured here" in home  # the README is the home page
    assert 'href="benchmarks/"' in home  # and its docs/ links are site links
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        assert (site / rel / "index.html").exists(), f"{page} was not built"


def test_links_leaving_docs_point_at_the_repository() -> None:
    hooks = _hooks()
    md = ("[code](../kvbridge/fingerprint.py#L3) [page](usage.md#x) [web](https://x.org/a.py)\n"
          "```\n[in a fence](../kvbridge/x.py)\n```\n")
    with_repo = hooks._outside_links(md, "", {"repo_url": "https://github.com/o/kvbridge/"})
    assert with_repo.splitlines()[0] == (
        "[code](https://github.com/o/kvbridge/blob/main/kvbridge/fingerprint.py#L3) "
        "[page](usage.md#x) [web](https://x.org/a.py)")
    assert "[in a fence](../kvbridge/x.py)" in with_repo
    nested = hooks._outside_links("[tests](../../tests)", "backends", {"repo_url": "https://r"})
    assert nested == "[tests](https://r/tree/main/tests)"
    assert hooks._outside_links("[code](../kvbridge/x.py)", "", {}) == \
        "code (`kvbridge/x.py`)"
    readme = hooks._readme(SimpleNamespace(get=lambda key, default=None: default))
    assert "](usage.md" in readme and "](docs/" not in readme

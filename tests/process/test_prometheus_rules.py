"""deploy/prometheus: the rules load in Prometheus' own checker and pass their unit tests.

``promtool check rules`` (syntax, PromQL, templates) and ``promtool test rules``
(kvbridge-rules.test.yml: series that fire and that do not fire each alert) from Debian's
``prometheus`` package (scripts/system-deps). The PrometheusRule of
deploy/k8s/components/monitoring carries the same groups, checked with promtool too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "components" / "monitoring" / "prometheus-rule.yaml"

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("promtool") is None,
                                 reason="promtool is not on PATH (apt-get install prometheus; "
                                 "scripts/system-deps installs it as root)")]


def promtool(*args: str, cwd: Path = RULES) -> str:
    out = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def test_rules_pass_promtool_check() -> None:
    assert "SUCCESS" in promtool("check", "rules", "kvbridge-rules.yml")


def test_rules_pass_their_promtool_unit_tests() -> None:
    assert "SUCCESS" in promtool("test", "rules", "kvbridge-rules.test.yml")


def test_prometheus_rule_groups_pass_promtool_and_equal_the_rules_file(tmp_path: Path) -> None:
    if not PROMETHEUS_RULE.exists():
        pytest.fail(f"{PROMETHEUS_RULE} is missing")
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    assert spec == yaml.safe_load((RULES / "kvbridge-rules.yml").read_text())
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(spec))
    assert "SUCCESS" in promtool("check", "rules", "rules.yml", cwd=tmp_path)

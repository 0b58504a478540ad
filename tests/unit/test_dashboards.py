"""The Grafana dashboard and the Prometheus rules, without Prometheus (tests/process has promtool).

* deploy/grafana/kvbridge.json is exactly what ``kvbridge dashboards`` generates (no drift);
* every series the dashboard and the rules query is one kvbridge exports (engines:
  kvbridge/integrations/vllm_stats.py; the proxy: kvbridge/proxy/metrics.py), none invented;
* every alert of deploy/prometheus/kvbridge-rules.yml has a promtool test that fires it and an
  evaluation at which it does not fire;
* the CLI writes the same file and --check reports drift.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvbridge.integrations import vllm_stats
from kvbridge.proxy.credit import KvAdmission, KvCredit
from kvbridge.proxy.members import Pool, Role
from kvbridge.proxy.metrics import ProxyMetrics
from kvbridge.tools import dashboards
from kvbridge.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "deploy" / "grafana" / dashboards.FILE_NAME
RULES = ROOT / "deploy" / "prometheus" / "kvbridge-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvbridge-rules.test.yml"
SERIES = re.compile(r"\b(vllm:kvbridge_\w+|kvbridge_proxy_\w+)")
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def exported() -> set[str]:
    """Every sample name kvbridge's engines and proxy can publish."""
    source = Path(vllm_stats.__file__).read_text()
    families = set(re.findall(r'"(vllm:kvbridge_\w+)"', source))
    families |= {f"vllm:kvbridge_{n}" for n in vllm_stats.EXPORTED}
    proxy = ProxyMetrics()  # with admission on, so its KV credit series are listed too
    proxy.watch_credit(KvCredit(Pool(Role.DECODE, ["http://d:1"]), KvAdmission.REJECT))
    families |= {f.name for f in proxy.registry.collect()}
    return {f + s for f in families for s in SUFFIXES}


def rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_committed_dashboard_is_what_the_generator_writes() -> None:
    assert COMMITTED.read_text() == dashboards.render(), \
        "run: kvbridge dashboards --out deploy/grafana"


def test_every_panel_query_names_exported_series_only() -> None:
    known = exported()
    model = json.loads(dashboards.render())
    exprs = [t["expr"] for p in model["panels"] for t in p.get("targets", [])]
    assert exprs == [q.expr for q in dashboards.queries()] and len(exprs) >= 30
    for expr in exprs:
        names = SERIES.findall(expr)
        assert names and set(names) <= known, expr
        assert dashboards.RATE in expr or "[" not in expr
    assert {p["id"] for p in model["panels"]} == set(range(1, len(model["panels"]) + 1))
    for q in dashboards.queries():  # a query may be empty on a healthy fleet only with a reason
        assert q.sparse == "" or len(q.sparse) > 20


def test_every_rule_names_exported_or_recorded_series_only() -> None:
    known = exported()
    recorded = {str(r["record"]) for r in rules() if "record" in r}
    for rule in rules():
        expr = str(rule["expr"])
        assert set(SERIES.findall(expr)) <= known, expr
        used = set(re.findall(r"\bkvbridge(?:_proxy)?:[\w:]+", expr))
        assert used <= recorded, expr
    alerts = [r for r in rules() if "alert" in r]
    for a in alerts:
        assert a["labels"]["severity"] in ("warning", "critical")  # type: ignore[index]
        assert "docs/metrics.md#alerts" in a["annotations"]["description"]  # type: ignore[index]


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    assert tests["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = {str(r["alert"]) for r in rules() if "alert" in r}
    assert fires == alerts and quiet == alerts


def test_cli_writes_the_dashboard_and_checks_drift(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "--out", str(tmp_path / "out")]) == 0
    written = tmp_path / "out" / dashboards.FILE_NAME
    assert written.read_text() == COMMITTED.read_text()
    assert main(["dashboards", "--out", str(tmp_path / "out"), "--check"]) == 0
    written.write_text("{}\n")
    assert main(["dashboards", "--out", str(tmp_path / "out"), "--check"]) == 1
    assert "differs" in capsys.readouterr().out

"""Prometheus Operator objects of deploy/k8s (``components/monitoring``): structure and targets.

Kubernetes' OpenAPI schemas do not cover the operator's CRDs (``monitoring.coreos.com/v1``), so
:func:`structure_problems` checks the fields kvbridge's manifests use, strictly (an unknown
field is a problem, as in a strict schema): ``PodMonitor`` (``selector.matchLabels``,
``podMetricsEndpoints`` with ``port``/``path``/``interval``, ``podTargetLabels``,
``namespaceSelector``), ``ServiceMonitor`` (the same with ``endpoints``) and ``PrometheusRule``
(``groups`` of ``record`` or ``alert`` rules with ``expr``, ``for``, ``labels``,
``annotations``). :func:`target_problems` checks what would silently scrape nothing: a monitor
whose selector misses every pod (Service), or whose port names no port of a selected pod
(Service). PromQL itself is checked by ``promtool`` (tests/process/test_prometheus_rules.py).

:func:`prometheus_rule` renders the PrometheusRule of deploy/prometheus/kvbridge-rules.yml;
``python -m kvbridge.tools.deploycheck.monitoring --write-rule`` rewrites the committed one.
Pure functions over dicts; problems are strings naming the object, never raised.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvbridge.tools.deploycheck.objects import Obj, name, pod_labels, pod_spec, selects

__all__ = ["API", "KINDS", "is_monitoring", "structure_problems", "target_problems",
           "prometheus_rule", "RULES_FILE", "RULE_FILE", "main"]

API = "monitoring.coreos.com/v1"
KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")
_ROOT = Path(__file__).resolve().parents[3]
RULES_FILE = _ROOT / "deploy" / "prometheus" / "kvbridge-rules.yml"
RULE_FILE = _ROOT / "deploy" / "k8s" / "components" / "monitoring" / "prometheus-rule.yaml"
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
_METADATA = {"name", "namespace", "labels", "annotations"}
_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
_SPEC = {"PodMonitor": ({"selector", "podMetricsEndpoints"},
                        {"podTargetLabels", "namespaceSelector", "jobLabel"}),
         "ServiceMonitor": ({"selector", "endpoints"},
                            {"podTargetLabels", "targetLabels", "namespaceSelector",
                             "jobLabel"}),
         "PrometheusRule": ({"groups"}, set())}
_RULE = {"record": {"record", "expr", "labels"},
         "alert": {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}}


def is_monitoring(obj: Obj) -> bool:
    """Whether ``obj`` is a Prometheus Operator object (checked here, not by a schema)."""
    return obj.get("apiVersion") == API


def structure_problems(obj: Obj) -> list[str]:
    """The fields of one operator object (see the module docstring)."""
    out: list[str] = []
    kind, where = obj.get("kind"), name(obj)
    if kind not in KINDS:
        return [f"{where}: kind {kind!r} of {API} is not one of {', '.join(KINDS)}"]
    out += _keys(where, obj, {"apiVersion", "kind", "metadata", "spec"},
                 {"apiVersion", "kind", "metadata", "spec"})
    meta = obj.get("metadata") or {}
    out += _keys(f"{where}: metadata", meta, {"name"}, _METADATA)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return out + [f"{where}: spec is not a mapping"]
    required, optional = _SPEC[str(kind)]
    out += _keys(f"{where}: spec", spec, required, required | optional)
    if kind == "PrometheusRule":
        return out + _groups(where, spec.get("groups"))
    selector = spec.get("selector")
    if not isinstance(selector, dict) or set(selector) != {"matchLabels"} \
            or not selector["matchLabels"]:
        out.append(f"{where}: spec.selector must be a non-empty matchLabels")
    key = "podMetricsEndpoints" if kind == "PodMonitor" else "endpoints"
    endpoints = spec.get(key)
    if not isinstance(endpoints, list) or not endpoints:
        return out + [f"{where}: spec.{key} must be a non-empty list"]
    for i, ep in enumerate(endpoints):
        at = f"{where}: spec.{key}[{i}]"
        out += _keys(at, ep, {"port"}, _ENDPOINT)
        if not isinstance(ep.get("port"), str):
            out.append(f"{at}: port must name a port (a string)")
        if not str(ep.get("path", "/metrics")).startswith("/"):
            out.append(f"{at}: path must start with /")
        for field in ("interval", "scrapeTimeout"):
            if field in ep and not _DURATION.match(str(ep[field])):
                out.append(f"{at}: {field} {ep[field]!r} is no Prometheus duration")
    return out


def target_problems(objs: Sequence[Obj]) -> list[str]:
    """Monitors that would scrape nothing: no selected pod (Service), or an unknown port."""
    out: list[str] = []
    workloads = [o for o in objs if o.get("kind") in ("Deployment", "StatefulSet", "ReplicaSet")]
    services = [o for o in objs if o.get("kind") == "Service"]
    for mon in objs:
        if not is_monitoring(mon) or mon.get("kind") == "PrometheusRule":
            continue
        spec = mon.get("spec") or {}
        wanted = (spec.get("selector") or {}).get("matchLabels") or {}
        if mon["kind"] == "PodMonitor":
            pods = [w for w in workloads if selects(wanted, pod_labels(w))]
            targets = [(name(w), {p.get("name") for c in pod_spec(w).get("containers", [])
                                  for p in c.get("ports", [])}) for w in pods]
            endpoints = spec.get("podMetricsEndpoints") or []
        else:
            svcs = [s for s in services if selects(wanted, s["metadata"].get("labels", {}))]
            targets = [(name(s), {p.get("name") for p in s.get("spec", {}).get("ports", [])})
                       for s in svcs]
            endpoints = spec.get("endpoints") or []
        if not targets:
            out.append(f"{name(mon)}: selector {wanted} selects nothing")
        for ep in endpoints:
            for target, ports in targets:
                if ep.get("port") not in ports:
                    out.append(f"{name(mon)}: port {ep.get('port')!r} is no named port of "
                               f"{target}")
    return out


def prometheus_rule(rules_text: str) -> str:
    """The PrometheusRule whose spec is the rules file ``rules_text``, as committed."""
    dumper: Any = type("_Dumper", (yaml.SafeDumper,), {})

    def text(d: Any, value: str) -> Any:
        style = "|" if "\n" in value else None
        return d.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    dumper.add_representer(str, text)
    obj = {"apiVersion": API, "kind": "PrometheusRule",
           "metadata": {"name": "kvbridge", "labels": {"app.kubernetes.io/name": "kvbridge"}},
           "spec": yaml.safe_load(rules_text)}
    head = ("# kvbridge's recording and alerting rules for the Prometheus Operator: spec is\n"
            "# exactly deploy/prometheus/kvbridge-rules.yml. Generated: python -m\n"
            "# kvbridge.tools.deploycheck.monitoring --write-rule (tests/unit/test_dashboards.py\n"
            "# checks it). Add the labels your Prometheus' ruleSelector wants (kube-prometheus-\n"
            "# stack: release: <its release name>) in an overlay patch.\n")
    return head + str(yaml.dump(obj, Dumper=dumper, sort_keys=False, width=100))


def _keys(where: str, obj: Any, required: set[str], allowed: set[str]) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not a mapping"]
    out = [f"{where}: missing {k}" for k in sorted(required - set(obj))]
    return out + [f"{where}: unknown field {k}" for k in sorted(set(obj) - allowed)]


def _groups(where: str, groups: Any) -> list[str]:
    if not isinstance(groups, list) or not groups:
        return [f"{where}: spec.groups must be a non-empty list"]
    out: list[str] = []
    names = [str(g.get("name")) for g in groups if isinstance(g, dict)]
    out += [f"{where}: group {n!r} twice" for n in sorted({n for n in names
                                                           if names.count(n) > 1})]
    for i, g in enumerate(groups):
        at = f"{where}: spec.groups[{i}]"
        out += _keys(at, g, {"name", "rules"}, {"name", "rules", "interval"})
        for j, rule in enumerate(g.get("rules") or [] if isinstance(g, dict) else []):
            kinds = [k for k in _RULE if k in rule] if isinstance(rule, dict) else []
            if len(kinds) != 1:
                out.append(f"{at}.rules[{j}]: needs exactly one of record, alert")
                continue
            out += _keys(f"{at}.rules[{j}]", rule, {kinds[0], "expr"}, _RULE[kinds[0]])
            if "for" in rule and not _DURATION.match(str(rule["for"])):
                out.append(f"{at}.rules[{j}]: for {rule['for']!r} is no Prometheus duration")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``--write-rule``: rewrite the committed PrometheusRule from the rules file."""
    parser = argparse.ArgumentParser(prog="python -m kvbridge.tools.deploycheck.monitoring",
                                     description=main.__doc__)
    parser.add_argument("--write-rule", action="store_true",
                        help=f"write {RULE_FILE.name} from {RULES_FILE.name}")
    args = parser.parse_args(argv)
    if args.write_rule:
        RULE_FILE.write_text(prometheus_rule(RULES_FILE.read_text()))
        print(f"wrote {RULE_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

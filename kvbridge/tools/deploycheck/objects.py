"""Reading rendered Kubernetes objects, and the consistency checks any deployment needs.

The kvbridge-specific checks live in :mod:`kvbridge.tools.deploycheck.k8s`; this module knows
Kubernetes only:

* :func:`schema_problems` validates objects against a pinned Kubernetes version's strict OpenAPI
  schema (unknown fields are errors) with the offline ``kubernetes-validate`` package;
* :class:`Objects` finds objects, resolves a container's environment the way the kubelet does
  (ConfigMaps, Secrets, the downward API, ``$(VAR)`` expansion) and checks what the API server
  or the kubelet would refuse, or what would silently not work, that a schema cannot see:
  selectors that miss their pods, Services, probes and scrape annotations naming undeclared
  ports, extended resources and hugepages whose request differs from their limit, hugepages
  without a CPU or memory request or without their volume's limit, images without registry
  and tag.

Problems are strings naming the object (``Kind/name: …``), collected, never raised: a malformed
object (the schema says why) becomes a ``cannot be checked`` problem. Pure functions over dicts.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Obj", "Objects", "schema_problems", "expand", "name", "pod_spec", "main_container",
           "pod_labels", "selects", "policy_selects", "ports", "resolve_port", "quantity",
           "pod_ip", "PROBES"]

Obj = dict[str, Any]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def schema_problems(objs: Sequence[Obj], version: str) -> list[str]:
    """Every object validated against Kubernetes ``version``'s strict schema."""
    import kubernetes_validate as kv

    out = []
    for obj in objs:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            out.append(f"{name(obj)}: schema {version}: {where}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            out.append(f"{name(obj)}: {exc.message}")
    return out


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command, args and env values: ``$$`` is ``$``,
    an unknown variable stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def name(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def pod_spec(obj: Obj) -> Obj:
    spec: Obj = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec


def main_container(obj: Obj) -> Obj:
    """The first container of a workload's pod ({} if none)."""
    first: Obj = (pod_spec(obj).get("containers") or [{}])[0]
    return first


def pod_labels(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj.get("spec", {}).get("template", {}).get("metadata", {}).get(
        "labels", {})
    return labels


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A non-empty ``matchLabels``-style selector matches ``labels``."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def policy_selects(policy: Obj, labels: Mapping[str, str]) -> bool:
    """A NetworkPolicy's ``podSelector`` (labels and expressions) matches ``labels``."""
    sel = policy.get("spec", {}).get("podSelector", {})
    if sel.get("matchLabels") and not selects(sel["matchLabels"], labels):
        return False
    for e in sel.get("matchExpressions", []):
        has, values = labels.get(e["key"]), e.get("values", [])
        if {"In": has not in values, "NotIn": has in values, "Exists": has is None,
                "DoesNotExist": has is not None}.get(e["operator"], True):
            return False
    return True


def ports(container: Obj) -> dict[str, int]:
    """A container's declared ports by name (unnamed ones by number)."""
    return {str(p.get("name", p["containerPort"])): int(p["containerPort"])
            for p in container.get("ports", [])}


def resolve_port(port: Any, containers: Sequence[Obj]) -> int | None:
    """A probe's or Service's (named or numbered) target port, if some container declares it."""
    declared = {k: v for c in containers for k, v in ports(c).items()}
    if isinstance(port, str) and not port.isdigit():
        return declared.get(port)
    return int(port) if int(port) in declared.values() else None


def quantity(value: Any) -> float:
    """A resource quantity (``5120Mi``, ``2Gi``, ``500m``, ``4``) as a number."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "m": 1e-3}
    for unit, mult in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * mult
    return float(text)


def pod_ip(index: int) -> str:
    """The stand-in IP of pod ``index`` (the downward API's ``status.podIP``)."""
    return f"10.0.{index // 250}.{index % 250 + 2}"


class Objects:
    """Rendered objects and the problems found in them (appended to :attr:`problems`)."""

    def __init__(self, objs: Sequence[Obj]) -> None:
        self.objs = list(objs)
        self.problems: list[str] = []

    def problem(self, obj: Obj, text: str) -> None:
        self.problems.append(f"{name(obj)}: {text}")

    @contextlib.contextmanager
    def guard(self, obj: Obj) -> Iterator[None]:
        """A malformed object (the schema reports why) is a problem, never an exception."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            self.problem(obj, f"cannot be checked: {type(exc).__name__}: {exc}")

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objs if o.get("kind") == kind]

    def workloads(self) -> list[Obj]:
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")

    def find(self, kind: str, wanted: str) -> Obj | None:
        return next((o for o in self.of_kind(kind)
                     if o.get("metadata", {}).get("name") == wanted), None)

    # -- environment ---------------------------------------------------------------------------

    def env(self, w: Obj, c: Obj, index: int) -> dict[str, str]:
        """Container ``c``'s environment in pod ``index`` of workload ``w``: ConfigMaps, Secrets
        and the downward API resolved (the pod IP is :func:`pod_ip`); a missing reference that
        is not ``optional`` is a problem."""
        fields = {"metadata.name": f"{w['metadata']['name']}-{index}",
                  "status.podIP": pod_ip(index),
                  "metadata.namespace": w["metadata"].get("namespace", "default")}
        out: dict[str, str] = {}
        for src in c.get("envFrom", []):
            kind = "ConfigMap" if "configMapRef" in src else "Secret"
            out.update(self.source(w, kind, src.get("configMapRef") or src.get("secretRef"), None))
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "value" in e:
                out[e["name"]] = expand(str(e["value"]), out)
            elif "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                if path not in fields:
                    self.problem(w, f"env {e['name']}: fieldRef {path} is not modelled here")
                out[e["name"]] = fields.get(path, "")
            elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
                kind = "Secret" if "secretKeyRef" in ref else "ConfigMap"
                sel = ref.get("secretKeyRef") or ref["configMapKeyRef"]
                value = self.source(w, kind, sel, sel["key"]).get(sel["key"])
                if value is not None:
                    out[e["name"]] = value
        return out

    def source(self, w: Obj, kind: str, ref: Mapping[str, Any], key: str | None
               ) -> dict[str, str]:
        """The decoded data of the ConfigMap or Secret ``ref`` names."""
        obj = self.find(kind, str(ref.get("name")))
        if obj is None:
            if not ref.get("optional"):
                self.problem(w, f"refers to {kind} {ref.get('name')!r}, which is not deployed")
            return {}
        data = {k: str(v) for k, v in obj.get("data", {}).items()}
        if kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update({k: str(v) for k, v in obj.get("stringData", {}).items()})
        if key is not None and key not in data and not ref.get("optional"):
            self.problem(w, f"refers to key {key!r} of {kind} {ref.get('name')!r}, which has "
                            "no such key")
        return data

    # -- checks every deployment needs ---------------------------------------------------------

    def check_generic(self) -> None:
        """Workloads, their containers, and Services (see the module docstring)."""
        for w in self.workloads():
            with self.guard(w):
                self.check_workload(w)
        for svc in self.of_kind("Service"):
            with self.guard(svc):
                self.check_service(svc)

    def check_workload(self, w: Obj) -> None:
        selector = w.get("spec", {}).get("selector", {}).get("matchLabels", {})
        if not selects(selector, pod_labels(w)):
            self.problem(w, f"selector {selector} does not match the pod labels")
        notes = w.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        if notes.get("prometheus.io/scrape") != "true":
            self.problem(w, "pod annotation prometheus.io/scrape is not \"true\"")
        else:
            port = notes.get("prometheus.io/port", "")
            if not port.isdigit() or resolve_port(port, pod_spec(w).get("containers", [])) is None:
                self.problem(w, f"prometheus.io/port {port!r} is no container port")
            if notes.get("prometheus.io/path", "/metrics") != "/metrics":
                self.problem(w, "prometheus.io/path is not /metrics")
        spec = pod_spec(w)
        for c in list(spec.get("containers", [])) + list(spec.get("initContainers", [])):
            self.check_container(w, c)

    def check_container(self, w: Obj, c: Obj) -> None:
        where = f"container {c.get('name')}"
        image = str(c.get("image", ""))
        if "/" not in image or not re.search(r"(:\w[\w.-]*|@sha256:[0-9a-f]{64})$",
                                             image.rsplit("/", 1)[-1]):
            self.problem(w, f"{where}: image {image!r} names no registry and tag (set images: "
                            "in the overlay)")
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for key in sorted(set(req) | set(lim)):
            if ("/" in key or key.startswith("hugepages-")) and key in req and key in lim \
                    and quantity(req[key]) != quantity(lim[key]):
                self.problem(w, f"{where}: {key} request {req[key]} != limit {lim[key]}")
            if key.startswith("hugepages-") and not ({"cpu", "memory"} & set(req)):
                self.problem(w, f"{where}: {key} needs a cpu or memory request")
        pages = {v["emptyDir"]["medium"][len("HugePages-"):]
                 for v in pod_spec(w).get("volumes", [])
                 if str(v.get("emptyDir", {}).get("medium", "")).startswith("HugePages-")}
        for size in sorted(pages - {k[len("hugepages-"):] for k in lim}):
            self.problem(w, f"{where}: a HugePages-{size} volume without a hugepages-{size} "
                            "limit")
        for kind in PROBES:
            probe = c.get(kind) or {}
            port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
            if port is not None and resolve_port(port, [c]) is None:
                self.problem(w, f"{where}: {kind} port {port} is not declared")

    def check_service(self, svc: Obj) -> None:
        selector = svc.get("spec", {}).get("selector", {})
        pods = [w for w in self.workloads() if selects(selector, pod_labels(w))]
        if not pods:
            self.problem(svc, f"selector {selector} selects no workload's pods")
        for p in svc.get("spec", {}).get("ports", []):
            target = p.get("targetPort", p.get("port"))
            for w in pods:
                if resolve_port(target, pod_spec(w).get("containers", [])) is None:
                    self.problem(svc, f"targetPort {target} is no port of {name(w)}")

    def policy_opens(self, w: Obj, wanted: range) -> bool:
        """Some ingress rule of a NetworkPolicy selecting ``w``'s pods opens every port of
        ``wanted`` (True when no policy selects them: then nothing is closed)."""
        selecting = [p for p in self.of_kind("NetworkPolicy")
                     if policy_selects(p, pod_labels(w))]
        return not selecting or any(
            isinstance(p.get("port"), int) and p["port"] <= wanted.start
            and wanted.stop - 1 <= p.get("endPort", p["port"])
            for pol in selecting for rule in pol["spec"].get("ingress", [])
            for p in rule.get("ports", []))

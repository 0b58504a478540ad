"""Checks of a rendered kvbridge xPyD deployment (``deploy/k8s``): schemas, then what they miss.

:func:`schema_problems` validates every object against a pinned Kubernetes version's OpenAPI
schema, strict (unknown fields are errors), with the offline ``kubernetes-validate`` package.
:func:`check_fleet` checks what a schema cannot, on the objects of
:func:`kvbridge.testing.kustomize.render`:

* engines: every pod's ``vllm serve`` command line, after Kubernetes' ``$(VAR)`` expansion with
  the pod's environment, parses with vLLM's own parser (``serve_parser``); its
  ``--kv-transfer-config`` names a kvbridge connector with the role of the workload (prefill:
  ``kv_producer``, decode: ``kv_consumer``) and loads with :meth:`kvbridge.config.Config.load`
  (extra_config plus the pod's ``KVBRIDGE_*`` variables) with no unknown key, into the expected
  backend and backend options; the guard middleware is on; the control channel advertises the
  pod's IP on a fixed port range that misses the HTTP port and that the NetworkPolicy opens;
  engine ids are unique; every prefill/decode pair of shapes passes D's own check of a decode
  leg (tensor-parallel sizes); GPUs equal the tensor-parallel size, EFA interfaces are requested,
  with ``IPC_LOCK`` and ``/dev/shm``, and hugepages unless ``FI_EFA_USE_HUGE_PAGE=0``; every
  engine is a StatefulSet behind a headless Service;
* the proxy: its args parse with the proxy's own argparse; it binds all addresses on its
  container port; its ``--prefill``/``--decode`` pools are exactly the engines' stable DNS
  names on their vLLM port, one per pod; no GPU, no EFA;
* the secret: every ``KVBRIDGE_SECRET`` comes from one Secret key (``secretKeyRef``), never a
  literal value, a ConfigMap, ``--control-secret`` or ``kv_connector_extra_config``;
* everywhere: selectors match their pod labels; Services, probes and scrape annotations name
  declared container ports; extended resources and hugepages have requests equal to limits;
  images name a registry and a tag.

Problems are returned as strings naming the object, never raised. Pure functions; imports
neither vLLM (the parser is passed in) nor a backend except the nixl options parser.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvbridge.config import ENV_PREFIX, Config, TransferMode
from kvbridge.errors import ConfigError, ParamsError
from kvbridge.integrations.names import preset_for
from kvbridge.testing.engines import GUARD_MIDDLEWARE

__all__ = ["KUBE_VERSION", "Expect", "EnginePod", "Fleet", "ServeParser", "schema_problems",
           "check_fleet", "expand", "ROLES", "main"]

#: The Kubernetes version whose schemas the examples are validated against.
KUBE_VERSION = "1.32"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
COMPONENT = "app.kubernetes.io/component"
GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
SECRET_ENV = ENV_PREFIX + "SECRET"

Obj = dict[str, Any]
ServeParser = Callable[[Sequence[str]], argparse.Namespace]


@dataclass(frozen=True)
class Expect:
    """What every engine must be configured as: backend and (a subset of) backend options."""

    backend: str = "nixl"
    backend_options: Mapping[str, Any] = field(
        default_factory=lambda: {"backends": ["LIBFABRIC"]})


@dataclass(frozen=True)
class EnginePod:
    """One engine pod as the manifests configure it."""

    role: str
    workload: str
    pod: str
    service: str
    port: int
    tp: int
    config: Config
    engine_id: str


@dataclass
class Fleet:
    """The engines, the proxy's pools and every problem found."""

    engines: list[EnginePod] = field(default_factory=list)
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def role(self, role: str) -> list[EnginePod]:
        return [e for e in self.engines if e.role == role]


def schema_problems(objs: Sequence[Obj], version: str = KUBE_VERSION) -> list[str]:
    """Every object validated against Kubernetes ``version``'s strict schema."""
    import kubernetes_validate as kv

    out = []
    for obj in objs:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            out.append(f"{_name(obj)}: schema {version}: {where}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            out.append(f"{_name(obj)}: {exc.message}")
    return out


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command and args: ``$$`` is ``$``, an unknown
    variable stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def check_fleet(objs: Sequence[Obj], serve_parser: ServeParser,
                expect: Expect | None = None) -> Fleet:
    """Everything the schemas cannot check (see the module docstring)."""
    fleet = Fleet()
    c = _Checker(list(objs), fleet, expect or Expect())
    c.generic()
    engines = [w for w in c.workloads() if _command(w)[:2] == ["vllm", "serve"]]
    proxies = [w for w in c.workloads() if _command(w)[:2] == ["kvbridge", "proxy"]]
    for w in engines:
        with c.guard(w):
            c.engine(w, serve_parser)
    for role in ROLES:
        if not fleet.role(role):
            fleet.problems.append(f"no {role} engine (a StatefulSet labelled {COMPONENT}: {role} "
                                  "running vllm serve)")
    c.pairs()
    ids = [e.engine_id for e in fleet.engines]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        fleet.problems.append(f"engine_id {dup!r} is used by several pods")
    if len(proxies) != 1:
        fleet.problems.append(f"expected one proxy Deployment (kvbridge proxy), found "
                              f"{len(proxies)}")
    for w in proxies:
        with c.guard(w):
            c.proxy(w)
    c.secret_sources()
    return fleet


def _pod_ip(index: int) -> str:
    """The stand-in IP of pod ``index`` (the downward API's ``status.podIP``)."""
    return f"10.0.{index // 250}.{index % 250 + 2}"


def _name(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def _pod(obj: Obj) -> Obj:
    spec: Obj = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec


def _containers(obj: Obj) -> list[Obj]:
    pod = _pod(obj)
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def _command(obj: Obj) -> list[str]:
    main = _pod(obj).get("containers", [{}])[0]
    return [str(x) for x in main.get("command", [])]


def _labels(obj: Obj) -> dict[str, str]:
    labels: dict[str, str] = obj.get("spec", {}).get("template", {}).get("metadata", {}).get(
        "labels", {})
    return labels


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _ports(container: Obj) -> dict[str, int]:
    return {str(p.get("name", p["containerPort"])): int(p["containerPort"])
            for p in container.get("ports", [])}


def _resolve(port: Any, containers: Sequence[Obj]) -> int | None:
    """A probe's or Service's (named or numbered) target port, if some container declares it."""
    declared = {k: v for c in containers for k, v in _ports(c).items()}
    if isinstance(port, str) and not port.isdigit():
        return declared.get(port)
    return int(port) if int(port) in declared.values() else None


def _quantity(value: Any) -> float:
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "m": 1e-3}
    for unit, mult in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * mult
    return float(text)


class _Checker:
    def __init__(self, objs: list[Obj], fleet: Fleet, expect: Expect) -> None:
        self.objs, self.fleet, self.expect = objs, fleet, expect
        self.secret_refs: set[tuple[str, str]] = set()

    def problem(self, obj: Obj, text: str) -> None:
        self.fleet.problems.append(f"{_name(obj)}: {text}")

    @contextlib.contextmanager
    def guard(self, w: Obj) -> Iterator[None]:
        """A malformed object (the schema reports why) is a problem, never an exception."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            self.problem(w, f"cannot be checked: {type(exc).__name__}: {exc}")

    def workloads(self) -> list[Obj]:
        return [o for o in self.objs if o.get("kind") in ("Deployment", "StatefulSet")]

    def find(self, kind: str, name: str) -> Obj | None:
        return next((o for o in self.objs if o.get("kind") == kind
                     and o.get("metadata", {}).get("name") == name), None)

    # -- every workload and Service ------------------------------------------------------------

    def generic(self) -> None:
        for cm in (o for o in self.objs if o.get("kind") == "ConfigMap"):
            if SECRET_ENV in cm.get("data", {}):
                self.problem(cm, f"holds {SECRET_ENV}: the secret belongs in a Secret")
        for w in self.workloads():
            with self.guard(w):
                self.workload(w)
        for svc in (o for o in self.objs if o.get("kind") == "Service"):
            with self.guard(svc):
                self.service(svc)

    def workload(self, w: Obj) -> None:
        selector = w.get("spec", {}).get("selector", {}).get("matchLabels", {})
        if not _selects(selector, _labels(w)):
            self.problem(w, f"selector {selector} does not match the pod labels")
        self.annotations(w)
        for c in _containers(w):
            self.container(w, c)

    def service(self, svc: Obj) -> None:
        selector = svc.get("spec", {}).get("selector", {})
        pods = [w for w in self.workloads() if _selects(selector, _labels(w))]
        if not pods:
            self.problem(svc, f"selector {selector} selects no workload's pods")
        for p in svc.get("spec", {}).get("ports", []):
            target = p.get("targetPort", p.get("port"))
            for w in pods:
                if _resolve(target, _pod(w).get("containers", [])) is None:
                    self.problem(svc, f"targetPort {target} is no port of {_name(w)}")

    def annotations(self, w: Obj) -> None:
        notes = w.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        if notes.get("prometheus.io/scrape") != "true":
            self.problem(w, "pod annotation prometheus.io/scrape is not \"true\"")
            return
        port = notes.get("prometheus.io/port", "")
        if not port.isdigit() or _resolve(port, _pod(w).get("containers", [])) is None:
            self.problem(w, f"prometheus.io/port {port!r} is no container port")
        if notes.get("prometheus.io/path", "/metrics") != "/metrics":
            self.problem(w, "prometheus.io/path is not /metrics")

    def container(self, w: Obj, c: Obj) -> None:
        where = f"container {c.get('name')}"
        image = str(c.get("image", ""))
        if "/" not in image or not re.search(r"(:[\w][\w.-]*|@sha256:[0-9a-f]{64})$",
                                             image.rsplit("/", 1)[-1]):
            self.problem(w, f"{where}: image {image!r} names no registry and tag (set images: "
                            "in the overlay)")
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for key in sorted(set(req) | set(lim)):
            if ("/" in key or key.startswith("hugepages-")) and key in req and key in lim \
                    and _quantity(req[key]) != _quantity(lim[key]):
                self.problem(w, f"{where}: {key} request {req[key]} != limit {lim[key]}")
            if key.startswith("hugepages-") and not ({"cpu", "memory"} & set(req)):
                self.problem(w, f"{where}: {key} needs a cpu or memory request")
        pages = {v["emptyDir"]["medium"][len("HugePages-"):] for v in _pod(w).get("volumes", [])
                 if str(v.get("emptyDir", {}).get("medium", "")).startswith("HugePages-")}
        for size in pages - {k[len("hugepages-"):] for k in lim}:
            self.problem(w, f"{where}: a HugePages-{size} volume without a hugepages-{size} "
                            "limit")
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if not probe:
                continue
            port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
            if port is not None and _resolve(port, [c]) is None:
                self.problem(w, f"{where}: {kind} port {port} is not declared")
        for e in c.get("env", []):
            if e.get("name") == SECRET_ENV and "value" in e:
                self.problem(w, f"{where}: {SECRET_ENV} is a literal value; use secretKeyRef")

    # -- environment ---------------------------------------------------------------------------

    def env(self, w: Obj, c: Obj, index: int) -> dict[str, str]:
        """The container's environment in pod ``index``: ConfigMaps, Secrets and the downward
        API resolved (the pod IP is a stand-in address); missing references are problems."""
        pod = f"{w['metadata']['name']}-{index}"
        fields = {"metadata.name": pod, "status.podIP": _pod_ip(index),
                  "metadata.namespace": w["metadata"].get("namespace", "default")}
        out: dict[str, str] = {}
        for src in c.get("envFrom", []):
            ref = src.get("configMapRef") or src.get("secretRef") or {}
            kind = "ConfigMap" if "configMapRef" in src else "Secret"
            out.update(self.source(w, kind, ref, None))
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
                sel = ref.get("secretKeyRef") or ref.get("configMapKeyRef")
                if e["name"] == SECRET_ENV and kind == "Secret":
                    self.secret_refs.add((sel["name"], sel["key"]))
                value = self.source(w, kind, sel, sel["key"]).get(sel["key"])
                if value is not None:
                    out[e["name"]] = value
        return out

    def source(self, w: Obj, kind: str, ref: Mapping[str, Any], key: str | None
               ) -> dict[str, str]:
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

    def secret_sources(self) -> None:
        engines_and_proxy = [w for w in self.workloads()
                             if _command(w)[:2] in (["vllm", "serve"], ["kvbridge", "proxy"])]
        for w in engines_and_proxy:
            main = _pod(w)["containers"][0]
            if not any(e.get("name") == SECRET_ENV and "secretKeyRef" in e.get("valueFrom", {})
                       for e in main.get("env", [])):
                self.problem(w, f"{SECRET_ENV} does not come from a Secret (secretKeyRef)")
        if len(self.secret_refs) > 1:
            self.fleet.problems.append(f"{SECRET_ENV} comes from several Secret keys "
                                       f"{sorted(self.secret_refs)}: one fleet, one secret")

    # -- engines -------------------------------------------------------------------------------

    def engine(self, w: Obj, serve_parser: ServeParser) -> None:
        role = _labels(w).get(COMPONENT, "")
        if role not in ROLES:
            self.problem(w, f"runs vllm serve but its {COMPONENT} label {role!r} is not one of "
                            f"{sorted(ROLES)}")
            return
        if w["kind"] != "StatefulSet":
            self.problem(w, "engines must be a StatefulSet (stable DNS names for the proxy)")
            return
        svc = self.find("Service", str(w["spec"].get("serviceName")))
        if svc is None or svc["spec"].get("clusterIP") != "None" \
                or not _selects(svc["spec"].get("selector", {}), _labels(w)):
            self.problem(w, f"serviceName {w['spec'].get('serviceName')!r} is no headless "
                            "Service selecting its pods")
        c = _pod(w)["containers"][0]
        for i in range(int(w["spec"].get("replicas", 1))):
            pod = self.engine_pod(w, c, role, i, serve_parser)
            if pod is not None:
                self.fleet.engines.append(pod)

    def engine_pod(self, w: Obj, c: Obj, role: str, i: int, serve_parser: ServeParser
                   ) -> EnginePod | None:
        env = self.env(w, c, i)
        argv = [expand(str(a), env) for a in [*c.get("command", [])[2:], *c.get("args", [])]]
        for a in argv:
            if "$(" in a:
                self.problem(w, f"argument {a[:80]!r} names an undefined variable")
        try:
            ns = serve_parser(argv)
        except ValueError as exc:
            self.problem(w, f"vllm serve args: {exc}")
            return None
        ktc = ns.kv_transfer_config
        if ktc is None:
            self.problem(w, "vllm serve has no --kv-transfer-config")
            return None
        extra = dict(ktc.kv_connector_extra_config or {})
        if ktc.kv_role != ROLES[role]:
            self.problem(w, f"kv_role {ktc.kv_role!r}, a {role} engine needs {ROLES[role]!r}")
        if "secret" in extra:
            self.problem(w, "the secret is inlined in kv_connector_extra_config (visible in ps); "
                            f"use {SECRET_ENV} from a Secret")
        if GUARD_MIDDLEWARE not in (ns.middleware or []):
            self.problem(w, f"--middleware {GUARD_MIDDLEWARE} is missing")
        kvenv = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
        try:
            config = Config.load(extra, kvenv, preset_for(ktc.kv_connector, "kv_connector"))
        except ConfigError as exc:
            self.problem(w, f"kv-transfer-config: {exc}")
            return None
        for warning in config.warnings:
            self.problem(w, warning)
        self.engine_config(w, c, config, env, i, int(ns.port), int(ns.tensor_parallel_size),
                           int(ns.pipeline_parallel_size))
        name = w["metadata"]["name"]
        return EnginePod(role, name, f"{name}-{i}", str(w["spec"].get("serviceName")),
                         int(ns.port), int(ns.tensor_parallel_size), config,
                         str(ktc.engine_id))

    def pairs(self) -> None:
        """Every prefill/decode shape pair passes D's own check of a decode leg from that P
        (:meth:`TransferParams.check_decode_leg`: today, equal tensor-parallel sizes)."""
        from kvbridge import params

        shapes = {(p.tp, d.tp): (p, d) for p in self.fleet.role("prefill")
                  for d in self.fleet.role("decode")}
        for (p_tp, d_tp), (p, d) in sorted(shapes.items()):
            host = p.config.side_channel_host
            leg = params.parse({
                "do_remote_prefill": True, "remote_engine_id": p.engine_id, "remote_host": host,
                "remote_port": p.config.side_channel_port, "tp_size": p_tp,
                "remote_block_ids": [0], "remote_num_tokens": 16,
                "kvbridge_peers": [{"address": f"tcp://{host}:{p.config.side_channel_port + r}",
                                    "generation": "g"} for r in range(p_tp)]})
            for mode in (TransferMode.PULL, TransferMode.PUSH):
                try:
                    leg.check_decode_leg(mode, d_tp, 16, 16)
                except ParamsError as exc:
                    self.fleet.problems.append(f"{p.workload} (tp {p_tp}) -> {d.workload} (tp "
                                               f"{d_tp}), {mode.value}: {exc}")
                    break

    def engine_config(self, w: Obj, c: Obj, config: Config, env: Mapping[str, str], index: int,
                      port: int, tp: int, pp: int) -> None:
        want = self.expect
        if config.backend != want.backend:
            self.problem(w, f"backend {config.backend!r}, expected {want.backend!r}")
        for key, value in want.backend_options.items():
            if config.backend_options.get(key) != value:
                self.problem(w, f"backend_options.{key} is "
                                f"{config.backend_options.get(key)!r}, expected {value!r}")
        if not config.secret:
            self.problem(w, "no fleet secret: a routable control channel refuses to start")
        if config.side_channel_host != _pod_ip(index):
            self.problem(w, f"side_channel_host {config.side_channel_host!r} is not the pod's "
                            "IP (fieldRef status.podIP)")
        ports = _ports(c)
        if ports.get("http") != port:
            self.problem(w, f"vllm serve --port {port}, container port http is "
                            f"{ports.get('http')}")
        control = range(config.side_channel_port, config.side_channel_port + tp)
        if config.side_channel_port == 0 or control.stop > 65536 or port in control:
            self.problem(w, f"control ports {control.start}-{control.stop - 1} (tp {tp}) must be "
                            f"fixed, below 65536 and miss the HTTP port {port}")
        elif not self.policy_opens(w, control):
            self.problem(w, f"no NetworkPolicy rule selecting these pods opens control ports "
                            f"{control.start}-{control.stop - 1}")
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = (c.get(kind) or {}).get("httpGet") or {}
            if get.get("path") != "/health" or _resolve(get.get("port"), [c]) != port:
                self.problem(w, f"{kind} is not GET /health on the vLLM port {port}")
        lim = c.get("resources", {}).get("limits", {})
        if int(lim.get(GPU, 0)) != tp * pp:
            self.problem(w, f"{GPU} limit {lim.get(GPU)}, tensor x pipeline parallel size is "
                            f"{tp * pp}")
        if int(lim.get(EFA, 0)) < 1:
            self.problem(w, f"no {EFA} limit: the engine gets no EFA interface")
        if "IPC_LOCK" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            self.problem(w, "no IPC_LOCK capability (EFA registers pinned memory)")
        pages = [k for k in lim if k.startswith("hugepages-")]
        if env.get("FI_EFA_USE_HUGE_PAGE", "1") != "0" and not pages:
            self.problem(w, "FI_EFA_USE_HUGE_PAGE is not 0 but the pod gets no hugepages "
                            "(libfabric's buffers would fault): request hugepages-2Mi or set 0")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        vols = {v["name"]: v for v in _pod(w).get("volumes", [])}
        if vols.get(mounts.get("/dev/shm", ""), {}).get("emptyDir", {}).get("medium") != "Memory":
            self.problem(w, "/dev/shm is not a memory-backed emptyDir")

    def policy_opens(self, w: Obj, ports: range) -> bool:
        for pol in (o for o in self.objs if o.get("kind") == "NetworkPolicy"):
            if not _policy_selects(pol, _labels(w)):
                continue
            for rule in pol["spec"].get("ingress", []):
                for p in rule.get("ports", []):
                    if isinstance(p.get("port"), int) and p["port"] <= ports.start \
                            and ports.stop - 1 <= p.get("endPort", p["port"]):
                        return True
            return False
        return True  # no policy selects the pods: everything is open

    # -- proxy ---------------------------------------------------------------------------------

    def proxy(self, w: Obj) -> None:
        from kvbridge.proxy.app import add_arguments

        c = _pod(w)["containers"][0]
        self.env(w, c, 0)
        argv = [str(a) for a in [*c.get("command", [])[2:], *c.get("args", [])]]
        if any(a.startswith("--control-secret") for a in argv):
            self.problem(w, "--control-secret puts the secret on the command line (visible in "
                            f"ps); use {SECRET_ENV} from a Secret")
        parser = argparse.ArgumentParser(prog="kvbridge proxy")
        add_arguments(parser)
        parser.add_argument("--log-level")
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
        except SystemExit:
            self.problem(w, f"proxy args: {err.getvalue().strip().splitlines()[-1]}")
            return
        if args.host not in ("0.0.0.0", "::"):
            self.problem(w, f"--host {args.host}: the Service cannot reach it (0.0.0.0)")
        if _ports(c).get("http") != args.port:
            self.problem(w, f"--port {args.port}, container port http is {_ports(c).get('http')}")
        lim = c.get("resources", {}).get("limits", {}) | c.get("resources", {}).get("requests", {})
        for key in (GPU, EFA):
            if key in lim:
                self.problem(w, f"the proxy requests {key}: it moves no KV")
        self.fleet.prefill_urls, self.fleet.decode_urls = list(args.prefill), list(args.decode)
        for role, urls in (("prefill", args.prefill), ("decode", args.decode)):
            self.pool(w, role, list(urls))

    def pool(self, w: Obj, role: str, urls: list[str]) -> None:
        want = {e.pod: e for e in self.fleet.role(role)}
        ns = w["metadata"].get("namespace")
        seen: list[str] = []
        for url in urls:
            parts = urlsplit(url if "://" in url else f"http://{url}")
            labels = (parts.hostname or "").split(".")
            pod = want.get(labels[0])
            # <pod>.<service>, optionally .<namespace>[.svc[.cluster.local]]
            if pod is None or labels[1:2] != [pod.service] or (
                    len(labels) > 2 and labels[2] != ns) or labels[3:] not in (
                    [], ["svc"], ["svc", "cluster", "local"]):
                self.problem(w, f"--{role} {url}: no {role} engine pod by that name "
                                "(<pod>.<headless service>)")
                continue
            if parts.port != pod.port:
                self.problem(w, f"--{role} {url}: port {parts.port}, the engine serves on "
                                f"{pod.port}")
            seen.append(pod.pod)
        for name in sorted(set(want) - set(seen), key=lambda p: (len(p), p)):
            self.problem(w, f"--{role} lacks {name} (its StatefulSet has more replicas than the "
                            "proxy lists)")
        for name in sorted({p for p in seen if seen.count(p) > 1}):
            self.problem(w, f"--{role} lists {name} more than once")


def _policy_selects(pol: Obj, labels: Mapping[str, str]) -> bool:
    sel = pol.get("spec", {}).get("podSelector", {})
    if not _selects(sel.get("matchLabels", {}), labels) and sel.get("matchLabels"):
        return False
    for e in sel.get("matchExpressions", []):
        has = labels.get(e["key"])
        if e["operator"] == "In" and has not in e.get("values", []):
            return False
        if e["operator"] == "NotIn" and has in e.get("values", []):
            return False
        if e["operator"] == "Exists" and has is None:
            return False
        if e["operator"] == "DoesNotExist" and has is not None:
            return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge.testing.k8s OVERLAY_DIR...``: render each kustomization, print every
    problem; exit status 1 if there is one. Needs kubernetes-validate, PyYAML and vLLM."""
    from pathlib import Path

    from kvbridge.integrations.vllm_serve import parse_serve_args
    from kvbridge.testing.kustomize import KustomizeError, render

    parser = argparse.ArgumentParser(prog="python -m kvbridge.testing.k8s",
                                     description=main.__doc__)
    parser.add_argument("overlays", nargs="+", type=Path, help="kustomization directories")
    parser.add_argument("--kube-version", default=KUBE_VERSION)
    args = parser.parse_args(argv)
    bad = 0
    for overlay in args.overlays:
        try:
            objs = render(overlay)
        except KustomizeError as exc:
            found = [str(exc)]
        else:
            found = (schema_problems(objs, args.kube_version)
                     + check_fleet(objs, parse_serve_args).problems)
        for line in found:
            print(f"{overlay}: {line}")
        if not found:
            print(f"{overlay}: ok ({len(objs)} objects, Kubernetes {args.kube_version})")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

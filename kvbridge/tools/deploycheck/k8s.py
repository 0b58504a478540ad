"""Checks of a rendered kvbridge xPyD deployment (``deploy/k8s``): schemas, then what they miss.

:func:`schema_problems` validates every object against :data:`KUBE_VERSION`'s strict schema
(:mod:`kvbridge.tools.deploycheck.objects`). :func:`check_fleet` checks what a schema cannot, on the
objects of :func:`kvbridge.tools.deploycheck.kustomize.render`: first what any deployment needs
(:meth:`Objects.check_generic`), then kvbridge's fleet:

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
  container port; each role's engines are found by ``--prefill-dns``/``--decode-dns`` naming
  the role's headless Service (optionally ``.<namespace>[.svc[.cluster.local]]``) on the
  engines' vLLM port (scaling then needs no proxy edit), or listed by ``--prefill``/``--decode``
  as exactly the engines' stable DNS names on their vLLM port, one per pod (without discovery);
  no GPU, no EFA;
* monitors (``components/monitoring``): a PodMonitor or ServiceMonitor selects pods (Services)
  and names one of their ports (:func:`kvbridge.tools.deploycheck.monitoring.target_problems`);
* the secret: every ``KVBRIDGE_SECRET`` comes from one Secret key (``secretKeyRef``), never a
  literal value, a ConfigMap, ``--control-secret`` or ``kv_connector_extra_config``.

Problems are strings naming the object, never raised, each reported once (not once per pod).
Pure functions; the ``vllm serve`` parser is passed in. ``python -m kvbridge.tools.deploycheck.k8s``
passes :func:`kvbridge.tools.deploycheck.serve_args.parse_serve_args` (the flags the checks read,
without vLLM), or with ``--vllm`` vLLM's own (:func:`kvbridge.integrations.vllm_serve.
parse_serve_args`); it checks an overlay whose ``secret.env`` is not written yet with a
placeholder secret, and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvbridge import params
from kvbridge.config import ENV_PREFIX, Config, TransferMode
from kvbridge.errors import ConfigError, ParamsError
from kvbridge.integrations.names import preset_for
from kvbridge.tools.deploycheck import monitoring
from kvbridge.tools.deploycheck import objects as ko
from kvbridge.tools.deploycheck.objects import Obj, Objects
from kvbridge.tools.engines import GUARD_MIDDLEWARE

__all__ = ["KUBE_VERSION", "Expect", "EnginePod", "Fleet", "ServeParser", "schema_problems",
           "check_fleet", "expand", "ROLES", "main"]

#: The Kubernetes version whose schemas the examples are validated against.
KUBE_VERSION = "1.32"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
COMPONENT = "app.kubernetes.io/component"
GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
SECRET_ENV = ENV_PREFIX + "SECRET"
#: the file each overlay's secretGenerator reads (never committed; docs/deploy.md)
SECRET_FILE = "secret.env"
ENGINE, PROXY = ["vllm", "serve"], ["kvbridge", "proxy"]

ServeParser = Callable[[Sequence[str]], argparse.Namespace]
expand = ko.expand


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
    discovery: dict[str, str] = field(default_factory=dict)
    """role → the proxy's ``--ROLE-dns`` value (roles found by DNS)."""
    problems: list[str] = field(default_factory=list)

    def role(self, role: str) -> list[EnginePod]:
        return [e for e in self.engines if e.role == role]


def schema_problems(objs: Sequence[Obj], version: str = KUBE_VERSION) -> list[str]:
    """Every object validated against Kubernetes ``version``'s strict schema; the Prometheus
    Operator's objects, which no Kubernetes schema covers, structurally
    (:mod:`kvbridge.tools.deploycheck.monitoring`)."""
    ours = [o for o in objs if not monitoring.is_monitoring(o)]
    theirs = [p for o in objs if monitoring.is_monitoring(o)
              for p in monitoring.structure_problems(o)]
    return ko.schema_problems(ours, version) + theirs


def check_fleet(objs: Sequence[Obj], serve_parser: ServeParser,
                expect: Expect | None = None) -> Fleet:
    """Everything the schemas cannot check (see the module docstring)."""
    c = _Checker(objs, expect or Expect())
    c.check_generic()
    for w in c.runs(ENGINE):
        with c.guard(w):
            c.engine(w, serve_parser)
    for role in ROLES:
        if not c.fleet.role(role):
            c.problems.append(f"no {role} engine (a StatefulSet labelled {COMPONENT}: {role} "
                              "running vllm serve)")
    c.pairs()
    ids = [e.engine_id for e in c.fleet.engines]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        c.problems.append(f"engine_id {dup!r} is used by several pods")
    proxies = c.runs(PROXY)
    if len(proxies) != 1:
        c.problems.append(f"expected one proxy Deployment (kvbridge proxy), found {len(proxies)}")
    for w in proxies:
        with c.guard(w):
            c.proxy(w)
    c.secret_sources()
    c.problems += monitoring.target_problems(objs)
    c.fleet.problems = list(dict.fromkeys(c.problems))  # once, not once per pod
    return c.fleet


class _Checker(Objects):
    def __init__(self, objs: Sequence[Obj], expect: Expect) -> None:
        super().__init__(objs)
        self.expect, self.fleet = expect, Fleet()

    def runs(self, command: list[str]) -> list[Obj]:
        """The workloads whose first container's command starts with ``command``."""
        return [w for w in self.workloads()
                if [str(x) for x in ko.main_container(w).get("command", [])][:2] == command]

    def secret_sources(self) -> None:
        """Engines and proxy take the secret from one Secret key; never a literal, a ConfigMap
        or a command line (the last two are checked where those are read)."""
        for cm in self.of_kind("ConfigMap"):
            if SECRET_ENV in cm.get("data", {}):
                self.problem(cm, f"holds {SECRET_ENV}: the secret belongs in a Secret")
        refs = set()
        for w in self.runs(ENGINE) + self.runs(PROXY):
            entry: Obj = next((e for e in ko.main_container(w).get("env", [])
                               if e.get("name") == SECRET_ENV), {})
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            if "value" in entry:
                self.problem(w, f"{SECRET_ENV} is a literal value; use secretKeyRef")
            elif not ref:
                self.problem(w, f"{SECRET_ENV} does not come from a Secret (secretKeyRef)")
            else:
                refs.add((str(ref.get("name")), str(ref.get("key"))))
        if len(refs) > 1:
            self.problems.append(f"{SECRET_ENV} comes from several Secret keys {sorted(refs)}: "
                                 "one fleet, one secret")

    # -- engines -------------------------------------------------------------------------------

    def engine(self, w: Obj, serve_parser: ServeParser) -> None:
        role = ko.pod_labels(w).get(COMPONENT, "")
        if role not in ROLES:
            self.problem(w, f"runs vllm serve but its {COMPONENT} label {role!r} is not one of "
                            f"{sorted(ROLES)}")
            return
        if w["kind"] != "StatefulSet":
            self.problem(w, "engines must be a StatefulSet (stable DNS names for the proxy)")
            return
        svc = self.find("Service", str(w["spec"].get("serviceName")))
        if svc is None or svc["spec"].get("clusterIP") != "None" \
                or not ko.selects(svc["spec"].get("selector", {}), ko.pod_labels(w)):
            self.problem(w, f"serviceName {w['spec'].get('serviceName')!r} is no headless "
                            "Service selecting its pods")
        c = ko.main_container(w)
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
        (:meth:`TransferParams.check_decode_leg`), and has equal tensor-parallel sizes: GPU
        engines do not describe their KV heads, so kvbridge's handshake refuses heterogeneous
        TP between them (docs/concepts.md#heterogeneous-tp-and-block-size)."""
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
                    if p_tp != d_tp:
                        raise ParamsError("kv_transfer_params.tp_size",
                                          f"prefill runs tensor-parallel {p_tp}, this engine "
                                          f"{d_tp}: GPU engines map no KV heads, so the "
                                          "handshake refuses heterogeneous TP")
                    leg.check_decode_leg(mode, 16, 16)
                except ParamsError as exc:
                    self.problems.append(f"{p.workload} (tp {p_tp}) -> {d.workload} (tp "
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
        if config.side_channel_host != ko.pod_ip(index):
            self.problem(w, f"side_channel_host {config.side_channel_host!r} is not the pod's "
                            "IP (fieldRef status.podIP)")
        ports = ko.ports(c)
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
        for kind in ko.PROBES:
            get = (c.get(kind) or {}).get("httpGet") or {}
            if get.get("path") != "/health" or ko.resolve_port(get.get("port"), [c]) != port:
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
        vols = {v["name"]: v for v in ko.pod_spec(w).get("volumes", [])}
        if vols.get(mounts.get("/dev/shm", ""), {}).get("emptyDir", {}).get("medium") != "Memory":
            self.problem(w, "/dev/shm is not a memory-backed emptyDir")

    # -- proxy ---------------------------------------------------------------------------------

    def proxy(self, w: Obj) -> None:
        from kvbridge.proxy.cli import add_arguments  # pulls aiohttp: optional and heavy

        c = ko.main_container(w)
        self.env(w, c, 0)
        argv = [str(a) for a in [*c.get("command", [])[2:], *c.get("args", [])]]
        if any(a.startswith("--control-secret") for a in argv):
            self.problem(w, "--control-secret puts the secret on the command line (visible in "
                            f"ps); use {SECRET_ENV} from a Secret")
        parser = argparse.ArgumentParser(prog="kvbridge proxy")
        add_arguments(parser)  # --log-level included
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(argv)
        except SystemExit:
            self.problem(w, f"proxy args: {err.getvalue().strip().splitlines()[-1]}")
            return
        if args.host not in ("0.0.0.0", "::"):
            self.problem(w, f"--host {args.host}: the Service cannot reach it (0.0.0.0)")
        if ko.ports(c).get("http") != args.port:
            self.problem(w, f"--port {args.port}, container port http is {ko.ports(c).get('http')}")
        lim = c.get("resources", {}).get("limits", {}) | c.get("resources", {}).get("requests", {})
        for key in (GPU, EFA):
            if key in lim:
                self.problem(w, f"the proxy requests {key}: it moves no KV")
        self.fleet.prefill_urls, self.fleet.decode_urls = list(args.prefill), list(args.decode)
        for role, urls in (("prefill", args.prefill), ("decode", args.decode)):
            dns = getattr(args, f"{role}_dns")
            if dns is not None:
                self.fleet.discovery[role] = dns
                self.dns(w, role, dns)
            static_only = dns is None and args.engines_file is None
            if urls or static_only:
                self.pool(w, role, list(urls), every_pod=static_only)

    def dns(self, w: Obj, role: str, target: str) -> None:
        """``--ROLE-dns`` must name the role's headless Service on its engines' port."""
        from kvbridge.proxy.settings import parse_dns_target

        try:
            name, port = parse_dns_target(target, f"--{role}-dns")
        except ConfigError as exc:
            self.problem(w, str(exc))
            return
        pods = self.fleet.role(role)
        services = {e.service for e in pods}
        labels = name.rstrip(".").split(".")
        ns = w["metadata"].get("namespace")
        if labels[0] not in services or (len(labels) > 1 and labels[1] != ns) or labels[2:] not in (
                [], ["svc"], ["svc", "cluster", "local"]):
            self.problem(w, f"--{role}-dns {target}: names no {role} headless Service "
                            f"({', '.join(sorted(services)) or 'none'}"
                            f"[.{ns}[.svc[.cluster.local]]])")
            return
        ports = sorted({e.port for e in pods if e.service == labels[0]})
        if ports != [port]:
            self.problem(w, f"--{role}-dns {target}: port {port}, the engines serve on "
                            f"{', '.join(map(str, ports))}")

    def pool(self, w: Obj, role: str, urls: list[str], every_pod: bool = True) -> None:
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
        for name in sorted(set(want) - set(seen) if every_pod else (),
                           key=lambda p: (len(p), p)):
            self.problem(w, f"--{role} lacks {name} (its StatefulSet has more replicas than the "
                            f"proxy lists; --{role}-dns finds them all)")
        for name in sorted({p for p in seen if seen.count(p) > 1}):
            self.problem(w, f"--{role} lists {name} more than once")


def _placeholder(missing: list[Path]) -> Callable[[Path], str | None]:
    """A stand-in for an overlay's unwritten ``secret.env`` (a fixed, well-formed secret);
    every file it stands in for is added to ``missing``."""
    def stand_in(path: Path) -> str | None:
        if path.name != SECRET_FILE:
            return None
        missing.append(path)
        return f"{SECRET_ENV}={'0' * 64}\n"
    return stand_in


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvbridge.tools.deploycheck.k8s OVERLAY_DIR...``: render each kustomization,
    print every problem; exit status 1 if there is one. An overlay whose secret.env is not
    written yet is checked with a placeholder secret (a note says so). Needs
    kubernetes-validate and PyYAML; vLLM only with --vllm."""
    # PyYAML (kustomize) is optional: only the command line renders overlays
    from kvbridge.tools.deploycheck.kustomize import KustomizeError, render
    from kvbridge.tools.deploycheck.serve_args import parse_serve_args

    parser = argparse.ArgumentParser(prog="python -m kvbridge.tools.deploycheck.k8s",
                                     description=main.__doc__)
    parser.add_argument("overlays", nargs="+", type=Path, help="kustomization directories")
    parser.add_argument("--kube-version", default=KUBE_VERSION,
                        help="Kubernetes version of the schemas (default %(default)s)")
    parser.add_argument("--vllm", action="store_true",
                        help="parse the engines' command lines with vLLM's own serve parser "
                        "(imports vLLM: seconds; every flag checked), not only the flags the "
                        "checks read")
    args = parser.parse_args(argv)
    serve_parser: ServeParser = parse_serve_args
    if args.vllm:
        from kvbridge.integrations import vllm_serve

        serve_parser = vllm_serve.parse_serve_args
    bad = 0
    for overlay in args.overlays:
        missing: list[Path] = []
        try:
            objs = render(overlay, _placeholder(missing))
        except KustomizeError as exc:
            found = [str(exc)]
        else:
            found = (schema_problems(objs, args.kube_version)
                     + check_fleet(objs, serve_parser).problems)
        for line in found:
            print(f"{overlay}: {line}")
        for path in missing:
            print(f"{overlay}: note: {path} does not exist, checked with a placeholder "
                  f"{SECRET_ENV}; write it before kubectl apply -k (docs/deploy.md, the secret)")
        if not found:
            print(f"{overlay}: ok ({len(objs)} objects, Kubernetes {args.kube_version}, "
                  + ("vLLM's serve parser)" if args.vllm else "the flags the checks read; "
                     "--vllm: every flag, with vLLM's parser)"))
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

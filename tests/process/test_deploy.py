"""deploy/k8s: the xPyD manifests render, validate against Kubernetes' schemas and are consistent.

Each overlay is rendered (kvbridge.tools.deploycheck.kustomize; cross-checked against
`kubectl kustomize` where kubectl is installed), every object is validated against the strict
schema of Kubernetes KUBE_VERSION (kubernetes-validate, offline), and
kvbridge.tools.deploycheck.k8s checks what schemas cannot: vLLM's own parser and kvbridge's Config
on every engine pod's command line, the proxy's own argparse, the secret's sources, ports, pools
and resources. Broken copies, in memory and on disk, must fail with a message naming the fault.
Nothing starts; no real EFA.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvbridge.tools.deploycheck import k8s, monitoring
from kvbridge.tools.deploycheck import objects as ko
from kvbridge.tools.deploycheck.kustomize import KustomizeError, render, strategic_merge

pytestmark = pytest.mark.timeout(300)  # importing vLLM (for its parser) is most of it

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "k8s"
OVERLAYS = ["1p1d", "8p2d"]
SECRET = "0f" * 32

Objs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with the secret.env each overlay's secretGenerator reads."""
    root = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(DEPLOY, root)
    for name in OVERLAYS:
        (root / "overlays" / name / "secret.env").write_text(f"KVBRIDGE_SECRET={SECRET}\n")
    return root


@pytest.fixture(scope="module")
def serve_parser() -> k8s.ServeParser:
    from kvbridge.integrations.vllm_serve import parse_serve_args

    return parse_serve_args


def problems(objs: Objs, parser: k8s.ServeParser) -> list[str]:
    return k8s.schema_problems(objs) + k8s.check_fleet(objs, parser).problems


# -- the manifests as committed ----------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_and_consistent(tree: Path, serve_parser: k8s.ServeParser,
                                         overlay: str, caplog: pytest.LogCaptureFixture) -> None:
    from kvbridge_nixl._agent import NixlOptions

    objs = render(tree / "overlays" / overlay)
    assert k8s.schema_problems(objs) == []
    fleet = k8s.check_fleet(objs, serve_parser)
    assert fleet.problems == []
    n_p, n_d = {"1p1d": (1, 1), "8p2d": (8, 2)}[overlay]
    assert [e.pod for e in fleet.role("prefill")] == [f"kvbridge-prefill-{i}" for i in range(n_p)]
    assert [e.pod for e in fleet.role("decode")] == [f"kvbridge-decode-{i}" for i in range(n_d)]
    # the proxy finds the engines by their headless Services' DNS names: scaling needs no edit
    assert fleet.discovery == {"prefill": "kvbridge-prefill:8000", "decode": "kvbridge-decode:8000"}
    assert fleet.prefill_urls == fleet.decode_urls == []
    for engine in fleet.engines:
        assert engine.engine_id == engine.pod
        assert engine.config.secret == SECRET
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbridge.transport.nixl"):
            opts = NixlOptions.parse(engine.config.backend_options)
        assert opts.backends == ("LIBFABRIC",) and not caplog.records  # no unknown option
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Secret", "Service",
                     "StatefulSet"]
    assert {o["metadata"]["namespace"] for o in objs} == {"kvbridge"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_agrees_with_kubectl_kustomize(tree: Path, overlay: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the renderer is checked by the tests below only")
    out = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]

    def by_name(objs: Objs) -> dict[str, Any]:  # kubectl wraps base64 at 76 columns
        return {f"{o['kind']}/{o['metadata']['name']}": o | (
            {"data": {k: base64.b64decode(v) for k, v in o["data"].items()}}
            if o["kind"] == "Secret" else {}) for o in objs}

    assert by_name(render(tree / "overlays" / overlay)) == by_name(theirs)


def test_secret_env_is_ignored_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for overlay in OVERLAYS:
        path = f"deploy/k8s/overlays/{overlay}/secret.env"
        assert subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", path]).returncode == 0
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "deploy"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert not [p for p in tracked if p.endswith("secret.env")]


# -- broken copies, in memory: every fault is reported by name ---------------------------------

Mutation = Callable[[Objs], None]
P, D, PROXY = "kvbridge-prefill", "kvbridge-decode", "kvbridge-proxy"


def obj(objs: Objs, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def container(objs: Objs, name: str) -> dict[str, Any]:
    kind = "Deployment" if name == "kvbridge-proxy" else "StatefulSet"
    c: dict[str, Any] = obj(objs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return c


def env_entry(objs: Objs, name: str, var: str) -> dict[str, Any]:
    return next(e for e in container(objs, name)["env"] if e["name"] == var)


def edit_ktc(name: str, fn: Callable[[dict[str, Any]], None]) -> Mutation:
    def mutate(objs: Objs) -> None:
        args = container(objs, name)["args"]
        i = args.index("--kv-transfer-config") + 1
        ktc = json.loads(args[i])
        fn(ktc)
        args[i] = json.dumps(ktc)
    return mutate


def literal_env(name: str, var: str, value: str) -> Mutation:
    def mutate(objs: Objs) -> None:
        entry = env_entry(objs, name, var)
        entry.pop("valueFrom")
        entry["value"] = value
    return mutate


def replace_arg(name: str, old: str, new: str) -> Mutation:
    def mutate(objs: Objs) -> None:
        args = container(objs, name)["args"]
        args[args.index(old)] = new
    return mutate


def static_pools(prefill: list[str], decode: list[str]) -> Mutation:
    """The proxy lists its engines (``--prefill``/``--decode``) instead of discovering them."""
    def mutate(objs: Objs) -> None:
        args = container(objs, PROXY)["args"]
        for flag in ("--prefill-dns", "--decode-dns"):
            i = args.index(flag)
            del args[i:i + 2]
        args.extend(["--prefill", *prefill, "--decode", *decode])
    return mutate


def pod_urls(name: str, n: int) -> list[str]:
    return [f"http://{name}-{i}.{name}:8000" for i in range(n)]


def set_path(kind: str, name: str, path: str, value: Any) -> Mutation:
    def mutate(objs: Objs) -> None:
        node: Any = obj(objs, kind, name)
        *head, last = path.split("/")
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is None:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return mutate


def with_tp(n: int, *names: str) -> Mutation:
    """Tensor parallelism ``n`` on these engines, with their GPUs and EFA interfaces."""
    def mutate(objs: Objs) -> None:
        for name in names:
            c = container(objs, name)
            c["args"][c["args"].index("--tensor-parallel-size") + 1] = str(n)
            for k in ("requests", "limits"):
                c["resources"][k].update({"nvidia.com/gpu": n, "vpc.amazonaws.com/efa": 2 * n})
    return mutate


def both(*fns: Mutation) -> Mutation:
    def mutate(objs: Objs) -> None:
        for fn in fns:
            fn(objs)
    return mutate


C0 = "spec/template/spec/containers/0"
TP4 = with_tp(4, P, D)

BROKEN: dict[str, tuple[str, Mutation, str]] = {
    # what a schema catches
    "typo in a container field": (
        "1p1d", lambda o: container(o, P).__setitem__("resource", container(o, P).pop(
            "resources")), "schema 1.32: spec/template/spec/containers/0: Additional properties"),
    "port as a string": (
        "1p1d", set_path("StatefulSet", D, f"{C0}/ports/0/containerPort", "8000"),
        "containers/0/ports/0/containerPort: '8000' is not of type 'integer'"),
    "replicas as a word": (
        "1p1d", set_path("StatefulSet", P, "spec/replicas", "two"), "spec/replicas: 'two'"),
    # the engines' command lines (vLLM's parser, kvbridge's Config)
    "unknown extra_config key": (
        "1p1d", edit_ktc(P, lambda k: k["kv_connector_extra_config"].update(
            {"backend_option": {}})), "did you mean 'backend_options'"),
    "unknown kv-transfer-config key": (
        "1p1d", edit_ktc(D, lambda k: k.update({"kv_conector": "x"})),
        "kv_conector Unexpected keyword argument"),
    "unknown vllm flag": (
        "1p1d", replace_arg(P, "--tensor-parallel-size", "--tensor-paralel-size"),
        "unrecognized arguments: --tensor-paralel-size"),
    "decode as a producer": (
        "1p1d", edit_ktc(D, lambda k: k.update({"kv_role": "kv_producer"})),
        "StatefulSet/kvbridge-decode: kv_role 'kv_producer', a decode engine needs "
        "'kv_consumer'"),
    "not a kvbridge connector": (
        "1p1d", edit_ktc(P, lambda k: k.update({"kv_connector": "NixlConnector"})),
        "no kvbridge connector is called 'NixlConnector'"),
    "heterogeneous TP": (
        "8p2d", with_tp(4, D), "kvbridge-prefill (tp 1) -> kvbridge-decode (tp 4), pull: "
        "kv_transfer_params.tp_size: prefill runs tensor-parallel 1, this engine 4"),
    "UCX instead of LIBFABRIC": (
        "8p2d", edit_ktc(D, lambda k: k["kv_connector_extra_config"].update(
            {"backend_options": {"backends": ["UCX"]}})),
        "backend_options.backends is ['UCX'], expected ['LIBFABRIC']"),
    "another backend than the connector's": (
        "1p1d", edit_ktc(P, lambda k: k["kv_connector_extra_config"].update(
            {"backend": "shm"})), "selects backend 'nixl', but kv_connector_extra_config"),
    "no guard middleware": (
        "1p1d", replace_arg(D, "kvbridge.integrations.vllm_http.KVTransferParamsGuard",
                            "x.Y"), "--middleware kvbridge.integrations.vllm_http"),
    "undefined variable": (
        "1p1d", replace_arg(P, "$(MODEL)", "$(MODLE)"), "'$(MODLE)' names an undefined variable"),
    "unknown KVBRIDGE_ variable": (
        "1p1d", lambda o: obj(o, "ConfigMap", "kvbridge-engine-env")["data"].update(
            {"KVBRIDGE_SIDECHANNEL_PORT": "5600"}), "KVBRIDGE_SIDECHANNEL_PORT"),
    "control channel on 0.0.0.0": (
        "1p1d", literal_env(P, "KVBRIDGE_SIDE_CHANNEL_HOST", "0.0.0.0"),
        "side_channel_host '0.0.0.0' is not the pod's IP"),
    "duplicate engine ids": (
        "8p2d", edit_ktc(P, lambda k: k.update({"engine_id": "prefill"})),
        "engine_id 'prefill' is used by several pods"),
    # the secret
    "secret as a literal env value": (
        "1p1d", literal_env(D, "KVBRIDGE_SECRET", SECRET),
        "KVBRIDGE_SECRET is a literal value; use secretKeyRef"),
    "secret in the ConfigMap": (
        "1p1d", lambda o: obj(o, "ConfigMap", "kvbridge-engine-env")["data"].update(
            {"KVBRIDGE_SECRET": SECRET}), "holds KVBRIDGE_SECRET"),
    "secret in extra_config": (
        "1p1d", edit_ktc(P, lambda k: k["kv_connector_extra_config"].update({"secret": SECRET})),
        "the secret is inlined in kv_connector_extra_config"),
    "secret on the proxy's command line": (
        "1p1d", lambda o: container(o, PROXY)["args"].extend(["--control-secret", SECRET]),
        "--control-secret puts the secret on the command line"),
    "secret key that does not exist": (
        "1p1d", lambda o: env_entry(o, PROXY, "KVBRIDGE_SECRET")["valueFrom"]["secretKeyRef"]
        .update({"key": "secret"}), "refers to key 'secret' of Secret 'kvbridge-secret'"),
    "no secret on the proxy": (
        "1p1d", set_path("Deployment", PROXY, f"{C0}/env", []),
        "Deployment/kvbridge-proxy: KVBRIDGE_SECRET does not come from a Secret"),
    # ports, pools, probes
    "DNS name of no engine Service": (
        "1p1d", replace_arg(PROXY, "kvbridge-decode:8000", "kvbridge-decoder:8000"),
        "--decode-dns kvbridge-decoder:8000: names no decode headless Service"),
    "DNS name in another namespace": (
        "1p1d", replace_arg(PROXY, "kvbridge-prefill:8000", "kvbridge-prefill.other.svc:8000"),
        "--prefill-dns kvbridge-prefill.other.svc:8000: names no prefill headless Service"),
    "DNS on the wrong port": (
        "8p2d", replace_arg(PROXY, "kvbridge-prefill:8000",
                            "kvbridge-prefill.kvbridge.svc.cluster.local:8100"),
        "port 8100, the engines serve on 8000"),
    "DNS name that is a URL": (
        "1p1d", replace_arg(PROXY, "kvbridge-decode:8000", "http://kvbridge-decode:8000"),
        "--decode-dns must be a DNS name"),
    "static pools, scaled without the proxy": (
        "8p2d", both(static_pools(pod_urls(P, 8), pod_urls(D, 2)),
                     set_path("StatefulSet", P, "spec/replicas", 9)),
        "--prefill lacks kvbridge-prefill-8"),
    "static pool names a pod that does not exist": (
        "1p1d", static_pools(pod_urls(P, 1), ["http://kvbridge-decode-1.kvbridge-decode:8000"]),
        "--decode http://kvbridge-decode-1.kvbridge-decode:8000: no decode engine pod"),
    "static pool on the wrong port": (
        "1p1d", static_pools(["http://kvbridge-prefill-0.kvbridge-prefill:8100"], pod_urls(D, 1)),
        "port 8100, the engine serves on 8000"),
    "static pool lists a pod twice": (
        "8p2d", static_pools(pod_urls(P, 7) + pod_urls(P, 7)[-1:], pod_urls(D, 2)),
        "--prefill lists kvbridge-prefill-6 more than once"),
    "unknown proxy flag": (
        "1p1d", replace_arg(PROXY, "--mode", "--modes"),
        "proxy args: kvbridge proxy: error: unrecognized arguments: --modes"),
    "proxy on loopback": (
        "1p1d", replace_arg(PROXY, "0.0.0.0", "127.0.0.1"), "--host 127.0.0.1"),
    "proxy port disagrees with its container": (
        "1p1d", replace_arg(PROXY, "8000", "9000"), "--port 9000, container port http is 8000"),
    "vLLM port disagrees with its container": (
        "1p1d", replace_arg(D, "8000", "8001"), "vllm serve --port 8001, container port http"),
    "Service targets an undeclared port": (
        "1p1d", set_path("Service", PROXY, "spec/ports/0/targetPort", "web"),
        "Service/kvbridge-proxy: targetPort web is no port"),
    "health probe on another path": (
        "1p1d", set_path("StatefulSet", P, f"{C0}/readinessProbe/httpGet/path", "/healthz"),
        "readinessProbe is not GET /health"),
    "control ports over the HTTP port": (
        "8p2d", both(TP4, lambda o: obj(o, "ConfigMap", "kvbridge-engine-env")["data"].update(
            {"KVBRIDGE_SIDE_CHANNEL_PORT": "7998"})), "control ports 7998-8001 (tp 4)"),
    "policy closes rank 3's control port": (
        "8p2d", both(TP4, set_path("NetworkPolicy", "kvbridge-engines",
                                   "spec/ingress/1/ports/0/endPort", 5602)),
        "no NetworkPolicy rule selecting these pods opens control ports 5600-5603"),
    "scrape port that is not declared": (
        "1p1d", lambda o: obj(o, "StatefulSet", D)["spec"]["template"]["metadata"][
            "annotations"].update({"prometheus.io/port": "9090"}),
        "prometheus.io/port '9090' is no container port"),
    # resources
    "GPU on the proxy": (
        "1p1d", lambda o: container(o, PROXY)["resources"]["limits"].update(
            {"nvidia.com/gpu": 1}), "the proxy requests nvidia.com/gpu"),
    "no EFA on an engine": (
        "1p1d", lambda o: [container(o, P)["resources"][k].pop("vpc.amazonaws.com/efa")
                           for k in ("requests", "limits")],
        "no vpc.amazonaws.com/efa limit"),
    "fewer GPUs than TP": (
        "8p2d", both(TP4, lambda o: [container(o, D)["resources"][k].update(
            {"nvidia.com/gpu": 2}) for k in ("requests", "limits")]),
        "nvidia.com/gpu limit 2, tensor x pipeline parallel size is 4"),
    "hugepages request != limit": (
        "1p1d", lambda o: container(o, D)["resources"]["requests"].update(
            {"hugepages-2Mi": "2Gi"}), "hugepages-2Mi request 2Gi != limit 5120Mi"),
    "hugepages in the env but not in the pod": (
        "8p2d", lambda o: obj(o, "ConfigMap", "kvbridge-engine-env")["data"].update(
            {"FI_EFA_USE_HUGE_PAGE": "1"}), "FI_EFA_USE_HUGE_PAGE is not 0 but the pod gets no "
        "hugepages"),
    "hugepages volume without a limit": (
        "1p1d", lambda o: [container(o, P)["resources"][k].pop("hugepages-2Mi")
                           for k in ("requests", "limits")],
        "a HugePages-2Mi volume without a hugepages-2Mi limit"),
    "no IPC_LOCK": (
        "1p1d", set_path("StatefulSet", P, f"{C0}/securityContext", {}), "no IPC_LOCK"),
    "image without registry and tag": (
        "1p1d", lambda o: container(o, P).update({"image": "kvbridge-vllm"}),
        "image 'kvbridge-vllm' names no registry and tag"),
    "selector that misses the pods": (
        "1p1d", lambda o: obj(o, "StatefulSet", D)["spec"]["selector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "prefil"}), "StatefulSet/kvbridge-decode: selector"),
    "engine as a Deployment": (
        "1p1d", lambda o: obj(o, "StatefulSet", P).update({"kind": "Deployment"}),
        "engines must be a StatefulSet"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_copy_is_refused_naming_the_fault(tree: Path, serve_parser: k8s.ServeParser,
                                                 case: str) -> None:
    overlay, mutate, expected = BROKEN[case]
    objs = copy.deepcopy(_rendered(tree, overlay))
    mutate(objs)
    found = k8s.check_fleet(objs, serve_parser).problems
    if not any(expected in p for p in found):  # the schemas' turn (slower: large JSON files)
        found += k8s.schema_problems(objs)
    assert any(expected in p for p in found), f"{case}: {expected!r} not in {found}"


_CACHE: dict[str, Objs] = {}


def _rendered(tree: Path, overlay: str) -> Objs:
    if overlay not in _CACHE:
        _CACHE[overlay] = render(tree / "overlays" / overlay)
    return _CACHE[overlay]


def test_scaling_a_statefulset_needs_no_proxy_edit(tree: Path,
                                                    serve_parser: k8s.ServeParser) -> None:
    objs = copy.deepcopy(_rendered(tree, "8p2d"))
    set_path("StatefulSet", P, "spec/replicas", 12)(objs)
    set_path("StatefulSet", D, "spec/replicas", 3)(objs)
    fleet = k8s.check_fleet(objs, serve_parser)
    assert fleet.problems == [] and len(fleet.role("prefill")) == 12
    static_pools(pod_urls(P, 12), pod_urls(D, 3))(objs)  # listing every pod still passes
    assert k8s.check_fleet(objs, serve_parser).problems == []


def test_a_tensor_parallel_fleet_is_valid(tree: Path, serve_parser: k8s.ServeParser) -> None:
    objs = copy.deepcopy(_rendered(tree, "8p2d"))
    TP4(objs)
    fleet = k8s.check_fleet(objs, serve_parser)
    assert fleet.problems == [] and {e.tp for e in fleet.engines} == {4}
    assert k8s.schema_problems(objs) == []


# -- broken copies on disk: the renderer refuses, the checks fail ------------------------------


def broken_tree(tree: Path, tmp_path: Path) -> Path:
    root = tmp_path / "k8s"
    shutil.copytree(tree, root)
    return root


def test_typo_in_a_base_file_fails_every_overlay(tree: Path, tmp_path: Path,
                                                 serve_parser: k8s.ServeParser) -> None:
    root = broken_tree(tree, tmp_path)
    prefill = root / "base" / "prefill.yaml"
    prefill.write_text(prefill.read_text().replace("          volumeMounts:",
                                                   "          volumeMount:"))
    for overlay in OVERLAYS:
        found = problems(render(root / "overlays" / overlay), serve_parser)
        assert any("StatefulSet/kvbridge-prefill: schema" in p and "volumeMount" in p
                   for p in found), found


def test_patch_naming_no_resource_is_refused(tree: Path, tmp_path: Path) -> None:
    root = broken_tree(tree, tmp_path)
    (root / "overlays" / "8p2d" / "proxy-args.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: kvbridge-prox\n"
        "spec:\n  replicas: 2\n")
    k = root / "overlays" / "8p2d" / "kustomization.yaml"
    k.write_text(k.read_text() + "patches:\n  - path: proxy-args.yaml\n")
    with pytest.raises(KustomizeError, match="Deployment 'kvbridge-prox', which no resource"):
        render(root / "overlays" / "8p2d")


def test_missing_secret_env_is_refused(tree: Path, tmp_path: Path) -> None:
    root = broken_tree(tree, tmp_path)
    (root / "overlays" / "1p1d" / "secret.env").unlink()
    with pytest.raises(KustomizeError, match="secret.env"):
        render(root / "overlays" / "1p1d")


def test_command_line_reports_each_overlay(tree: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    root = broken_tree(tree, tmp_path)
    assert k8s.main([str(root / "overlays" / o) for o in OVERLAYS]) == 0
    assert capsys.readouterr().out.count(": ok (") == 2
    proxy = root / "base" / "proxy.yaml"
    proxy.write_text(proxy.read_text().replace("- --host\n            - 0.0.0.0",
                                               "- --host\n            - 127.0.0.1"))
    assert k8s.main([str(root / "overlays" / "1p1d")]) == 1
    assert "Deployment/kvbridge-proxy: --host 127.0.0.1" in capsys.readouterr().out


def test_unsupported_kustomization_field_is_refused(tree: Path, tmp_path: Path) -> None:
    root = broken_tree(tree, tmp_path)
    k = root / "overlays" / "1p1d" / "kustomization.yaml"
    k.write_text(k.read_text() + "commonLabels:\n  team: a\n")
    with pytest.raises(KustomizeError, match="unsupported field.*commonLabels"):
        render(root / "overlays" / "1p1d")


# -- the renderer's pieces ---------------------------------------------------------------------


def test_strategic_merge_uses_merge_keys_and_null_deletes() -> None:
    base = {"containers": [{"name": "a", "args": ["1", "2"], "env": [{"name": "X", "value": "1"}],
                            "ports": [{"containerPort": 80, "name": "http"}]},
                           {"name": "b"}],
            "keep": 1, "drop": 2}
    patch = {"containers": [{"name": "a", "args": ["3"], "env": [{"name": "Y", "value": "2"}],
                             "ports": [{"containerPort": 80, "protocol": "TCP"}]}],
             "drop": None}
    out = strategic_merge(base, patch)
    a = out["containers"][0]
    assert a["args"] == ["3"]  # lists of scalars are replaced
    assert [e["name"] for e in a["env"]] == ["Y", "X"]  # merged by name, new ones first
    assert a["ports"] == [{"containerPort": 80, "name": "http", "protocol": "TCP"}]
    assert [c["name"] for c in out["containers"]] == ["a", "b"] and "drop" not in out
    assert base["containers"][0]["args"] == ["1", "2"]  # inputs untouched


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "x", "B": "$(A)"}
    assert k8s.expand("$(A)-$(B)-$$(A)-$(C)-$$", env) == "x-$(A)-$(A)-$(C)-$"


def test_expect_defaults_are_the_efa_setup() -> None:
    assert dataclasses.asdict(k8s.Expect()) == {"backend": "nixl",
                                                "backend_options": {"backends": ["LIBFABRIC"]}}


# -- components/monitoring: the Prometheus Operator's PodMonitor and PrometheusRule ------------

MONITORING_KINDS = ["PodMonitor", "PrometheusRule"]


def with_monitoring(tree: Path, overlay: str, tmp_path: Path) -> Objs:
    """The overlay with ../../components/monitoring added to its components, rendered."""
    root = tmp_path / "k8s"
    shutil.copytree(tree, root)
    path = root / "overlays" / overlay / "kustomization.yaml"
    k = yaml.safe_load(path.read_text())
    k["components"] = [*k.get("components", []), "../../components/monitoring"]
    path.write_text(yaml.safe_dump(k))
    return render(root / "overlays" / overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_with_monitoring_is_valid_and_scrapes_every_pod(
        tree: Path, serve_parser: k8s.ServeParser, overlay: str, tmp_path: Path) -> None:
    objs = with_monitoring(tree, overlay, tmp_path)
    assert problems(objs, serve_parser) == []
    assert sorted(o["kind"] for o in objs if o["apiVersion"] == monitoring.API) \
        == MONITORING_KINDS
    assert {o["metadata"]["namespace"] for o in objs} == {"kvbridge"}
    pm = obj(objs, "PodMonitor", "kvbridge")
    wanted = pm["spec"]["selector"]["matchLabels"]
    scraped = {o["metadata"]["name"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")
               and ko.selects(wanted, ko.pod_labels(o))}
    assert scraped == {P, D, PROXY}


def test_prometheus_rule_is_the_rules_file() -> None:
    committed = (DEPLOY / "components" / "monitoring" / "prometheus-rule.yaml").read_text()
    assert committed == monitoring.prometheus_rule(monitoring.RULES_FILE.read_text()), \
        "run: python -m kvbridge.tools.deploycheck.monitoring --write-rule"


MONITORING_BROKEN: dict[str, tuple[Mutation, str]] = {
    "a selector missing every pod": (
        set_path("PodMonitor", "kvbridge", "spec/selector/matchLabels", {"app": "vllm"}),
        "selects nothing"),
    "a port no pod declares": (
        set_path("PodMonitor", "kvbridge", "spec/podMetricsEndpoints/0/port", "metrics"),
        "port 'metrics' is no named port of StatefulSet/kvbridge-prefill"),
    "a typo in a monitor field": (
        set_path("PodMonitor", "kvbridge", "spec/podMetricsEndpoint", []),
        "PodMonitor/kvbridge: spec: unknown field podMetricsEndpoint"),
    "a scrape interval that is no duration": (
        set_path("PodMonitor", "kvbridge", "spec/podMetricsEndpoints/0/interval", "15"),
        "interval '15' is no Prometheus duration"),
    "a rule both record and alert": (
        set_path("PrometheusRule", "kvbridge", "spec/groups/0/rules/0/alert", "X"),
        "spec.groups[0].rules[0]: needs exactly one of record, alert"),
    "a rule without expr": (
        set_path("PrometheusRule", "kvbridge", "spec/groups/1/rules/0/expr", None),
        "spec.groups[1].rules[0]: missing expr"),
}


@pytest.mark.parametrize("case", sorted(MONITORING_BROKEN))
def test_broken_monitoring_is_refused_naming_the_fault(
        tree: Path, serve_parser: k8s.ServeParser, tmp_path: Path, case: str) -> None:
    mutate, expected = MONITORING_BROKEN[case]
    objs = with_monitoring(tree, "1p1d", tmp_path)
    mutate(objs)
    found = problems(objs, serve_parser)
    assert any(expected in p for p in found), found

"""A small, strict renderer for the kustomize subset kvbridge's deployment examples use.

``render(directory)`` reads ``directory/kustomization.yaml`` and returns the objects that
``kubectl kustomize directory`` would print (in no particular order), for tests on machines
without kubectl. It supports only what ``deploy/k8s`` uses, and refuses everything else with
:class:`KustomizeError` rather than ignore a field kustomize would apply:

* ``resources``: YAML files (several documents each) and directories with a kustomization;
* ``components``: directories with a ``kind: Component`` kustomization, applied to the
  resources gathered so far (before this kustomization's own generators and transformers);
* ``namespace``: set on every object;
* ``replicas``: ``spec.replicas`` of the named workload;
* ``images``: ``newName`` / ``newTag`` / ``digest`` of every container whose image is ``name``;
* ``patches``: strategic-merge patches from ``path`` or inline ``patch``, matched by kind and
  name (a patch that matches nothing is an error, as in kustomize);
* ``secretGenerator``: ``envs`` files and ``literals``, with
  ``generatorOptions.disableNameSuffixHash: true`` (name hashing is not implemented). A
  missing ``envs`` file is an error, as in kustomize, unless ``render``'s ``stand_in`` gives
  text in its place (the command-line check's placeholder for an unwritten ``secret.env``).

Strategic merge follows Kubernetes' merge keys for the lists the examples patch (containers,
env, ports, volumes, volume mounts by name or port; new elements first, as kustomize orders
them); other lists are replaced, and a ``null`` value deletes the key. Pure functions over
files; no network, no kubectl.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["KustomizeError", "render", "load_yaml", "strategic_merge", "MERGE_KEYS"]

Obj = dict[str, Any]
#: a missing ``envs`` file -> the text to use in its place, or None (then it is an error)
StandIn = Callable[[Path], "str | None"]

#: Lists merged element by element, by this key (Kubernetes' ``patchMergeKey``).
MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name",
}
#: ``ports`` merge by ``containerPort`` in a container and by ``port`` in a Service.
_PORT_KEYS = ("containerPort", "port")
_SUPPORTED = {"apiVersion", "kind", "resources", "components", "namespace", "replicas",
              "images", "patches", "secretGenerator", "generatorOptions"}
_WORKLOADS = {"Deployment", "StatefulSet", "ReplicaSet"}


class KustomizeError(ValueError):
    """The kustomization cannot be rendered (unsupported field, missing file, unmatched patch)."""


def load_yaml(path: Path) -> list[Obj]:
    """Every non-empty document of ``path``; each must be a mapping."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise KustomizeError(f"{path}: {exc}") from exc
    for doc in docs:
        if not isinstance(doc, dict):
            raise KustomizeError(f"{path}: a document is {type(doc).__name__}, not a mapping")
    return docs


def render(directory: Path, stand_in: StandIn | None = None) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` prints (see the module docstring)."""
    return _build(Path(directory), [], "Kustomization", stand_in)


def _build(directory: Path, objs: list[Obj], kind: str,
           stand_in: StandIn | None = None) -> list[Obj]:
    """Apply the kustomization (or component) in ``directory`` to ``objs``."""
    path = directory / "kustomization.yaml"
    docs = load_yaml(path)
    if len(docs) != 1:
        raise KustomizeError(f"{path}: expected one document, got {len(docs)}")
    k = docs[0]
    if k.get("kind", "Kustomization") != kind:
        raise KustomizeError(f"{path}: kind {k.get('kind')!r}, expected {kind}")
    unsupported = sorted(set(k) - _SUPPORTED)
    if unsupported:
        raise KustomizeError(f"{path}: unsupported field(s) {', '.join(unsupported)}")
    for entry in _list(k, "resources", path):
        target = directory / str(entry)
        objs += render(target, stand_in) if target.is_dir() else load_yaml(target)
    for entry in _list(k, "components", path):
        objs = _build(directory / str(entry), objs, "Component", stand_in)
    objs += _secrets(k, directory, path, stand_in)
    for patch in _patches(k, directory, path):
        _apply_patch(objs, patch, path)
    for rep in _list(k, "replicas", path):
        _set_replicas(objs, rep, path)
    for image in _list(k, "images", path):
        _set_image(objs, image, path)
    if "namespace" in k:
        for obj in objs:
            obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objs


def _list(k: Obj, key: str, path: Path) -> list[Any]:
    value = k.get(key, [])
    if not isinstance(value, list):
        raise KustomizeError(f"{path}: {key} must be a list")
    return value


def _secrets(k: Obj, directory: Path, path: Path, stand_in: StandIn | None) -> list[Obj]:
    gens = _list(k, "secretGenerator", path)
    if gens and not (k.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{path}: secretGenerator needs generatorOptions."
                             "disableNameSuffixHash: true here (hashing is not implemented)")
    out = []
    for gen in gens:
        unknown = sorted(set(gen) - {"name", "envs", "literals", "type"})
        if unknown:
            raise KustomizeError(f"{path}: secretGenerator {gen.get('name')}: unsupported "
                                 f"field(s) {', '.join(unknown)}")
        pairs: list[str] = list(gen.get("literals", []))
        for env in gen.get("envs", []):
            try:
                lines = (directory / env).read_text().splitlines()
            except OSError as exc:
                text = stand_in(directory / env) if stand_in is not None else None
                if text is None:
                    raise KustomizeError(f"{path}: secretGenerator {gen['name']}: {exc}") \
                        from exc
                lines = text.splitlines()
            pairs += [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
        data = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise KustomizeError(f"{path}: secretGenerator {gen['name']}: {pair!r} is not "
                                     "KEY=VALUE")
            data[key] = base64.b64encode(value.encode()).decode()
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                    "type": gen.get("type", "Opaque"), "data": data})
    return out


def _patches(k: Obj, directory: Path, path: Path) -> Iterable[Obj]:
    for entry in _list(k, "patches", path):
        if set(entry) - {"path", "patch"}:
            raise KustomizeError(f"{path}: patches: only path or patch is supported, got "
                                 f"{sorted(entry)}")
        if "path" in entry:
            yield from load_yaml(directory / entry["path"])
        else:
            yield from (d for d in yaml.safe_load_all(entry["patch"]) if d is not None)


def _find(objs: list[Obj], kind: str | None, name: str, path: Path, what: str) -> list[Obj]:
    found = [o for o in objs if o.get("metadata", {}).get("name") == name
             and (kind is None or o.get("kind") == kind)]
    if not found:
        raise KustomizeError(f"{path}: {what} names {kind or 'an object'} {name!r}, which no "
                             "resource defines")
    return found


def _apply_patch(objs: list[Obj], patch: Obj, path: Path) -> None:
    name = patch.get("metadata", {}).get("name")
    if not name or not patch.get("kind"):
        raise KustomizeError(f"{path}: a patch needs kind and metadata.name")
    for obj in _find(objs, patch["kind"], name, path, "a patch"):
        merged = strategic_merge(obj, patch)
        obj.clear()
        obj.update(merged)


def _set_replicas(objs: list[Obj], rep: Obj, path: Path) -> None:
    targets = [o for o in _find(objs, None, rep["name"], path, "replicas")
               if o.get("kind") in _WORKLOADS]
    if not targets or not isinstance(rep.get("count"), int):
        raise KustomizeError(f"{path}: replicas {rep}: needs a workload name and an int count")
    for obj in targets:
        obj.setdefault("spec", {})["replicas"] = rep["count"]


def _image_name(ref: str) -> str:
    """``registry:5000/repo/name:tag@sha256:…`` → ``registry:5000/repo/name``."""
    ref = ref.split("@")[0]
    head, _, last = ref.rpartition("/")
    return (head + "/" if head else "") + last.split(":")[0]


def _set_image(objs: list[Obj], image: Obj, path: Path) -> None:
    for obj in objs:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            ref = str(c.get("image", ""))
            name = _image_name(ref)
            if name != image["name"]:
                continue
            new = image.get("newName", name)
            if "digest" in image:
                c["image"] = f"{new}@{image['digest']}"
            elif "newTag" in image:
                c["image"] = f"{new}:{image['newTag']}"
            else:
                c["image"] = new + ref[len(name):]


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base`` (neither is modified), with :data:`MERGE_KEYS`."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = MERGE_KEYS.get(field)
        if field == "ports":
            key = next((k for k in _PORT_KEYS if all(k in p for p in base + patch)), None)
        if key and all(isinstance(x, dict) and key in x for x in base + patch):
            out_list = copy.deepcopy(base)
            added = []
            for item in patch:
                match = [i for i, b in enumerate(out_list) if b[key] == item[key]]
                if match:
                    out_list[match[0]] = strategic_merge(out_list[match[0]], item, field)
                else:
                    added.append(copy.deepcopy(item))
            return added + out_list  # kustomize puts new elements first
    return copy.deepcopy(patch)

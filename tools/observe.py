"""`make observe`: a local Prometheus for the `make run` stack, with the alert rules Kubernetes gets.

    python -m tools.observe config DIR    # writes DIR/prometheus.yml and DIR/rules.yml

The scrape jobs are named after the services, as the ServiceMonitors name them in a cluster, so the shipped
rules (deploy/k8s/base/prometheusrule.yaml, rule groups unchanged) and the dashboard queries work as they are;
no `honor_labels`, as in the ServiceMonitors (no metric label collides with `job` or `instance`).
scripts/observe.sh runs Prometheus on this configuration and the local trace sink next to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from libs.config import SERVICE_PORTS

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
SCRAPE_INTERVAL = "5s"


def rule_groups(path: Path = PROMETHEUS_RULE) -> list[dict[str, Any]]:
    """The rule groups of the PrometheusRule object, as a plain Prometheus rule file holds them."""
    doc = yaml.safe_load(path.read_text())
    if doc.get("kind") != "PrometheusRule":
        raise ValueError(f"{path} is not a PrometheusRule")
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def prometheus_config(rules_file: str, host: str = "127.0.0.1",
                      ports: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [rules_file],
        "scrape_configs": [
            {"job_name": service, "honor_labels": False, "metrics_path": "/metrics",
             "static_configs": [{"targets": [f"{host}:{port}"], "labels": {"namespace": "local"}}]}
            for service, port in sorted((ports or SERVICE_PORTS).items())
        ],
    }


def write_config(folder: Path, ports: dict[str, int] | None = None) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rules = folder / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(rules.name, ports=ports), sort_keys=False))
    return config, rules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.observe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    config = sub.add_parser("config", help="write prometheus.yml and rules.yml into a folder")
    config.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    written = write_config(args.folder)
    print("\n".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The PrometheusRule under promtool: `promtool check rules` on its rule groups, `promtool test rules`
on tests/prometheus/*_test.yaml (series that must make each alert fire and series that must not),
and the conventions every alert follows (summary, description, a runbook in docs/runbooks/).

promtool reads plain rule files, so the groups are taken out of the PrometheusRule's `spec` into a
temporary folder. The unit tests get them without annotations: promtool compares an alert's
annotations exactly, which would tie every test case to the wording of its summary; the
annotations are checked here instead. To run promtool by hand:

    .venv/bin/python -m tests.unit.test_prometheus_rules /tmp/rules
    promtool test rules /tmp/rules/*_test.yaml
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.config import SERVICE_PORTS
from libs.telemetry import metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "base" / "prometheusrule.yaml"
PROMTOOL_TESTS = ROOT / "tests" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks"
# The rule file the promtool tests name in `rule_files:` (written next to copies of them).
TEST_RULES_NAME = "prometheusrule.rules.yml"
# The SLO group apart (tests/prometheus/slo_test.yaml): its long-window recording rules would otherwise be
# evaluated at every step of every other test, and theirs at every step of its.
SLO_GROUP = "monitoring-dispatch.slo"
SLO_RULES_NAME = "prometheusrule.slo.rules.yml"
FULL_RULES_NAME = "prometheusrule.full.yml"
RUNBOOK_SECTIONS = ("## What it means", "## Confirm", "## What to do")


def rule_groups() -> list[dict[str, Any]]:
    doc = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert doc["kind"] == "PrometheusRule"
    groups: list[dict[str, Any]] = doc["spec"]["groups"]
    return groups


def alerting_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def _without_annotations(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**group, "rules": [{k: v for k, v in rule.items() if k != "annotations"} for rule in group["rules"]]}
            for group in groups]


def write_rule_files(folder: Path) -> list[Path]:
    """The rule groups as promtool files in `folder`, with copies of the promtool tests beside them;
    returns the test files."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = rule_groups()
    (folder / FULL_RULES_NAME).write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    plain = [g for g in groups if g["name"] != SLO_GROUP]
    slo = [g for g in groups if g["name"] == SLO_GROUP]
    (folder / TEST_RULES_NAME).write_text(yaml.safe_dump({"groups": _without_annotations(plain)}, sort_keys=False))
    (folder / SLO_RULES_NAME).write_text(yaml.safe_dump({"groups": _without_annotations(slo)}, sort_keys=False))
    tests = []
    for source in sorted(PROMTOOL_TESTS.glob("*_test.yaml")):
        shutil.copy(source, folder / source.name)
        tests.append(folder / source.name)
    return tests


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is not installed: run scripts/ensure-promtool.sh (Debian's prometheus package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _run(*args: str, cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def _test_cases() -> list[tuple[str, dict[str, Any]]]:
    """(file name, alert_rule_test case) of every promtool test."""
    cases = []
    for path in sorted(PROMTOOL_TESTS.glob("*_test.yaml")):
        spec = yaml.safe_load(path.read_text())
        assert spec["rule_files"] == [SLO_RULES_NAME if path.name == "slo_test.yaml" else TEST_RULES_NAME], path.name
        for test in spec["tests"]:
            cases += [(path.name, case) for case in test.get("alert_rule_test", [])]
    return cases


# ---- promtool --------------------------------------------------------------------------------------

def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    promtool = _promtool()
    write_rule_files(tmp_path)
    _run(promtool, "check", "rules", FULL_RULES_NAME, cwd=tmp_path)


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    promtool = _promtool()
    tests = write_rule_files(tmp_path)
    assert tests, "tests/prometheus/ has no *_test.yaml"
    _run(promtool, "test", "rules", *(t.name for t in tests), cwd=tmp_path)


def test_every_alert_is_seen_firing_and_silent_by_promtool() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for _, case in _test_cases():
        (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    alerts = {rule["alert"] for rule in alerting_rules()}
    assert alerts - fires == set(), "alerts no promtool test sees firing"
    assert alerts - silent == set(), "alerts no promtool test sees staying silent"
    assert (fires | silent) - alerts == set(), "promtool tests name alerts the rules do not have"


# ---- conventions ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", alerting_rules(), ids=lambda r: str(r["alert"]))
def test_alert_has_summary_description_and_runbook(rule: dict[str, Any]) -> None:
    alert = rule["alert"]
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    assert annotations["summary"].strip() and annotations["description"].strip()
    # Repository-relative; the overlays prefix where the repository is browsable.
    assert annotations["runbook_url"] == f"docs/runbooks/{alert}.md"
    assert rule["labels"]["severity"] in {"critical", "warning"}
    assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", alert)


@pytest.mark.parametrize("alert", sorted({r["alert"] for r in alerting_rules()}))
def test_runbook_says_what_the_alert_means_how_to_confirm_and_what_to_do(alert: str) -> None:
    path = RUNBOOKS / f"{alert}.md"
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    text = path.read_text()
    assert text.startswith(f"# {alert}\n")
    positions = [text.find(section) for section in RUNBOOK_SECTIONS]
    assert -1 not in positions and positions == sorted(positions), f"{alert}: sections {RUNBOOK_SECTIONS} in order"
    confirm = text[positions[1]:positions[2]]
    assert "```promql" in confirm, f"{alert}: the Confirm section gives the PromQL to run"
    assert "monitorctl" in text or "kubectl" in text, f"{alert}: say which command shows the state"


def test_every_runbook_belongs_to_an_alert() -> None:
    alerts = {r["alert"] for r in alerting_rules()}
    runbooks = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    assert runbooks - alerts == set()


def test_every_service_has_a_service_down_rule_and_scrape_failing_covers_it() -> None:
    rules = alerting_rules()
    down = {r["labels"]["service"]: r for r in rules if r["alert"] == "ServiceDown"}
    assert set(down) == set(SERVICE_PORTS)
    for service, rule in down.items():
        assert rule["expr"] == f'absent(up{{job="{service}"}} == 1)'
    (scrape_failing,) = [r for r in rules if r["alert"] == "DispatchPodScrapeFailing"]
    (jobs,) = re.findall(r'up\{job=~"([^"]+)"\} == 0', scrape_failing["expr"])
    assert set(jobs.split("|")) == set(SERVICE_PORTS)


# Alerts kube-prometheus-stack ships (its default rules): an alert of ours with one of these names would be
# grouped, silenced and inhibited together with theirs (TargetDown's inhibition of its own kind, say).
KUBE_PROMETHEUS_ALERTS = {
    "TargetDown", "Watchdog", "InfoInhibitor", "PrometheusDown", "AlertmanagerDown", "KubePodCrashLooping",
    "KubePodNotReady", "KubeDeploymentReplicasMismatch", "KubeDeploymentRolloutStuck", "KubeHpaMaxedOut",
    "KubeHpaReplicasMismatch", "KubeJobFailed", "KubeJobNotCompleted", "KubeContainerWaiting", "NodeDown",
    "CPUThrottlingHigh", "KubeQuotaExceeded", "PrometheusRuleFailures", "PrometheusTargetSyncFailure",
}


def test_no_alert_takes_a_name_of_kube_prometheus() -> None:
    names = {r["alert"] for r in alerting_rules()}
    assert names & KUBE_PROMETHEUS_ALERTS == set()
    assert "TargetDown" in KUBE_PROMETHEUS_ALERTS and "DispatchPodScrapeFailing" in names


def test_every_leader_role_has_a_leader_missing_rule() -> None:
    roles = {r["labels"]["role"]: r for r in alerting_rules() if r["alert"] == "LeaderMissing"}
    assert set(roles) == set(metrics.LEADER_OWNED.values())
    for role, rule in roles.items():
        assert rule["expr"] == f'absent(leader_is_active{{role="{role}"}} == 1)'


def main() -> None:
    """Write the promtool rule files and tests into the folder given on the command line."""
    folder = Path(sys.argv[1])
    for path in write_rule_files(folder):
        print(path)


if __name__ == "__main__":
    main()

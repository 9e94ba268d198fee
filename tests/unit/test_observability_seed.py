"""docs/architecture.md §15.1 metrics and §15.2 alerts: every metric is registered and exposed under its exact name,
every alert exists in the PrometheusRule with the §15.2 metric / aggregation / window / threshold /
duration, and every metric a rule or a dashboard panel queries is one the services expose."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, Gauge, Histogram

from libs.telemetry import metrics
from libs.telemetry.metrics import ExactCounter
from libs.telemetry.metrics import exposition as render_exposition

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s" / "base"

# docs/architecture.md §15.1, every metric with its type and the labels alerts and dashboards group by.
SEED_15_1_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    # existing metrics
    "collect_now_accept_count": ("counter", ()),
    "collect_now_first_dispatch_latency_ms": ("histogram", ()),
    "collect_now_first_result_latency_ms": ("histogram", ()),
    "monitor_dispatch_high_backlog": ("gauge", ()),
    "monitor_dispatch_normal_backlog": ("gauge", ()),
    "monitor_result_ingest_lag_ms": ("gauge", ("shard",)),
    "monitor_projection_rebuild_lag_ms": ("gauge", ()),
    "monitor_preempt_request_count": ("counter", ()),
    "monitor_preempt_success_count": ("counter", ()),
    "monitor_preempt_timeout_count": ("counter", ("client_id",)),
    "desktop_client_monitor_queue_depth": ("gauge", ("client_id",)),
    "monitoring_pg_write_qps": ("gauge", ()),
    # added in V1.1
    "collect_now_preempt_induced_retry_count": ("counter", ()),
    "monitor_normal_starvation_age_p99": ("gauge", ()),
    "safe_point_interval_ms_p95": ("gauge", ("platform",)),
    "monitor_dispatch_reject_by_reason_count": ("counter", ("reason",)),
    "interrupt_generation_mismatch_count": ("counter", ()),
    "collect_request_ttl_expired_count": ("counter", ()),
    "execution_owner_legacy_count": ("gauge", ()),
    "execution_owner_desktop_tasks_count": ("gauge", ()),
    "phase2_reconcile_fixed_count": ("counter", ()),
    "monitor_dispatch_high_oldest_age_ms": ("gauge", ()),
    "tenant_monitor_normal_backlog": ("gauge", ("tenant_id",)),
}

def events_pattern(counter: str, window: str, seconds: int) -> str:
    """Pattern of the events a counter counted within `window` (collapsed whitespace)."""
    c = re.escape(counter)
    return (rf"\(last_over_time\({c}\[{window}\]\) unless {c} offset {window}\) and on \(instance\) "
            rf"\(up offset {window} == 1 or process_start_time_seconds > time\(\) - {seconds}\) "
            rf"or increase\({c}\[{window}\]\)")


def runs_pattern(counter: str) -> str:
    """Pattern of the runs a counter's changes count within the 15-minute window."""
    c = re.escape(counter)
    return (rf"\(changes\({c}\[15m\]\) \+ 1 unless {c} offset 15m\) and on \(instance\) "
            rf"\(up offset 15m == 1 or process_start_time_seconds > time\(\) - 900\) or changes\({c}\[15m\]\)")


FIXED = 'phase2_reconcile_fixed_count{check="migration_reconcile"}'
RECONCILE_RUNS = 'reconciler_job_runs_count{reconcile_job="migration_reconcile",outcome="ok"}'

# §15.2 (+ note 2 and the outbox backstop): alert -> (metric, expression patterns, `for`).
# Patterns are matched against the expression with whitespace collapsed.
SEED_15_2_ALERTS: dict[str, tuple[str, list[str], str | None]] = {
    "MonitorHighLaneBacklog": (
        "monitor_dispatch_high_oldest_age_ms",
        [r"^max\(monitor_dispatch_high_oldest_age_ms\) > 60000$"], "2m"),
    "CollectNowFirstResultSlow": (
        "collect_now_first_result_latency_ms_bucket",
        [r"^histogram_quantile\(0\.99, sum by \(le\) \(rate\(collect_now_first_result_latency_ms_bucket\[5m\]\)\)\)"
         r" > 180000$"], "10m"),
    "MonitorProjectionLagHigh": (
        "monitor_projection_rebuild_lag_ms",
        [r"^max\(max_over_time\(monitor_projection_rebuild_lag_ms\[5m\]\)\) > 300000$"], "10m"),
    # A client's series appears with its first timeout: events in the window are increase() plus the
    # whole value of a series born inside it (see prometheusrule.yaml's header).
    "MonitorClientPreemptTimeouts": (
        "monitor_preempt_timeout_count",
        [r"^sum by \(client_id\) \(" + events_pattern("monitor_preempt_timeout_count", "1h", 3600)
         + r"\) >= 3$"], None),
    # min over 30 min (a missing minute counts as 0) > 100 and last - first (30 min ago) >= 0.
    "TenantNormalBacklogNotDecreasing": (
        "tenant_monitor_normal_backlog",
        [r"^min_over_time\(\(max by \(tenant_id\) \(tenant_monitor_normal_backlog\) or on \(tenant_id\) "
         r"0 \* group by \(tenant_id\) \(tenant_monitor_normal_backlog @ end\(\)\)\)\[30m:1m\]\) > 100",
         r" and on \(tenant_id\) \(",
         r"max by \(tenant_id\) \(tenant_monitor_normal_backlog\) - on \(tenant_id\) "
         r"max by \(tenant_id\) \(tenant_monitor_normal_backlog offset 30m\) >= 0\)$"], None),
    "InterruptGenerationMismatchSpike": (
        "interrupt_generation_mismatch_count",
        [r"^sum\(" + events_pattern("interrupt_generation_mismatch_count", "10m", 600) + r"\) >= 10$"], "20m"),
    # 3 consecutive reconcile runs with fixed > 0 in the 15-minute window: runs are counted (changes of the
    # counters, +1 for a series born in the window), every run in the window fixed rows.
    "Phase2ReconcileInconsistent": (
        "phase2_reconcile_fixed_count",
        [r"^sum\(" + runs_pattern(FIXED) + r"\) >= 3 and sum\(" + runs_pattern(FIXED) + r"\) >= sum\("
         + runs_pattern(RECONCILE_RUNS) + r"\)$"], None),
    "CollectRequestTtlExpired": (
        "collect_request_ttl_expired_count",
        [r"^sum\(" + events_pattern("collect_request_ttl_expired_count", "5m", 300) + r"\) > 0$"], None),
    "OutboxDeadLetters": (
        "outbox_dead_letter_count",
        [r"^sum\(" + events_pattern("outbox_dead_letter_count", "10m", 600) + r"\) > 0$"], None),
}

# Series Prometheus itself makes for every target.
SYNTHETIC_SERIES = {"up"}
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                "bool", "offset", "inf", "nan"}
TEST_LABEL_VALUE = "observability-test"


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords or label names)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+-?\d+[smhdwy]", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", text):
        following = text[match.end():].lstrip()
        if following.startswith("(") or match.group(0).lower() in PROMQL_WORDS:
            continue
        names.add(match.group(0))
    return names


def _labelnames(collector: object) -> tuple[str, ...]:
    if isinstance(collector, ExactCounter):
        return collector.labelnames
    names: tuple[str, ...] = getattr(collector, "_labelnames", ())
    return names


@pytest.fixture(scope="module")
def exposition() -> Iterator[str]:
    """`generate_latest()` of the default registry with one child of every labelled metric
    (a labelled metric without children exposes no sample)."""
    touched: list[tuple[Gauge | Histogram, tuple[str, ...]]] = []
    for name in vars(metrics):
        collector = getattr(metrics, name)
        labels = _labelnames(collector)
        if not labels:
            continue
        values = {label: TEST_LABEL_VALUE for label in labels}
        if isinstance(collector, ExactCounter):
            collector.inc(0, **values)
        elif isinstance(collector, Gauge | Histogram):
            collector.labels(**values)
            touched.append((collector, tuple(values.values())))
    # As the leader of every role exposes them (a standby leaves the leader-owned gauges out).
    roles = set(metrics.LEADER_OWNED.values())
    for role in roles:
        metrics.set_leading(role, True)
    yield render_exposition(REGISTRY).decode()
    for role in roles:
        metrics.set_leading(role, False)
    for collector, label_values in touched:
        collector.remove(*label_values)


def _sample_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{|\s)", text, re.M)}


def _types(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def _rules() -> dict[str, dict[str, Any]]:
    rule = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    # ServiceDown and LeaderMissing have one rule per service / role; the §15.2 alerts one each.
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r}


# The main dashboard, and the rollout between the execution paths (docs/legacy-path.md).
MAIN_DASHBOARD = "grafana-dashboard.yaml"
ROLLOUT_DASHBOARD = "grafana-dashboard-rollout.yaml"
DASHBOARDS = (MAIN_DASHBOARD, ROLLOUT_DASHBOARD)


def _dashboard(file: str = MAIN_DASHBOARD) -> dict[str, Any]:
    configmap = yaml.safe_load((K8S / file).read_text())
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (body,) = configmap["data"].values()
    dashboard: dict[str, Any] = json.loads(body)
    return dashboard


def _panel_exprs(file: str = MAIN_DASHBOARD) -> list[str]:
    return [t["expr"] for p in _dashboard(file)["panels"] if p["type"] != "row" for t in p["targets"]]


def _all_panel_exprs() -> list[str]:
    return [expr for file in DASHBOARDS for expr in _panel_exprs(file)]


def _collapse(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).replace("( ", "(").replace(" )", ")").strip()


# ---- §15.1 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SEED_15_1_METRICS))
def test_seed_metric_is_defined_under_its_exact_name(name: str) -> None:
    kind, labels = SEED_15_1_METRICS[name]
    collector = getattr(metrics, name, None)
    assert collector is not None, f"libs/telemetry/metrics.py must define {name}"
    expected_class = {"counter": ExactCounter, "gauge": Gauge, "histogram": Histogram}[kind]
    assert isinstance(collector, expected_class)
    assert set(labels) <= set(_labelnames(collector))
    (family,) = list(collector.describe())
    assert family.name == name


@pytest.mark.parametrize("name", sorted(SEED_15_1_METRICS))
def test_seed_metric_is_exposed_with_its_exact_sample_name(name: str, exposition: str) -> None:
    kind, _ = SEED_15_1_METRICS[name]
    samples = _sample_names(exposition)
    if kind == "histogram":
        assert _types(exposition).get(name) == "histogram"
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= samples
    else:
        assert name in samples
        assert f"{name}_total" not in samples, "alerts use the bare counter names of §15.1"
    if kind == "gauge":
        assert _types(exposition).get(name) == "gauge"


# /metrics (libs.telemetry.metrics.exposition) names the TYPE line after the exact counter samples.
@pytest.mark.parametrize("name", sorted(n for n, (kind, _) in SEED_15_1_METRICS.items() if kind == "counter"))
def test_counter_type_metadata_matches_its_samples(name: str, exposition: str) -> None:
    assert _types(exposition).get(name) == "counter"


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, platform) (rate(a_ms_bucket{platform="x y"}[5m]))) > 1e3 '
            "and on (tenant_id) (max by (tenant_id) (delta(b[30m] offset 5m)) >= 0) or vector(0) unless c")
    assert metric_names(expr) == {"a_ms_bucket", "b", "c"}


# ---- §15.2 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("alert", sorted(SEED_15_2_ALERTS))
def test_seed_alert_matches_the_seed(alert: str) -> None:
    metric, patterns, duration = SEED_15_2_ALERTS[alert]
    rules = _rules()
    assert alert in rules, f"PrometheusRule lacks {alert}"
    rule = rules[alert]
    expr = _collapse(str(rule["expr"]))
    assert metric in metric_names(expr)
    for pattern in patterns:
        assert re.search(pattern, expr), f"{alert}: {expr!r} does not match {pattern!r}"
    assert rule.get("for") == duration
    assert rule["labels"]["severity"] in {"critical", "warning"}
    assert rule["annotations"]["summary"]


def test_every_queried_metric_is_exposed(exposition: str) -> None:
    # Recording rules (the SLO error ratios) expose what they record, from series the services expose.
    recording = [r for group in yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["spec"]["groups"]
                 for r in group["rules"] if "record" in r]
    exposed = _sample_names(exposition) | {r["record"] for r in recording}
    queries = [str(r["expr"]) for r in [*_rules().values(), *recording]] + _all_panel_exprs()
    assert queries
    for expr in queries:
        unknown = metric_names(expr) - exposed - SYNTHETIC_SERIES
        assert not unknown, f"{expr!r} queries metrics nobody exposes: {sorted(unknown)}"


# ---- dashboard -----------------------------------------------------------------------------------

def test_dashboard_has_a_panel_for_every_seed_metric() -> None:
    queried = set().union(*(metric_names(e) for e in _panel_exprs()))
    for name, (kind, _) in SEED_15_1_METRICS.items():
        sample = f"{name}_bucket" if kind == "histogram" else name
        assert sample in queried, f"no dashboard panel shows {name}"


@pytest.mark.parametrize("file", DASHBOARDS)
def test_dashboard_is_well_formed(file: str) -> None:
    dashboard = _dashboard(file)
    assert dashboard["uid"] and dashboard["title"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    datasource_vars = {v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"].strip("${}") in datasource_vars
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) and ref_ids


# Grafana's variables, replaced by values of the right shape before the queries go to promtool.
DASHBOARD_VARIABLES = {"$__rate_interval": "5m", "$namespace": "monitoring-dispatch", "$job": ".*"}


@pytest.mark.parametrize("file", DASHBOARDS)
def test_dashboard_filters_by_namespace_and_service(file: str) -> None:
    variables = {v["name"]: v for v in _dashboard(file)["templating"]["list"]}
    assert {"datasource", "namespace", "job"} <= set(variables)
    assert "up{" in variables["namespace"]["definition"] and "namespace" in variables["namespace"]["definition"]
    assert 'namespace="$namespace"' in variables["job"]["definition"]
    assert variables == {v["name"]: v for v in _dashboard()["templating"]["list"]}, "the main dashboard's variables"
    for expr in _panel_exprs(file):
        # Every selector names the namespace: two overlays on one Prometheus never mix.
        for selector in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*\{[^}]*\}", expr):
            assert 'namespace="$namespace"' in selector, expr
        assert "{" in expr, f"{expr!r} selects every namespace"


def test_dashboard_has_red_panels_per_service() -> None:
    exprs = _panel_exprs()
    red = [e for e in exprs if "http_requests_total" in metric_names(e)]
    assert any("by (service, status)" in e for e in red), "requests by service and status"
    assert any('status=~"5.."' in e for e in red), "errors"
    duration = [e for e in exprs if "http_request_duration_seconds_bucket" in metric_names(e)]
    assert any("histogram_quantile" in e and "service" in e for e in duration), "duration per service"
    assert all('service=~"$job"' in e for e in red + duration)


def test_dashboard_has_rows_for_each_subsystem() -> None:
    rows = {p["title"] for p in _dashboard()["panels"] if p["type"] == "row"}
    assert {"Services (RED)", "Ingest", "Projections", "Phase 2 rollout and reconciler", "Outbox and leaders"} <= rows
    queried = set().union(*(metric_names(e) for e in _panel_exprs()))
    for metric in ("outbox_depth", "ingest_dead_letter_count", "projection_queue_depth",
                   "reconciler_job_last_success_timestamp", "reconciler_job_runs_count", "up"):
        assert metric in queried, metric


@pytest.mark.parametrize("file", DASHBOARDS)
def test_every_panel_query_parses(tmp_path: Path, file: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool is not installed: run scripts/ensure-promtool.sh (Debian's prometheus package)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    rules = []
    for panel in _dashboard(file)["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"panel {panel['id']}: unknown variable in {target['expr']!r}"
            rules.append({"record": f"panel_{panel['id']}_{target['refId']}", "expr": expr})
    (tmp_path / "panels.yml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", "panels.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboards_are_distinct() -> None:
    uids = [_dashboard(file)["uid"] for file in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    names = [yaml.safe_load((K8S / file).read_text())["metadata"]["name"] for file in DASHBOARDS]
    assert len(set(names)) == len(names)


# ---- the rollout dashboard ---------------------------------------------------------------------------

ROLLOUT_METRICS = {
    "dispatch_rollout_percentage", "execution_owner_legacy_count", "execution_owner_desktop_tasks_count",
    "dispatch_in_flight_tasks", "dispatch_dispatched_by_owner_count", "dispatch_scanner_tasks_created_count",
    "phase2_reconcile_fixed_count", "reconciler_migration_stalled_ready_tasks", "reconciler_migration_orphan_tasks",
    "reconciler_job_runs_count", "reconciler_job_last_rows_fixed", "reconciler_job_last_success_timestamp",
    "reconciler_job_duration_ms_bucket",
}


def test_the_rollout_dashboard_shows_both_paths_and_the_migration_reconcile() -> None:
    exprs = _panel_exprs(ROLLOUT_DASHBOARD)
    queried = set().union(*(metric_names(e) for e in exprs))
    assert ROLLOUT_METRICS <= queried, sorted(ROLLOUT_METRICS - queried)
    per_path = [e for e in exprs if metric_names(e) & {"dispatch_in_flight_tasks", "dispatch_dispatched_by_owner_count",
                                                        "dispatch_scanner_tasks_created_count"}]
    assert any("by (execution_owner)" in e for e in per_path)
    for expr in exprs:
        if metric_names(expr) & {n for n in ROLLOUT_METRICS if n.startswith("reconciler_job_")}:
            assert 'job="migration_reconcile"' in expr, expr
    # The new gauges describe the whole system: exported by the coordinator's leader only.
    for gauge in ("dispatch_rollout_percentage", "dispatch_in_flight_tasks"):
        assert metrics.LEADER_OWNED[gauge] == "dispatch-coordinator"
        assert all("max(" in e or "max by" in e for e in exprs if gauge in metric_names(e))


# ---- events of counters in dashboards ----------------------------------------------------------------

_WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_INCREASE = re.compile(
    r"increase\((?P<counter>[A-Za-z_:][A-Za-z0-9_:]*)(?P<selector>\{[^}]*\})?\[(?P<window>\d+[smhd])\]\)")


def _counters() -> dict[str, tuple[str, ...]]:
    """Every exact-name counter of libs/telemetry/metrics.py, with its labels."""
    return {c.name: c.labelnames for c in vars(metrics).values() if isinstance(c, ExactCounter)}


def plain_increases(expr: str) -> list[str]:
    """The increase() calls over the services' counters that are not the alert rules' events form: a labelled
    counter's series is born at 1 with its first event, a new pod's counters with what they counted before the
    first scrape, and increase() misses that first value (a client's first 3 preemption timeouts showed 2)."""
    text = _collapse(expr)
    counters = _counters()
    found = []
    for match in _INCREASE.finditer(text):
        counter, window = match["counter"], match["window"]
        if counter not in counters:
            continue
        seconds = int(window[:-1]) * _WINDOW_SECONDS[window[-1]]
        c = re.escape(counter + (match["selector"] or ""))
        w = re.escape(window)
        form = (rf"\(last_over_time\({c}\[{w}\]\) unless {c} offset {w}\) and on \(instance\) "
                rf"\(up(?:\{{[^}}]*\}})? offset {w} == 1 or process_start_time_seconds(?:\{{[^}}]*\}})? > time\(\) - "
                rf"{seconds}\) or $")
        if not re.search(form, text[:match.start()]):
            found.append(match.group(0))
    return found


def test_the_plain_increase_check_flags_what_it_should() -> None:
    counters = _counters()
    assert counters["monitor_preempt_timeout_count"] == ("client_id",)
    old = 'sum by (client_id) (increase(monitor_preempt_timeout_count{namespace="$namespace"}[1h]))'
    assert plain_increases(old) == ['increase(monitor_preempt_timeout_count{namespace="$namespace"}[1h])']
    c = 'monitor_preempt_timeout_count{namespace="$namespace"}'
    up = 'up{namespace="$namespace"}'
    start = 'process_start_time_seconds{namespace="$namespace"}'
    good = (f"sum by (client_id) ((last_over_time({c}[1h]) unless {c} offset 1h) and on (instance) "
            f"({up} offset 1h == 1 or {start} > time() - 3600) or increase({c}[1h]))")
    assert plain_increases(good) == []
    assert plain_increases(good.replace("3600", "600")), "the guard's seconds must be the window's"
    assert plain_increases(good.replace(f"unless {c} offset 1h", f"unless {c} offset 5m")), "the same window"
    # The rules are written that way too.
    for rule in _rules().values():
        assert plain_increases(str(rule["expr"])) == [], rule["alert"]


@pytest.mark.parametrize("file", DASHBOARDS)
def test_dashboards_count_events_the_way_the_alert_rules_do(file: str) -> None:
    for panel in _dashboard(file)["panels"]:
        for target in panel.get("targets", []):
            assert plain_increases(target["expr"]) == [], f"panel {panel['id']} {panel['title']!r}"


# ---- WebSocket RED and processes ---------------------------------------------------------------------

def test_the_main_dashboard_shows_websocket_latency_and_errors_and_process_resources() -> None:
    exprs = _panel_exprs()
    queried = set().union(*(metric_names(e) for e in exprs))
    assert {"desktop_ws_delivery_seconds_bucket", "desktop_ws_hello_seconds_bucket", "desktop_ws_abnormal_closes_total",
            "desktop_ws_send_failures_total", "process_cpu_seconds_total", "process_resident_memory_bytes"} <= queried
    closes = [e for e in exprs if "desktop_ws_abnormal_closes_total" in metric_names(e)]
    assert closes and all("by (code)" in e for e in closes)
    for expr in exprs:
        if metric_names(expr) & {"process_cpu_seconds_total", "process_resident_memory_bytes"}:
            assert 'job=~"$job"' in expr, expr


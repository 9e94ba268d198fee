"""Every metric of docs/architecture.md §15.1, under its exact names, plus the ones each service adds.

prometheus_client renames counters to `<name>_total`; the §15.2 alert rules use the bare
names, so counters here are `ExactCounter`s that keep the name as written (valid Prometheus
text exposition: the `_total` suffix is a convention of OpenMetrics, not of format 0.0.4).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 15, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000,
                      180000, 600000)


EXACT_COUNTER_NAMES: set[str] = set()
_COUNTER_META = re.compile(rb"^# (HELP|TYPE) ([A-Za-z_:][A-Za-z0-9_:]*)_total ", re.M)


# Gauges that describe the whole system and are computed by a leader-elected role: a standby would export its
# stale or initial values (zeros) beside the leader's, which an alert or a dashboard could take for the truth,
# so only the replica leading that role exports them (libs/leader.py reports leadership here).
LEADER_OWNED: dict[str, str] = {
    "monitor_dispatch_high_backlog": "dispatch-coordinator",
    "monitor_dispatch_normal_backlog": "dispatch-coordinator",
    "monitor_dispatch_high_oldest_age_ms": "dispatch-coordinator",
    "monitor_normal_starvation_age_p99": "dispatch-coordinator",
    "execution_owner_legacy_count": "dispatch-coordinator",
    "execution_owner_desktop_tasks_count": "dispatch-coordinator",
    "desktop_client_monitor_queue_depth": "dispatch-coordinator",
    "tenant_monitor_normal_backlog": "dispatch-coordinator",
    "dispatch_auto_slowdown_signal": "dispatch-coordinator",
    "dispatch_auto_slowdown_active": "dispatch-coordinator",
    "monitor_tenant_platform_paused": "dispatch-coordinator",
    "dispatch_rollout_percentage": "dispatch-coordinator",
    "dispatch_in_flight_tasks": "dispatch-coordinator",
    "safe_point_interval_ms_p95": "reconciler",
    "reconciler_migration_stalled_ready_tasks": "reconciler",
    "reconciler_migration_orphan_tasks": "reconciler",
}
_leading: set[str] = set()
_service = "unknown"


def set_service_name(name: str) -> None:
    """The service this process runs (the `service` label of the RED metrics); set once at start-up."""
    global _service
    _service = name


def service_name() -> str:
    return _service


def set_leading(role: str, leading: bool) -> None:
    """Whether this process leads `role` now (its leader-owned gauges are exported only while it does)."""
    if leading:
        _leading.add(role)
    else:
        _leading.discard(role)


class _LeaderFiltered(CollectorRegistry):
    """A view of a registry without the leader-owned families of roles this process does not lead."""

    def __init__(self, source: CollectorRegistry) -> None:
        super().__init__(auto_describe=False)
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            role = LEADER_OWNED.get(metric.name)
            if role is None or role in _leading:
                yield metric


def exposition(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The Prometheus text exposition, with HELP/TYPE lines of exact-name counters naming the
    samples they describe (generate_latest() writes `<name>_total` for every counter family), and
    leader-owned gauges only from the leader."""

    def fix(match: re.Match[bytes]) -> bytes:
        name = match.group(2)
        if name.decode() in EXACT_COUNTER_NAMES:
            return b"# " + match.group(1) + b" " + name + b" "
        return match.group(0)

    return _COUNTER_META.sub(fix, generate_latest(_LeaderFiltered(registry)))


class ExactCounter(Collector):
    """A monotonically increasing counter exposed under exactly `name`."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = REGISTRY) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._labelset = frozenset(self.labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        EXACT_COUNTER_NAMES.add(name)
        if registry is not None:
            registry.register(self)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if labels.keys() != self._labelset:
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        self._add(tuple([str(labels[n]) for n in self.labelnames]) if labels else (), amount)

    def bound(self, **labels: object) -> BoundCounter:
        """This counter at fixed label values, for a hot path (the hub counts every frame it sends): `inc` without
        the labels' check and key on every call."""
        if labels.keys() != self._labelset:
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return BoundCounter(self, tuple(str(labels[n]) for n in self.labelnames))

    def _add(self, key: tuple[str, ...], amount: float) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: object) -> float:
        key = tuple(str(labels[n]) for n in self.labelnames)
        with self._lock:
            return self._values.get(key, 0.0)

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        with self._lock:
            items = list(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0.0)]
        for key, value in items:
            metric.add_sample(self.name, dict(zip(self.labelnames, key, strict=True)), value)
        return [metric]

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "counter")]


@dataclass(frozen=True, slots=True)
class BoundCounter:
    """An ExactCounter at fixed label values (`ExactCounter.bound`)."""

    counter: ExactCounter
    key: tuple[str, ...]

    def inc(self, amount: float = 1.0) -> None:
        self.counter._add(self.key, amount)


def _hist(name: str, doc: str, labels: Sequence[str] = ()) -> Histogram:
    return Histogram(name, doc, labelnames=labels, buckets=LATENCY_BUCKETS_MS)


# ---- §15.1, existing metrics ------------------------------------------------------------------
collect_now_accept_count = ExactCounter(
    "collect_now_accept_count", "Collect-now requests accepted (new requests, not idempotent replays).")
collect_now_first_dispatch_latency_ms = _hist(
    "collect_now_first_dispatch_latency_ms", "Click to the first task of a request dispatched (ms).")
collect_now_first_result_latency_ms = _hist(
    "collect_now_first_result_latency_ms", "Click to the first result of a request ingested (ms).")
monitor_dispatch_high_backlog = Gauge(
    "monitor_dispatch_high_backlog", "Ready business tasks in the high lane not yet dispatched.")
monitor_dispatch_normal_backlog = Gauge(
    "monitor_dispatch_normal_backlog", "Ready business tasks in normal and normal_boosted lanes.")
monitor_result_ingest_lag_ms = Gauge(
    "monitor_result_ingest_lag_ms", "Age of the oldest result a shard holds and has not applied (ms), recomputed "
    "every second, so a stuck batch keeps raising it.", ["shard"])
monitor_projection_rebuild_lag_ms = Gauge(
    "monitor_projection_rebuild_lag_ms", "Age of the oldest pending projection rebuild request (ms).")
monitor_preempt_request_count = ExactCounter(
    "monitor_preempt_request_count", "Interrupts requested on running or leased scheduled tasks.")
monitor_preempt_success_count = ExactCounter(
    "monitor_preempt_success_count", "Preempted tasks that yielded with the current generation.")
monitor_preempt_timeout_count = ExactCounter(
    "monitor_preempt_timeout_count", "Interrupts that passed the platform's hard timeout.", ["client_id"])
desktop_client_monitor_queue_depth = Gauge(
    "desktop_client_monitor_queue_depth", "Queued monitor executions per client.", ["client_id"])
monitoring_pg_write_qps = Gauge(
    "monitoring_pg_write_qps", "Rows written per second to the monitoring database by every writer "
    "(pg_stat_database tup_inserted + tup_updated + tup_deleted; the same figure from every ingest replica: max it).")

# ---- §15.1, added in V1.1 ---------------------------------------------------------------------
collect_now_preempt_induced_retry_count = ExactCounter(
    "collect_now_preempt_induced_retry_count", "Extra retries of scheduled tasks caused by preemption.")
monitor_normal_starvation_age_p99 = Gauge(
    "monitor_normal_starvation_age_p99", "p99 wait of ready normal tasks (ms); alert on the longest.")
safe_point_interval_ms = _hist(
    "safe_point_interval_ms", "Interval between desktop safe points (ms).", ["platform"])
safe_point_interval_ms_p95 = Gauge(
    "safe_point_interval_ms_p95",
    "P95 of the safe-point intervals every hub measured per platform over safe_point_window_days (ms); "
    "computed by the reconciler's safe_point_tuning job from the shared histogram.", ["platform"])
monitor_dispatch_reject_by_reason_count = ExactCounter(
    "monitor_dispatch_reject_by_reason_count", "Dispatch rejections by reason.", ["reason"])
interrupt_generation_mismatch_count = ExactCounter(
    "interrupt_generation_mismatch_count", "Callbacks or events ignored for a stale interrupt generation.")
collect_request_ttl_expired_count = ExactCounter(
    "collect_request_ttl_expired_count", "Collect-now requests that reached their TTL unfinished.")
execution_owner_legacy_count = Gauge(
    "execution_owner_legacy_count", "Business tasks pending on the legacy execution path.")
execution_owner_desktop_tasks_count = Gauge(
    "execution_owner_desktop_tasks_count", "Business tasks pending on the desktop_tasks path.")
phase2_reconcile_fixed_count = ExactCounter(
    "phase2_reconcile_fixed_count", "Rows fixed by the §16.2.4 consistency reconcile.", ["check"])
monitor_dispatch_high_oldest_age_ms = Gauge(
    "monitor_dispatch_high_oldest_age_ms", "Age of the oldest undispatched high-lane task (ms).")
tenant_monitor_normal_backlog = Gauge(
    "tenant_monitor_normal_backlog", "Ready normal-lane backlog per tenant.", ["tenant_id"])

# ---- outbox -----------------------------------------------------------------------------------
outbox_published_count = ExactCounter("outbox_published_count", "Outbox events published.", ["exchange"])
outbox_publish_failed_count = ExactCounter(
    "outbox_publish_failed_count", "Outbox publish attempts that failed.", ["exchange"])
outbox_dead_letter_count = ExactCounter("outbox_dead_letter_count", "Outbox events moved to dead_letter.")
outbox_dispatch_batches_published_count = ExactCounter(
    "outbox_dispatch_batches_published_count",
    "dispatch_batch envelopes published (many dispatch events towards one hub in one message; the events are "
    "counted one by one in outbox_published_count).")
outbox_commit_to_publish_ms = _hist(
    "outbox_commit_to_publish_ms", "Outbox row creation to broker-confirmed publish (ms).")
outbox_depth = Gauge("outbox_depth", "Outbox rows by status.", ["status"])
outbox_oldest_pending_age_ms = Gauge("outbox_oldest_pending_age_ms", "Age of the oldest unpublished row (ms).")

# ---- WebSocket / hub --------------------------------------------------------------------------
monitor_tenant_platform_paused = Gauge(
    "monitor_tenant_platform_paused",
    "1 while a tenant's scheduled work of a platform is held: every eligible client reports its login broken "
    "(source=health) or an operator paused it (source=operator).", ["tenant_id", "platform", "source"])
desktop_websocket_connections = Gauge(
    "desktop_websocket_connections", "Open desktop WebSocket connections on this hub instance.")
desktop_ws_handshakes_waiting = Gauge(
    "desktop_ws_handshakes_waiting", "WebSocket upgrades on this hub waiting for one of its HUB_HANDSHAKE_CONCURRENCY "
    "handshake slots (a reconnect storm's queue).")
# RED metrics of every HTTP API (and WebSocket upgrades), by route template: libs/http.py's middleware.
http_requests_total = ExactCounter(
    "http_requests_total", "HTTP requests answered, by service, route template, method and status.",
    labelnames=("service", "route", "method", "status"))
http_request_duration_seconds = Histogram(
    "http_request_duration_seconds", "Time to answer an HTTP request (WebSocket sessions excluded), seconds.",
    ["service", "route", "method"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
websocket_messages_total = ExactCounter(
    "websocket_messages_total", "WebSocket messages, by direction (in: from clients, out: to clients) and kind.",
    labelnames=("direction", "kind"))
# WebSocket RED beside the message counts (services/dispatch_hub/connections.py): latency and errors of the sockets.
WS_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
python_gc_pause_seconds = Histogram(
    "python_gc_pause_seconds",
    "A garbage collection's duration, by generation, seconds: it runs on the event loop, which waits meanwhile "
    "(libs/gc_control.py watch_gc_pauses).", ["generation"], buckets=WS_SECONDS_BUCKETS)
desktop_ws_delivery_seconds = Histogram(
    "desktop_ws_delivery_seconds",
    "A dispatch event's arrival at the hub's broker consumer to its frame written on a client's socket, seconds "
    "(one observation per socket it went to).", buckets=WS_SECONDS_BUCKETS)
desktop_ws_hello_seconds = Histogram(
    "desktop_ws_hello_seconds",
    "A WebSocket upgrade answered to the hello frame written (online, replay read), seconds.",
    buckets=WS_SECONDS_BUCKETS)
desktop_ws_abnormal_closes_total = ExactCounter(
    "desktop_ws_abnormal_closes_total",
    "Desktop sockets that ended with an abnormal close code (not 1000/1001 nor a deliberate 4401/4403/4409), by "
    "code: 1006 dropped without a close frame, 1009 message too big, 1013 too slow (outbound queue full), "
    "4408 heartbeat timeout, other ...", labelnames=("code",))
desktop_ws_send_failures_total = ExactCounter(
    "desktop_ws_send_failures_total",
    "Frame writes to a desktop socket that failed (the socket was closing or gone; what was queued behind it is "
    "dropped, the client gets it again from its replay on reconnect).")
hub_dispatch_events_received_total = ExactCounter(
    "hub_dispatch_events_received_total",
    "Dispatch events this hub's queue took (targeted delivery: only those routed to it by its clients' presence; "
    "per replica, its share of the fleet's dispatch events).")
hub_dispatch_events_not_here_total = ExactCounter(
    "hub_dispatch_events_not_here_total",
    "Dispatch events routed to this hub for a client it no longer holds (it moved or went away after the event "
    "was routed; its replay on reconnect carries the task).")
hub_push_lease_key_mismatch = Gauge(
    "hub_push_lease_key_mismatch",
    "1 while this hub's PUSH_LEASE_SECRET is not the leader coordinator's (the fingerprint the leader publishes "
    "differs): the hub grants push_lease to no socket and its clients' work is pulled; 0 otherwise.")
hub_rebalance_closes_total = ExactCounter(
    "hub_rebalance_closes_total",
    "Sockets this hub closed (4503, with a reconnect delay) because it held more than HUB_REBALANCE_SLACK over its "
    "fair share of the live replicas' sockets: their clients reconnect through the load balancer.")
hub_dispatch_batches_received_total = ExactCounter(
    "hub_dispatch_batches_received_total",
    "dispatch_batch envelopes this hub's queue took (each carries many of its clients' dispatch events, counted one "
    "by one in hub_dispatch_events_received_total).")
hub_dispatch_batches_dead_lettered_total = ExactCounter(
    "hub_dispatch_batches_dead_lettered_total",
    "dispatch_batch envelopes copied to the hub's DLQ with a reason, by reason: malformed (unreadable or an "
    "unknown version; none of its events delivered) or malformed_items (some items unreadable: the others were "
    "delivered).", labelnames=("reason",))
hub_dispatch_events_malformed_total = ExactCounter(
    "hub_dispatch_events_malformed_total",
    "Items of a dispatch_batch that could not be read and were not delivered (the other items of the envelope "
    "were; the envelope went to the DLQ; the client's replay on reconnect carries the task).")
# Edge limits (one client or tenant cannot take what others need).
edge_rejected_total = ExactCounter(
    "edge_rejected_total", "Requests refused by a per-client, per-address or per-tenant limit, by reason.",
    labelnames=("service", "reason"))

# ---- leader election --------------------------------------------------------------------------
leader_is_active = Gauge("leader_is_active", "1 when this replica holds the leader lock.", ["role"])

# ---- reconciler -------------------------------------------------------------------------------
reconciler_job_runs_count = ExactCounter(
    "reconciler_job_runs_count", "Reconcile job runs by outcome (ok | error).", ["reconcile_job", "outcome"])
reconciler_job_duration_ms = _hist("reconciler_job_duration_ms", "Duration of one reconcile job run (ms).",
                                   ["reconcile_job"])
reconciler_job_rows_fixed_count = ExactCounter(
    "reconciler_job_rows_fixed_count", "Rows changed by reconcile job runs.", ["reconcile_job"])
reconciler_job_last_rows_fixed = Gauge(
    "reconciler_job_last_rows_fixed", "Rows changed by the last run of each reconcile job.", ["reconcile_job"])
reconciler_job_last_success_timestamp = Gauge(
    "reconciler_job_last_success_timestamp", "Unix time of the last successful run of each reconcile job.",
    ["reconcile_job"])
collect_request_no_dispatch_warning_count = ExactCounter(
    "collect_request_no_dispatch_warning_count",
    "Collect-now requests still accepted without any dispatch after the warning delay (docs/architecture.md §10.6).")
reconciler_migration_stalled_ready_tasks = Gauge(
    "reconciler_migration_stalled_ready_tasks",
    "desktop_tasks-owned ready tasks waiting longer than the reconcile interval without an execution.")
reconciler_migration_orphan_tasks = Gauge(
    "reconciler_migration_orphan_tasks",
    "desktop_tasks-owned business tasks that look executed but have no desktop_tasks row (needs a human).")

# ---- dispatch-hub -----------------------------------------------------------------------------
monitor_preempt_latency_ms = _hist(
    "monitor_preempt_latency_ms", "Collect-now click to the preempted task yielding (cancel acknowledged, ms).")

# ---- ingest-shard-workers ---------------------------------------------------------------------
ingest_results_applied_count = ExactCounter(
    "ingest_results_applied_count", "MonitorResults applied by ingest, by result status.", ["status"])
ingest_results_duplicate_count = ExactCounter(
    "ingest_results_duplicate_count", "Redelivered MonitorResults already applied (acked, nothing changed).")
ingest_dead_letter_count = ExactCounter(
    "ingest_dead_letter_count", "MonitorResults sent to the ingest DLQ, by reason.", ["reason"])
ingest_dead_letter_unconfirmed_count = ExactCounter(
    "ingest_dead_letter_unconfirmed_count",
    "Ingest dead letters the broker did not confirm (returned, nacked, timed out); the original was given back.")
ingest_poison_fallback_count = ExactCounter(
    "ingest_poison_fallback_count",
    "Ingest batches refused by an error that is not transient, then applied one result per transaction.")
ingest_transient_error_count = ExactCounter(
    "ingest_transient_error_count",
    "Transient database errors applying ingest batches (the deliveries are held and the batch retried).")
ingest_shard_yield_count = ExactCounter(
    "ingest_shard_yield_count", "Shards this replica handed to the live member they are assigned to.")
ingest_reshard_forwarded_count = ExactCounter(
    "ingest_reshard_forwarded_count", "Results that reached a drained old-epoch shard queue during a reshard (routed "
    "just before its unbind) and were forwarded to the active epoch instead of applied.")
ingest_batch_size = Histogram(
    "ingest_batch_size", "MonitorResults applied per ingest transaction.",
    buckets=(1, 2, 5, 10, 25, 50, 100, 200, 500, 1000))
ingest_batch_duration_ms = _hist("ingest_batch_duration_ms", "Duration of one ingest batch transaction (ms).")
ingest_active_shards = Gauge("ingest_active_shards", "Shard queues this replica received results from recently.")

# ---- projection-worker ------------------------------------------------------------------------
projection_rebuild_count = ExactCounter(
    "projection_rebuild_count", "Projection keys rebuilt, by trigger (event | sweep | merge).", ["trigger"])
projection_rebuild_rerequested_count = ExactCounter(
    "projection_rebuild_rerequested_count", "Rebuilds whose key was requested again meanwhile (row kept).")
projection_rebuild_failed_count = ExactCounter(
    "projection_rebuild_failed_count", "Projection rebuild attempts that failed.")
projection_dead_letter_count = ExactCounter(
    "projection_dead_letter_count", "ProjectionRebuild events sent to the projection DLQ, by reason.", ["reason"])
projection_dead_letter_unconfirmed_count = ExactCounter(
    "projection_dead_letter_unconfirmed_count",
    "Projection dead letters the broker did not confirm; the event was given back (requeued).")
projection_rebuild_duration_ms = _hist("projection_rebuild_duration_ms", "Duration of one projection rebuild (ms).")
projection_queue_depth = Gauge("projection_queue_depth", "Rows waiting in projection_rebuild_queue.")
projection_merge_mode_active = Gauge(
    "projection_merge_mode_active",
    "1 while auto slow-down (docs/architecture.md §12.4) has the projection worker merge rebuilds into batches.")
projection_rebuild_deferred_count = ExactCounter(
    "projection_rebuild_deferred_count",
    "ProjectionRebuild events acked without a rebuild in merge mode (the queue row stays the request).")
projection_merge_duration_ms = _hist(
    "projection_merge_duration_ms", "Duration of one merged batch rebuild, all its keys in one transaction (ms).")

# ---- dispatch-coordinator ---------------------------------------------------------------------
dispatch_decisions_count = ExactCounter(
    "dispatch_decisions_count", "Executions created by the dispatch coordinator, by lane.", ["lane"])
dispatch_pass_duration_ms = _hist("dispatch_pass_duration_ms", "Duration of one dispatch pass (ms).")
dispatch_auto_slowdown_active = Gauge(
    "dispatch_auto_slowdown_active", "1 while auto slow-down (§12.4) pauses normal and retry dispatch.")
dispatch_auto_slowdown_signal = Gauge(
    "dispatch_auto_slowdown_signal",
    "Auto slow-down inputs: ingest_lag_ms, projection_lag_ms, db_write_p95_ms, conflict_rate.", ["signal"])
dispatch_scanner_plans_count = ExactCounter(
    "dispatch_scanner_plans_count", "Due plans the schedule scanner processed.")
dispatch_scanner_tasks_created_count = ExactCounter(
    "dispatch_scanner_tasks_created_count", "Business tasks created by the schedule scanner, by execution owner.",
    ["execution_owner"])
# The rollout between the two execution paths (docs/legacy-path.md), beside execution_owner_*_count.
dispatch_dispatched_by_owner_count = ExactCounter(
    "dispatch_dispatched_by_owner_count",
    "Dispatches committed by the coordinator, by execution path: desktop_tasks executions created, legacy offers "
    "made.", ["execution_owner"])
dispatch_rollout_percentage = Gauge(
    "dispatch_rollout_percentage",
    "dispatch_settings.rollout_percentage as stored: new tasks of tenants with tenant_id % 100 below it take the "
    "desktop_tasks path, the others legacy.")
dispatch_in_flight_tasks = Gauge(
    "dispatch_in_flight_tasks",
    "Work in flight per execution path: active desktop_tasks executions (queued, in progress, unknown), live legacy "
    "leases (offered, pulled).", ["execution_owner"])
dispatch_aging_boosted_count = ExactCounter(
    "dispatch_aging_boosted_count", "Ready normal tasks boosted by aging (docs/architecture.md §9.4).")
dispatch_aging_round_limit = Gauge(
    "dispatch_aging_round_limit",
    "The most tasks the last aging round could boost: twice the dispatches between rounds (or their moving average), "
    "within one batch and the budget's limit (docs/architecture.md §9.4).")

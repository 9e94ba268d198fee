-- migrate: no-transaction
-- The clients reporting a blocking login state for some platform (libs.domain.platform_health.BLOCKING_STATES), by
-- tenant: what a full pass reads for the platform-health pauses (libs/tasks/dispatch_reads.py _HEALTH_PAUSES,
-- docs/architecture.md "Full pass: clients of the window"), a few rows instead of a scan of every client. The
-- predicate is the code's HEALTH_BLOCKING_SQL, spelled the same (a partial index serves only a query repeating it;
-- tests/unit/test_health_blocking_index.py). Built concurrently: the hub updates clients on every heartbeat.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_clients_health_blocking ON desktop_clients (tenant_id)
    WHERE platform_health @? '$.* ? (@ == "captcha" || @ == "login_required" || @ == "rate_limited")';

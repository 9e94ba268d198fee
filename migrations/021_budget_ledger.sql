-- Dispatch coordinator: a budget ledger per window, and the aging index covering what aging filters on.
--
-- Every dispatch pass read the budget use of its window (cluster and tenant budgets per window, README "Dispatch
-- rules") by counting every execution created in the window: work that grows with the dispatch rate, on every
-- pass, the click's high pass included. The ledger keeps those counts per (window, tenant, high or not). Triggers
-- on desktop_tasks write it in the transaction of every change it counts, whichever code makes the change: the
-- coordinator's execution inserts, collect-now's cancel of queued executions (the budget refund), and
-- libs/tasks/transitions.end_execution(s) on every other path. The coordinator starts the ledger for a window
-- length (`budget_window_seconds`) by counting once, under its pass lock and this ledger's lock (LEDGER_LOCK in
-- services/dispatch_coordinator/queries.py), and reads it from then on; a change of the window length starts it
-- again for the new length.

-- Whether an execution counts against the budget of the window it was created in: every monitor execution except
-- one a collect-now aborted before it was ever leased (its budget is given back). The one definition for the
-- ledger and the count it replaces (queries.BUDGET_USED: the ledger's start, the ops status). NULL-safe: an
-- execution aborted for another reason (interrupt_reason NULL) counts.
CREATE FUNCTION dispatch_budget_counts(kind text, status text, interrupt_reason text, lease_epoch int)
RETURNS boolean LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT kind = 'monitor'
       AND NOT (status = 'aborted' AND interrupt_reason IS NOT DISTINCT FROM 'collect_now_preempt' AND lease_epoch = 0)
$$;

-- The start (epoch seconds) of the fixed window of `window_seconds` that `ts` falls in
-- (libs.domain.dispatch.window_start). STABLE like extract() on a timestamptz, so that it is inlined.
CREATE FUNCTION dispatch_budget_window(ts timestamptz, window_seconds int)
RETURNS bigint LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT (floor(extract(epoch FROM ts) / window_seconds) * window_seconds)::bigint
$$;

-- The window length the ledger counts for, and the first window it is complete for (later ones are too).
CREATE TABLE dispatch_budget_ledger_tracking (
    window_seconds      int         PRIMARY KEY CHECK (window_seconds > 0),
    since_window_start  bigint      NOT NULL,
    started_at          timestamptz NOT NULL DEFAULT now()
);

-- Executions counted per window, tenant and lane class (high or not). `source` keeps the writers apart: the
-- coordinator's inserts (0) and the updates that give budget back or take it again (1, collect-now's cancel among
-- them), so a click's refund never waits for the lock of a dispatch pass's row. A window's use is the sum.
CREATE TABLE dispatch_budget_ledger (
    window_start    bigint   NOT NULL,
    window_seconds  int      NOT NULL,
    tenant_id       bigint   NOT NULL,
    high            boolean  NOT NULL,
    source          smallint NOT NULL,
    used            int      NOT NULL,
    PRIMARY KEY (window_start, window_seconds, tenant_id, high, source)
);

-- The same counts per window and lane class only, in 16 shards of tenants (tenant_id % 16): what the high pass reads
-- (two numbers, the cluster budget's use; the full pass reads the per-tenant rows for the tenant budget). Shards, so
-- that two clicks of different tenants refunding at once rarely wait for each other's row.
CREATE TABLE dispatch_budget_totals (
    window_start    bigint   NOT NULL,
    window_seconds  int      NOT NULL,
    high            boolean  NOT NULL,
    shard           smallint NOT NULL,
    source          smallint NOT NULL,
    used            int      NOT NULL,
    PRIMARY KEY (window_start, window_seconds, high, shard, source)
);

-- Inserted and deleted executions, one aggregate per statement (a pass inserts hundreds at once).
CREATE FUNCTION dispatch_budget_ledger_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Shared with every other writer; the coordinator takes it exclusively to start the ledger, so a change
    -- is either in its count or applied to the rows it wrote, never lost between the two.
    PERFORM pg_advisory_xact_lock_shared(7401552112);
    IF TG_OP = 'INSERT' THEN
        WITH c AS MATERIALIZED (
            SELECT dispatch_budget_window(n.created_at, k.window_seconds) AS window_start, k.window_seconds,
                   n.tenant_id, n.lane = 'high' AS high, count(*)::int AS n
            FROM changed_new n CROSS JOIN dispatch_budget_ledger_tracking k
            WHERE dispatch_budget_counts(n.kind, n.status, n.interrupt_reason, n.lease_epoch)
              AND dispatch_budget_window(n.created_at, k.window_seconds) >= k.since_window_start
            GROUP BY 1, 2, 3, 4
        ), per_tenant AS (
            INSERT INTO dispatch_budget_ledger AS l (window_start, window_seconds, tenant_id, high, source, used)
            SELECT c.window_start, c.window_seconds, c.tenant_id, c.high, 0, c.n FROM c
            ON CONFLICT (window_start, window_seconds, tenant_id, high, source) DO UPDATE SET used = l.used + EXCLUDED.used
        )
        INSERT INTO dispatch_budget_totals AS t (window_start, window_seconds, high, shard, source, used)
        SELECT c.window_start, c.window_seconds, c.high, c.tenant_id % 16, 0, sum(c.n) FROM c GROUP BY 1, 2, 3, 4
        ON CONFLICT (window_start, window_seconds, high, shard, source) DO UPDATE SET used = t.used + EXCLUDED.used;
    ELSE
        WITH c AS MATERIALIZED (
            SELECT dispatch_budget_window(o.created_at, k.window_seconds) AS window_start, k.window_seconds,
                   o.tenant_id, o.lane = 'high' AS high, -count(*)::int AS n
            FROM changed_old o CROSS JOIN dispatch_budget_ledger_tracking k
            WHERE dispatch_budget_counts(o.kind, o.status, o.interrupt_reason, o.lease_epoch)
              AND dispatch_budget_window(o.created_at, k.window_seconds) >= k.since_window_start
            GROUP BY 1, 2, 3, 4
        ), per_tenant AS (
            INSERT INTO dispatch_budget_ledger AS l (window_start, window_seconds, tenant_id, high, source, used)
            SELECT c.window_start, c.window_seconds, c.tenant_id, c.high, 0, c.n FROM c
            ON CONFLICT (window_start, window_seconds, tenant_id, high, source) DO UPDATE SET used = l.used + EXCLUDED.used
        )
        INSERT INTO dispatch_budget_totals AS t (window_start, window_seconds, high, shard, source, used)
        SELECT c.window_start, c.window_seconds, c.high, c.tenant_id % 16, 0, sum(c.n) FROM c GROUP BY 1, 2, 3, 4
        ON CONFLICT (window_start, window_seconds, high, shard, source) DO UPDATE SET used = t.used + EXCLUDED.used;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER tr_desktop_tasks_budget_insert AFTER INSERT ON desktop_tasks
    REFERENCING NEW TABLE AS changed_new FOR EACH STATEMENT EXECUTE FUNCTION dispatch_budget_ledger_rows();
CREATE TRIGGER tr_desktop_tasks_budget_delete AFTER DELETE ON desktop_tasks
    REFERENCING OLD TABLE AS changed_old FOR EACH STATEMENT EXECUTE FUNCTION dispatch_budget_ledger_rows();

-- An updated execution that starts or stops counting (a refund), or changes what it counts for. Row by row, and
-- only for those rows (the WHEN clause): leases, heartbeats and results never call it.
CREATE FUNCTION dispatch_budget_ledger_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(7401552112);
    WITH c AS MATERIALIZED (
        SELECT v.window_start, k.window_seconds, v.tenant_id, v.high, sum(v.delta)::int AS n
        FROM dispatch_budget_ledger_tracking k
        CROSS JOIN LATERAL (VALUES
            (dispatch_budget_window(OLD.created_at, k.window_seconds), OLD.tenant_id, OLD.lane = 'high',
             CASE WHEN dispatch_budget_counts(OLD.kind, OLD.status, OLD.interrupt_reason, OLD.lease_epoch) THEN -1
                  ELSE 0 END),
            (dispatch_budget_window(NEW.created_at, k.window_seconds), NEW.tenant_id, NEW.lane = 'high',
             CASE WHEN dispatch_budget_counts(NEW.kind, NEW.status, NEW.interrupt_reason, NEW.lease_epoch) THEN 1
                  ELSE 0 END)) AS v(window_start, tenant_id, high, delta)
        WHERE v.delta <> 0 AND v.window_start >= k.since_window_start
        GROUP BY 1, 2, 3, 4
        HAVING sum(v.delta) <> 0
    ), per_tenant AS (
        INSERT INTO dispatch_budget_ledger AS l (window_start, window_seconds, tenant_id, high, source, used)
        SELECT c.window_start, c.window_seconds, c.tenant_id, c.high, 1, c.n FROM c
        ON CONFLICT (window_start, window_seconds, tenant_id, high, source) DO UPDATE SET used = l.used + EXCLUDED.used
    )
    INSERT INTO dispatch_budget_totals AS t (window_start, window_seconds, high, shard, source, used)
    SELECT c.window_start, c.window_seconds, c.high, c.tenant_id % 16, 1, sum(c.n) FROM c GROUP BY 1, 2, 3, 4
    ON CONFLICT (window_start, window_seconds, high, shard, source) DO UPDATE SET used = t.used + EXCLUDED.used;
    RETURN NULL;
END
$$;

CREATE TRIGGER tr_desktop_tasks_budget_update AFTER UPDATE ON desktop_tasks FOR EACH ROW
    WHEN (dispatch_budget_counts(OLD.kind, OLD.status, OLD.interrupt_reason, OLD.lease_epoch)
              IS DISTINCT FROM dispatch_budget_counts(NEW.kind, NEW.status, NEW.interrupt_reason, NEW.lease_epoch)
          OR (dispatch_budget_counts(OLD.kind, OLD.status, OLD.interrupt_reason, OLD.lease_epoch)
              AND (OLD.created_at, OLD.tenant_id, OLD.lane = 'high')
                  IS DISTINCT FROM (NEW.created_at, NEW.tenant_id, NEW.lane = 'high')))
    EXECUTE FUNCTION dispatch_budget_ledger_update();

-- Aging's walk (maintenance.run_aging): the oldest ready normal tasks in (enqueued_at, id) order. The included
-- columns let the walk find the round's boundary (the oldest `aging_fraction`) and skip the tasks whose boost is
-- already at the cap from the index alone: at 1,000,000 ready tasks the walk read every task's heap row (5.1 s a
-- round; docs/benchmarks.md "Cost as the backlog grows").
DROP INDEX ix_collect_tasks_aging;
CREATE INDEX ix_collect_tasks_aging
    ON monitoring_collect_tasks (enqueued_at, id) INCLUDE (dispatch_after, aging_boost)
    WHERE status = 'pending' AND execution_owner = 'desktop_tasks' AND dispatch_lane IN ('normal', 'normal_boosted');

-- The legacy (Phase 1) execution path (docs/architecture.md §16.1, docs/legacy-path.md).
--
-- A business task with execution_owner = 'legacy' is leased on its own row: the coordinator offers it to a client
-- (status 'leased', leased_to_executor, legacy_lease_id set, no token yet), the client pulls it with the same lease
-- call as desktop_tasks work (lease_token_hash, leased_at, lease_expires_at set), posts its result (status
-- 'received'), and ingest ends it (completed, or back to pending for a retry, or failed). The business row is the
-- authority for the lease; legacy_leases keeps one row per offer, its history: which client held it when, how it
-- ended, what it counted against the budget. Its columns have the names desktop_tasks uses for the same things,
-- so the budget ledger's triggers (migration 021) count legacy offers exactly as they count executions.

ALTER TABLE monitoring_collect_tasks ADD COLUMN legacy_lease_id uuid;

CREATE TABLE legacy_leases (
    id                    uuid         PRIMARY KEY,  -- the task_id a client sees for this lease
    kind                  varchar(20)  NOT NULL DEFAULT 'monitor' CHECK (kind = 'monitor'),
    monitor_task_id       bigint       NOT NULL REFERENCES monitoring_collect_tasks (id),
    tenant_id             bigint       NOT NULL REFERENCES tenants (id),
    workspace_id          bigint       NOT NULL,
    target_client_id      uuid         NOT NULL REFERENCES desktop_clients (id),
    ai_platform_id        bigint       NOT NULL,
    brand_id              bigint       NOT NULL,
    question_id           bigint       NOT NULL,
    business_date         date         NOT NULL,
    lane                  varchar(20)  NOT NULL CHECK (lane IN ('high', 'normal', 'normal_boosted', 'retry')),
    lane_weight           int          NOT NULL,
    priority              int          NOT NULL,
    -- queued: offered, not pulled yet; in_progress: leased by the client (until its result or its end).
    status                varchar(20)  NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'in_progress', 'succeeded', 'failed', 'aborted', 'expired')),
    lease_epoch           int          NOT NULL DEFAULT 0 CHECK (lease_epoch IN (0, 1)),
    -- The token's hash while the lease lives (the business row holds it too): what a retried result post is
    -- checked against, as on desktop_tasks.
    lease_token_hash      varchar(64),
    interrupt_generation  bigint       NOT NULL DEFAULT 0,
    interrupt_reason      varchar(64),
    control_flags         jsonb        NOT NULL DEFAULT '{}'::jsonb,
    execution_phase       varchar(20)
        CHECK (execution_phase IN ('PREPARING', 'NAVIGATING', 'AUTHENTICATING', 'INPUTTING',
                                   'SUBMITTING', 'WAITING', 'PARSING', 'POSTING')),
    result_digest         varchar(64),
    result_received_at    timestamptz,
    collect_request_id    uuid,
    enqueued_at           timestamptz  NOT NULL,
    created_at            timestamptz  NOT NULL DEFAULT now(),
    leased_at             timestamptz,
    finished_at           timestamptz,
    error                 text,
    updated_at            timestamptz  NOT NULL DEFAULT now()
);
-- One live offer or lease per business task.
CREATE UNIQUE INDEX uq_legacy_leases_active ON legacy_leases (monitor_task_id) WHERE status IN ('queued', 'in_progress');
-- A client's offers in dispatch order (its lease call), and its load (the coordinator's snapshot).
CREATE INDEX ix_legacy_leases_client_active ON legacy_leases (target_client_id, lane_weight DESC, priority DESC, enqueued_at)
    WHERE status IN ('queued', 'in_progress');
CREATE INDEX ix_legacy_leases_tenant_platform_active ON legacy_leases (tenant_id, ai_platform_id)
    WHERE status IN ('queued', 'in_progress');
CREATE INDEX ix_legacy_leases_monitor_task ON legacy_leases (monitor_task_id, created_at);
CREATE INDEX ix_legacy_leases_created ON legacy_leases (created_at);
-- Leased business rows by holder (the offline-client job, rollout status).
CREATE INDEX ix_collect_tasks_legacy_holder ON monitoring_collect_tasks (leased_to_executor)
    WHERE status IN ('leased', 'received');

-- Budget: a legacy offer counts against its window like an execution (refunded when collect-now withdraws it
-- before it was pulled: status aborted, reason collect_now_preempt, epoch 0).
CREATE TRIGGER tr_legacy_leases_budget_insert AFTER INSERT ON legacy_leases
    REFERENCING NEW TABLE AS changed_new FOR EACH STATEMENT EXECUTE FUNCTION dispatch_budget_ledger_rows();
CREATE TRIGGER tr_legacy_leases_budget_delete AFTER DELETE ON legacy_leases
    REFERENCING OLD TABLE AS changed_old FOR EACH STATEMENT EXECUTE FUNCTION dispatch_budget_ledger_rows();
CREATE TRIGGER tr_legacy_leases_budget_update AFTER UPDATE ON legacy_leases FOR EACH ROW
    WHEN (dispatch_budget_counts(OLD.kind, OLD.status, OLD.interrupt_reason, OLD.lease_epoch)
              IS DISTINCT FROM dispatch_budget_counts(NEW.kind, NEW.status, NEW.interrupt_reason, NEW.lease_epoch)
          OR (dispatch_budget_counts(OLD.kind, OLD.status, OLD.interrupt_reason, OLD.lease_epoch)
              AND (OLD.created_at, OLD.tenant_id, OLD.lane = 'high')
                  IS DISTINCT FROM (NEW.created_at, NEW.tenant_id, NEW.lane = 'high')))
    EXECUTE FUNCTION dispatch_budget_ledger_update();

-- The dispatch indexes serve both paths now: the coordinator reads ready work of either owner and routes each task
-- by its owner at write time.
DROP INDEX ix_collect_tasks_ready_pair;
CREATE INDEX ix_collect_tasks_ready_pair
    ON monitoring_collect_tasks (tenant_id, ai_platform_id, dispatch_lane, dispatch_priority DESC, enqueued_at, id)
    WHERE status = 'pending';
DROP INDEX ix_collect_tasks_aging;
CREATE INDEX ix_collect_tasks_aging
    ON monitoring_collect_tasks (enqueued_at, id) INCLUDE (dispatch_after, aging_boost)
    WHERE status = 'pending' AND dispatch_lane IN ('normal', 'normal_boosted');

-- What the budget counts, on both paths: the executions and the legacy offers (the passes' count before the ledger
-- starts, the ledger's start, the ops status). Predicates on created_at reach each branch's index.
CREATE VIEW dispatch_budget_rows AS
    SELECT kind, status, interrupt_reason, lease_epoch, created_at, tenant_id, lane FROM desktop_tasks
    UNION ALL
    SELECT kind, status, interrupt_reason, lease_epoch, created_at, tenant_id, lane FROM legacy_leases;

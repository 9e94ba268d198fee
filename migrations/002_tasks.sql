-- Two-layer task model (seed §5.1, §7): business truth + execution control.

-- Business truth: one row per business key and business date (seed §7.1, §12.3).
CREATE TABLE monitoring_collect_tasks (
    id                        bigserial    PRIMARY KEY,
    tenant_id                 bigint       NOT NULL REFERENCES tenants (id),
    workspace_id              bigint       NOT NULL,
    brand_id                  bigint       NOT NULL REFERENCES brands (id),
    question_id               bigint       NOT NULL REFERENCES monitoring_questions (id),
    ai_platform_id            bigint       NOT NULL REFERENCES ai_platforms (id),
    collector_type            varchar(20)  NOT NULL DEFAULT 'desktop',
    run_mode                  varchar(20)  NOT NULL DEFAULT 'daily',
    business_date             date         NOT NULL,
    plan_id                   bigint       REFERENCES monitoring_plans (id),
    status                    varchar(20)  NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'leased', 'received', 'completed', 'failed', 'skipped', 'expired')),
    trigger_source            varchar(20)  NOT NULL DEFAULT 'automatic'
        CHECK (trigger_source IN ('automatic', 'manual')),
    dispatch_priority         int          NOT NULL DEFAULT 100,
    dispatch_lane             varchar(20)  NOT NULL DEFAULT 'normal'
        CHECK (dispatch_lane IN ('high', 'normal', 'normal_boosted', 'retry')),
    target_client_id          uuid         REFERENCES desktop_clients (id),
    dispatch_after            timestamptz  NOT NULL DEFAULT now(),
    interrupt_generation      bigint       NOT NULL DEFAULT 0,
    superseded_by_request_id  uuid,
    collect_request_id        uuid,
    last_dispatched_at        timestamptz,
    dispatch_attempts         int          NOT NULL DEFAULT 0,
    aging_boost               int          NOT NULL DEFAULT 0 CHECK (aging_boost BETWEEN 0 AND 900),
    ingest_shard_key          varchar(120) NOT NULL,
    execution_owner           varchar(20)  NOT NULL DEFAULT 'legacy'
        CHECK (execution_owner IN ('legacy', 'desktop_tasks')),
    -- Legacy (Phase 1) lease columns, used only when execution_owner = 'legacy'.
    lease_token_hash          varchar(64),
    leased_to_executor        uuid,
    leased_at                 timestamptz,
    lease_expires_at          timestamptz,
    enqueued_at               timestamptz  NOT NULL DEFAULT now(),
    completed_at              timestamptz,
    last_error                text,
    created_at                timestamptz  NOT NULL DEFAULT now(),
    updated_at                timestamptz  NOT NULL DEFAULT now(),
    -- Write matrix of seed §7.1: the desktop_tasks path never holds leased/received on the business row.
    CONSTRAINT ck_collect_tasks_write_matrix
        CHECK (execution_owner = 'legacy' OR status NOT IN ('leased', 'received'))
);
CREATE UNIQUE INDEX uq_monitoring_collect_tasks_business_key
    ON monitoring_collect_tasks (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date);
-- Ready list per lane in dispatch order (lane, priority DESC, enqueued_at ASC).
CREATE INDEX ix_collect_tasks_ready
    ON monitoring_collect_tasks (dispatch_lane, dispatch_priority DESC, enqueued_at, id)
    WHERE status = 'pending';
CREATE INDEX ix_collect_tasks_ready_tenant
    ON monitoring_collect_tasks (tenant_id, dispatch_lane, dispatch_priority DESC, enqueued_at)
    WHERE status = 'pending';
CREATE INDEX ix_collect_tasks_target_client
    ON monitoring_collect_tasks (target_client_id)
    WHERE status = 'pending' AND target_client_id IS NOT NULL;
CREATE INDEX ix_collect_tasks_request ON monitoring_collect_tasks (collect_request_id)
    WHERE collect_request_id IS NOT NULL;
CREATE INDEX ix_collect_tasks_legacy_lease ON monitoring_collect_tasks (lease_expires_at)
    WHERE execution_owner = 'legacy' AND leased_to_executor IS NOT NULL;
CREATE INDEX ix_collect_tasks_business_date ON monitoring_collect_tasks (business_date)
    WHERE status = 'pending';

-- Execution control plane (seed §7.2): kind publish | monitor.
CREATE TABLE desktop_tasks (
    id                    uuid         PRIMARY KEY,
    kind                  varchar(20)  NOT NULL CHECK (kind IN ('publish', 'monitor')),
    tenant_id             bigint       NOT NULL REFERENCES tenants (id),
    workspace_id          bigint       NOT NULL,
    target_client_id      uuid         NOT NULL REFERENCES desktop_clients (id),
    status                varchar(20)  NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'in_progress', 'succeeded', 'failed', 'aborted', 'unknown')),
    priority              int          NOT NULL,
    lane                  varchar(20)  NOT NULL
        CHECK (lane IN ('urgent', 'high', 'normal', 'normal_boosted', 'retry')),
    lane_weight           int          NOT NULL,
    source                varchar(20)  NOT NULL
        CHECK (source IN ('collect_now', 'daily_schedule', 'retry_recovery', 'publish')),
    scheduler_group_key   varchar(120),
    monitor_task_id       bigint       REFERENCES monitoring_collect_tasks (id),
    supersedes_task_id    uuid,
    control_flags         jsonb        NOT NULL DEFAULT '{}'::jsonb,
    interrupt_generation  bigint       NOT NULL DEFAULT 0,
    started_at            timestamptz,
    interrupted_at        timestamptz,
    interrupt_reason      varchar(64),
    enqueued_at           timestamptz  NOT NULL DEFAULT now(),
    -- Denormalised from the business task so the hub needs no join on the hot path.
    brand_id              bigint,
    question_id           bigint,
    ai_platform_id        bigint,
    business_date         date,
    collect_request_id    uuid,
    -- Lease with fencing: the token is stored hashed; lease_epoch grows with every lease.
    lease_token_hash      varchar(64),
    lease_epoch           int          NOT NULL DEFAULT 0,
    leased_at             timestamptz,
    lease_expires_at      timestamptz,
    execution_phase       varchar(20)
        CHECK (execution_phase IN ('PREPARING', 'NAVIGATING', 'AUTHENTICATING', 'INPUTTING',
                                   'SUBMITTING', 'WAITING', 'PARSING', 'POSTING')),
    result_received_at    timestamptz,
    finished_at           timestamptz,
    error                 text,
    payload               jsonb,
    created_at            timestamptz  NOT NULL DEFAULT now(),
    updated_at            timestamptz  NOT NULL DEFAULT now(),
    CHECK (kind <> 'monitor' OR monitor_task_id IS NOT NULL)
);
CREATE UNIQUE INDEX uq_desktop_tasks_monitor_active
    ON desktop_tasks (monitor_task_id)
    WHERE kind = 'monitor' AND status IN ('queued', 'in_progress', 'unknown');
-- Lease claim: the best queued task of one client, in dispatch order.
CREATE INDEX ix_desktop_tasks_lease
    ON desktop_tasks (target_client_id, lane_weight DESC, priority DESC, enqueued_at)
    WHERE status = 'queued';
CREATE INDEX ix_desktop_tasks_client_active
    ON desktop_tasks (target_client_id, ai_platform_id)
    WHERE status IN ('queued', 'in_progress', 'unknown');
CREATE INDEX ix_desktop_tasks_tenant_platform_active
    ON desktop_tasks (tenant_id, ai_platform_id)
    WHERE status IN ('in_progress', 'queued');
CREATE INDEX ix_desktop_tasks_lease_expiry
    ON desktop_tasks (lease_expires_at)
    WHERE status = 'in_progress';
CREATE INDEX ix_desktop_tasks_monitor_task ON desktop_tasks (monitor_task_id);
CREATE INDEX ix_desktop_tasks_created ON desktop_tasks (created_at);
CREATE INDEX ix_desktop_tasks_unknown ON desktop_tasks (updated_at) WHERE status = 'unknown';

-- Attempt history: one row per lease of an execution.
CREATE TABLE desktop_task_attempts (
    id                    bigserial    PRIMARY KEY,
    task_id               uuid         NOT NULL REFERENCES desktop_tasks (id),
    monitor_task_id       bigint,
    tenant_id             bigint       NOT NULL,
    client_id             uuid         NOT NULL,
    lease_epoch           int          NOT NULL,
    status                varchar(20)  NOT NULL DEFAULT 'in_progress'
        CHECK (status IN ('in_progress', 'succeeded', 'failed', 'aborted', 'expired')),
    execution_phase       varchar(20),
    interrupt_generation  bigint       NOT NULL DEFAULT 0,
    abort_reason          varchar(64),
    error                 text,
    started_at            timestamptz  NOT NULL DEFAULT now(),
    finished_at           timestamptz,
    UNIQUE (task_id, lease_epoch)
);
CREATE INDEX ix_attempts_monitor_task ON desktop_task_attempts (monitor_task_id, started_at);
CREATE INDEX ix_attempts_client_recent ON desktop_task_attempts (client_id, finished_at);

-- Collect-now requests (seed §7.4).
CREATE TABLE monitoring_collect_requests (
    id                        uuid         PRIMARY KEY,
    tenant_id                 bigint       NOT NULL REFERENCES tenants (id),
    workspace_id              bigint       NOT NULL,
    brand_id                  bigint       NOT NULL REFERENCES brands (id),
    keyword_id                bigint,
    requested_by_user_id      bigint       NOT NULL,
    target_client_id          uuid,
    scope_hash                varchar(64)  NOT NULL,
    request_scope             jsonb        NOT NULL,
    status                    varchar(30)  NOT NULL DEFAULT 'accepted'
        CHECK (status IN ('accepted', 'dispatching', 'running', 'partial', 'succeeded', 'failed',
                          'timed_out', 'superseded')),
    preempt                   boolean      NOT NULL DEFAULT true,
    interrupt_generation      bigint       NOT NULL DEFAULT 0,
    requested_task_count      int          NOT NULL DEFAULT 0,
    dispatched_task_count     int          NOT NULL DEFAULT 0,
    completed_task_count      int          NOT NULL DEFAULT 0,
    failed_task_count         int          NOT NULL DEFAULT 0,
    aborted_queued_count      int          NOT NULL DEFAULT 0,
    interrupt_requested_count int          NOT NULL DEFAULT 0,
    superseded_by_request_id  uuid,
    first_dispatched_at       timestamptz,
    first_result_at           timestamptz,
    first_preempt_at          timestamptz,
    no_dispatch_warned_at     timestamptz,
    ttl_expires_at            timestamptz  NOT NULL,
    finished_at               timestamptz,
    created_at                timestamptz  NOT NULL DEFAULT now(),
    updated_at                timestamptz  NOT NULL DEFAULT now()
);
CREATE INDEX ix_collect_requests_idempotency
    ON monitoring_collect_requests (requested_by_user_id, brand_id, scope_hash, created_at DESC);
CREATE INDEX ix_collect_requests_active_tenant
    ON monitoring_collect_requests (tenant_id)
    WHERE status IN ('accepted', 'dispatching', 'running');
CREATE INDEX ix_collect_requests_user_recent
    ON monitoring_collect_requests (requested_by_user_id, created_at DESC);
CREATE INDEX ix_collect_requests_ttl
    ON monitoring_collect_requests (ttl_expires_at)
    WHERE status IN ('accepted', 'dispatching', 'running');

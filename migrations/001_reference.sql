-- Reference data: tenants, brands, questions, platforms, plans, desktop clients, settings.

CREATE TABLE tenants (
    id          bigserial PRIMARY KEY,
    name        text        NOT NULL,
    time_zone   text        NOT NULL DEFAULT 'UTC',
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE brands (
    id            bigserial PRIMARY KEY,
    tenant_id     bigint      NOT NULL REFERENCES tenants (id),
    workspace_id  bigint      NOT NULL,
    name          text        NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_brands_tenant ON brands (tenant_id, id);

CREATE TABLE monitoring_keywords (
    id          bigserial PRIMARY KEY,
    tenant_id   bigint      NOT NULL REFERENCES tenants (id),
    brand_id    bigint      NOT NULL REFERENCES brands (id),
    text        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_keywords_brand ON monitoring_keywords (tenant_id, brand_id);

CREATE TABLE monitoring_questions (
    id          bigserial PRIMARY KEY,
    tenant_id   bigint      NOT NULL REFERENCES tenants (id),
    brand_id    bigint      NOT NULL REFERENCES brands (id),
    keyword_id  bigint      REFERENCES monitoring_keywords (id),
    text        text        NOT NULL,
    enabled     boolean     NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_questions_brand ON monitoring_questions (tenant_id, brand_id, keyword_id);

CREATE TABLE ai_platforms (
    id          bigserial PRIMARY KEY,
    code        varchar(40) NOT NULL UNIQUE,
    name        text        NOT NULL,
    enabled     boolean     NOT NULL DEFAULT true
);

-- Which platforms a tenant collects from (the collect-now scope is questions x enabled platforms).
CREATE TABLE tenant_platforms (
    tenant_id       bigint  NOT NULL REFERENCES tenants (id),
    ai_platform_id  bigint  NOT NULL REFERENCES ai_platforms (id),
    enabled         boolean NOT NULL DEFAULT true,
    PRIMARY KEY (tenant_id, ai_platform_id)
);

-- Per-platform limits and interrupt timeouts (seed §9.2 item 5, §10.5); hot-reloaded.
CREATE TABLE platform_settings (
    ai_platform_id             bigint      PRIMARY KEY REFERENCES ai_platforms (id),
    max_concurrent             int         NOT NULL DEFAULT 1 CHECK (max_concurrent >= 0),
    interrupt_soft_timeout_ms  int         NOT NULL DEFAULT 15000 CHECK (interrupt_soft_timeout_ms > 0),
    interrupt_hard_timeout_ms  int         NOT NULL DEFAULT 45000,
    safe_point_p95_ms          int,
    paused                     boolean     NOT NULL DEFAULT false,
    updated_at                 timestamptz NOT NULL DEFAULT now(),
    CHECK (interrupt_hard_timeout_ms >= interrupt_soft_timeout_ms)
);

-- Budgets, lane pauses, thresholds, rollout percentage: key -> JSON value, read on every tick.
CREATE TABLE dispatch_settings (
    key         varchar(80) PRIMARY KEY,
    value       jsonb       NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE monitoring_plans (
    id                bigserial PRIMARY KEY,
    tenant_id         bigint      NOT NULL REFERENCES tenants (id),
    workspace_id      bigint      NOT NULL,
    brand_id          bigint      NOT NULL REFERENCES brands (id),
    question_id       bigint      NOT NULL REFERENCES monitoring_questions (id),
    ai_platform_id    bigint      NOT NULL REFERENCES ai_platforms (id),
    collector_type    varchar(20) NOT NULL DEFAULT 'desktop',
    run_mode          varchar(20) NOT NULL DEFAULT 'daily',
    interval_seconds  int         NOT NULL DEFAULT 86400 CHECK (interval_seconds > 0),
    next_run_at       timestamptz NOT NULL,
    enabled           boolean     NOT NULL DEFAULT true,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode)
);
-- The scanner's query: due, enabled plans in next_run_at order.
CREATE INDEX ix_plans_due ON monitoring_plans (next_run_at) WHERE enabled;

CREATE TABLE desktop_clients (
    id                      uuid        PRIMARY KEY,
    tenant_id               bigint      NOT NULL REFERENCES tenants (id),
    workspace_id            bigint      NOT NULL,
    user_id                 bigint      NOT NULL,
    name                    text        NOT NULL DEFAULT '',
    token_hash              varchar(64) NOT NULL UNIQUE,
    max_concurrent_monitor  int         NOT NULL DEFAULT 2 CHECK (max_concurrent_monitor >= 0),
    max_queue_depth         int         NOT NULL DEFAULT 20 CHECK (max_queue_depth >= 0),
    -- {"<platform code>": "healthy" | "login_required" | "captcha"}
    platform_health         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    -- Per-client interrupt generation (seed §10.2): incremented atomically by every collect-now.
    interrupt_generation    bigint      NOT NULL DEFAULT 0,
    last_heartbeat_at       timestamptz,
    connected_hub           text,
    online                  boolean     NOT NULL DEFAULT false,
    offline_since           timestamptz,
    disabled_at             timestamptz,
    created_at              timestamptz NOT NULL DEFAULT now(),
    updated_at              timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ix_clients_tenant_heartbeat ON desktop_clients (tenant_id, workspace_id, last_heartbeat_at DESC);
CREATE INDEX ix_clients_online_heartbeat ON desktop_clients (last_heartbeat_at) WHERE online;

-- Raw facts and daily projections (seed §12).

CREATE TABLE question_monitor_runs (
    id               bigserial    PRIMARY KEY,
    tenant_id        bigint       NOT NULL,
    workspace_id     bigint       NOT NULL,
    brand_id         bigint       NOT NULL,
    question_id      bigint       NOT NULL,
    ai_platform_id   bigint       NOT NULL,
    collector_type   varchar(20)  NOT NULL,
    run_mode         varchar(20)  NOT NULL,
    business_date    date         NOT NULL,
    status           varchar(20)  NOT NULL CHECK (status IN ('succeeded', 'failed')),
    answer_text      text,
    brand_mentioned  boolean      NOT NULL DEFAULT false,
    citation_count   int          NOT NULL DEFAULT 0,
    error            text,
    desktop_task_id  uuid,
    client_id        uuid,
    result_id        uuid,
    started_at       timestamptz,
    finished_at      timestamptz,
    created_at       timestamptz  NOT NULL DEFAULT now(),
    updated_at       timestamptz  NOT NULL DEFAULT now(),
    -- Success-priority upsert target (seed §12.3).
    CONSTRAINT uk_monitor_run_idempotent
        UNIQUE (tenant_id, brand_id, question_id, ai_platform_id, collector_type, run_mode, business_date)
);
CREATE INDEX ix_runs_projection ON question_monitor_runs (tenant_id, brand_id, business_date);

CREATE TABLE question_monitor_parse_results (
    id                    bigserial    PRIMARY KEY,
    run_id                bigint       NOT NULL REFERENCES question_monitor_runs (id) ON DELETE CASCADE,
    tenant_id             bigint       NOT NULL,
    citation_fingerprint  varchar(64)  NOT NULL,
    url                   text         NOT NULL,
    title                 text,
    position              int,
    domain                varchar(255),
    created_at            timestamptz  NOT NULL DEFAULT now(),
    UNIQUE (run_id, citation_fingerprint)
);

CREATE TABLE monitoring_citation_facts (
    id                    bigserial    PRIMARY KEY,
    run_id                bigint       NOT NULL REFERENCES question_monitor_runs (id) ON DELETE CASCADE,
    tenant_id             bigint       NOT NULL,
    brand_id              bigint       NOT NULL,
    question_id           bigint       NOT NULL,
    ai_platform_id        bigint       NOT NULL,
    business_date         date         NOT NULL,
    citation_fingerprint  varchar(64)  NOT NULL,
    url                   text         NOT NULL,
    domain                varchar(255) NOT NULL,
    position              int,
    created_at            timestamptz  NOT NULL DEFAULT now(),
    UNIQUE (run_id, citation_fingerprint)
);
CREATE INDEX ix_citation_facts_projection ON monitoring_citation_facts (tenant_id, brand_id, business_date);

-- Coalesced projection rebuild requests: one row per (tenant_id, brand_id, business_date).
CREATE TABLE projection_rebuild_queue (
    tenant_id          bigint       NOT NULL,
    brand_id           bigint       NOT NULL,
    business_date      date         NOT NULL,
    requested_at       timestamptz  NOT NULL DEFAULT now(),
    last_requested_at  timestamptz  NOT NULL DEFAULT now(),
    request_count      int          NOT NULL DEFAULT 1,
    claimed_by         varchar(120),
    claim_expires_at   timestamptz,
    attempts           int          NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, brand_id, business_date)
);
CREATE INDEX ix_projection_queue_age ON projection_rebuild_queue (requested_at);

CREATE TABLE monitoring_brand_daily (
    tenant_id               bigint       NOT NULL,
    brand_id                bigint       NOT NULL,
    business_date           date         NOT NULL,
    runs                    int          NOT NULL DEFAULT 0,
    succeeded_runs          int          NOT NULL DEFAULT 0,
    failed_runs             int          NOT NULL DEFAULT 0,
    brand_mentioned_runs    int          NOT NULL DEFAULT 0,
    mention_rate            numeric(6,4) NOT NULL DEFAULT 0,
    citations               int          NOT NULL DEFAULT 0,
    distinct_cited_domains  int          NOT NULL DEFAULT 0,
    rebuilt_at              timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, brand_id, business_date)
);

CREATE TABLE monitoring_brand_platform_daily (
    tenant_id               bigint       NOT NULL,
    brand_id                bigint       NOT NULL,
    business_date           date         NOT NULL,
    ai_platform_id          bigint       NOT NULL,
    runs                    int          NOT NULL DEFAULT 0,
    succeeded_runs          int          NOT NULL DEFAULT 0,
    failed_runs             int          NOT NULL DEFAULT 0,
    brand_mentioned_runs    int          NOT NULL DEFAULT 0,
    mention_rate            numeric(6,4) NOT NULL DEFAULT 0,
    citations               int          NOT NULL DEFAULT 0,
    distinct_cited_domains  int          NOT NULL DEFAULT 0,
    rebuilt_at              timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, brand_id, business_date, ai_platform_id)
);

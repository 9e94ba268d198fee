-- Transactional outbox (seed 003 rulebook): queued -> running -> published | retryable | dead_letter.

CREATE TABLE outbox (
    id                bigserial    PRIMARY KEY,
    event_id          uuid         NOT NULL UNIQUE,
    exchange          varchar(120) NOT NULL,
    routing_key       varchar(255) NOT NULL,
    message_type      varchar(60)  NOT NULL,
    payload           bytea        NOT NULL,
    headers           jsonb        NOT NULL DEFAULT '{}'::jsonb,
    -- Events sharing an ordering key are published in commit order (writers of one key are
    -- serialised by a transaction advisory lock in enqueue(), so id order is commit order).
    ordering_key      varchar(160),
    tenant_id         bigint,
    traceparent       varchar(55),
    status            varchar(20)  NOT NULL DEFAULT 'queued'
        CHECK (status IN ('queued', 'running', 'retryable', 'published', 'dead_letter')),
    attempts          int          NOT NULL DEFAULT 0,
    max_attempts      int          NOT NULL DEFAULT 10 CHECK (max_attempts > 0),
    next_retry_at     timestamptz  NOT NULL DEFAULT now(),
    claimed_by        varchar(120),
    claim_expires_at  timestamptz,
    last_error        text,
    created_at        timestamptz  NOT NULL DEFAULT now(),
    published_at      timestamptz,
    dead_lettered_at  timestamptz,
    CHECK (status <> 'running' OR claim_expires_at IS NOT NULL)
);
-- Claim: pending rows in id order.
CREATE INDEX ix_outbox_claimable ON outbox (id) WHERE status IN ('queued', 'retryable');
-- Ordering check: unfinished predecessors of the same key.
CREATE INDEX ix_outbox_ordering ON outbox (ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status IN ('queued', 'running', 'retryable');
-- Stale-claim reclaim.
CREATE INDEX ix_outbox_running ON outbox (claim_expires_at) WHERE status = 'running';
CREATE INDEX ix_outbox_dead_letter ON outbox (dead_lettered_at) WHERE status = 'dead_letter';
CREATE INDEX ix_outbox_published ON outbox (published_at) WHERE status = 'published';

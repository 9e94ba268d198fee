-- collect-now's `Idempotency-Key` (docs/api.md, Idempotency): the first answer to a key, kept for its retention
-- (COLLECT_NOW_IDEMPOTENCY_KEY_TTL_HOURS) and replayed byte for byte to the same key of the same tenant and user.
-- Written in the click's own transaction, beside the request row, so a key never names a request that was not
-- committed nor a committed request lacks its key. `request_fingerprint` is sha256 of the brand and the body as
-- decoded: the same key with another request is refused (422). Expired rows are ignored by the lookup and deleted
-- by collect-now-api's purge loop (`expires_at` index).
CREATE TABLE collect_now_idempotency_keys (
    tenant_id            bigint      NOT NULL REFERENCES tenants (id),
    user_id              bigint      NOT NULL,
    idempotency_key      text        NOT NULL CHECK (length(idempotency_key) BETWEEN 1 AND 255),
    request_fingerprint  text        NOT NULL,
    collect_request_id   uuid        NOT NULL,
    response_status      smallint    NOT NULL CHECK (response_status BETWEEN 200 AND 299),
    response_body        bytea       NOT NULL,
    created_at           timestamptz NOT NULL DEFAULT now(),
    expires_at           timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, user_id, idempotency_key)
);

CREATE INDEX ix_collect_now_idempotency_keys_expiry ON collect_now_idempotency_keys (expires_at);

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON collect_now_idempotency_keys
    FOR EACH STATEMENT
    WHEN (current_setting('monitoring.leader_term', true) <> '')
    EXECUTE FUNCTION leader_fence();

-- §10.5 as written (libs/domain/safe_points.py):
--
-- 1. Dynamic measurement is the default for a platform without fixed values. The specification gives fixed interrupt
--    timeouts for OpenAI, Gemini and Perplexity and "measure dynamically" for the others, so a platform row created
--    from now on is dynamic unless it is given fixed values (`monitorctl platform set CODE --soft-timeout-ms ...`, or
--    `--static`). Existing rows of other platforms still at the column defaults, never tuned and never given values,
--    become dynamic too.
-- 2. Safe-point intervals are recorded per reporting client, so the tuning can take each client's P95 and use their
--    median: one client's reports (a broken or hostile desktop) cannot move a platform's timeouts for everyone.
--    Hubs of this version write safe_point_client_histogram; rows an older hub still writes to safe_point_histogram
--    during a rolling deploy are read as one anonymous client.

ALTER TABLE platform_settings ALTER COLUMN timeouts_dynamic SET DEFAULT true;
ALTER TABLE platform_settings ADD COLUMN safe_point_clients int;

UPDATE platform_settings s SET timeouts_dynamic = true, updated_at = now()
FROM ai_platforms p
WHERE p.id = s.ai_platform_id AND p.code NOT IN ('openai', 'gemini', 'perplexity') AND NOT s.timeouts_dynamic
  AND s.interrupt_soft_timeout_ms = 15000 AND s.interrupt_hard_timeout_ms = 45000 AND s.timeouts_tuned_at IS NULL;

CREATE TABLE safe_point_client_histogram (
    ai_platform_id  bigint      NOT NULL REFERENCES ai_platforms (id),
    client_id       uuid        NOT NULL,
    hour            timestamptz NOT NULL,
    le_ms           int         NOT NULL,  -- the bucket's upper bound; 2147483647 for "longer"
    n               bigint      NOT NULL CHECK (n >= 0),
    PRIMARY KEY (ai_platform_id, hour, client_id, le_ms)
);

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON safe_point_client_histogram
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '')
    EXECUTE FUNCTION leader_fence();

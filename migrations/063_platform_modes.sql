-- §10.5 per-mode interrupt timeouts: a platform can run a question in more than one mode (OpenAI: a quick answer, or
-- deep reasoning, whose safe points are minutes apart), and each mode has its own soft / hard timeouts.
--
-- A plan names the mode its question runs in on its platform (monitoring_plans.platform_mode; NULL: the platform's
-- default). The lease carries it to the client (`platform.mode`), and the coordinator's soft timeout and the
-- reconciler's hard timeout of an interrupted execution are the mode's when the platform has values for it, else
-- the platform's (libs/tasks/fragments.interrupt_timeout_ms_sql).

ALTER TABLE monitoring_plans ADD COLUMN platform_mode varchar(40);

CREATE TABLE platform_mode_settings (
    ai_platform_id             bigint      NOT NULL REFERENCES ai_platforms (id),
    mode                       varchar(40) NOT NULL,
    interrupt_soft_timeout_ms  int         NOT NULL CHECK (interrupt_soft_timeout_ms > 0),
    interrupt_hard_timeout_ms  int         NOT NULL,
    updated_at                 timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (ai_platform_id, mode),
    CHECK (interrupt_hard_timeout_ms >= interrupt_soft_timeout_ms)
);

CREATE TRIGGER leader_fence AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON platform_mode_settings
    FOR EACH STATEMENT WHEN (current_setting('monitoring.leader_term', true) <> '')
    EXECUTE FUNCTION leader_fence();

-- The specification's values for OpenAI's two modes, where the platform exists (libs/demo.py creates them with it).
INSERT INTO platform_mode_settings (ai_platform_id, mode, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms)
SELECT p.id, m.mode, m.soft, m.hard
FROM ai_platforms p, (VALUES ('quick', 15000, 45000), ('deep_reasoning', 60000, 180000)) AS m(mode, soft, hard)
WHERE p.code = 'openai'
ON CONFLICT DO NOTHING;

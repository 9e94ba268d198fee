-- An operator's override of the platform-health pause for one tenant's platform (libs/domain/platform_health.py):
-- 'pause' holds the tenant's scheduled work of the platform whatever its clients report; 'ignore_health'
-- dispatches it whatever they report. No row: the clients' reports decide.
CREATE TABLE platform_health_overrides (
    tenant_id       bigint      NOT NULL REFERENCES tenants (id),
    ai_platform_id  bigint      NOT NULL REFERENCES ai_platforms (id),
    mode            varchar(16) NOT NULL CHECK (mode IN ('pause', 'ignore_health')),
    reason          text        NOT NULL DEFAULT '',
    set_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, ai_platform_id)
);

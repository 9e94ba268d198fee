-- Safe-point intervals measured by every hub replica (a desktop reports the milliseconds since its previous safe
-- point on extend and cancel), as hourly histograms per platform: bounded in size whatever the traffic. The
-- reconciler's safe_point_tuning job reads the last days of them for each platform's P95, and for platforms marked
-- dynamic sets the interrupt timeouts from it (libs/domain/safe_points.py).
CREATE TABLE safe_point_histogram (
    ai_platform_id  bigint      NOT NULL REFERENCES ai_platforms (id),
    hour            timestamptz NOT NULL,
    le_ms           int         NOT NULL,  -- the bucket's upper bound; 2147483647 for "longer"
    n               bigint      NOT NULL CHECK (n >= 0),
    PRIMARY KEY (ai_platform_id, hour, le_ms)
);

ALTER TABLE platform_settings
    ADD COLUMN timeouts_dynamic        boolean     NOT NULL DEFAULT false,
    ADD COLUMN safe_point_samples      bigint,
    ADD COLUMN safe_point_measured_at  timestamptz,
    ADD COLUMN timeouts_tuned_at       timestamptz;

-- Tenant-fair projection rebuild claims: each claim serves the tenants with pending keys in turns, each
-- tenant's own keys oldest first. This index walks one tenant's keys in request order (and, on its leading
-- column, finds the tenants with pending keys one index probe each), so a claim reads about as many rows
-- as it takes instead of sorting the whole queue.
CREATE INDEX ix_projection_queue_tenant_age
    ON projection_rebuild_queue (tenant_id, requested_at, brand_id, business_date);

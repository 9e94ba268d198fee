-- Each live hub's socket count, written with its sweep (services/dispatch_hub/queries.py HUB_SEEN): a hub holding
-- more than its share of the fleet's sockets (after a rolling restart, the replicas restarted first hold most of
-- them) sheds a few a sweep with 4503, and their clients reconnect through the load balancer
-- (docs/architecture.md "Hub fleet"). hub_instances has a row per live replica: a small table.
ALTER TABLE hub_instances ADD COLUMN sockets integer NOT NULL DEFAULT 0 CHECK (sockets >= 0);

-- Push-lease (docs/desktop-protocol.md "Push-lease"): a client that announces the `push_lease` capability on its
-- WebSocket upgrade gets its executions already leased at dispatch, the lease token riding on `task_available`.
-- The hub records what the client's latest socket announced; the dispatcher reads it (under its FOR SHARE lock on
-- the client row) when it creates the client's executions. Old clients leave it false and keep pull-lease.

ALTER TABLE desktop_clients ADD COLUMN push_lease boolean NOT NULL DEFAULT false;

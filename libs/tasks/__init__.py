"""State transitions of business tasks and executions shared by hub, ingest, reconciler, coordinator."""

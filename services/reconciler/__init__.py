"""reconciler: expired leases, request TTLs, offline clients, interrupt hard timeouts, `unknown`
convergence, business-day expiry and the §16.2.4 migration reconcile (docs/architecture.md, Services; contract 9)."""

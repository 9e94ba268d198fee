"""collect-now-api: the tenant HTTP API for "collect now" and its request status (§10, §13.1, §13.5)."""

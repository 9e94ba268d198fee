"""collect-now-api: the tenant HTTP API for "collect now" and its request status (seed §10, §13.1, §13.5)."""

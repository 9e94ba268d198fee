"""Pure result-ingest logic (docs/architecture.md §12): citation fingerprints, run upsert rule, request progress,
projection aggregate definitions and shard spreading. No I/O here except `lag.py`'s readers."""

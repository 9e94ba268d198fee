"""Result shards (docs/architecture.md §12.2): shard = stable_hash(tenant_id, brand_id, business_date) % N."""

from __future__ import annotations

import hashlib
from datetime import date


def ingest_shard_key(tenant_id: int, brand_id: int, business_date: date) -> str:
    """The business shard key stored on the task (`ingest_shard_key`), also the projection coalesce key."""
    return f"{tenant_id}:{brand_id}:{business_date.isoformat()}"


def shard_for_key(shard_key: str, shards: int) -> int:
    """Stable across processes and Python versions (unlike `hash()`): BLAKE2b, big-endian, mod N."""
    if shards <= 0:
        raise ValueError("shards must be positive")
    digest = hashlib.blake2b(shard_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def shard_for(tenant_id: int, brand_id: int, business_date: date, shards: int) -> int:
    return shard_for_key(ingest_shard_key(tenant_id, brand_id, business_date), shards)

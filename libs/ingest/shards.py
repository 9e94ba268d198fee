"""Spreading the single active consumers of the shard queues across ingest replicas."""

from __future__ import annotations

from collections.abc import Iterable


def assign_shards(members: Iterable[str], shards: int) -> dict[int, str]:
    """Shard k -> the replica that should be its active consumer: round robin over sorted live members.

    Every replica consumes every shard (single active consumer keeps the others on standby, so a
    dead replica's shards fail over at once); a replica that is active on a shard assigned to
    another live member yields it by re-subscribing, which hands it to the next consumer in line.
    """
    ordered = sorted(set(members))
    if not ordered:
        return {}
    return {shard: ordered[shard % len(ordered)] for shard in range(shards)}


def lag_ms(now_epoch_ms: float, oldest_received_epoch_ms: float | None) -> float:
    """Ingest lag of one shard: age of the oldest result not yet applied; 0 when nothing waits."""
    if oldest_received_epoch_ms is None:
        return 0.0
    return max(0.0, now_epoch_ms - oldest_received_epoch_ms)

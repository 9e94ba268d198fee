"""A lease takes one result: the first body posted on a lease claims it by its digest, and a publish that failed
gives the claim back. The same two statements on either execution path's lease table (desktop_tasks, legacy_leases:
the same column names)."""

from __future__ import annotations

from typing import Literal

LeaseTable = Literal["desktop_tasks", "legacy_leases"]


def claim_result(table: LeaseTable) -> str:
    """Claim the lease's result for a digest; `previous` is the digest an earlier post stored (NULL: this post is
    the first)."""
    return f"""
WITH prev AS (
    SELECT id, result_digest FROM {table}
    WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
    FOR UPDATE
)
UPDATE {table} x SET result_digest = coalesce(prev.result_digest, %(digest)s)
FROM prev WHERE x.id = prev.id
RETURNING prev.result_digest AS previous, x.result_received_at
"""


def release_result_claim(table: LeaseTable) -> str:
    """Give the claim back after a failed publish, so the client's retry can post again."""
    return f"""
UPDATE {table} SET result_digest = NULL
WHERE id = %(task_id)s AND tenant_id = %(tenant_id)s AND lease_epoch = %(epoch)s
  AND result_digest = %(digest)s AND result_received_at IS NULL
"""

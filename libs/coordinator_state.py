"""What the active dispatch-coordinator publishes in `dispatch_coordinator_state` (auto slow-down of
docs/architecture.md §12.4, the leader), read by `explain`, `monitorctl status` and the projection-worker's merge mode.

An entry the coordinator stopped refreshing (no leader, or it is stuck) is treated as not active.
"""

from __future__ import annotations

from typing import Any

from libs.db.pool import Conn

# The coordinator rewrites its entries every maintenance round (a few seconds).
SLOWDOWN_MAX_AGE_S = 30.0

READ_STATE = """
SELECT key, value, extract(epoch FROM (now() - updated_at)) AS age_s FROM dispatch_coordinator_state
"""


async def read_coordinator_state(conn: Conn) -> dict[str, Any]:
    """What the active coordinator last published (slow-down, leader), with its age in seconds."""
    cur = await conn.execute(READ_STATE)
    return {r["key"]: {"value": r["value"], "age_s": float(r["age_s"])} for r in await cur.fetchall()}


def slowdown_from_state(state: dict[str, Any], max_age_s: float = SLOWDOWN_MAX_AGE_S) -> tuple[bool, dict[str, Any]]:
    """(active, the published slow-down value); no entry or a stale one is not active."""
    entry = state.get("slowdown")
    if entry is None or entry["age_s"] > max_age_s:
        return False, {"active": None, "note": "no fresh state from an active coordinator"}
    value = dict(entry["value"])
    return bool(value.get("active")), value

"""Why handling a message failed: a bad moment (give the message back, it will work later) or the message
itself (dead-letter it with the reason, so it stops blocking the ones behind it)."""

from __future__ import annotations

import psycopg
from aiormq.exceptions import AMQPError, ChannelInvalidStateError

# SQLSTATE classes that say nothing about the data: connection exception, transaction rollback (serialization
# failure, deadlock), insufficient resources, operator intervention (admin shutdown, query cancelled),
# system error (I/O).
_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
# ... and single states of other classes: lock not available (lock_timeout), object in use, idle-in-transaction
# and transaction timeouts, snapshot too old; and insufficient privilege: the statements are fixed and a message's
# values cannot touch the grants, so a refusal is the deployment's moment (a rolling deploy between `migrate`,
# which creates a table, and `db-roles`, which grants it), not the message's fault.
_TRANSIENT_STATES = frozenset({"55P03", "55006", "25P03", "25P04", "72000", "42501"})


def is_transient(exc: BaseException) -> bool:
    """True when retrying the same work later may succeed; False when the work itself is refused (a
    constraint, a value the database cannot store, a trigger, a bug on this input)."""
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        if state is None:
            # Raised on the client side: the connection was lost or closed, or no pooled connection in time
            # (PoolTimeout); a client-side DataError (a NUL byte in a text parameter) is about the data.
            return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
        return state[:2] in _TRANSIENT_CLASSES or state in _TRANSIENT_STATES
    # TimeoutError and ConnectionError are OSErrors.
    return isinstance(exc, OSError | AMQPError | ChannelInvalidStateError)


def describe_failure(exc: BaseException, limit: int = 300) -> str:
    """`Type SQLSTATE: first line of the message`, short. The database's DETAIL (which may quote the row,
    answer text included) is left out."""
    if isinstance(exc, psycopg.Error):
        text = exc.diag.message_primary or str(exc)
        head = f"{type(exc).__name__} {exc.sqlstate}" if exc.sqlstate else type(exc).__name__
    else:
        text, head = str(exc), type(exc).__name__
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{head}: {first}"[:limit] if first else head[:limit]

"""LISTEN on a dedicated connection, for as long as a service runs: reconnects with a capped backoff (at most
`MAX_RECONNECT_DELAY_S` apart: back within about a second of the database), and calls `on_notify(None)` after every
(re)connect, since anything committed while the connection was down sent its NOTIFY to nobody. The connection has
`connect()`'s keepalives, so a silently lost server is noticed in seconds too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable

from libs.db.pool import Conn, connect

log = logging.getLogger("db.listen")

FIRST_RECONNECT_DELAY_S = 0.2
MAX_RECONNECT_DELAY_S = 1.0


async def listen_forever(url: str, channel: str, on_notify: Callable[[str | None], None], *,
                         stop: asyncio.Event, listening: asyncio.Event, name: str, meanwhile: str) -> None:
    """`on_notify(payload)` for every notification on `channel` until `stop`; `listening` is set while the
    connection is up. `meanwhile` says in the warning what the service does while it is down."""
    delay = FIRST_RECONNECT_DELAY_S
    while not stop.is_set():
        conn: Conn | None = None
        try:
            conn = await connect(url, name=name)
            await conn.execute(f"LISTEN {channel}")
            listening.set()
            delay = FIRST_RECONNECT_DELAY_S
            on_notify(None)
            async for notify in conn.notifies():
                on_notify(notify.payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            listening.clear()
            log.warning(f"LISTEN connection lost; {meanwhile} until it is back",
                        extra={"channel": channel, "error": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, MAX_RECONNECT_DELAY_S * random.uniform(0.5, 1.0))
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

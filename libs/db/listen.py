"""LISTEN on a dedicated connection, for as long as a service runs: reconnects with backoff, and calls
`on_notify(None)` after every (re)connect, since anything committed while the connection was down sent
its NOTIFY to nobody."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from libs.db.pool import Conn, connect

log = logging.getLogger("db.listen")


async def listen_forever(url: str, channel: str, on_notify: Callable[[str | None], None], *,
                         stop: asyncio.Event, listening: asyncio.Event, name: str, meanwhile: str) -> None:
    """`on_notify(payload)` for every notification on `channel` until `stop`; `listening` is set while the
    connection is up. `meanwhile` says in the warning what the service does while it is down."""
    delay = 0.2
    while not stop.is_set():
        conn: Conn | None = None
        try:
            conn = await connect(url, name=name)
            await conn.execute(f"LISTEN {channel}")
            listening.set()
            delay = 0.2
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
            delay = min(delay * 2, 5.0)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

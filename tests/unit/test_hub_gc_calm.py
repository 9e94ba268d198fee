"""dispatch-hub's calm test for its full garbage collections: no handshake waiting for a slot and few sockets opened
or closed since the last look."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.http_api import GATEWAY, HANDSHAKES
from services.dispatch_hub.main import CALM_SOCKET_CHANGES, _calm


@dataclass
class Churn:
    sockets_changed: int = 0


async def test_calm_needs_few_socket_changes_since_the_last_look_and_a_free_handshake_slot() -> None:
    app = web.Application()
    app[HANDSHAKES] = slots = asyncio.Semaphore(1)
    calm = _calm(app)
    assert not calm(), "still starting: no gateway yet"
    churn = Churn()
    app[GATEWAY] = cast(Gateway, churn)
    assert calm()
    churn.sockets_changed += CALM_SOCKET_CHANGES + 1
    assert not calm(), "a storm of sockets since the last look"
    assert calm(), "nothing changed since"
    churn.sockets_changed += CALM_SOCKET_CHANGES
    assert calm()
    await slots.acquire()
    assert not calm(), "every handshake slot taken"
    slots.release()
    assert calm()

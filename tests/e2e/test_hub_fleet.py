"""dispatch-hub replicas as real processes: one client's socket cap holds across two hubs, and a SIGTERM'd hub
drains (refuses new sockets, tells each client when to reconnect, exits within its deadline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import HUB_DRAINING_CLOSE, reconnect_delay_ms
from libs.db.pool import Conn
from libs.demo import seed_demo
from tests.support.procs import ServiceProcess, service_env
from tests.support.wait import eventually

REPLACED = 4409


@pytest.fixture
async def seed(pool: AsyncConnectionPool[Conn]) -> dict[str, Any]:
    async with pool.connection() as conn:
        return await seed_demo(conn, tenants=1, brands=1, questions=1, clients=3, due=False)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _hub(settings: Settings, tmp_path: Path, **env: str | int | float) -> ServiceProcess:
    return ServiceProcess("dispatch-hub", service_env(settings, **{str(k): str(v) for k, v in env.items()}),
                          log_dir=tmp_path)


async def _socket(http: aiohttp.ClientSession, hub: ServiceProcess, token: str) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(f"{hub.url}/api/desktop/ws", headers={"Authorization": f"Bearer {token}"})
    hello = await ws.receive_json(timeout=10)
    assert hello["type"] == "hello", hello
    return ws


async def _closed_with(ws: aiohttp.ClientWebSocketResponse) -> tuple[int | None, str]:
    """Read until the hub closes the socket: its close code and reason."""
    while True:
        msg = await ws.receive(timeout=15)
        if msg.type == aiohttp.WSMsgType.CLOSE:
            return int(msg.data), str(msg.extra or "")
        if msg.type in (aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return ws.close_code, ""


async def _live_rows(pool: AsyncConnectionPool[Conn], client: str) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT hub_id FROM hub_sockets WHERE client_id = %s AND replaced_at IS NULL "
                                 "ORDER BY opened_at", (client,))
        return [r["hub_id"] for r in await cur.fetchall()]


async def test_two_hubs_hold_one_socket_cap_and_a_sigtermed_one_drains_within_its_deadline(
        settings: Settings, tmp_path: Path, pool: AsyncConnectionPool[Conn], seed: dict[str, Any],
        http: aiohttp.ClientSession) -> None:
    """One pair of hub processes for both (a hub process takes seconds to start on a loaded box)."""
    clients = seed["tenants"][0]["clients"]
    spread_ms, deadline_s = 2000, 3.0
    env = {"HUB_MAX_SOCKETS_PER_CLIENT": 2, "HUB_REVOCATION_CHECK_S": 0.3, "HUB_UPGRADE_BURST_PER_CLIENT": 20,
           "HUB_DRAIN_RECONNECT_SPREAD_MS": spread_ms, "HUB_DRAIN_DEADLINE_S": deadline_s}
    hub_a, hub_b = _hub(settings, tmp_path, **env), _hub(settings, tmp_path, **env)
    await asyncio.gather(asyncio.to_thread(hub_a.start), asyncio.to_thread(hub_b.start))
    try:
        await _cap_holds_across_hubs(http, pool, hub_a, hub_b, clients[0])
        await _drains(http, hub_a, clients, spread_ms=spread_ms, deadline_s=deadline_s)
    finally:
        await asyncio.gather(asyncio.to_thread(hub_a.stop), asyncio.to_thread(hub_b.stop))
        hub_a.kill()  # closes its log (stop leaves that to a process it stopped itself)


async def _cap_holds_across_hubs(http: aiohttp.ClientSession, pool: AsyncConnectionPool[Conn],
                                 hub_a: ServiceProcess, hub_b: ServiceProcess, client: dict[str, Any]) -> None:
    # Alternating hubs, so neither hub alone ever holds more than the cap: only the fleet-wide count can close.
    sockets = [await _socket(http, hub, client["token"]) for hub in (hub_a, hub_b, hub_a, hub_b)]
    first, second, third, fourth = sockets
    # The two oldest (one on each hub) were replaced by the newer two: each closed by the hub holding it.
    assert await asyncio.wait_for(_closed_with(first), 15) == (REPLACED, "replaced by a newer connection of "
                                                               "this client")
    assert (await asyncio.wait_for(_closed_with(second), 15))[0] == REPLACED
    assert not third.closed and not fourth.closed

    async def two_live() -> list[str] | None:
        rows = await _live_rows(pool, client["client_id"])
        return rows if len(rows) == 2 else None

    assert len(set(await eventually(two_live, message="two live sockets in the fleet"))) == 2  # one per hub
    for ws in (third, fourth):
        await ws.close()

    async def none_left() -> bool:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT count(*) AS n FROM hub_sockets WHERE client_id = %s",
                                     (client["client_id"],))
            row = await cur.fetchone()
            return row is not None and row["n"] == 0

    await eventually(none_left, message="closed sockets' rows deleted")


async def _drains(http: aiohttp.ClientSession, hub: ServiceProcess, clients: list[dict[str, Any]], *,
                  spread_ms: int, deadline_s: float) -> None:
    sockets = [await _socket(http, hub, c["token"]) for c in clients]
    closes = [asyncio.create_task(_closed_with(ws)) for ws in sockets]
    assert hub.proc is not None
    started = time.monotonic()
    hub.proc.terminate()
    told = await asyncio.wait_for(asyncio.gather(*closes), 15)
    assert {code for code, _ in told} == {HUB_DRAINING_CLOSE}, told
    delays = [reconnect_delay_ms(reason) for _, reason in told]
    assert all(d is not None and 0 <= d <= spread_ms for d in delays), told
    # No new socket while draining (refused at the upgrade, or the listener is already gone).
    with pytest.raises((aiohttp.WSServerHandshakeError, aiohttp.ClientConnectionError)):
        await http.ws_connect(f"{hub.url}/api/desktop/ws", headers={"Authorization": f"Bearer {clients[0]['token']}"})
    code = await asyncio.to_thread(hub.proc.wait, 30)
    exited_after = time.monotonic() - started
    assert code == 0, hub.logs()[-3000:]
    # The drain's deadline plus the service's shutdown grace (tests/support/procs.py: 5 s) at most.
    assert exited_after < deadline_s + 5, f"exited {exited_after:.1f} s after SIGTERM"

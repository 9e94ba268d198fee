"""`bench hub_scale`'s probe desktop against a hub that resets it (a connect storm on a loaded box): a lost socket or a
reset call is one of the errors the probe reconnects after, and the reconnect skips the replay and finishes what the
lost socket left (bench/b_hub_scale.py `_ProbeClient`), instead of the benchmark crashing."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.b_hub_scale import _PROBE_LOST, _next_event, _ProbeClient, _SocketLost


class FakeHub:
    """Upgrades answered per `plan` (one entry per connection: "refuse" a 503, "close" a hello then a close, "serve"
    a hello with one replayed event, then a fresh one); a lease call aborted while `abort_leases` lasts."""

    def __init__(self, plan: list[str], abort_leases: int = 0) -> None:
        self.plan, self.abort_leases = plan, abort_leases
        self.upgrades = self.leases = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/desktop/ws", self.ws)
        app.router.add_post("/api/desktop/monitor/lease", self.lease)
        return app

    async def ws(self, request: web.Request) -> web.StreamResponse:
        step = self.plan[min(self.upgrades, len(self.plan) - 1)]
        self.upgrades += 1
        if step == "refuse":
            return web.Response(status=503)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if step == "close":
            await ws.send_str(json.dumps({"type": "hello", "replayed_available": 0}))
            await ws.close()
            return ws
        await ws.send_str(json.dumps({"type": "hello", "replayed_available": 1}))
        await ws.send_str(json.dumps({"type": "task_available", "task_id": "replayed", "lane": "high"}))
        await ws.send_str(json.dumps({"type": "task_available", "task_id": "fresh", "lane": "high"}))
        async for _ in ws:  # until the client closes
            pass
        return ws

    async def lease(self, request: web.Request) -> web.Response:
        self.leases += 1
        if self.abort_leases > 0:
            self.abort_leases -= 1
            assert request.transport is not None
            request.transport.abort()  # the connection reset under the call
        return web.json_response({"tasks": []})


async def _probe_against(hub: FakeHub) -> tuple[TestServer, aiohttp.ClientSession, _ProbeClient]:
    server = TestServer(hub.app())
    await server.start_server()
    http = aiohttp.ClientSession()
    return server, http, _ProbeClient(http, str(server.make_url("")).rstrip("/"), {"Authorization": "Bearer t"})


async def test_a_socket_closed_under_the_probe_is_reopened_past_its_replay() -> None:
    hub = FakeHub(["close", "serve"])
    server, http, probe = await _probe_against(hub)
    try:
        ws = await probe.open()
        with pytest.raises(_SocketLost):
            await _next_event(ws, 5)
        await probe.reset(_SocketLost("closed"))
        assert probe.resets == 1 and hub.upgrades == 2
        assert hub.leases == 1  # what the lost socket may have left leased or queued is finished
        assert probe.ws is not None
        event: dict[str, Any] = await _next_event(probe.ws, 5)
        assert event["task_id"] == "fresh"  # the replay was read past: the next click's event comes first
        await probe.ws.close()
    finally:
        await http.close()
        await server.close()


async def test_a_refused_upgrade_is_retried() -> None:
    hub = FakeHub(["refuse", "serve"])
    server, http, probe = await _probe_against(hub)
    try:
        ws = await probe.open()
        assert probe.resets == 1 and hub.upgrades == 2
        assert (await _next_event(ws, 5))["task_id"] == "fresh"
        await ws.close()
    finally:
        await http.close()
        await server.close()


async def test_a_call_reset_under_the_probe_is_one_it_reconnects_after() -> None:
    hub = FakeHub(["serve"], abort_leases=1)
    server, http, probe = await _probe_against(hub)
    try:
        await probe.open()
        with pytest.raises(_PROBE_LOST) as lost:
            await probe.lease()
        assert isinstance(lost.value, aiohttp.ClientConnectionError)
        assert issubclass(aiohttp.ClientConnectionResetError, _PROBE_LOST)
        assert await probe.lease() == []
        assert probe.ws is not None
        await probe.ws.close()
    finally:
        await http.close()
        await server.close()

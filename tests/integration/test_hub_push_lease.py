"""Push-lease negotiation on the real hub (docs/desktop-protocol.md "Push-lease"): a socket that asks (header or query
parameter) is granted `push_lease` by a hub holding the key, and the client row records it; an old client asks for
nothing and a hub without the key grants nothing. A pushed lease is replayed on connect with its derived token; a 1.0
client's Structs still decode that replay."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import aiohttp
import msgspec
from aio_pika.abc import AbstractRobustConnection
from aiohttp.test_utils import TestServer
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.wire import CAPABILITIES_HEADER, PUSH_LEASE, TaskAvailable
from libs.db.pool import Conn
from libs.demo import seed_demo
from libs.mq.topology import Topology
from libs.tasks import push_leases
from libs.tasks.push_leases import PushLeaseIssuer
from services.dispatch_coordinator.coordinator import Coordinator, CoordinatorConfig
from services.dispatch_hub.http_api import GATEWAY
from tests.support import protocol_v1
from tests.support.desktop import dispatch_execution, running_hub
from tests.support.wait import eventually

SECRET = "integration-hub-push-lease-secret-0123456789"


async def _hello_and_replay(hub: TestServer, token: str, *, headers: dict[str, str] | None = None,
                            query: str = "") -> tuple[dict[str, Any], list[bytes]]:
    async with aiohttp.ClientSession() as http, http.ws_connect(
            str(hub.make_url("/api/desktop/ws")) + query,
            headers={"Authorization": f"Bearer {token}", **(headers or {})}) as ws:
        hello = msgspec.json.decode((await ws.receive(timeout=10)).data)
        replay = [(await ws.receive(timeout=10)).data.encode() for _ in range(hello["replayed_available"])]
    return hello, replay


async def _push_lease(pool: AsyncConnectionPool[Conn], client_id: str) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT push_lease FROM desktop_clients WHERE id = %s", (uuid.UUID(client_id),))
        row = await cur.fetchone()
    assert row is not None
    return bool(row["push_lease"])


async def test_push_lease_is_granted_when_asked_and_replayed_with_its_token(
        settings: Settings, amqp: AbstractRobustConnection, pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=2, clients=1, due=False)
        tenant = seed["tenants"][0]
        client = tenant["clients"][0]
        queued = await dispatch_execution(conn, tenant=tenant, platform_id=seed["platforms"][0]["ai_platform_id"],
                                          client_id=client["client_id"])
    async with running_hub(settings, push_lease_enabled=True, push_lease_secret=SECRET,
                           hub_upgrade_burst_per_client=50) as hub:
        hello, _ = await _hello_and_replay(hub, client["token"])
        assert hello["capabilities"] == [] and not await _push_lease(pool, client["client_id"])  # an old client
        hello, _ = await _hello_and_replay(hub, client["token"], headers={CAPABILITIES_HEADER: f"x, {PUSH_LEASE}"})
        assert hello["capabilities"] == [PUSH_LEASE] and await _push_lease(pool, client["client_id"])
        hello, _ = await _hello_and_replay(hub, client["token"])
        assert not await _push_lease(pool, client["client_id"])  # the latest socket decides
        hello, _ = await _hello_and_replay(hub, client["token"], query=f"?capabilities={PUSH_LEASE}")
        assert hello["capabilities"] == [PUSH_LEASE] and await _push_lease(pool, client["client_id"])

        # The queued execution leased as a push would have (the coordinator's statement, as at dispatch): the replay
        # gives it back with the derived token, first; a second reconnect gives the very same token.
        async with pool.connection() as conn:
            leased = await push_leases.issue(conn, [{"id": queued["task_id"]}], key=SECRET.encode(), ttl_s=30)
        assert [lease.task_id for lease in leased] == [queued["task_id"]]
        for _ in range(2):
            hello, replay = await _hello_and_replay(hub, client["token"], headers={CAPABILITIES_HEADER: PUSH_LEASE})
            assert hello["replayed_available"] == 1
            event = msgspec.json.decode(replay[0], type=TaskAvailable)
            assert event.task_id == queued["task_id"] and event.lease_epoch == 1
            assert event.lease_token == push_leases.derive_token(SECRET.encode(), queued["task_id"], 1)
            assert event.question is not None and event.brand is not None and event.platform is not None
            protocol_v1.server_event_decoder.decode(replay[0])  # additive: a 1.0 client still decodes it
    # Push-lease off: nothing granted, and the row follows.
    async with running_hub(settings, hub_upgrade_burst_per_client=50) as hub:
        hello, _ = await _hello_and_replay(hub, client["token"], headers={CAPABILITIES_HEADER: PUSH_LEASE})
        assert hello["capabilities"] == [] and not await _push_lease(pool, client["client_id"])


async def test_a_hub_whose_key_is_not_the_leaders_grants_no_push_lease_and_takes_it_back(
        settings: Settings, amqp: AbstractRobustConnection, pool: AsyncConnectionPool[Conn],
        topology: Topology) -> None:
    """Two secrets (a rotation done in one Deployment only): every token the hub derived would match no lease. The
    leader publishes its key's fingerprint (Coordinator.maintain_once), the hub compares its own on its sweep: on a
    mismatch it grants push_lease to no new socket, takes it back from the clients it holds (so the leader stops
    pushing to them) and says so in `hub_push_lease_key_mismatch`; once the keys agree, push-lease is on again."""
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=1, brands=1, questions=1, clients=1, due=False)
    client = seed["tenants"][0]["clients"][0]
    other = "another-push-lease-secret-rotated-elsewhere-0123456789"
    config = CoordinatorConfig(database_url=settings.database_url, topology=topology, instance_id="leader",
                               push_leases=PushLeaseIssuer(other.encode(), ttl_s=30))
    leader = Coordinator(pool, config)
    async with running_hub(settings, push_lease_enabled=True, push_lease_secret=SECRET,
                           hub_upgrade_burst_per_client=50, hub_revocation_check_s=0.2) as hub:
        gateway = hub.app[GATEWAY]
        async with aiohttp.ClientSession() as http, http.ws_connect(
                str(hub.make_url("/api/desktop/ws")),
                headers={"Authorization": f"Bearer {client['token']}", CAPABILITIES_HEADER: PUSH_LEASE}) as ws:
            hello = msgspec.json.decode((await ws.receive(timeout=10)).data)
            assert hello["capabilities"] == [PUSH_LEASE]  # no leader has published a key: nothing to spoil
            await eventually(lambda: _push_lease(pool, client["client_id"]), message="the capability recorded")

            await leader.maintain_once()  # the leader publishes the other key's fingerprint
            await eventually(lambda: gateway.push_key_mismatch == push_leases.key_fingerprint(other.encode()),
                             message="the hub seeing the leader's other key")
            assert REGISTRY.get_sample_value("hub_push_lease_key_mismatch") == 1
            assert not await _push_lease(pool, client["client_id"])  # taken back from the socket it holds
        hello, _ = await _hello_and_replay(hub, client["token"], headers={CAPABILITIES_HEADER: PUSH_LEASE})
        assert hello["capabilities"] == [] and not await _push_lease(pool, client["client_id"])

        # The rotation finished: the next leader holds the hub's key.
        await Coordinator(pool, replace(config, push_leases=PushLeaseIssuer(SECRET.encode(), ttl_s=30))).maintain_once()
        await eventually(lambda: gateway.push_key_mismatch is None, message="the keys agreeing again")
        assert REGISTRY.get_sample_value("hub_push_lease_key_mismatch") == 0
        hello, _ = await _hello_and_replay(hub, client["token"], headers={CAPABILITIES_HEADER: PUSH_LEASE})
        assert hello["capabilities"] == [PUSH_LEASE] and await _push_lease(pool, client["client_id"])

"""dispatch-hub without I/O: the group-commit batcher, a socket's on-demand writer and its bounds, and the pinger
that pings only silent sockets."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from libs.mq.hub_routing import hub_binding, hub_routing_key
from libs.mq.topology import CLIENT_DISPATCH_KEYS
from services.dispatch_hub.auth import ClientPrincipal
from services.dispatch_hub.batching import Batcher
from services.dispatch_hub.connections import Connection
from services.dispatch_hub.gateway import Gateway
from services.dispatch_hub.logic import client_id_from_routing_key
from tests.support.wait import eventually


class Lookups:
    """A `run` for a Batcher that answers key * 10, records its calls, and can be held mid-call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail: Exception | None = None

    async def __call__(self, keys: list[int]) -> dict[int, int]:
        self.calls.append(keys)
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return {k: k * 10 for k in keys if k >= 0}


async def test_a_lone_key_goes_at_once_and_keys_that_arrive_meanwhile_share_the_next_call() -> None:
    run = Lookups()
    batcher = Batcher(run, default=-1, name="t", max_batch=3)
    assert await batcher.submit(1) == 10
    run.release.clear()
    first = asyncio.create_task(batcher.submit(2))
    await eventually(lambda: len(run.calls) == 2, message="the first call started")
    rest = [asyncio.create_task(batcher.submit(k)) for k in (3, 4, 4, 5, -7)]  # 4 twice, -7 unanswered
    await asyncio.sleep(0)
    run.release.set()
    assert await first == 20
    assert [await t for t in rest] == [30, 40, 40, 50, -1]
    assert run.calls == [[1], [2], [3, 4, 5], [-7]]  # at most max_batch distinct keys a call
    assert (batcher.calls, batcher.largest) == (4, 3)


async def test_a_key_submitted_as_the_last_call_ends_gets_a_call_of_its_own() -> None:
    """The caller a call answered resumes before the call's task is done (its wake-up was scheduled first): a key
    it submits then must start a call, not wait behind the finished one until some later key comes along. The hub
    left the 21 sockets of a reconnect storm's tail waiting for their attach for good this way (the clients'
    locks held, so their reconnects to the same hub waited too)."""
    run = Lookups()
    batcher: Batcher[int, int] = Batcher(run, default=-1, name="test")
    assert await batcher.submit(1) == 10
    async with asyncio.timeout(2):
        assert await batcher.submit(2) == 20
    async with asyncio.timeout(2):
        assert await asyncio.gather(*(batcher.submit(k) for k in (3, 4))) == [30, 40]
    assert run.calls == [[1], [2], [3, 4]]


async def test_a_failed_call_fails_each_of_its_callers_and_the_next_call_runs() -> None:
    run = Lookups()
    batcher = Batcher(run, default=0, name="t")
    run.release.clear()
    run.fail = RuntimeError("database away")
    waiting = [asyncio.create_task(batcher.submit(k)) for k in (1, 2)]
    await asyncio.sleep(0)
    run.release.set()
    for task in waiting:
        with pytest.raises(RuntimeError, match="database away"):
            await task
    run.fail = None
    assert await batcher.submit(3) == 30


async def test_a_caller_that_gives_up_does_not_cancel_the_call_of_the_others() -> None:
    run = Lookups()
    batcher = Batcher(run, default=0, name="t")
    run.release.clear()
    quitter, stayer = asyncio.create_task(batcher.submit(1)), asyncio.create_task(batcher.submit(2))
    await eventually(lambda: len(run.calls) == 1, message="the call started")
    quitter.cancel()
    run.release.set()
    assert await stayer == 20
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await batcher.wait_idle()


class FakeSocket:
    """What a Connection uses of aiohttp's WebSocketResponse; `gate` holds sends back (a slow reader)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.closes: list[int] = []
        self.pings = 0
        self.closed = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def send_str(self, text: str) -> None:
        await self.gate.wait()
        self.sent.append(text)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        self.closes.append(code)
        return True

    async def ping(self, message: bytes = b"") -> None:
        self.pings += 1


def principal() -> ClientPrincipal:
    return ClientPrincipal(client_id=uuid.uuid4(), tenant_id=1, workspace_id=1, user_id=1, token_hash="ab")


def connection(ws: FakeSocket, **kwargs: Any) -> Connection:
    conn = Connection(ws, principal(), **kwargs)  # type: ignore[arg-type]
    conn.start()
    return conn


async def test_a_socket_sends_hello_and_replay_then_what_was_held_back_then_live_events_and_idles_without_a_task(
        ) -> None:
    ws = FakeSocket()
    conn = connection(ws)
    conn.deliver("early")
    assert not conn.writing and ws.sent == []
    conn.go_live(["hello", "replayed"])
    conn.deliver("live")
    await eventually(lambda: len(ws.sent) == 4, message="everything sent")
    assert ws.sent == ["hello", "replayed", "early", "live"]
    await eventually(lambda: not conn.writing, message="the writer task gone once the queue is empty")
    conn.deliver("later")
    await eventually(lambda: ws.sent[-1:] == ["later"], message="a new writer for a new event")


async def test_a_frame_the_socket_takes_at_once_is_written_in_the_callers_turn_without_a_task() -> None:
    """A fan-out's event to a socket whose send buffer has room goes out before `deliver` returns: no task a
    socket (libs/eager.py); only a send that waits leaves a writer task behind, which carries the rest in order."""
    ws = FakeSocket()
    conn = connection(ws)
    conn.go_live(["hello"])
    conn.deliver("live")
    assert ws.sent == ["hello", "live"] and not conn.writing
    ws.gate.clear()  # the socket's send buffer is full: its next send waits
    conn.deliver("waits")
    conn.deliver("queued behind it")
    assert conn.writing and ws.sent == ["hello", "live"]
    ws.gate.set()
    await eventually(lambda: not conn.writing, message="the writer task carried the rest")
    assert ws.sent == ["hello", "live", "waits", "queued behind it"]


async def test_a_replay_larger_than_the_bound_goes_out_but_a_reader_that_far_behind_on_live_events_is_closed(
        ) -> None:
    ws = FakeSocket()
    ws.gate.clear()
    conn = connection(ws, max_outbound=3)
    conn.go_live(["hello", *(f"replayed-{n}" for n in range(5))])  # 6 > 3: still queued
    assert ws.closes == []
    for n in range(3):
        conn.deliver(f"live-{n}")
    await eventually(lambda: ws.closes == [1013], message="closed as too slow")
    assert conn.overflowed
    ws.gate.set()
    await conn.stop()
    assert ws.sent == ["hello", *(f"replayed-{n}" for n in range(5))]  # live events beyond the bound dropped
    conn.deliver("after stop")
    assert not conn.writing


async def test_stop_lets_the_queue_drain_within_its_grace() -> None:
    ws = FakeSocket()
    ws.gate.clear()
    conn = connection(ws)
    conn.go_live(["hello", "one", "two"])
    stopping = asyncio.create_task(conn.stop())
    await asyncio.sleep(0)
    ws.gate.set()
    await stopping
    assert ws.sent == ["hello", "one", "two"]


async def test_the_pinger_pings_only_silent_sockets_and_closes_the_ones_past_the_timeout() -> None:
    gateway = Gateway(None, None, None, hub_id="hub-unit", heartbeat_interval_s=0.05,  # type: ignore[arg-type]
                      heartbeat_timeout_s=30, heartbeat_flush_s=1)
    beating, silent, gone = FakeSocket(), FakeSocket(), FakeSocket()
    conns = {name: connection(ws) for name, ws in (("beating", beating), ("silent", silent), ("gone", gone))}
    conns["beating"].last_seen = time.monotonic() + 60  # heartbeats keep arriving
    conns["silent"].last_seen = time.monotonic() - 1  # answers pings only
    conns["gone"].last_seen = time.monotonic() - 31
    for conn in conns.values():
        gateway._sockets[conn.principal.client_id] = {conn}
    stop = asyncio.Event()
    pinger = asyncio.create_task(gateway.run_pinger(stop))
    await eventually(lambda: silent.pings >= 1 and gone.closes == [4408], message="a round of the pinger")
    stop.set()
    await pinger
    assert beating.pings == 0 and beating.closes == [] and gone.pings == 0


def test_the_hub_queue_binding_takes_every_dispatch_key_routed_to_it_and_none_of_another_hub() -> None:
    client = uuid.uuid4()
    keys = [f"monitor.{lane}.{client}" for lane in ("high", "normal", "retry", "control")] + [f"publish.{client}"]
    for key in keys:
        assert any(_topic_match(pattern, key) for pattern in CLIENT_DISPATCH_KEYS), key
        routed = hub_routing_key("pod-a.1", key)
        assert _hash_match(hub_binding("pod-a.1"), routed), routed
        assert not _hash_match(hub_binding("pod-a"), routed), routed
        assert not _hash_match(hub_binding("pod-b.1"), routed), routed
        assert client_id_from_routing_key(routed) == client_id_from_routing_key(key) == client


def _hash_match(pattern: str, key: str) -> bool:
    """A topic binding ending in `#` (zero or more words), no `*`."""
    prefix = pattern.removesuffix("#")
    return key.startswith(prefix)


def _topic_match(pattern: str, key: str) -> bool:
    """A topic binding without `#`: `*` is exactly one word."""
    words, parts = pattern.split("."), key.split(".")
    return len(words) == len(parts) and all(w in ("*", p) for w, p in zip(words, parts, strict=True))

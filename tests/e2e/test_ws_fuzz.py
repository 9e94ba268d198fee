"""Malformed WebSocket frames against the real dispatch-hub process, next to a well-behaved client of another tenant.

One client sends every kind of bad frame: broken JSON, wrong types, unknown `type`s, binary frames, NUL and other
control characters, deep nesting, oversized and unknown platform_health reports, frames over the 64 KiB limit;
first a fixed list, then frames generated from a seed (tests/support/ws_frames.py). Each one must be answered by an
`error` event naming the problem, and the socket stays usable; only a frame over the 256 KiB transport cap gets a
clean close with 1009. After every frame, a client of another tenant gets its next heartbeat acked: its
`last_heartbeat_at` keeps moving in Postgres, its socket is never closed, and the hub process neither logs an
unhandled exception nor restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from psycopg_pool import AsyncConnectionPool

from libs.config import Settings
from libs.contracts.common import ContractError
from libs.db.pool import Conn
from libs.demo import seed_demo
from services.dispatch_hub.http_api import MAX_WS_FRAME, MAX_WS_MESSAGE, decode_client_message
from tests.support.fuzz_report import error_lines, fuzz_report
from tests.support.procs import ServiceProcess, service_env
from tests.support.wait import eventually
from tests.support.ws_frames import generated_frames, seed_in_use

LIMIT = 64 * 1024
CAP = 256 * 1024
MESSAGE_TOO_BIG = 1009
GOOD_BEAT = json.dumps({"type": "heartbeat", "platform_health": {"openai": "healthy"}})


def _padded(size: int) -> str:
    """A valid heartbeat of exactly `size` bytes (padding in a field the hub ignores)."""
    head, tail = '{"type":"heartbeat","padding":"', '"}'
    return head + "x" * (size - len(head) - len(tail)) + tail


def _nested(depth: int, key: str = "x") -> str:
    return '{"type":"heartbeat","' + key + '":' + "[" * depth + "]" * depth + "}"


def _health(entries: dict[str, Any]) -> str:
    return json.dumps({"type": "heartbeat", "platform_health": entries})


# (what, frame, expected error codes, the field the error must name or None when it names none)
TEXT_CASES: list[tuple[str, str, set[str], str | None]] = [
    ("truncated JSON", '{"type": "heartbeat"', {"invalid_json"}, None),
    ("not JSON", "hello hub", {"invalid_json"}, None),
    ("single quotes", "{'type': 'heartbeat'}", {"invalid_json"}, None),
    ("trailing garbage", '{"type":"heartbeat"} x', {"invalid_json"}, None),
    ("empty frame", "", {"invalid_body"}, None),
    ("blank frame", "   \n", {"invalid_body"}, None),
    ("JSON array", "[1, 2]", {"invalid_field"}, None),
    ("JSON number", "42", {"invalid_field"}, None),
    ("JSON null", "null", {"invalid_field"}, None),
    ("JSON string", '"heartbeat"', {"invalid_field"}, None),
    ("no type", "{}", {"missing_field"}, "type"),
    ("type is a number", '{"type": 5}', {"invalid_field", "unknown_type"}, "type"),
    ("type is null", '{"type": null}', {"invalid_field", "unknown_type"}, "type"),
    ("unknown type", '{"type": "dance"}', {"unknown_type"}, "type"),
    ("a server event's type", '{"type": "hello"}', {"unknown_type"}, "type"),
    ("type in capitals", '{"type": "HEARTBEAT"}', {"unknown_type"}, "type"),
    ("empty type", '{"type": ""}', {"unknown_type"}, "type"),
    ("NUL in type", '{"type": "heart\\u0000beat"}', {"unknown_type", "invalid_field"}, "type"),
    ("sent_at a number", '{"type": "heartbeat", "sent_at": 5}', {"invalid_field"}, "sent_at"),
    ("sent_at not a time", '{"type": "heartbeat", "sent_at": "yesterday"}', {"invalid_field"}, "sent_at"),
    ("queue depth a string", '{"type": "heartbeat", "local_queue_depth": "3"}', {"invalid_field"},
     "local_queue_depth"),
    ("queue depth negative", '{"type": "heartbeat", "local_queue_depth": -1}', {"invalid_field"},
     "local_queue_depth"),
    ("queue depth past int64", '{"type": "heartbeat", "local_queue_depth": 18446744073709551616}',
     {"invalid_field"}, "local_queue_depth"),
    ("queue depth a fraction", '{"type": "heartbeat", "local_queue_depth": 1.5}', {"invalid_field"},
     "local_queue_depth"),
    ("queue depth a boolean", '{"type": "heartbeat", "local_queue_depth": true}', {"invalid_field"},
     "local_queue_depth"),
    ("task id not a UUID", '{"type": "heartbeat", "active_task_id": "task-1"}', {"invalid_field"},
     "active_task_id"),
    ("unknown phase", '{"type": "heartbeat", "execution_phase": "DANCING"}', {"invalid_field"}, "execution_phase"),
    ("health is a list", '{"type": "heartbeat", "platform_health": ["openai"]}', {"invalid_field"},
     "platform_health"),
    ("health state a number", _health({"openai": 5}), {"invalid_field"}, "platform_health"),
    ("unknown health state", _health({"openai": "sunny"}), {"invalid_field"}, "platform_health"),
    ("unknown platform code", _health({"myspace": "healthy"}), {"unknown_platform"}, "platform_health"),
    ("platform code in capitals", _health({"OpenAI": "healthy"}), {"invalid_field", "unknown_platform"},
     "platform_health"),
    ("hundreds of platforms", _health({f"p{i}": "healthy" for i in range(300)}), {"invalid_field"},
     "platform_health"),
    ("hundreds of unknown codes, valid states", _health({f"platform-{i}": "degraded" for i in range(60)}),
     {"invalid_field", "unknown_platform"}, "platform_health"),
    ("NUL in a health state", _health({"openai": "healthy\u0000"}), {"invalid_field"}, "platform_health"),
    ("NUL in a platform code", _health({"open\u0000ai": "healthy"}), {"invalid_field"}, "platform_health"),
    ("escape char in a state", _health({"openai": "healthy\u001b[31m"}), {"invalid_field"}, "platform_health"),
    ("DEL in a code", _health({"openai\u007f": "healthy"}), {"invalid_field"}, "platform_health"),
    ("newline in a code", _health({"open\nai": "healthy"}), {"invalid_field"}, "platform_health"),
    ("raw control char in a string", '{"type": "heartbeat", "execution_phase": "WAIT\x01ING"}', {"invalid_json"},
     None),
    ("raw NUL byte", '{"type": "heartbeat"}\x00', {"invalid_json"}, None),
    ("lone surrogate", '{"type": "heartbeat", "execution_phase": "\\ud800"}', {"invalid_json", "invalid_field"},
     None),
    ("deeply nested unknown field", _nested(20_000), {"invalid_json"}, None),
    ("deeply nested health", '{"type":"heartbeat","platform_health":' + '{"a":' * 5000 + "1" + "}" * 5000 + "}",
     {"invalid_json", "invalid_field"}, None),
    ("deeply nested array", "[" * 30_000 + "]" * 30_000, {"invalid_json", "invalid_field"}, None),
    ("exactly at the limit but not a heartbeat", '{"type":"nope","padding":"' + "x" * (LIMIT - 28) + '"}',
     {"unknown_type"}, "type"),
]
BINARY_CASES: list[tuple[str, bytes]] = [
    ("binary bytes", b"\x00\x01\x02\xff"),
    ("binary JSON heartbeat", GOOD_BEAT.encode()),
    ("empty binary frame", b""),
    ("binary over the limit", b"\x00" * (LIMIT + 1)),
]
# Over the 64 KiB message limit but within the transport cap: an error event, the socket stays open.
TOO_LARGE_CASES: list[tuple[str, str]] = [
    ("a valid heartbeat one byte over the limit", _padded(LIMIT + 1)),
    ("text far over the limit", "x" * (3 * LIMIT)),
    ("a heartbeat of exactly the transport cap", _padded(CAP)),
]
# Over the transport cap: refused from the frame's header, a clean close with 1009.
OVER_CAP_CASES: list[tuple[str, str | bytes]] = [
    ("text one byte over the cap", _padded(CAP + 1)),
    ("text far over the cap", "x" * (4 * CAP)),
    ("binary over the cap", b"\x00" * (CAP + 1)),
]


@dataclass
class GoodClient:
    """The well-behaved neighbour: heartbeats every `period_s`, each must be acked within a few seconds."""

    ws: aiohttp.ClientWebSocketResponse
    period_s: float = 0.01
    acks: int = 0
    problems: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.ws.send_str(GOOD_BEAT)
            while True:
                msg = await self.ws.receive(timeout=5)
                if msg.type != aiohttp.WSMsgType.TEXT:
                    self.problems.append(f"good client got {msg.type.name} {msg.data!r} {msg.extra!r}")
                    return
                event = json.loads(msg.data)
                if event["type"] == "heartbeat_ack":
                    self.acks += 1
                    break
                if event["type"] == "error":
                    self.problems.append(f"good client's heartbeat refused: {event}")
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)


@pytest.fixture
def hub_process(settings: Settings, tmp_path: Path) -> Iterator[ServiceProcess]:
    # Fast heartbeat writes (flushed every 0.2 s, a client's liveness rewritten at most once per ping interval), so
    # the good client's last_heartbeat_at visibly moves during the few seconds of fuzzing; the bad client
    # reconnects after each frame over the transport cap, within its upgrade budget.
    env = service_env(settings, HUB_HEARTBEAT_FLUSH_S="0.2", HUB_PING_INTERVAL_S="0.25",
                      HUB_UPGRADE_BURST_PER_CLIENT=20)
    proc = ServiceProcess("dispatch-hub", env, log_dir=tmp_path)
    proc.start()
    try:
        yield proc
    finally:
        code = proc.stop()
    assert code == 0, proc.logs()[-3000:]


async def _next_reply(ws: aiohttp.ClientWebSocketResponse) -> aiohttp.WSMessage | dict[str, Any]:
    """The hub's answer to the last frame: an error event or an ack (dispatch events in between are skipped),
    or the closing message."""
    while True:
        msg = await ws.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return msg
        event: dict[str, Any] = json.loads(msg.data)
        if event["type"] in ("error", "heartbeat_ack"):
            return event


async def _heartbeat_at(pool: AsyncConnectionPool[Conn], client_id: str) -> datetime:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT last_heartbeat_at FROM desktop_clients WHERE id = %s", (client_id,))
        row = await cur.fetchone()
    assert row is not None and row["last_heartbeat_at"] is not None
    return row["last_heartbeat_at"]  # type: ignore[no-any-return]


async def test_malformed_frames_get_errors_and_never_disturb_another_tenant(
        hub_process: ServiceProcess, pool: AsyncConnectionPool[Conn], request: pytest.FixtureRequest) -> None:
    async with pool.connection() as conn:
        seed = await seed_demo(conn, tenants=2, clients=1, due=False)
    bad, good = (t["clients"][0] for t in seed["tenants"])
    pid = hub_process.proc.pid if hub_process.proc else None
    url = hub_process.url + "/api/desktop/ws"
    generated = generated_frames()
    sent: Counter[str] = Counter()
    neighbour_checks = 0
    problems: list[str] = []

    async with aiohttp.ClientSession() as http:
        async def connect(token: str) -> aiohttp.ClientWebSocketResponse:
            ws = await http.ws_connect(url, headers={"Authorization": f"Bearer {token}"}, max_msg_size=0)
            hello = json.loads((await ws.receive(timeout=10)).data)
            assert hello["type"] == "hello", hello
            return ws

        good_client = GoodClient(await connect(good["token"]))
        stop = asyncio.Event()
        good_task = asyncio.create_task(good_client.run(stop))
        first_beat = await eventually(lambda: _heartbeat_at(pool, good["client_id"]), timeout=10,
                                      message="the good client's first heartbeat written")
        beats_seen = {first_beat}

        async def watch_heartbeats() -> None:
            while not stop.is_set():
                beats_seen.add(await _heartbeat_at(pool, good["client_id"]))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)

        watcher = asyncio.create_task(watch_heartbeats())
        ws = await connect(bad["token"])
        acks_before = good_client.acks

        async def neighbour_served(after: str) -> None:
            """The other tenant's next heartbeat is acked after each bad frame (so they interleave)."""
            nonlocal neighbour_checks
            neighbour_checks += 1
            target = good_client.acks + 1
            try:
                await eventually(lambda: good_client.acks >= target or bool(good_client.problems), timeout=5,
                                 interval=0.005, message="the good client's next ack")
            except AssertionError:
                problems.append(f"after {after}: the good client's heartbeat was not acked within 5 s")

        async def exchange(kind: str, what: str, frame: str | bytes) -> aiohttp.WSMessage | dict[str, Any]:
            """One frame and the hub's answer to it, then the neighbour's next ack: every frame sent goes
            through here, so each is followed by its own neighbour check."""
            await (ws.send_str(frame) if isinstance(frame, str) else ws.send_bytes(frame))
            sent[kind] += 1
            reply = await _next_reply(ws)
            await neighbour_served(what)
            return reply

        async def expect_error(kind: str, what: str, frame: str | bytes, codes: set[str] | frozenset[str],
                               named: str | None) -> None:
            nonlocal ws
            reply = await exchange(kind, what, frame)
            if not isinstance(reply, dict) or reply["type"] != "error":
                problems.append(f"{what}: expected an error event, got {reply!r}")
                if not isinstance(reply, dict):
                    ws = await connect(bad["token"])
                return
            if reply["error"] not in codes or not reply.get("message"):
                problems.append(f"{what}: error {reply['error']!r} ({reply.get('message')!r}), expected {codes}")
            if named is not None and not str(reply.get("field") or "").startswith(named):
                problems.append(f"{what}: the error names field {reply.get('field')!r}, expected {named!r}")

        try:
            for what, frame, codes, named in TEXT_CASES:
                await expect_error("text", what, frame, codes, named)
            for what, data in BINARY_CASES:
                await expect_error("binary", what, data, {"invalid_message"}, "type")
            # The socket still works: a valid heartbeat at exactly the limit is acked.
            what = f"a valid heartbeat of exactly {LIMIT} bytes"
            reply = await exchange("text", what, _padded(LIMIT))
            if not isinstance(reply, dict) or reply["type"] != "heartbeat_ack":
                problems.append(f"{what}: expected an ack, got {reply!r}")
            for what, big in TOO_LARGE_CASES:
                await expect_error("over the limit", what, big, {"frame_too_large"}, None)
            for case in generated:
                await expect_error("generated", f"generated {case.kind} {case.frame!r:.160}", case.frame, case.codes,
                                   case.named)
            for what, huge in OVER_CAP_CASES:
                if ws.closed:
                    problems.append(f"before {what}: the socket was closed ({ws.close_code})")
                    ws = await connect(bad["token"])
                reply = await exchange("over the cap", what, huge)
                if isinstance(reply, dict) or reply.type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED) \
                        or ws.close_code != MESSAGE_TOO_BIG:
                    problems.append(f"{what}: expected a close with {MESSAGE_TOO_BIG}, got {reply!r} "
                                    f"(close code {ws.close_code})")
                await ws.close()
                ws = await connect(bad["token"])
            await ws.send_str(GOOD_BEAT)
            reply = await _next_reply(ws)
            if not isinstance(reply, dict) or reply["type"] != "heartbeat_ack":
                problems.append(f"the bad client's own valid heartbeat afterwards: got {reply!r}")
            acks_during, beats_during = good_client.acks - acks_before, len(beats_seen)
            # The good client's heartbeats keep landing in Postgres after the fuzzing, too.
            last = max(beats_seen)
            await eventually(lambda: _newer(pool, good["client_id"], last), timeout=10,
                             message="a good heartbeat written after the fuzzing")
        finally:
            stop.set()
            await asyncio.gather(good_task, watcher, return_exceptions=True)
            await ws.close()
            good_closed = good_client.ws.closed
            await good_client.ws.close()

    total = sum(sent.values())
    kinds = ", ".join(f"{n} {kind}" for kind, n in sent.items())
    generated_kinds = ", ".join(f"{n} {kind}" for kind, n in Counter(case.kind for case in generated).items())
    fuzz_report(request.config).add("websocket fuzz (dispatch-hub)", (
        f"{total} malformed or boundary frames sent ({kinds}), {len(problems)} answered wrongly; "
        f"the generated ones from seed {seed_in_use()} (WS_FUZZ_SEED): {generated_kinds}; "
        f"the other tenant's client meanwhile: {acks_during} heartbeats acked, {neighbour_checks} of them checked "
        f"one by one after each frame, {beats_during} distinct last_heartbeat_at values, socket "
        f"{'closed' if good_closed else 'open'} throughout"))
    assert not problems, "\n".join(problems)
    assert not good_client.problems, good_client.problems
    assert not good_closed, "the good client's socket was closed"
    assert neighbour_checks == total, (neighbour_checks, sent)
    assert acks_during >= total and beats_during >= 3, (acks_during, total, sorted(beats_seen))
    assert hub_process.proc is not None and hub_process.proc.poll() is None and hub_process.proc.pid == pid
    assert error_lines(hub_process.logs()) == []


async def _newer(pool: AsyncConnectionPool[Conn], client_id: str, than: datetime) -> bool:
    return await _heartbeat_at(pool, client_id) > than


def test_the_cases_are_distinct_and_fit_the_limit() -> None:
    whats = ([c[0] for c in TEXT_CASES] + [c[0] for c in BINARY_CASES] + [c[0] for c in TOO_LARGE_CASES]
             + [c[0] for c in OVER_CAP_CASES])
    assert len(whats) == len(set(whats))
    assert all(len(frame.encode()) <= LIMIT for _, frame, _, _ in TEXT_CASES)
    assert len(_padded(LIMIT).encode()) == LIMIT and len(_padded(CAP).encode()) == CAP
    assert all(LIMIT < len(frame.encode()) <= CAP for _, frame in TOO_LARGE_CASES)
    assert all(len(frame.encode() if isinstance(frame, str) else frame) > CAP for _, frame in OVER_CAP_CASES)
    assert (LIMIT, CAP) == (MAX_WS_MESSAGE, MAX_WS_FRAME)


def test_the_generated_frames_are_what_they_claim() -> None:
    """Offline, against the hub's own decoder: each generated frame fits the limit, is malformed, and gets the
    error its kind expects (so the run against the process checks the process, not the generator)."""
    frames = generated_frames()
    by_kind = Counter(frame.kind for frame in frames)
    assert len(by_kind) == 7 and min(by_kind.values()) >= 8, by_kind
    for frame in frames:
        if isinstance(frame.frame, bytes):
            assert frame.codes == {"invalid_message"}
            continue
        assert len(frame.frame.encode()) <= LIMIT, (frame.kind, len(frame.frame.encode()))
        with pytest.raises(ContractError) as refused:
            decode_client_message(frame.frame)
        assert refused.value.code in frame.codes, (frame, refused.value.code, refused.value.message)
        assert frame.named is None or str(refused.value.field or "").startswith(frame.named), (
            frame, refused.value.field)


def test_the_generated_frames_are_the_same_for_the_same_seed() -> None:
    assert generated_frames(4) == generated_frames(4)

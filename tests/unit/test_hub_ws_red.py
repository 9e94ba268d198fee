"""A desktop socket's RED metrics (services/dispatch_hub/connections.py) without a network: a failed send is counted
(and what was queued behind it dropped), live frames are timed from their arrival, the hello once, and a close is
counted by how the socket ended: the hub's own code first, a dropped socket as 1006, normal and deliberate codes not
at all, a client's unknown code as "other", each socket once."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import REGISTRY

from libs.telemetry import metrics
from services.dispatch_hub import gateway
from services.dispatch_hub.connections import ABNORMAL_CODES, NORMAL_CLOSES, Connection
from tests.support.wait import eventually
from tests.unit.test_hub_batching import FakeSocket, connection


class FailingSocket(FakeSocket):
    """A socket whose peer is gone: every send fails as aiohttp's does on a closing transport."""

    close_code: int | None = None

    async def send_str(self, text: str) -> None:
        raise ConnectionResetError("Cannot write to closing transport")


def _count(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_a_failed_send_is_counted_once_and_drops_what_was_queued_behind_it() -> None:
    before = metrics.desktop_ws_send_failures_total.value()
    delivered = _count("desktop_ws_delivery_seconds_count")
    conn = connection(FailingSocket())
    conn.go_live(["hello", "replayed"])
    conn.deliver("live", time.monotonic())
    await eventually(lambda: not conn.writing, message="the writer gave up")
    assert metrics.desktop_ws_send_failures_total.value() == before + 1
    assert _count("desktop_ws_delivery_seconds_count") == delivered, "nothing was delivered"


async def test_live_frames_are_timed_from_their_arrival_and_the_hello_once() -> None:
    delivered, hellos = _count("desktop_ws_delivery_seconds_count"), _count("desktop_ws_hello_seconds_count")
    delivered_s = _count("desktop_ws_delivery_seconds_sum")
    ws = FakeSocket()
    conn = connection(ws)
    conn.deliver("held live event", time.monotonic() - 2.0)  # arrived 2 s ago, held until the hello went out
    conn.go_live(["hello", "replayed"])
    conn.deliver("an ack the hub made")
    await eventually(lambda: len(ws.sent) == 4, message="everything sent")
    assert _count("desktop_ws_hello_seconds_count") == hellos + 1
    assert _count("desktop_ws_delivery_seconds_count") == delivered + 1
    assert 2.0 <= _count("desktop_ws_delivery_seconds_sum") - delivered_s < 10
    conn.go_live(["not a second hello"])
    await eventually(lambda: len(ws.sent) == 5, message="sent")
    assert _count("desktop_ws_hello_seconds_count") == hellos + 1


def _closed(code: int | None, *, hub: int | None = None) -> Connection:
    ws: Any = FakeSocket()
    ws.close_code = code
    conn = connection(ws)
    conn.closed_with = hub
    return conn


def test_closes_are_counted_by_how_the_socket_ended() -> None:
    codes = ("1006", "1009", "1013", "4408", "other", "1000", "1001", "4401", "4403", "4409")
    before = {c: metrics.desktop_ws_abnormal_closes_total.value(code=c) for c in codes}
    expected = dict(before)
    for code, hub, counted in [
        (1000, None, None), (1001, None, None), (None, None, "1006"), (1009, None, "1009"), (3999, None, "other"),
        (1000, 4408, "4408"),  # the hub closed a silent client: its code, whatever the client replied
        (1006, 4409, None), (1000, 4401, None), (1000, 4403, None), (None, 1001, None), (1000, 1013, "1013"),
    ]:
        conn = _closed(code, hub=hub)
        conn.count_close()
        conn.count_close()  # once per socket
        if counted is not None:
            expected[counted] += 1
    assert {c: metrics.desktop_ws_abnormal_closes_total.value(code=c) for c in codes} == expected


def test_the_hubs_close_codes_are_in_the_right_set() -> None:
    assert {gateway.GOING_AWAY, gateway.TOKEN_ROTATED_CLOSE, gateway.CLIENT_DISABLED_CLOSE,
            gateway.REPLACED_CLOSE} <= NORMAL_CLOSES
    assert gateway.HEARTBEAT_TIMEOUT_CLOSE in ABNORMAL_CODES and not NORMAL_CLOSES & ABNORMAL_CODES

"""`bench hub_scale`'s simulated load balancer (bench/hub_scale_client.py `Fleet.other_hub`)."""

from __future__ import annotations

from bench.hub_scale_client import Fleet, Socket


def test_the_simulated_load_balancer_sends_a_drained_or_refused_desktop_to_any_other_hub() -> None:
    # A Kubernetes Service picks any ready endpoint: never the hub that refused or drained the desktop, and every
    # other hub in turn (always the next one piled a rolling restart's clients onto the last replica).
    fleet = Fleet([f"http://127.0.0.1:{9000 + k}" for k in range(4)], [])
    for hub in range(4):
        picks = {fleet.other_hub(hub) for _ in range(200)}
        assert picks == set(range(4)) - {hub}
    assert Fleet(["http://127.0.0.1:9000"], []).other_hub(0) == 0


async def test_a_socket_that_ended_does_not_clear_its_desktops_next_socket() -> None:
    # A drain's close frame ends the socket; its transport's connection_lost can come after the desktop's next
    # socket had its hello and replay: the desktop stays ready (the benchmark waited for 22 such "missing" clients).
    fleet = Fleet(["http://127.0.0.1:9000"], ["token"])
    [desktop] = fleet.desktops
    old = Socket(fleet, desktop, "127.0.0.1:9000")
    old.upgraded = True
    old._end("closed")
    assert await old.done == "closed"
    desktop.connected, desktop.ready_at = True, 123.0  # the next socket, ready
    old.connection_lost(None)
    assert (desktop.connected, desktop.ready_at) == (True, 123.0)

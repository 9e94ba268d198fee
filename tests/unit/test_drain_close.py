"""The draining hub's close reason round-trips its reconnect delay; anything else names none."""

from libs.contracts.wire import draining_close_reason, reconnect_delay_ms


def test_the_drain_reason_names_its_delay() -> None:
    for delay in (0, 1, 2500, 600_000):
        assert reconnect_delay_ms(draining_close_reason(delay)) == delay
    assert reconnect_delay_ms(draining_close_reason(-5)) == 0


def test_a_reason_that_is_not_a_drain_names_no_delay() -> None:
    for reason in ("", "server shutting down", "draining; reconnect after soon", "draining; reconnect after 5 s",
                   "reconnect after 100 ms", "draining; reconnect after -3 ms"):
        assert reconnect_delay_ms(reason) is None, reason

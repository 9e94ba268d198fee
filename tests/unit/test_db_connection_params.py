"""libs.db.pool: what every connection gets on top of DATABASE_URL, and the pools' capped reconnect schedule."""

from __future__ import annotations

import pytest
from psycopg.conninfo import make_conninfo

from libs.config import ConfigError, Settings
from libs.db.pool import CappedBackoff, LifoConnectionPool, connection_params, make_pool

URL = "postgresql://u@db:5432/monitoring"


def test_every_connection_gets_keepalives_timeouts_and_server_keepalives() -> None:
    params = connection_params(URL, Settings())
    assert {k: params[k] for k in ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count",
                                   "tcp_user_timeout", "connect_timeout")} == {
        "keepalives": 1, "keepalives_idle": 4, "keepalives_interval": 2, "keepalives_count": 3,
        "tcp_user_timeout": 10_000, "connect_timeout": 5}
    assert params["options"].split(" -c ") == [
        "-c statement_timeout=30000", "lock_timeout=10000", "idle_in_transaction_session_timeout=60000",
        "tcp_keepalives_idle=4", "tcp_keepalives_interval=2", "tcp_keepalives_count=3", "tcp_user_timeout=10000"]


def test_server_keepalives_follow_the_setting_unless_asked_for() -> None:
    off = Settings(db_server_keepalive=False)
    assert "tcp_keepalives_idle" not in connection_params(URL, off)["options"]
    assert "tcp_keepalives_idle=4" in connection_params(URL, off, server_keepalive=True)["options"]
    assert "tcp_keepalives_idle" not in connection_params(URL, Settings(), server_keepalive=False)["options"]


def test_what_the_url_sets_itself_wins() -> None:
    url = URL + "?connect_timeout=30&keepalives_idle=60&options=-c%20statement_timeout%3D0"
    params = connection_params(url, Settings())
    assert "connect_timeout" not in params and "keepalives_idle" not in params
    assert params["keepalives_interval"] == 2
    # After ours: Postgres applies `-c` in order, so the URL's statement_timeout is the one in force.
    assert params["options"].startswith("-c statement_timeout=30000 ")
    assert params["options"].endswith(" -c statement_timeout=0")


def test_a_multi_host_url_keeps_its_hosts_for_libpq() -> None:
    url = "postgresql://u@h1:5432,h2:5433/monitoring?target_session_attrs=read-write"
    params = connection_params(url, Settings())
    assert "host" not in params and "port" not in params and "target_session_attrs" not in params
    # ensure_database (libs/db/migrate.py) swaps the database name of such a URL, keeping both hosts.
    admin = make_conninfo(url, dbname="postgres")
    assert "h1,h2" in admin and "5432,5433" in admin and "target_session_attrs=read-write" in admin


def test_the_pool_reconnects_on_a_capped_schedule_and_never_gives_up() -> None:
    pool = make_pool(Settings(db_reconnect_max_delay_ms=1000), name="unit")
    assert isinstance(pool, LifoConnectionPool)
    assert pool.reconnect_timeout == float("inf") and pool.max_reconnect_delay == 1.0
    attempt = CappedBackoff(timeout=pool.reconnect_timeout, max_delay=pool.max_reconnect_delay)
    delays = []
    for step in range(40):
        attempt.update_delay(float(step))
        delays.append(attempt.delay)
        assert not attempt.time_to_give_up(float(step) + 1e6)
    assert 0.15 <= delays[0] <= 0.25
    assert all(0.0 < d <= 1.0 for d in delays)
    assert all(d >= 0.5 for d in delays[3:])


@pytest.mark.parametrize("name", ["DB_CONNECT_TIMEOUT_S", "DB_KEEPALIVES_IDLE_S", "DB_KEEPALIVES_COUNT",
                                  "DB_RECONNECT_MAX_DELAY_MS"])
def test_liveness_settings_must_be_positive(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env(env={name: "0"})


def test_broker_urls_ask_for_a_short_heartbeat_unless_they_name_one() -> None:
    from libs.mq.connection import with_heartbeat

    assert with_heartbeat("amqp://guest:guest@mq:5672/", 5) == "amqp://guest:guest@mq:5672/?heartbeat=5"
    assert with_heartbeat("amqp://mq/vhost?heartbeat=30", 5) == "amqp://mq/vhost?heartbeat=30"


def test_migrations_can_do_without_the_session_timeouts() -> None:
    params = connection_params(URL, Settings(), with_session_timeouts=False)
    assert "statement_timeout" not in params["options"] and "tcp_keepalives_idle=4" in params["options"]
    assert params["keepalives"] == 1
    bare = connection_params(URL, Settings(), with_session_timeouts=False, server_keepalive=False)
    assert "options" not in bare


def test_the_psycopg_pool_internals_the_pool_overrides_are_still_there() -> None:
    """LifoConnectionPool overrides two private methods of psycopg_pool (pinned in constraints.txt); an upgrade
    that renames them would silently bring back FIFO hand-out and the uncapped backoff."""
    import inspect

    from psycopg_pool import AsyncConnectionPool
    from psycopg_pool.base import AttemptWithBackoff

    assert list(inspect.signature(AsyncConnectionPool._add_connection).parameters) == ["self", "attempt", "growing"]
    assert list(inspect.signature(AsyncConnectionPool._get_ready_connection).parameters) == ["self", "timeout"]
    assert {"update_delay", "time_to_give_up", "INITIAL_DELAY"} <= set(vars(AttemptWithBackoff))

"""The hot-path settings cache (libs.dispatch_settings.SettingsCache) against real Postgres."""

from __future__ import annotations

from libs.dispatch_settings import SettingsCache, set_setting
from tests.support.wait import eventually


async def test_a_stale_value_is_served_at_once_while_one_background_reread_catches_up(pool) -> None:
    cache = SettingsCache(pool, max_age_s=0.0)  # every read after the first finds its value stale
    before = (await cache.get()).dispatch_tick_ms  # the first read waits for the database
    async with pool.connection() as conn:
        await set_setting(conn, "dispatch_tick_ms", before + 1)
    assert (await cache.get()).dispatch_tick_ms == before  # no wait: the old value, a re-read started
    await eventually(lambda: _tick(cache, before + 1), message="the re-read value served")


async def test_without_a_pool_a_stale_value_is_reread_on_the_callers_connection(pool) -> None:
    cache = SettingsCache(max_age_s=0.0)
    async with pool.connection() as conn:
        before = (await cache.get(conn)).dispatch_tick_ms
        await set_setting(conn, "dispatch_tick_ms", before + 1)
        assert (await cache.get(conn)).dispatch_tick_ms == before + 1


async def _tick(cache: SettingsCache, expected: int) -> bool:
    return (await cache.get()).dispatch_tick_ms == expected


"""Settings.from_env: the dispatch-hub timing settings are typed, defaulted and validated; OPS_API_TOKEN is checked
like the gateway secret."""

from __future__ import annotations

import pytest

from libs.config import ConfigError, Settings

HUB_VARS = ("HUB_PING_INTERVAL_S", "HUB_HEARTBEAT_FLUSH_S", "HUB_RESULT_CONFIRM_TIMEOUT_S")


def test_hub_settings_parse_from_their_variables() -> None:
    settings = Settings.from_env(env={"HUB_PING_INTERVAL_S": "0.5", "HUB_HEARTBEAT_FLUSH_S": "0.3",
                                      "HUB_RESULT_CONFIRM_TIMEOUT_S": "7"})
    assert settings.hub_ping_interval_s == 0.5
    assert settings.hub_heartbeat_flush_s == 0.3
    assert settings.hub_result_confirm_timeout_s == 7.0


def test_hub_settings_defaults() -> None:
    settings = Settings.from_env(env={})
    assert settings.hub_ping_interval_s == 10.0
    assert settings.hub_heartbeat_flush_s == 2.0
    assert settings.hub_result_confirm_timeout_s == 5.0


@pytest.mark.parametrize(("timeout", "interval"), [("3", 1.0), ("12", 4.0), ("90", 30.0)])
def test_ping_interval_follows_heartbeat_timeout_when_unset(timeout: str, interval: float) -> None:
    settings = Settings.from_env(env={"HEARTBEAT_TIMEOUT_SECONDS": timeout})
    assert settings.hub_ping_interval_s == interval
    explicit = Settings.from_env(env={"HEARTBEAT_TIMEOUT_SECONDS": timeout, "HUB_PING_INTERVAL_S": "0.25"})
    assert explicit.hub_ping_interval_s == 0.25


@pytest.mark.parametrize("name", HUB_VARS)
@pytest.mark.parametrize("raw", ["soon", "", "1s"])
def test_hub_setting_that_is_not_a_number_is_rejected(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^environment variable {name}='{raw}' is not a valid float$"):
        Settings.from_env(env={name: raw})


@pytest.mark.parametrize("name", HUB_VARS)
@pytest.mark.parametrize("raw", ["0", "-1.5", "nan", "inf"])
def test_hub_setting_that_is_not_positive_is_rejected(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}=\S+ must be a positive number of seconds$"):
        Settings.from_env(env={name: raw})


OPS_TOKEN = "Zq4v8NwLx2Rk7Tj0Hs5Bm3Yc9Pd1Gf6A"  # 32 random-looking bytes


@pytest.mark.parametrize("token", [
    "x",
    OPS_TOKEN[:-1],
    "REPLACE_ME_WITH_OUTPUT_OF_OPENSSL_RAND_HEX_32",  # deploy/k8s/base/secret.example.yaml's placeholder
    "dev-only-compose-ops-token-0123456789",
    "please-change-me-0123456789abcdefghij",
    "an-example-ops-token-0123456789abcdefgh",
], ids=["one-char", "31-bytes", "k8s-placeholder", "dev-only", "change-me", "example"])
def test_a_short_or_placeholder_ops_token_is_refused_outside_dev_mode(token: str) -> None:
    with pytest.raises(ConfigError, match=r"^OPS_API_TOKEN "):
        Settings.from_env(env={"OPS_API_TOKEN": token}).ops_token()
    assert Settings.from_env(env={"OPS_API_TOKEN": token, "DEV_MODE": "1"}).ops_token() == token


def test_a_real_ops_token_is_accepted_and_an_unset_one_disables_the_ops_api() -> None:
    assert Settings.from_env(env={"OPS_API_TOKEN": OPS_TOKEN}).ops_token() == OPS_TOKEN
    assert Settings.from_env(env={}).ops_token() == ""  # the ops routes answer 403 ops_api_disabled


def test_collect_now_tenant_gate_settings_parse_and_default() -> None:
    defaults = Settings.from_env(env={})
    assert (defaults.collect_now_tenant_max_in_flight, defaults.collect_now_tenant_wait_ms,
            defaults.collect_now_lock_wait_ms) == (2, 1000, 1000)
    tuned = Settings.from_env(env={"COLLECT_NOW_TENANT_MAX_IN_FLIGHT": "3", "COLLECT_NOW_TENANT_WAIT_MS": "250",
                                   "COLLECT_NOW_LOCK_WAIT_MS": "400"})
    assert (tuned.collect_now_tenant_max_in_flight, tuned.collect_now_tenant_wait_ms,
            tuned.collect_now_lock_wait_ms) == (3, 250, 400)


@pytest.mark.parametrize(("name", "raw"), [
    ("COLLECT_NOW_TENANT_MAX_IN_FLIGHT", "0"), ("COLLECT_NOW_TENANT_MAX_IN_FLIGHT", "65"),
    ("COLLECT_NOW_TENANT_WAIT_MS", "0"), ("COLLECT_NOW_TENANT_WAIT_MS", "60001"),
    ("COLLECT_NOW_LOCK_WAIT_MS", "0"),  # lock_timeout 0 would wait for ever
    ("COLLECT_NOW_LOCK_WAIT_MS", "-5"), ("COLLECT_NOW_LOCK_WAIT_MS", "60001"),
])
def test_collect_now_tenant_gate_settings_out_of_range_are_refused(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}={raw} must be from \d+ to \d+$"):
        Settings.from_env(env={name: raw})


def test_the_projection_event_path_settings_come_from_the_environment() -> None:
    defaults = Settings.from_env(env={})
    assert (defaults.projection_event_batch, defaults.projection_refused_hold_seconds) == (20, 60.0)
    settings = Settings.from_env(env={"PROJECTION_EVENT_BATCH": "5", "PROJECTION_REFUSED_HOLD_SECONDS": "2.5"})
    assert (settings.projection_event_batch, settings.projection_refused_hold_seconds) == (5, 2.5)


@pytest.mark.parametrize("raw", ["4", "3601", "-1"])
def test_hub_gc_full_collection_interval_out_of_range_is_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"^HUB_GC_FULL_COLLECTION_S must be 0 "):
        Settings.from_env(env={"HUB_GC_FULL_COLLECTION_S": raw})


def test_the_hub_can_leave_full_collections_to_cpython() -> None:
    assert Settings.from_env(env={}).hub_gc_full_collection_s == 600.0
    assert Settings.from_env(env={"HUB_GC_FULL_COLLECTION_S": "0"}).hub_gc_full_collection_s == 0.0

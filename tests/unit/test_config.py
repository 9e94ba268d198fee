"""Settings.from_env: the dispatch-hub timing settings are typed, defaulted and validated."""

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

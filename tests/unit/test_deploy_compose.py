"""docker-compose.yml: valid against the Compose Specification schema (vendored, offline), and it
runs every service of libs/config.py SERVICE_PORTS with its console script, port and start-up
ordering, within Postgres' max_connections, as a development stack (DEV_MODE)."""

from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from libs.config import SERVICE_PORTS, Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_SCHEMA = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
REQUIRED_ENV = {"DATABASE_URL", "AMQP_URL", "GATEWAY_JWT_SECRET", "OPS_API_TOKEN", "DEV_MODE", "INGEST_SHARDS"}
BACKENDS = {"postgres": "postgres:15", "rabbitmq": "rabbitmq:3.10-management"}
DEDICATED_CONNECTIONS_PER_SERVICE = 2  # LISTEN + leader advisory lock, outside the pool
OPERATOR_HEADROOM = 20  # monitorctl, psql, `--scale` of one service


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _console_scripts() -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        scripts: dict[str, str] = tomllib.load(fh)["project"]["scripts"]
    return scripts


def _errors(doc: dict[str, Any]) -> list[str]:
    validator_class = jsonschema.validators.validator_for(COMPOSE_SCHEMA)
    validator_class.check_schema(COMPOSE_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator_class(COMPOSE_SCHEMA).iter_errors(doc)]


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_compose_file_validates_against_the_compose_spec() -> None:
    assert _errors(_compose()) == []


def test_schema_validation_catches_mistakes() -> None:
    typo = copy.deepcopy(_compose())
    typo["services"]["dispatch-hub"]["comand"] = ["dispatch-hub"]
    assert any("comand" in e for e in _errors(typo))
    bad_condition = copy.deepcopy(_compose())
    bad_condition["services"]["reconciler"]["depends_on"]["migrate"]["condition"] = "service_done"
    assert _errors(bad_condition)


def test_backends_are_pinned_and_healthchecked() -> None:
    services = _compose()["services"]
    for name, image in BACKENDS.items():
        assert services[name]["image"] == image
        assert services[name]["healthcheck"]["test"]
    assert "max_connections=100" in services["postgres"]["command"]


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_every_service_runs_its_console_script_on_its_port(service: str) -> None:
    spec = _compose()["services"][service]
    assert spec["command"] == [service]
    assert service in _console_scripts()
    assert spec["build"]["dockerfile"] == "Dockerfile"
    published = [str(p) for p in spec["ports"]]
    assert any(p.endswith(f":{SERVICE_PORTS[service]}") for p in published), published
    readiness = " ".join(spec["healthcheck"]["test"])
    assert f"127.0.0.1:{SERVICE_PORTS[service]}/readyz" in readiness
    assert REQUIRED_ENV <= set(spec["environment"])


@pytest.mark.parametrize("service", sorted(SERVICE_PORTS))
def test_services_start_after_backends_and_migration(service: str) -> None:
    depends = _compose()["services"][service]["depends_on"]
    assert depends["postgres"]["condition"] == "service_healthy"
    assert depends["rabbitmq"]["condition"] == "service_healthy"
    assert depends["migrate"]["condition"] == "service_completed_successfully"


def test_one_image_for_all_and_a_one_shot_migration() -> None:
    services = _compose()["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["monitorctl", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    app_images = {spec["image"] for name, spec in services.items() if name not in BACKENDS}
    assert len(app_images) == 1


def test_services_agree_on_shared_settings() -> None:
    services = _compose()["services"]
    apps = [spec for name, spec in services.items() if name not in BACKENDS]
    for key in REQUIRED_ENV:
        assert len({str(spec["environment"][key]) for spec in apps}) == 1, key
    database_url = apps[0]["environment"]["DATABASE_URL"]
    assert "@postgres:5432/" in database_url
    assert "@rabbitmq:5672/" in apps[0]["environment"]["AMQP_URL"]


def test_stack_fits_postgres_max_connections() -> None:
    services = _compose()["services"]
    postgres_command = services["postgres"]["command"]
    max_connections = int(next(a for a in postgres_command if a.startswith("max_connections="))
                          .split("=")[1])
    reserved = int(next(a for a in postgres_command if a.startswith("superuser_reserved_connections="))
                   .split("=")[1])
    total = 0
    for name, spec in services.items():
        if name in BACKENDS:
            continue
        pool = int(spec["environment"].get("DB_POOL_MAX", 1))
        if name in SERVICE_PORTS:
            assert "DB_POOL_MAX" in spec["environment"], f"{name} must size its pool explicitly"
            assert pool <= 6
        total += pool + DEDICATED_CONNECTIONS_PER_SERVICE
    assert total <= max_connections - reserved - OPERATOR_HEADROOM


def test_stop_grace_covers_the_drain() -> None:
    services = _compose()["services"]
    for name in SERVICE_PORTS:
        spec = services[name]
        drain = float(spec["environment"]["SHUTDOWN_GRACE_SECONDS"])
        assert _seconds(spec["stop_grace_period"]) >= drain + 5


def test_demo_fleet_is_optional() -> None:
    sim = _compose()["services"]["desktop-sim"]
    assert sim["profiles"] == ["demo"]
    script = " ".join(sim["command"])
    assert "monitorctl" in script and "seed-demo" in script
    assert "exec desktop-sim" in script
    assert {"monitorctl", "desktop-sim"} <= set(_console_scripts())
    assert sim["depends_on"]["dispatch-hub"]["condition"] == "service_healthy"


def test_the_local_stack_runs_in_dev_mode() -> None:
    # Its Postgres, broker and gateway secret are development ones; deploy/k8s never sets DEV_MODE.
    services = _compose()["services"]
    for name, spec in services.items():
        if name in BACKENDS:
            continue
        # As compose runs it with nothing set in the shell: ${NAME:-default} is the default.
        env = {key: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value)) for key, value in spec["environment"].items()}
        settings = Settings.from_env(env=env)
        assert settings.dev_mode is True, name
        settings.jwt_key()  # the development gateway secret is accepted, so the stack starts
        assert settings.ops_api_token, f"{name}: the coordinator's /api/ops/* needs a token, even locally"

"""`make observe`'s local Prometheus, for real: it loads the shipped rules, scrapes a running service under the
service's job name, and an alert of the shipped rules fires against it (a service that is not running is down)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
import yaml

from libs.config import Settings
from tests.support.collect_now import JWT_SECRET
from tests.support.procs import ServiceProcess, die_with_parent, free_port, service_env
from tests.support.wait import eventually
from tools.observe import rule_groups, write_config


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing in CI: scripts/ensure-promtool.sh installs it")
        pytest.skip("prometheus not installed (scripts/ensure-promtool.sh installs it)")
    return found


# The shipped rule groups are evaluated once a minute (their `interval`), and a group's first evaluation can come up
# to an interval after Prometheus starts: this Prometheus evaluates the same groups, rules unchanged, every 2 s.
EVALUATION_INTERVAL_S = 2


def _evaluated_every(rules_file: Path, interval_s: int) -> None:
    groups = yaml.safe_load(rules_file.read_text())["groups"]
    assert groups == rule_groups()  # what write_config wrote: the shipped groups, as they are
    faster = [{**g, "interval": f"{interval_s}s"} for g in groups]
    rules_file.write_text(yaml.safe_dump({"groups": faster}, sort_keys=False))


def _start_prometheus(binary: str, config: Path, data: Path, port: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)


async def _api(url: str, path: str, **params: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(f"{url}{path}", params=params) as resp:
        body = await resp.json()
        assert body["status"] == "success", body
        return body["data"]


@pytest.mark.timeout(120)
async def test_the_local_prometheus_scrapes_the_stack_and_fires_the_shipped_alerts(settings: Settings,
                                                                                   tmp_path: Path) -> None:
    binary = _prometheus()
    api = ServiceProcess("collect-now-api", service_env(settings, GATEWAY_JWT_SECRET=JWT_SECRET), log_dir=tmp_path)
    await asyncio.to_thread(api.start)
    missing_port = free_port()  # nothing listens here: that "service" is down
    config, rules_file = write_config(tmp_path / "observe",
                                      ports={"collect-now-api": api.port, "outbox-pump": missing_port})
    _evaluated_every(rules_file, EVALUATION_INTERVAL_S)
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prometheus = _start_prometheus(binary, config, tmp_path / "data", port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        async def up() -> dict[str, float] | None:
            try:
                result = await _api(url, "/api/v1/query", query="up")
            except aiohttp.ClientError:
                return None
            values = {r["metric"]["job"]: float(r["value"][1]) for r in result["result"]}
            return values if len(values) == 2 else None

        assert await eventually(up, timeout=60, message="both targets scraped") == {
            "collect-now-api": 1.0, "outbox-pump": 0.0}
        rules = await _api(url, "/api/v1/rules")
        loaded = sum(len(g["rules"]) for g in rules["groups"])
        assert loaded == sum(len(g["rules"]) for g in rule_groups())

        async def firing() -> set[str] | None:
            alerts = await _api(url, "/api/v1/alerts")
            names = {(a["labels"]["alertname"], a["state"], a["labels"].get("job", "")) for a in alerts["alerts"]}
            down = {n for n in names if n[0] in ("DispatchPodScrapeFailing", "ServiceDown") and n[2] == "outbox-pump"}
            return {f"{n}/{s}" for n, s, _ in down} or None

        assert {g["name"]: g["interval"] for g in rules["groups"]} == {
            g["name"]: EVALUATION_INTERVAL_S for g in rule_groups()}
        assert await eventually(firing, timeout=60, message="the down service's alert pending or firing")
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        log.close()
        await asyncio.to_thread(api.stop)

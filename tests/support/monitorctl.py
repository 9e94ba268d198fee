"""Run the real `monitorctl` (a subprocess, as an operator would) against a test's database."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import msgspec

from libs.config import Settings


def run_monitorctl(settings: Settings, *args: str, env: dict[str, str] | None = None) -> (
        subprocess.CompletedProcess[str]):
    env = {**os.environ, "DATABASE_URL": settings.database_url, "AMQP_URL": settings.amqp_url, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tools.monitorctl", "--json", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


async def monitorctl_json(settings: Settings, *args: str, env: dict[str, str] | None = None) -> Any:
    """The command's JSON output; fails the test with its stderr if it did not succeed."""
    done = await asyncio.to_thread(run_monitorctl, settings, *args, env=env)
    assert done.returncode == 0, done.stderr
    return msgspec.json.decode(done.stdout)


async def monitorctl_status(settings: Settings) -> tuple[int, Any]:
    """`monitorctl --json status`: its exit code (0 healthy, 1 a problem named) and its JSON."""
    done = await asyncio.to_thread(run_monitorctl, settings, "status")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, msgspec.json.decode(done.stdout)


async def monitorctl_refused(settings: Settings, *args: str) -> str:
    """The error a refused command printed (exit code 2)."""
    done = await asyncio.to_thread(run_monitorctl, settings, *args)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    return done.stderr

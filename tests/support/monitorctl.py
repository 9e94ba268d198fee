"""Run the real `monitorctl` command code against a test's database.

In the test's own process and event loop (the parser, the command and its exit code exactly as `monitorctl` runs
them, its stdout and stderr captured): a subprocess per call cost an interpreter start and the imports, 1-3 s
under load, ~80 times a suite. `run_monitorctl` with `env` overrides, and `monitorctl_subprocess`, still start the
real executable, as an operator would."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import traceback
from typing import Any
from unittest import mock

import msgspec

from libs.config import Settings
from tools.monitorctl.common import Context
from tools.monitorctl.main import build_parser


def monitorctl_subprocess(settings: Settings, *args: str, env: dict[str, str] | None = None) -> (
        subprocess.CompletedProcess[str]):
    env = {**os.environ, "DATABASE_URL": settings.database_url, "AMQP_URL": settings.amqp_url, **(env or {})}
    return subprocess.run([sys.executable, "-m", "tools.monitorctl", "--json", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


async def run_in_process(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """`monitorctl --json ARGS` as its main() runs it, on this event loop: the exit code (argparse's and the
    command's), stdout and stderr (an uncaught exception: 1 and its traceback, as the executable would)."""
    argv = ["--json", *args]
    out, err = io.StringIO(), io.StringIO()
    environ = {"DATABASE_URL": settings.database_url, "AMQP_URL": settings.amqp_url}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.dict(os.environ, environ):
        try:
            parsed = build_parser().parse_args(argv)
            ctx = Context(settings=Settings.from_env(), as_json=True)
            try:
                code = await parsed.func(parsed, ctx)
            finally:
                await ctx.close()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["monitorctl", *argv], code, out.getvalue(), err.getvalue())


def run_monitorctl(settings: Settings, *args: str, env: dict[str, str] | None = None) -> (
        subprocess.CompletedProcess[str]):
    """For synchronous callers: in a fresh event loop of its own (or the executable when `env` overrides)."""
    if env:
        return monitorctl_subprocess(settings, *args, env=env)
    return asyncio.run(run_in_process(settings, *args))


async def _run(settings: Settings, *args: str, env: dict[str, str] | None,
               executable: bool = False) -> subprocess.CompletedProcess[str]:
    if env or executable:
        return await asyncio.to_thread(monitorctl_subprocess, settings, *args, env=env)
    return await run_in_process(settings, *args)


async def monitorctl_json(settings: Settings, *args: str, env: dict[str, str] | None = None,
                          executable: bool = False) -> Any:
    """The command's JSON output; fails the test with its stderr if it did not succeed. `executable`: run the real
    executable (an end-to-end test's operator, at an operator's pace)."""
    done = await _run(settings, *args, env=env, executable=executable)
    assert done.returncode == 0, done.stderr
    return msgspec.json.decode(done.stdout)


async def monitorctl_status(settings: Settings) -> tuple[int, Any]:
    """`monitorctl --json status`: its exit code (0 healthy, 1 a problem named) and its JSON."""
    done = await _run(settings, "status", env=None)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, msgspec.json.decode(done.stdout)


async def monitorctl_refused(settings: Settings, *args: str) -> str:
    """The error a refused command printed (exit code 2)."""
    done = await _run(settings, *args, env=None)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    return done.stderr

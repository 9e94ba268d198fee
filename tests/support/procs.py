"""Real service processes for end-to-end tests: start, wait until ready, stop or kill."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO

from libs.config import Settings
from tests.support.collect_now import GATEWAY_AUDIENCE, GATEWAY_ISSUER

BIN = Path(sys.executable).parent

# Linux: a child started with `preexec_fn=die_with_parent` gets SIGTERM when the process (strictly, the thread)
# that started it dies, so a test or benchmark killed mid-run does not leave its services running (they would
# take CPU from every later benchmark on the box). Elsewhere (a laptop with testcontainers) a no-op.
_PR_SET_PDEATHSIG = 1
_prctl = None
if sys.platform == "linux":
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """For `preexec_fn`: runs in the forked child before exec (only a foreign call: nothing takes a Python lock)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_env(settings: Settings, **extra: str | int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update({
        "DATABASE_URL": settings.database_url,
        "AMQP_URL": settings.amqp_url,
        "MQ_PREFIX": settings.mq_prefix,
        "INGEST_SHARDS": str(settings.ingest_shards),
        "GATEWAY_JWT_SECRET": settings.gateway_jwt_secret,
        # Required outside DEV_MODE; the test gateway's tokens (tests/support/collect_now.py) name these.
        "GATEWAY_JWT_AUDIENCE": settings.gateway_jwt_audience or GATEWAY_AUDIENCE,
        "GATEWAY_JWT_ISSUER": settings.gateway_jwt_issuer or GATEWAY_ISSUER,
        "LOG_LEVEL": "INFO",
        "SHUTDOWN_GRACE_SECONDS": "5",
        "DB_POOL_MAX": "4",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


class ServiceProcess:
    def __init__(self, name: str, env: dict[str, str], *, log_dir: Path, port: int | None = None,
                 args: list[str] | None = None, wrapper: list[str] | None = None) -> None:
        """`wrapper`: a command the service is started through (a fault test's, moving it into a cgroup)."""
        self.name = name
        self.wrapper = wrapper or []
        self.port = port or free_port()
        self.env = {**env, "HTTP_PORT": str(self.port), "HTTP_HOST": "127.0.0.1"}
        self.args = args or []
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, ready_path: str = "/readyz", timeout: float = 60.0) -> ServiceProcess:
        """Start the service and wait for `ready_path` to answer 200. A start takes about a second on a quiet box
        (most of it imports); a stack's five to thirteen processes importing at once beside another test file's
        took 10-20 s under a load of 10-18, so the deadline leaves room for that."""
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen([*self.wrapper, str(BIN / self.name), *self.args], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)  # polling a child process's HTTP port with a deadline
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.logs()[-4000:]}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            if self._log:
                self._log.close()
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)
        finally:
            if self._log:
                self._log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self._log:
            self._log.close()


async def refused_start(service: str, env: dict[str, str], log_dir: Path) -> tuple[str, str]:
    """Start `service` with `env` and expect it to refuse: it must exit with 2 (a configuration error) without a
    traceback. Returns the start error's text and the service's log; a service that starts is stopped and fails."""
    import asyncio

    process = ServiceProcess(service, env, log_dir=log_dir)
    try:
        await asyncio.to_thread(process.start)  # a refusal ends it as soon as its configuration is read
    except RuntimeError as exc:
        assert "exited with 2" in str(exc), str(exc)[-2000:]
        assert "Traceback" not in process.logs(), process.logs()[-2000:]
        return str(exc), process.logs()
    await asyncio.to_thread(process.stop)
    raise AssertionError(f"{service} started with a configuration it must refuse")

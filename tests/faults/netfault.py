"""Infrastructure faults for tests/faults: a cgroup whose processes' packets can be dropped (a node gone silent)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

CGROUP2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() \
    else Path("/sys/fs/cgroup")
FAULT_CGROUP = "monitoring-fault"


def have_iptables() -> bool:
    return os.geteuid() == 0 and shutil.which("iptables") is not None and (CGROUP2 / "cgroup.procs").exists()


def in_fault_cgroup() -> list[str]:
    """A wrapper command (ServiceProcess(wrapper=...)) that starts a process in the fault cgroup: iptables matches
    exactly the sockets that process opens."""
    (CGROUP2 / FAULT_CGROUP).mkdir(exist_ok=True)
    procs = CGROUP2 / FAULT_CGROUP / "cgroup.procs"
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "in-fault-cgroup"]


def _rules(ports: Sequence[int]) -> list[list[str]]:
    return [["OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port), "-m", "cgroup", "--path", FAULT_CGROUP,
             "-j", "DROP"] for port in ports]


@contextlib.contextmanager
def silenced(ports: Sequence[int]) -> Iterator[None]:
    """Every packet the fault cgroup's processes send to `ports` on loopback is dropped (no FIN, no RST: their
    peers see silence, as when a node dies), until the block ends; the rules are deleted whatever happens."""
    added: list[list[str]] = []
    try:
        for rule in _rules(ports):
            subprocess.run(["iptables", "-I", *rule], check=True)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-D", *rule], check=False)


def leftover_rules() -> list[str]:
    """Rules of the fault cgroup still in the OUTPUT chain (a fault test must leave none)."""
    listing = subprocess.run(["iptables", "-S", "OUTPUT"], check=True, capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if FAULT_CGROUP in line]


# The private servers `scripts/fault-servers.sh up` starts (`make faults` does): the suite stops, crashes and alarms
# them, never the machine's shared ones. Without them every fault test is skipped.
MQ_NODE = os.environ.get("FAULT_MQ_NODE", "")
PG_DATA = os.environ.get("FAULT_PG_DATA", "")
PG_BIN = Path(os.environ.get("FAULT_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _rabbitmqctl(*args: str, check: bool = True) -> str:
    return subprocess.run(["rabbitmqctl", "-n", MQ_NODE, *args], check=check, capture_output=True, text=True,
                          timeout=120).stdout


def have_rabbitmqctl() -> bool:
    return os.geteuid() == 0 and shutil.which("rabbitmqctl") is not None and bool(MQ_NODE)


@contextlib.contextmanager
def memory_alarm() -> Iterator[None]:
    """The broker's memory alarm raised (its high watermark set far below its use: every publisher is blocked,
    consumers keep consuming) until the block ends; the watermark it had is put back whatever happens."""
    before = _rabbitmqctl("eval", "vm_memory_monitor:get_vm_memory_high_watermark().").strip()
    try:
        _rabbitmqctl("set_vm_memory_high_watermark", "0.0000001")
        yield
    finally:
        restore = before if before.replace(".", "", 1).isdigit() else "0.4"
        _rabbitmqctl("set_vm_memory_high_watermark", restore, check=False)


def memory_alarm_raised() -> bool:
    return "memory" in _rabbitmqctl("eval", "rabbit_alarm:get_alarms().")


def have_pg_ctl() -> bool:
    return os.geteuid() == 0 and bool(PG_DATA) and (PG_BIN / "pg_ctl").exists()


def postgres(action: str, *options: str) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", PG_DATA, "-w", "-t", "120",
                    *(["-l", f"{PG_DATA}/server.log"] if action == "start" else []), action, *options],
                   check=True, capture_output=True, timeout=180)


@contextlib.contextmanager
def postgres_stopped(mode: str) -> Iterator[None]:
    """The fault suite's Postgres stopped (`-m fast`: sessions ended cleanly; `-m immediate`: as a crash, recovery
    at the next start) for the block; started again whatever happens."""
    postgres("stop", "-m", mode)
    try:
        yield
    finally:
        postgres("start")


@contextlib.contextmanager
def broker_stopped() -> Iterator[None]:
    """The broker's application stopped (every connection dropped, nothing accepted) for the block; started again
    whatever happens."""
    _rabbitmqctl("stop_app")
    try:
        yield
    finally:
        _rabbitmqctl("start_app", check=False)
        _rabbitmqctl("await_startup", check=False)

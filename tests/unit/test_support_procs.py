"""Test support: child processes die with the process that started them (a killed run leaves nothing behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from tests.support.procs import die_with_parent
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=die_with_parent if sys.argv[1] == "yes" else None)
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _orphan_after_parent_killed(die: bool, wait_s: float) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "yes" if die else "no"], stdout=subprocess.PIPE,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert parent.stdout is not None
    with parent.stdout:
        child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(5)
    deadline = time.monotonic() + wait_s
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling the orphan's state with a deadline
    return child, _alive(child)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed() -> None:
    _, alive = _orphan_after_parent_killed(die=True, wait_s=5)
    assert not alive
    # Without it the orphan lives on (what a killed benchmark used to leave behind).
    child, alive = _orphan_after_parent_killed(die=False, wait_s=0.3)
    try:
        assert alive
    finally:
        os.kill(child, signal.SIGKILL)

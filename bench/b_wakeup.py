"""The machine's floor for a chain of hops: one Postgres round trip (`SELECT 1` over TCP) from a uvloop
process, back to back and after the process (and the CPUs) sat idle for 50 ms and 300 ms.

A collect-now click crosses some twenty such wake-ups in sequence (HTTP, three collect-now round trips,
the coordinator's NOTIFY and two round trips, the pump's NOTIFY, claim and publish, the broker, the hub,
the WebSocket); when the machine idles between clicks each one costs the after-idle figure.

    .venv/bin/python -m bench wakeup
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import summary
from libs.config import Settings
from libs.db.pool import connect


async def run(args: argparse.Namespace) -> None:
    samples = 50 if args.quick else 200
    conn = await connect(Settings.from_env("bench").database_url, name="bench-wakeup")
    try:
        for gap_ms in (0, 50, 300):
            values: list[float] = []
            for _ in range(samples if gap_ms < 300 else samples // 4):
                if gap_ms:
                    await asyncio.sleep(gap_ms / 1000)  # the idle gap being measured
                started = time.perf_counter()
                await conn.execute("SELECT 1")
                values.append((time.perf_counter() - started) * 1000)
            print(f"SELECT 1 round trip after {gap_ms:>3} ms idle (ms): {summary(values)}", flush=True)
    finally:
        await conn.close()

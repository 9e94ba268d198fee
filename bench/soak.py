"""`make soak`: the whole stack for a long, steady run, watched for anything that keeps growing.

Every service as real processes, replicated as in the chaos test (tests/support/chaos.py: two coordinators,
pumps, hubs and ingest workers), a fleet of simulated desktop clients on four tenants, plans coming due evenly
over the whole run plus a collect-now click every 20 s or so, and no faults. Every SOAK_SAMPLE_SECONDS (60) it
prints the resident memory of every process, the Postgres connections per application_name, the outbox rows by
status and the depth of every queue of the run; at the end, per series, the mean of the first third of the
samples against the last third, and a verdict: "no growth trend", or the series that grew.

    SOAK_MINUTES=30 python -m bench.soak          # make soak; SOAK_REPORT=PATH also writes the summary there
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import psycopg
import uvloop

from bench.common import bench_environment
from libs.config import Settings
from libs.db.pool import connect
from tests.support.chaos import ChaosStack, Clicker, Fleet, queue_depths, schedule_business_day, seed_world

TENANTS, CLIENTS_PER_TENANT = 4, 4
TASKS_PER_MINUTE = 80  # scheduled business tasks coming due each minute, well inside the run's budgets
WARM_UP_SAMPLES = 1  # the sample taken as the fleet starts: processes still filling their caches

_PG_CONNECTIONS = """
SELECT coalesce(nullif(application_name, ''), '(none)') AS app, count(*) AS n
FROM pg_stat_activity WHERE datname = current_database() AND application_name <> 'soak' GROUP BY 1
"""
_OUTBOX = "SELECT status, count(*) AS n FROM outbox GROUP BY 1"
_DONE = "SELECT count(*) FILTER (WHERE status IN ('completed', 'failed', 'skipped', 'expired')) AS done, " \
        "count(*) AS total FROM monitoring_collect_tasks"


@dataclass(frozen=True)
class Kind:
    """How much a series may move between the first and the last third before it counts as growth."""

    unit: str
    absolute: float
    relative: float
    judged: bool = True


KINDS = {
    "rss": Kind("MB", 10.0, 0.10),
    "pg": Kind("conns", 2.0, 0.0),
    "outbox": Kind("rows", 25.0, 0.25),
    "queue": Kind("msgs", 25.0, 0.25),
    # Kept for OUTBOX_RETENTION_HOURS (24) before the pump purges them: they grow for the whole run by design.
    "retained": Kind("rows", 0.0, 0.0, judged=False),
    # The harness itself: every simulated client keeps its statistics (events, leases, phases) in memory.
    "harness": Kind("MB", 0.0, 0.0, judged=False),
}


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


async def sample(stack: ChaosStack, conn: psycopg.AsyncConnection[tuple[object, ...]]) -> dict[tuple[str, str], float]:
    """One reading of every series, keyed by (kind, name)."""
    values: dict[tuple[str, str], float] = {}
    for replica in stack.replicas:
        if replica.pid is not None:
            values[("rss", replica.label)] = rss_mb(replica.pid)
    values[("harness", "soak process (fleet, proxy)")] = rss_mb(os.getpid())
    for app, n in await (await conn.execute(_PG_CONNECTIONS)).fetchall():
        values[("pg", str(app))] = float(n)  # type: ignore[arg-type]
    statuses = {str(status): float(n) for status, n in await (await conn.execute(_OUTBOX)).fetchall()}  # type: ignore[arg-type]
    for status in ("queued", "running", "retryable", "dead_letter"):
        values[("outbox", status)] = statuses.get(status, 0.0)
    values[("retained", "outbox published")] = statuses.get("published", 0.0)
    prefix = stack.settings.mq_prefix
    for name, depth in (await asyncio.to_thread(queue_depths, prefix)).items():
        values[("queue", name.removeprefix(prefix))] = float(depth)
    return values


def third_means(values: list[float]) -> tuple[float, float]:
    third = max(1, len(values) // 3)
    return statistics.fmean(values[:third]), statistics.fmean(values[-third:])


def trends(samples: list[dict[tuple[str, str], float]]) -> tuple[list[str], list[str]]:
    """(a line per series: first third -> last third, the series that grew)."""
    series: dict[tuple[str, str], list[float]] = defaultdict(list)
    for reading in samples[WARM_UP_SAMPLES:] or samples:
        for key, value in reading.items():
            if not math.isnan(value):
                series[key].append(value)
    lines, grew = [], []
    idle: dict[str, int] = defaultdict(int)
    for (kind, name), values in sorted(series.items()):
        rule = KINDS[kind]
        first, last = third_means(values)
        growth = last - first
        if not any(values):
            idle[kind] += 1
            continue
        bound = max(rule.absolute, rule.relative * first)
        verdict = "informational" if not rule.judged else ("GREW" if growth > bound else "flat")
        lines.append(f"  {kind:<8} {name:<52} {first:9.1f} -> {last:9.1f} {rule.unit:<5} ({growth:+.1f}) {verdict}")
        if rule.judged and growth > bound:
            grew.append(f"{kind} {name}: {first:.1f} -> {last:.1f} {rule.unit}")
    lines += [f"  {kind:<8} {n} more series at 0 in every sample" for kind, n in sorted(idle.items())]
    return lines, grew


def format_sample(minute: float, reading: dict[tuple[str, str], float], done: tuple[int, int]) -> str:
    def group(kind: str) -> str:
        return ", ".join(f"{name} {value:.0f}" for (k, name), value in sorted(reading.items()) if k == kind)
    busy = {name: value for (k, name), value in reading.items() if k == "queue" and value}
    return (f"[{minute:5.1f} min] business tasks done {done[0]}/{done[1]}\n"
            f"  rss MB: {group('rss')}; soak process {reading.get(('harness', 'soak process (fleet, proxy)'), 0):.0f}\n"
            f"  pg connections: {group('pg')}\n"
            f"  outbox: {group('outbox')}, published {reading.get(('retained', 'outbox published'), 0):.0f}\n"
            f"  queues with messages: {busy or 'none'} (of {sum(1 for k, _ in reading if k == 'queue')} queues)")


async def soak(settings: Settings, minutes: float, sample_s: float, seed: int) -> str:
    questions = max(4, math.ceil(TASKS_PER_MINUTE * minutes / (TENANTS * 3)))
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    print(f"soak: {minutes:g} min, a sample every {sample_s:g}s, seed {seed}, service logs in {log_dir}", flush=True)
    async with await psycopg.AsyncConnection.connect(settings.database_url, autocommit=True,
                                                     application_name="soak") as watch:
        seeding = await connect(settings.database_url, name="soak")
        try:
            seeded = await seed_world(seeding, tenants=TENANTS, brands=1, questions=questions,
                                      clients=CLIENTS_PER_TENANT)
        finally:
            await seeding.close()
        stack = ChaosStack(settings, log_dir)
        fleet: Fleet | None = None
        samples: list[dict[tuple[str, str], float]] = []
        started = time.monotonic()
        try:
            await stack.start()
            fleet = Fleet(seeded, stack.hub_urls, random.Random(f"{seed}-fleet"), scale=10.0, record=False)
            await fleet.start()
            seeding = await connect(settings.database_url, name="soak")
            try:
                plans = await schedule_business_day(seeding, random.Random(f"{seed}-day"), minutes * 60 * 0.95)
            finally:
                await seeding.close()
            print(f"{plans} plans coming due over the run; {len(fleet.clients)} simulated clients", flush=True)
            clicker = Clicker(stack, seeded, random.Random(f"{seed}-clicks"))
            clicks = asyncio.create_task(clicker.run(minutes * 60, mean_gap_s=20.0))
            started = time.monotonic()
            while True:
                reading = await sample(stack, watch)
                done = await (await watch.execute(_DONE)).fetchone()
                samples.append(reading)
                elapsed = time.monotonic() - started
                print(format_sample(elapsed / 60, reading, (int(done[0]), int(done[1])) if done else (0, 0)),  # type: ignore[call-overload]
                      flush=True)
                if elapsed >= minutes * 60:
                    break
                await asyncio.sleep(min(sample_s, max(0.0, minutes * 60 - elapsed)))  # the sampling period
            await clicks
        finally:
            if fleet is not None:
                await fleet.stop()
            await stack.stop()
    lines, grew = trends(samples)
    verdict = "no growth trend" if not grew else "growth in: " + "; ".join(grew)
    crashes = [f"{label} at {at}s" for at, label, _ in stack.crashes]
    return "\n".join([
        f"soak summary: {(time.monotonic() - started) / 60:.1f} min, {len(samples)} samples, seed {seed}; "
        f"collect-now clicks {clicker.summary()}; replicas that exited on their own: {crashes or 'none'}",
        "series (mean of the first third of the samples -> the last third; the warm-up sample left out):",
        *lines, f"verdict: {verdict}"])


def main() -> None:
    minutes = float(os.environ.get("SOAK_MINUTES") or 30)
    sample_s = float(os.environ.get("SOAK_SAMPLE_SECONDS") or 60)
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(2**31))

    async def run() -> str:
        async with bench_environment() as settings:
            return await soak(settings, minutes, sample_s, seed)

    report = uvloop.run(run())
    print(report, flush=True)
    if os.environ.get("SOAK_REPORT"):
        Path(os.environ["SOAK_REPORT"]).write_text(report + "\n")
    if "growth in" in report.splitlines()[-1]:
        sys.exit(1)


if __name__ == "__main__":
    main()

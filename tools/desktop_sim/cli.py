"""`desktop-sim`: run a fleet of simulated desktop clients, one per client token.

    desktop-sim --hub http://127.0.0.1:8082 --seed-json .run/demo.json --timings demo
    desktop-sim --hub http://127.0.0.1:8082 --token dct_... --token dct_...
    desktop-sim --hub http://127.0.0.1:8082,http://127.0.0.1:8083 --seed-json .run/demo.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from libs.telemetry import tracing
from tools.desktop_sim.client import SimClient, SimOptions
from tools.desktop_sim.rules import PHASES
from tools.desktop_sim.timings import TIMING_PROFILES


def tokens_from_seed(seed: dict[str, Any]) -> list[tuple[str, str]]:
    """(client_id, token) for every client of every tenant in `monitorctl seed-demo --json` output."""
    return [(str(c["client_id"]), str(c["token"])) for t in seed.get("tenants", []) for c in t.get("clients", [])]


def _jitter(value: str) -> float:
    try:
        jitter = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= jitter < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {jitter}")
    return jitter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="desktop-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hub", default="http://127.0.0.1:8082",
                        help="dispatch-hub base URL; several, comma-separated, to fail over between them")
    parser.add_argument("--seed-json", "--from-seed", dest="seed_json", type=Path,
                        help="JSON printed by `monitorctl seed-demo --json`: one client per token in it")
    parser.add_argument("--token", action="append", default=[], help="a client token (repeatable)")
    parser.add_argument("--wait-for-seed", type=float, default=120.0,
                        help="seconds to wait for --seed-json to appear (make run writes it at start-up)")
    parser.add_argument("--timings", choices=sorted(TIMING_PROFILES), default="demo")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every phase duration (slow platforms)")
    parser.add_argument("--jitter", type=_jitter, default=None,
                        help="each phase takes its duration x a uniform factor in [1-J, 1+J] (default: the "
                             "profile's, 0.3 for demo; 0: every client in lockstep)")
    parser.add_argument("--concurrency", type=int, default=1, help="monitor tasks each client runs at once")
    parser.add_argument("--heartbeat-interval", type=float, default=5.0)
    parser.add_argument("--push-fraction", type=float, default=0.0,
                        help="the share of clients (0..1, the first ones) that ask for push-lease; the rest pull")
    parser.add_argument("--failure-rate", type=float, default=0.05)
    parser.add_argument("--mention-rate", type=float, default=0.4)
    parser.add_argument("--ignore-interrupts", action="store_true", help="misbehave: never yield to collect-now")
    parser.add_argument("--die-at-phase", choices=PHASES, help="misbehave: crash when the Nth task reaches it")
    parser.add_argument("--die-on-task", type=int, default=1)
    parser.add_argument("--stats-interval", type=float, default=30.0, help="print fleet stats every N seconds")
    return parser.parse_args(argv)


async def _load_seed(path: Path, wait_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            data: dict[str, Any] = json.loads(await asyncio.to_thread(path.read_text))
            return data
        if time.monotonic() >= deadline:
            raise SystemExit(f"desktop-sim: {path} did not appear within {wait_s}s")
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    tokens = [(f"token-{i + 1}", t) for i, t in enumerate(args.token)]
    if args.seed_json is not None:
        tokens += tokens_from_seed(await _load_seed(args.seed_json, args.wait_for_seed))
    if not tokens:
        raise SystemExit("desktop-sim: give --seed-json PATH or at least one --token")
    timings = TIMING_PROFILES[args.timings].scaled(args.scale)
    if args.jitter is not None:
        timings = timings.with_jitter(args.jitter)
    hub_url, *more_hubs = [url.strip() for url in args.hub.split(",") if url.strip()] or [""]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     trace_configs=tracing.client_trace_configs()) as session:
        clients = [SimClient(SimOptions(
            hub_url=hub_url, hub_urls=tuple(more_hubs), token=token, name=name, timings=timings,
            max_concurrent=args.concurrency, heartbeat_interval_s=args.heartbeat_interval,
            failure_rate=args.failure_rate, mention_rate=args.mention_rate, ignore_interrupts=args.ignore_interrupts,
            die_at_phase=args.die_at_phase, die_on_task=args.die_on_task,
            push_lease=n < round(args.push_fraction * len(tokens)),
            platform_health={"openai": "healthy", "gemini": "healthy", "perplexity": "healthy"}),
            session=session) for n, (name, token) in enumerate(tokens)]
        for client in clients:
            await client.start()
        print(json.dumps({"event": "fleet started", "clients": len(clients), "hub": args.hub,
                          "timings": args.timings}), flush=True)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.stats_interval)
                totals: dict[str, int] = {}
                for client in clients:
                    for key, value in client.stats.snapshot().items():
                        totals[key] = totals.get(key, 0) + int(value)
                print(json.dumps({"event": "fleet stats", **totals}), flush=True)
        finally:
            await asyncio.gather(*(c.stop() for c in clients), return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # OTEL_* as for the services: with tracing on, a client span per hub call, a child of the task's event.
    tracing.configure_tracing("desktop-sim", instrument_http=False)
    uvloop.run(run(args))

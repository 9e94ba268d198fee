"""Run every benchmark module (or those named): `python -m bench [outbox dispatch ...]`."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import pkgutil
import sys
from pathlib import Path

import uvloop


def available() -> list[str]:
    folder = Path(__file__).parent
    return sorted(m.name[2:] for m in pkgutil.iter_modules([str(folder)]) if m.name.startswith("b_"))


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default all): {available()}")
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke check")
    parser.add_argument("--clients", type=int, help="hub_scale: WebSocket clients on the one hub (default 10000)")
    parser.add_argument("--hubs", type=int, help="hub_scale: hub replicas behind a simulated load balancer (default 1)")
    parser.add_argument("--tracing", action="store_true",
                        help="collect_now: the services trace every request (100%%) into a local trace sink")
    parser.add_argument("--push", action="store_true",
                        help="collect_now: each scenario with a pull-lease probe, then a push-lease one")
    parser.add_argument("--legacy", action="store_true",
                        help="collect_now: the clicking tenant's tasks on the legacy execution path (rollout 0)")
    args = parser.parse_args()
    names = args.names or available()
    for name in names:
        if name not in available():
            sys.exit(f"unknown benchmark {name!r}; available: {available()}")
    for name in names:
        module = importlib.import_module(f"bench.b_{name}")
        print(f"\n=== {name} ===", flush=True)
        uvloop.run(module.run(args))
    asyncio.set_event_loop(None)


if __name__ == "__main__":
    main()

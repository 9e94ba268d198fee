"""`monitorctl ingest routing` and `monitorctl ingest reshard N [--apply] [--wait S]`: change the number of ingest
shards while results flow (docs/reliability.md, "Resharding ingest online"; libs/ingest/routing.py).

`reshard N` without `--apply` prints the plan: the epochs and, for each new shard, the old shards it waits for.
With `--apply`: declare the new epoch's queues (bound), make it the active epoch (the hubs route by it within a
second; a hub still on the old one has its publish returned and re-routes), unbind the old epoch's queues, put a
drain marker at the tail of each, then wait (up to `--wait` seconds) while the ingest workers apply everything before
the markers; once every old shard's marker was reached, delete the old queues and retire the epoch. Interrupted or
timed out, the same command again carries on from where the routing table says it is.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel

from libs.ingest.routing import DRAIN_GRACE_S, DRAIN_MARKER_TYPE, Routing, RoutingState, RoutingStore, plan_reshard
from libs.mq.connection import connect
from libs.mq.topology import Topology, declare_ingest
from tools.monitorctl.common import Context, fail, render_text

POLL_S = 0.5


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("ingest", help="result ingest: routing epochs, online resharding")
    commands = parser.add_subparsers(dest="ingest_command", required=True)
    routing = commands.add_parser("routing", help="the active routing epoch and any reshard under way")
    routing.set_defaults(func=show_routing)
    reshard = commands.add_parser("reshard", help="change the ingest shard count online (dry run unless --apply)")
    reshard.add_argument("shards", type=int, help="the new number of shards")
    reshard.add_argument("--apply", action="store_true", help="do it (default: print the plan only)")
    reshard.add_argument("--wait", type=float, default=300.0,
                         help="seconds to wait for the old shards to drain before exiting (default 300)")
    reshard.set_defaults(func=run_reshard)


def describe(state: RoutingState) -> dict[str, Any]:
    out: dict[str, Any] = {"active": {"epoch": state.active.epoch, "shards": state.active.shards}}
    if state.draining is not None:
        out["draining"] = {"epoch": state.draining.epoch, "shards": state.draining.shards,
                           "unbound": state.unbound_at is not None, "drained": sorted(state.drained)}
    return out


async def show_routing(args: argparse.Namespace, ctx: Context) -> int:
    store = RoutingStore(ctx.settings.ingest_shards)
    ctx.emit(describe(await store.state(await ctx.conn())))
    return 0


async def run_reshard(args: argparse.Namespace, ctx: Context) -> int:
    if args.shards <= 0:
        return fail("the shard count must be positive")
    store = RoutingStore(ctx.settings.ingest_shards)
    conn = await ctx.conn()
    state = await store.state(conn)
    if state.draining is not None and state.active.shards != args.shards:
        return fail(f"a reshard from {state.draining.shards} to {state.active.shards} shards is under way; finish it "
                    f"first (`monitorctl ingest reshard {state.active.shards} --apply`)")
    if state.draining is None and state.active.shards == args.shards:
        ctx.emit({"status": "unchanged", **describe(state)})
        return 0
    if not args.apply:
        plan = plan_reshard(state, args.shards) if state.draining is None else {"resuming": describe(state)}
        ctx.emit({"status": "dry_run", **plan}, lambda v: render_text(v) + "\n(dry run: add --apply to do it)")
        return 0
    topology = Topology(ctx.settings.mq_prefix, ctx.settings.ingest_shards)
    amqp = await connect(ctx.settings.amqp_url, name="monitorctl-reshard", timeout=10.0)
    try:
        async with amqp.channel(publisher_confirms=True, on_return_raises=True) as channel:
            if state.draining is None:
                new = Routing(state.active.epoch + 1, args.shards)
                # The new queues exist and are bound before any hub routes to them.
                await declare_ingest(channel, topology, [new])
                if await store.start_epoch(conn, state.active, args.shards) is None:
                    return fail("the routing table changed meanwhile; run the command again")
                state = await store.state(conn)
            assert state.draining is not None
            await _unbind(channel, topology, state.draining)
            await store.mark_unbound(conn, state.draining.epoch)
            # A deliberate pause, not a wait for a condition: publishes routed just before the unbind land first.
            await asyncio.sleep(DRAIN_GRACE_S)
            await _mark_tails(channel, topology, state.draining, state.drained)
            state = await _wait_drained(store, ctx, args.wait)
            if state.draining is not None and len(state.drained) < state.draining.shards:
                ctx.emit({"status": "draining", **describe(state)},
                         lambda v: render_text(v) + "\n(still draining: run the same command again to finish)")
                return 1
            if state.draining is None:  # another run of this command finished it meanwhile
                ctx.emit({"status": "done", **describe(state)})
                return 0
            await _delete_queues(channel, topology, state.draining)
            await store.retire(conn, state.draining.epoch)
    finally:
        await amqp.close()
    ctx.emit({"status": "done", **describe(await store.state(conn))})
    return 0


async def _unbind(channel: AbstractChannel, topology: Topology, old: Routing) -> None:
    for shard in range(old.shards):
        queue = await channel.declare_queue(topology.ingest_queue(shard, old.epoch), passive=True)
        await queue.unbind(topology.result_exchange, routing_key=old.routing_key(shard))


async def _mark_tails(channel: AbstractChannel, topology: Topology, old: Routing, drained: frozenset[int]) -> None:
    """A drain marker at the tail of each old queue not drained yet (confirmed; a second one is harmless)."""
    for shard in sorted(set(range(old.shards)) - drained):
        await channel.default_exchange.publish(aio_pika.Message(
            body=b"{}", type=DRAIN_MARKER_TYPE, message_id=f"drain-e{old.epoch}-s{shard}",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=topology.ingest_queue(shard, old.epoch),
            mandatory=True, timeout=10.0)


async def _wait_drained(store: RoutingStore, ctx: Context, wait_s: float) -> RoutingState:
    deadline = time.monotonic() + wait_s
    while True:
        state = await store.state(await ctx.conn())
        if state.draining is None or len(state.drained) >= state.draining.shards or time.monotonic() > deadline:
            return state
        await asyncio.sleep(POLL_S)  # polling the routing table, with the deadline above


async def _delete_queues(channel: AbstractChannel, topology: Topology, old: Routing) -> None:
    """Delete the drained epoch's queues: each one's consumer reached its tail marker, and nothing is routed to it."""
    for shard in range(old.shards):
        await channel.queue_delete(topology.ingest_queue(shard, old.epoch))

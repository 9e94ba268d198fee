"""`monitorctl trace REQUEST_ID`: a collect-now's trace from a trace sink's file (`python -m tools.trace_sink`),
printed as a tree: each span's service, name, duration, start after the trace's first span, key attributes."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

from tools.monitorctl.common import Context, fail
from tools.trace_sink import read_spans

REQUEST_ATTRIBUTE = "monitoring.collect_request_id"
# Attributes worth a place on a span's line (ours, without the `monitoring.` prefix, come first).
SHOWN = ("http.request.method", "http.method", "http.route", "http.response.status_code", "http.status_code",
         "messaging.rabbitmq.destination.routing_key")
MAX_VALUE_CHARS = 60


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("trace", help="print a collect-now request's trace (from a trace sink's file) as a tree")
    parser.add_argument("request_id", help="the collect request id (the collect-now answer's request_id)")
    parser.add_argument("--file", type=Path, default=Path(".run/traces.jsonl"),
                        help="the trace sink's JSON lines (python -m tools.trace_sink --out ...)")
    parser.set_defaults(func=run)


def traces_of_request(spans: list[dict[str, Any]], request_id: str) -> list[list[dict[str, Any]]]:
    """Every trace with a span carrying `request_id`, each as its spans, in the order the traces began."""
    wanted = {s["trace_id"] for s in spans if str(s.get("attributes", {}).get(REQUEST_ATTRIBUTE)) == request_id}
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        if span["trace_id"] in wanted:
            by_trace[span["trace_id"]].append(span)
    return sorted(by_trace.values(), key=lambda t: min(s["start_unix_nano"] for s in t))


def tree_lines(trace: list[dict[str, Any]]) -> list[str]:
    """The trace as indented lines, children under their parent by start time. A span whose parent is not in
    the trace (the caller's, e.g. the gateway's) starts a tree of its own."""
    started = min(s["start_unix_nano"] for s in trace)
    ids = {s["span_id"] for s in trace}
    children: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for span in trace:
        parent = span.get("parent_span_id")
        children[parent if parent in ids else None].append(span)
    lines = [f"trace {trace[0]['trace_id']}: {len(trace)} spans"]

    def walk(span: dict[str, Any], depth: int) -> None:
        offset_ms = (span["start_unix_nano"] - started) / 1e6
        line = (f"{'  ' * depth}{span.get('service') or '?'}  {span['name']}  {span['duration_ms']:.1f} ms"
                f"  (+{offset_ms:.1f} ms)")
        shown = key_attributes(span)
        if shown:
            line += "  " + " ".join(f"{k}={v}" for k, v in shown.items())
        if span.get("status") == "error":
            line += f"  ERROR {span.get('status_message') or ''}".rstrip()
        if span.get("links"):
            line += f"  links={len(span['links'])}"
        lines.append(line)
        for child in sorted(children.get(span["span_id"], []), key=lambda s: s["start_unix_nano"]):
            walk(child, depth + 1)

    for root in sorted(children[None], key=lambda s: s["start_unix_nano"]):
        walk(root, 1)
    return lines


def key_attributes(span: dict[str, Any]) -> dict[str, str]:
    attrs = span.get("attributes", {})
    shown = {k.removeprefix("monitoring."): v for k, v in attrs.items() if k.startswith("monitoring.")}
    shown.update({k: attrs[k] for k in SHOWN if k in attrs})
    return {k: str(v)[:MAX_VALUE_CHARS] for k, v in shown.items()}


async def run(args: argparse.Namespace, ctx: Context) -> int:
    spans = read_spans(args.file)
    if not spans:
        return fail(f"no spans in {args.file} (is the trace sink writing there, and tracing on?)")
    traces = traces_of_request(spans, args.request_id)
    if not traces:
        return fail(f"no trace in {args.file} has a span with {REQUEST_ATTRIBUTE}={args.request_id}")
    ctx.emit([sorted(t, key=lambda s: s["start_unix_nano"]) for t in traces],
             "\n\n".join("\n".join(tree_lines(t)) for t in traces))
    return 0

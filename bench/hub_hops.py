"""A probe click's time through the hub, hop by hop (`bench hub_scale`): pure arithmetic on the wall-clock marks
that the benchmark gathers for each click (docs/benchmarks.md, "Hub at scale": the per-hop breakdown).

A click's marks, in the order a click passes them (seconds, `time.time()` of one machine):

- `clicked`: the probe sent POST collect-now; `accepted`: its 202 arrived (the probe);
- `woken`: the coordinator's first wake-up for high work since its last high pass (the click's NOTIFY, as a rule:
  its "high pass woken" log line, which the dispatch loop writes when it takes the wake-up up);
- `pass_started`, `committed`: the coordinator's high pass that dispatched it began, and its transaction committed
  (the coordinator's "high pass committed" log line; absent when a full pass dispatched the click instead);
- `published`: the outbox row's `published_at`, the publisher's broker confirm;
- `at_broker`: a tap queue of the benchmark, bound to the probe client's dispatch keys, got the event (the broker's
  delivery, beside the hub's own queue);
- `on_socket`: the high `task_available` on the probe's WebSocket; `leased`: the lease call answered.

The 202 and the wake-up race (the NOTIFY goes out with the click's commit, the 202 after it), so that hop may be
negative; so may the tap's (the broker confirms as it delivers) and the socket's (the tap and the probe's socket are
both read by the benchmark's one event loop, in either order). A hop is the span between two consecutive marks; a
click lacking one of a hop's marks is left out of that hop only (and out of the shares, which need every mark).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bench.common import percentile

MARKS = ("clicked", "accepted", "woken", "pass_started", "committed", "published", "at_broker", "on_socket", "leased")
HOPS: tuple[tuple[str, str, str], ...] = (
    ("click -> 202 (collect-now request)", "clicked", "accepted"),
    ("202 -> coordinator woken (NOTIFY)", "accepted", "woken"),
    ("woken -> high pass started (the dispatch loop busy)", "woken", "pass_started"),
    ("high pass started -> committed", "pass_started", "committed"),
    ("committed -> relay published (broker confirm)", "committed", "published"),
    ("published -> at the broker's tap queue", "published", "at_broker"),
    ("at the broker -> task_available on the socket (hub)", "at_broker", "on_socket"),
    ("on the socket -> lease in hand", "on_socket", "leased"),
)

Marks = Mapping[str, float | None]


def span_ms(marks: Marks, start: str, end: str) -> float | None:
    """Milliseconds from the mark `start` to the mark `end` (None without both)."""
    a, b = marks.get(start), marks.get(end)
    return None if a is None or b is None else (b - a) * 1000


def hop_spans(clicks: Sequence[Marks]) -> dict[str, list[float]]:
    """Per hop (in HOPS order), the milliseconds of each click that has both of its marks."""
    spans: dict[str, list[float]] = {label: [] for label, _, _ in HOPS}
    for marks in clicks:
        for label, start, end in HOPS:
            if (ms := span_ms(marks, start, end)) is not None:
                spans[label].append(ms)
    return spans


def complete(marks: Marks) -> bool:
    return all(marks.get(m) is not None for m in MARKS)


def total_ms(marks: Marks) -> float | None:
    """Click -> lease in hand, milliseconds (None without both ends)."""
    return span_ms(marks, "clicked", "leased")


def hop_rows(clicks: Sequence[Marks]) -> list[tuple[str, int, float, float]]:
    """(hop, clicks measured, p50 ms, p99 ms) per hop, then the whole click -> lease in hand."""
    rows = [(label, len(v), percentile(v, 50), percentile(v, 99)) for label, v in hop_spans(clicks).items()]
    totals = [t for m in clicks if (t := total_ms(m)) is not None]
    return [*rows, ("click -> lease in hand (all hops)", len(totals), percentile(totals, 50), percentile(totals, 99))]


def shares(clicks: Sequence[Marks]) -> list[tuple[str, float]]:
    """Where the time went: each hop's part of the complete clicks' summed click -> lease time (0..1), largest
    first. Empty without a complete click."""
    whole = [m for m in clicks if complete(m)]
    spent = sum(t for m in whole if (t := total_ms(m)) is not None)
    if not whole or spent <= 0:
        return []
    parts = [(label, sum(v) / spent) for label, v in hop_spans(whole).items()]
    return sorted(parts, key=lambda kv: -kv[1])


def slowest(clicks: Sequence[Marks], n: int = 3) -> list[tuple[float, list[float | None]]]:
    """The n slowest clicks (click -> lease ms, largest first) with each hop's ms (None: a mark missing)."""
    ranked = sorted(((t, m) for m in clicks if (t := total_ms(m)) is not None), key=lambda tm: -tm[0])[:n]
    return [(t, [span_ms(marks, start, end) for _, start, end in HOPS]) for t, marks in ranked]


def lag_summary(samples_ms: Sequence[float]) -> dict[str, float]:
    """An event loop's lag samples (how late each timer fired, ms): count, p50, p99, max."""
    return {"n": float(len(samples_ms)), "p50": percentile(list(samples_ms), 50),
            "p99": percentile(list(samples_ms), 99), "max": max(samples_ms, default=float("nan"))}

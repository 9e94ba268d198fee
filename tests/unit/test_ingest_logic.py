"""Pure ingest logic: fingerprints, domains, success-priority fold, request progress, shard spreading."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from decimal import Decimal

import pytest

from libs.contracts.http import Citation
from libs.ingest.aggregates import CitationFact, RunFact, compute_daily, mention_rate
from libs.ingest.citations import citation_fingerprint, extract_domain, normalise_url, parse_citations
from libs.ingest.runs import fold_latest_effective, incoming_wins
from libs.ingest.shards import assign_shards, lag_ms
from libs.tasks.requests import CountDelta, request_count_delta, request_status_after


@pytest.mark.parametrize(("a", "b"), [
    ("https://Example.com/a", "https://example.com/a"),
    ("http://www.example.com/a/", "https://example.com/a"),
    ("https://example.com:443/a#section", "https://example.com/a"),
    ("https://example.com/a?b=2&a=1&utm_source=x", "https://example.com/a?a=1&b=2"),
    ("example.com/a", "https://example.com/a"),
    ("https://example.com", "https://example.com/"),
])
def test_the_same_page_has_one_fingerprint(a: str, b: str) -> None:
    assert normalise_url(a) == normalise_url(b)
    assert citation_fingerprint(a) == citation_fingerprint(b)
    assert len(citation_fingerprint(a)) == 64


@pytest.mark.parametrize(("a", "b"), [
    ("https://example.com/a", "https://example.com/b"),
    ("https://example.com/a?id=1", "https://example.com/a?id=2"),
    ("https://example.com:8443/a", "https://example.com/a"),
    ("https://a.example.com/", "https://b.example.com/"),
])
def test_different_pages_differ(a: str, b: str) -> None:
    assert citation_fingerprint(a) != citation_fingerprint(b)


@pytest.mark.parametrize(("url", "domain"), [
    ("https://WWW.Example.COM/x", "example.com"),
    ("http://news.example.org:8080/x", "news.example.org"),
    ("example.net/page", "example.net"),
    ("not a url", ""),
    ("mailto:someone@example.com", ""),
    ("https://[::1", ""),
])
def test_domains(url: str, domain: str) -> None:
    assert extract_domain(url) == domain


def test_parse_citations_dedupes_keeping_the_best_position() -> None:
    parsed = parse_citations([Citation(url="https://b.example/x", position=4),
                              Citation(url="https://a.example/y", title="A"),
                              Citation(url="http://www.b.example/x/", title="B", position=1)])
    assert [(c.domain, c.position) for c in parsed] == [("b.example", 1), ("a.example", 1)]
    assert parsed[0].url == "https://b.example/x" and parsed[0].title == "B"


@dataclass(frozen=True)
class R:
    key: str
    status: str
    tag: str


def test_incoming_wins_is_the_success_priority_rule() -> None:
    assert incoming_wins(None, "failed") and incoming_wins(None, "succeeded")
    assert incoming_wins("failed", "failed") and incoming_wins("failed", "succeeded")
    assert incoming_wins("succeeded", "succeeded")
    assert not incoming_wins("succeeded", "failed")


def _sequential(existing: R | None, results: list[R]) -> R | None:
    current = existing
    for r in results:
        if incoming_wins(None if current is None else current.status, r.status):  # type: ignore[arg-type]
            current = r
    return current


@pytest.mark.parametrize("statuses", [p for n in range(1, 5) for p in itertools.product(["failed", "succeeded"],
                                                                                         repeat=n)])
@pytest.mark.parametrize("existing", [None, "failed", "succeeded"])
def test_folding_a_batch_equals_applying_it_one_by_one(statuses: tuple[str, ...], existing: str | None) -> None:
    results = [R("k", s, f"r{i}") for i, s in enumerate(statuses)]
    before = None if existing is None else R("k", existing, "db")
    folded = fold_latest_effective(results, lambda r: r.key)["k"]  # type: ignore[arg-type,type-var]
    after_fold = _sequential(before, [folded])
    assert after_fold == _sequential(before, results)


def test_request_count_delta() -> None:
    assert request_count_delta("pending", "completed") == CountDelta(completed=1)
    assert request_count_delta("pending", "failed") == CountDelta(failed=1)
    assert request_count_delta("failed", "completed") == CountDelta(completed=1, failed=-1)
    assert request_count_delta("pending", "pending").empty
    assert request_count_delta("completed", "completed").empty
    assert request_count_delta("expired", "failed").empty


@pytest.mark.parametrize(("status", "requested", "completed", "failed", "after"), [
    ("running", 3, 1, 0, "running"),
    ("running", 3, 3, 0, "succeeded"),
    ("running", 3, 0, 3, "failed"),
    ("running", 3, 2, 1, "partial"),
    ("dispatching", 2, 2, 0, "succeeded"),
    ("superseded", 2, 2, 0, "superseded"),
    ("timed_out", 2, 1, 1, "timed_out"),
    ("running", 0, 0, 0, "running"),
])
def test_request_status_after(status: str, requested: int, completed: int, failed: int, after: str) -> None:
    assert request_status_after(status, requested=requested, completed=completed, failed=failed) == after


def test_daily_aggregates_by_definition() -> None:
    runs = [RunFact(1, 10, "succeeded", True), RunFact(2, 10, "succeeded", False), RunFact(3, 10, "failed", True),
            RunFact(4, 20, "succeeded", True)]
    cites = [CitationFact(1, "a.example"), CitationFact(1, "b.example"), CitationFact(2, "a.example"),
             CitationFact(3, "z.example"),  # a failed run's citation never counts
             CitationFact(4, "a.example"), CitationFact(4, "")]
    brand, platforms = compute_daily(runs, cites)
    assert brand is not None
    assert (brand.runs, brand.succeeded_runs, brand.failed_runs, brand.brand_mentioned_runs) == (4, 3, 1, 2)
    assert brand.mention_rate == Decimal("0.6667")
    assert (brand.citations, brand.distinct_cited_domains) == (5, 2)
    assert (platforms[10].runs, platforms[10].citations, platforms[10].distinct_cited_domains) == (3, 3, 2)
    assert (platforms[20].mention_rate, platforms[20].citations, platforms[20].distinct_cited_domains) == (
        Decimal("1.0000"), 2, 1)
    assert compute_daily([], []) == (None, {})
    assert mention_rate(0, 0) == Decimal("0.0000")


def test_shards_are_spread_round_robin_over_live_members() -> None:
    assert assign_shards([], 4) == {}
    assert assign_shards(["b", "a", "a"], 4) == {0: "a", 1: "b", 2: "a", 3: "b"}
    spread = assign_shards(["w3", "w1", "w2"], 16)
    counts = {m: sum(1 for v in spread.values() if v == m) for m in ("w1", "w2", "w3")}
    assert sorted(counts.values()) == [5, 5, 6]


def test_lag() -> None:
    assert lag_ms(10_000, None) == 0
    assert lag_ms(10_000, 7_500) == 2_500
    assert lag_ms(10_000, 12_000) == 0  # clock skew never gives a negative lag

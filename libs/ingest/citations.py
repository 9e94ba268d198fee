"""Citation parsing: URL normalisation, fingerprints (docs/architecture.md §12.3 `citation_fingerprint`) and domains."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from libs.contracts.http import Citation

# Query parameters that only track the click, never change the page: dropped before fingerprinting.
TRACKING_PARAMS = frozenset({"utm_source", "utm_medium", "utm_campaign", "utm_term", "utm_content", "utm_id",
                             "gclid", "fbclid", "msclkid", "yclid", "mc_cid", "mc_eid", "ref_src"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class ParsedCitation:
    fingerprint: str
    url: str
    normalised_url: str
    domain: str
    title: str | None
    position: int | None


def normalise_url(url: str) -> str:
    """Canonical form of a cited URL, so the same page cited twice fingerprints the same.

    Lower-cased scheme and host, `www.` kept off, default port dropped, fragment dropped, tracking
    parameters dropped, remaining query parameters sorted, empty path -> `/`, trailing slash of a
    non-root path dropped. Strings that are not http(s) URLs are only trimmed.
    """
    text = url.strip()
    try:
        parts = urlsplit(text if "://" in text else f"https://{text}" if _looks_like_host(text) else text)
        port = parts.port
    except ValueError:
        return text
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower().rstrip(".")
    if scheme not in ("http", "https") or not host:
        return text
    scheme = "https" if scheme == "http" else scheme  # the same page over http and https is one citation
    host = host.removeprefix("www.")
    netloc = host if port is None or port == _DEFAULT_PORTS.get(parts.scheme.lower()) else f"{host}:{port}"
    path = parts.path or "/"
    if len(path) > 1:
        path = path.rstrip("/") or "/"
    query = urlencode(sorted((k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                             if k.lower() not in TRACKING_PARAMS))
    return urlunsplit((scheme, netloc, path, query, ""))


def _looks_like_host(text: str) -> bool:
    head = text.split("/", 1)[0]
    return "." in head and " " not in head and ":" not in head


def citation_fingerprint(url: str) -> str:
    """sha256 hex of the normalised URL: the idempotency key (run_id, citation_fingerprint)."""
    return hashlib.sha256(normalise_url(url).encode()).hexdigest()


def extract_domain(url: str) -> str:
    """Registrable-ish host of a URL (lower case, no `www.`, no port); '' when it is not a web URL."""
    normalised = normalise_url(url)
    try:
        parts = urlsplit(normalised)
    except ValueError:
        return ""
    if parts.scheme not in ("http", "https"):
        return ""
    return (parts.hostname or "")[:255]


def parse_citations(citations: Iterable[Citation]) -> list[ParsedCitation]:
    """One entry per distinct fingerprint, in first-seen order, keeping the best (lowest) position."""
    by_fp: dict[str, ParsedCitation] = {}
    for index, citation in enumerate(citations):
        normalised = normalise_url(citation.url)
        fp = hashlib.sha256(normalised.encode()).hexdigest()
        position = citation.position if citation.position is not None else index
        seen = by_fp.get(fp)
        if seen is None:
            by_fp[fp] = ParsedCitation(fingerprint=fp, url=citation.url, normalised_url=normalised,
                                       domain=extract_domain(citation.url), title=citation.title, position=position)
        elif seen.position is None or position < seen.position:
            by_fp[fp] = ParsedCitation(fingerprint=fp, url=seen.url, normalised_url=normalised, domain=seen.domain,
                                       title=seen.title or citation.title, position=position)
    return list(by_fp.values())

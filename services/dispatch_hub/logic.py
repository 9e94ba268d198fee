"""Pure decisions of the hub over plain values (no I/O): lease tokens, fencing, generations, routing."""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
import secrets
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from libs.auth import hash_token
from libs.contracts.common import NOT_STARTED_PHASES
from libs.contracts.wire import SUBPROTOCOL_PREFIX, SUPPORTED_MAJORS, subprotocol
from libs.tasks.statuses import EndReason

LEASE_TOKEN_PREFIX = "lt1"
PREEMPT_REASON: EndReason = "collect_now_preempt"


def new_lease_token(epoch: int) -> str:
    """Opaque to the client, but it carries the lease epoch it was issued for (fencing)."""
    return f"{LEASE_TOKEN_PREFIX}.{epoch}.{secrets.token_urlsafe(24)}"


def lease_token_epoch(token: str) -> int | None:
    """The epoch a lease token was issued for; None for anything that is not one of our tokens."""
    parts = token.split(".", 2)
    if len(parts) != 3 or parts[0] != LEASE_TOKEN_PREFIX or not parts[1].isdigit() or not parts[2]:
        return None
    return int(parts[1])


class LeaseCheck(Enum):
    OK = "ok"
    NOT_FOUND = "not_found"      # no such task for this client (another client's task looks the same)
    STALE = "stale_lease"        # the lease is no longer this token's: expired, ended or re-leased


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What the database says about an execution, as far as fencing is concerned."""

    target_client_id: uuid.UUID
    status: str
    lease_epoch: int
    lease_token_hash: str | None


def check_lease(state: LeaseState | None, *, caller: uuid.UUID, token: str) -> LeaseCheck:
    """Fencing of contract 5: token hash AND epoch AND in_progress AND the caller owns the task."""
    if state is None or state.target_client_id != caller:
        return LeaseCheck.NOT_FOUND
    epoch = lease_token_epoch(token)
    if (state.status != "in_progress" or epoch is None or epoch != state.lease_epoch
            or state.lease_token_hash is None or hash_token(token) != state.lease_token_hash):
        return LeaseCheck.STALE
    return LeaseCheck.OK


def is_stale_generation(callback_generation: int, task_generation: int) -> bool:
    """docs/architecture.md §10.2: a preempt callback older than the task's current generation is ignored."""
    return callback_generation < task_generation


def announced_heartbeat_interval(seconds: float) -> int:
    """`hello.heartbeat_interval_s` is whole seconds: the hub's interval rounded down, at least 1 (a
    sub-second interval must not be announced as 0, which a client would read as "heartbeat constantly")."""
    return max(1, math.floor(seconds))


def routing_keys_for_client(client_id: uuid.UUID) -> tuple[str, str]:
    """What a hub binds for one connected client: every monitor lane plus control, and publish."""
    return (f"monitor.*.{client_id}", f"publish.{client_id}")


def client_id_from_routing_key(routing_key: str) -> uuid.UUID | None:
    """`monitor.high.<uuid>` / `monitor.control.<uuid>` / `publish.<uuid>` -> the client id."""
    _, _, tail = routing_key.rpartition(".")
    try:
        return uuid.UUID(tail)
    except ValueError:
        return None


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return None
    return value


def percentile(values: Iterable[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class RollingWindow:
    """The last `size` observations, for a p95 gauge that follows recent behaviour."""

    def __init__(self, size: int = 500) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        self._values.append(value)

    def p95(self) -> float | None:
        return percentile(self._values, 95)

    def __len__(self) -> int:
        return len(self._values)


# ---- idempotent results -------------------------------------------------------------------------

RESULT_ID_NAMESPACE = uuid.UUID("6f1c7e0a-3b7d-5a55-9c1e-8d2f4a6b9e10")


def result_id_for(task_id: uuid.UUID, lease_epoch: int) -> uuid.UUID:
    """The result of one lease has one id, whichever post published it: a re-publish after a lost answer or a
    crash between publish and bookkeeping is the same message to ingest, which applies a result id once."""
    return uuid.uuid5(RESULT_ID_NAMESPACE, f"{task_id}:{lease_epoch}")


def result_digest(body: bytes) -> str:
    """What tells an identical retry from a different result posted on the same lease."""
    return hashlib.sha256(body).hexdigest()


class ResultPost(Enum):
    FIRST = "first"            # nothing posted on this lease yet: publish
    REPUBLISH = "republish"    # the same body was posted but not confirmed (in flight or crashed): publish again
    REPLAY = "replay"          # the same body was accepted already: answer the same 202, publish nothing
    CONFLICT = "conflict"      # a different result was posted on this lease: 409


def classify_result_post(previous_digest: str | None, digest: str, *, received: bool) -> ResultPost:
    if previous_digest is None:
        return ResultPost.FIRST
    if previous_digest != digest:
        return ResultPost.CONFLICT
    return ResultPost.REPLAY if received else ResultPost.REPUBLISH


def preempt_cancel_allowed(control_flags: dict[str, object] | None) -> bool:
    """A cancel that says `collect_now_preempt` yields the business task without counting an attempt, so it is
    honoured only for an interrupt the server requested (otherwise a client could skip retry accounting)."""
    return bool((control_flags or {}).get("interrupt_requested"))


def preempt_wasted_work(phase: str | None) -> bool:
    """A yield at a safe point past NAVIGATING threw away started work: the scheduled task runs again because of
    the preemption (collect_now_preempt_induced_retry_count). Before that nothing had really started."""
    return phase is not None and phase not in NOT_STARTED_PHASES


# ---- rate limits ----------------------------------------------------------------------------------


class TokenBuckets:
    """Per-key token buckets (`rate` tokens a second, at most `burst` saved), for upgrade rate limits per
    client and per address. Keys idle long enough to have refilled are dropped, so memory stays bounded by
    the keys active in the last `burst / rate` seconds (and by `max_keys`)."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.full_rate = rate
        self.full_burst = burst
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def share_among(self, replicas: int) -> None:
        """One replica's share of a fleet-wide budget: the rate divided by the replicas, and the burst (at least
        one upgrade). Spread over every replica, a key gets the full rate and at most max(burst, replicas) at once."""
        replicas = max(1, replicas)
        self.rate = self.full_rate / replicas
        self.burst = max(1.0, self.full_burst / replicas)

    @property
    def tracked_keys(self) -> int:
        """How many keys have a bucket now."""
        return len(self._buckets)

    def take(self, key: str, now: float) -> float | None:
        """Take a token: None when allowed, else the seconds until one is available."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate
        if len(self._buckets) >= self.max_keys and key not in self._buckets:
            self._prune(now)
        self._buckets[key] = (tokens - 1, now)
        return None

    def _prune(self, now: float) -> None:
        full_after = self.burst / self.rate
        self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}
        if len(self._buckets) >= self.max_keys:
            self._buckets.clear()  # a flood of distinct keys: forget them all rather than grow without bound


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_address(raw: str) -> IPAddress | None:
    """An IP address as a peer or an X-Forwarded-For entry spells it (`1.2.3.4`, `1.2.3.4:5678`, `::1`,
    `[::1]:443`); an IPv4-mapped IPv6 address is its IPv4 address. None for anything else."""
    text = raw.strip()
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def address_bucket(address: str) -> str:
    """The per-address budget an address draws on: an IPv4 address alone, an IPv6 address its /64 (one subnet, the
    unit a provider hands a site: a client must not get a fresh budget by rotating addresses within it)."""
    parsed = parse_address(address)
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return address


def client_address(peer: str | None, forwarded_for: Iterable[str], trusted: Sequence[IPNetwork]) -> str:
    """The address a WebSocket upgrade counts against (its per-address budget).

    The connection's peer, unless the peer is a trusted proxy. Then the right-most X-Forwarded-For address that
    is not a trusted proxy: every trusted hop appends the address its connection came from, so that entry was
    written by a proxy we trust, while anything left of it is whatever the client chose to send. Every entry
    trusted: the left-most. An entry that is no address where a hop should be: the trusted hop that passed it
    on (a client never gets a bucket of its own choosing).
    """
    if not trusted:
        return peer or "unknown"
    address = parse_address(peer) if peer else None
    if address is None:
        return peer or "unknown"
    entries = [entry for header in forwarded_for for entry in header.split(",") if entry.strip()]
    hops = iter(reversed(entries))
    while any(address in network for network in trusted):
        hop = parse_address(next(hops, ""))
        if hop is None:
            break
        address = hop
    return str(address)


_SUBPROTOCOL = re.compile(re.escape(SUBPROTOCOL_PREFIX) + r"([1-9][0-9]{0,3})", re.ASCII)


@dataclass(frozen=True, slots=True)
class ProtocolChoice:
    """The outcome of a WebSocket upgrade's version negotiation (docs/desktop-protocol.md, Versioning): the major
    to speak and the subprotocol to echo in the 101 (None: the client offered none), or a refusal (`major` None)."""

    major: int | None
    subprotocol: str | None = None


def choose_protocol(offered_headers: Iterable[str], supported: Sequence[int] = SUPPORTED_MAJORS) -> ProtocolChoice:
    """The highest supported major among the `Sec-WebSocket-Protocol` values a client offered. No header at all is
    a client from before versioning: major 1, nothing echoed. A header naming only majors this hub does not serve
    (a newer client) or only foreign subprotocols is refused: RFC 6455 has the client fail a handshake whose answer
    echoes none of its offers, so the hub says why before the upgrade instead."""
    offered = [token.strip() for header in offered_headers for token in header.split(",") if token.strip()]
    if not offered:
        return ProtocolChoice(major=1)
    majors = {int(match.group(1)) for match in map(_SUBPROTOCOL.fullmatch, offered) if match}
    served = sorted(majors & set(supported))
    if not served:
        return ProtocolChoice(major=None)
    return ProtocolChoice(major=served[-1], subprotocol=subprotocol(served[-1]))


# Rebalancing (docs/architecture.md "Hub fleet"): a sweep sheds at most this share of the hub's sockets (at least
# one), and only when calm: its sockets changed by at most REBALANCE_CALM_CHANGES plus this share since the last
# sweep, its own closes aside (never while a storm or a rolling restart is moving clients anyway).
REBALANCE_SHARE = 0.01
REBALANCE_CALM_CHANGES = 20
# ... and never below its fair share plus this many: a few sockets over are not worth a reconnect (a small fleet's
# hubs are always a few apart).
REBALANCE_MIN_EXCESS = 10


def sockets_to_shed(mine: int, fleet: int, live_hubs: int, *, slack: float, changed: int,
                    lightest: int | None = None) -> int:
    """How many of its `mine` sockets a hub closes this sweep (4503, its clients reconnect through the load
    balancer) so that every replica holds its fair share of the `fleet`'s sockets over the `live_hubs` within
    `slack`: none more than (1 + `slack`) times it, and, while the `lightest` holds less than (1 - `slack`) times
    it, none above it (a random reconnect lands on the light one only now and then, so the heavy ones go on
    shedding until it has its part). Never closer than REBALANCE_MIN_EXCESS to the fair share. 0 with one hub,
    with `slack` 0 (rebalancing off), within all that, or when the sockets `changed` by more than a calm sweep's
    since the last one; else the excess, at most REBALANCE_SHARE of `mine` (at least 1)."""
    if slack <= 0 or live_hubs < 2 or mine <= 0:
        return 0
    if changed > REBALANCE_CALM_CHANGES + REBALANCE_SHARE * mine:
        return 0
    fair = max(fleet, mine) / live_hubs
    allowed = max(math.ceil(fair * (1 + slack)), math.ceil(fair) + REBALANCE_MIN_EXCESS)
    if lightest is not None and lightest < fair * (1 - slack) and fair - lightest >= REBALANCE_MIN_EXCESS:
        allowed = math.ceil(fair) + REBALANCE_MIN_EXCESS
    return max(0, min(mine - allowed, max(1, int(REBALANCE_SHARE * mine))))


class ShedReturns:
    """Whether the clients a hub shed to rebalance come back to it: behind a load balancer that pins a client to a
    replica (session affinity by address, a consistent hash), every shed socket returns at once and shedding only
    churns. A client shed is counted as returned when it attaches here again within `window_s`, as away until then
    and after; once at least `min_shed` were shed in the last two windows and `futile_share` of them returned (a
    random pick over N replicas returns 1/N: half with two), rebalancing pauses for `pause_s`."""

    def __init__(self, *, window_s: float = 60.0, pause_s: float = 600.0, min_shed: int = 20,
                 futile_share: float = 0.8) -> None:
        self.window_s, self.pause_s, self.min_shed, self.futile_share = window_s, pause_s, min_shed, futile_share
        self._pending: dict[uuid.UUID, float] = {}  # shed, not back (yet): when
        self._outcomes: deque[tuple[float, bool]] = deque()  # (when, came back)
        self.paused_until = 0.0

    def shed(self, client_ids: Iterable[uuid.UUID], now: float) -> None:
        for client_id in client_ids:
            self._pending[client_id] = now

    def attached(self, client_id: uuid.UUID, now: float) -> None:
        if self._pending.pop(client_id, None) is not None:
            self._outcomes.append((now, True))

    def paused(self, now: float) -> bool:
        """True while rebalancing is paused; starts a pause when the shed clients keep coming back."""
        for client_id, at in list(self._pending.items()):
            if now - at > self.window_s:
                del self._pending[client_id]
                self._outcomes.append((at, False))
        while self._outcomes and now - self._outcomes[0][0] > 2 * self.window_s:
            self._outcomes.popleft()
        returned = sum(1 for _, back in self._outcomes if back)
        seen = len(self._outcomes) + len(self._pending)  # the ones not back yet count as away
        if seen >= self.min_shed and returned >= self.futile_share * seen:
            self.paused_until = now + self.pause_s
            self._outcomes.clear()
            self._pending.clear()
        return now < self.paused_until

"""Typed configuration from the environment (12-factor), defaults of docs/architecture.md, Interfaces."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import uuid
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, get_type_hints

if TYPE_CHECKING:
    from libs.auth import GatewayVerifier

DEV_JWT_SECRET = "dev-only-gateway-secret-change-me"
MIN_JWT_SECRET_BYTES = 32
DEV_PUSH_LEASE_SECRET = "dev-only-push-lease-secret-change-me"
# Words that mark a secret copied from an example or a default: refused outside DEV_MODE.
PLACEHOLDER_MARKERS = ("change-me", "changeme", "change_me", "replace-me", "replace_me", "replaceme", "dev-only",
                       "example", "placeholder", "secret-here", "your-secret", "not-a-secret")

SERVICE_PORTS: dict[str, int] = {
    "collect-now-api": 8081,
    "dispatch-hub": 8082,
    "dispatch-coordinator": 9101,
    "outbox-pump": 9102,
    "ingest-shard-workers": 9103,
    "projection-worker": 9104,
    "reconciler": 9105,
}


class ConfigError(ValueError):
    """A setting in the environment cannot be parsed."""


def _parse(name: str, raw: str, kind: Any) -> Any:
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered in {"1", "true", "yes", "on"}:
                return True
            if lowered in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        return raw
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from exc


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting a service reads; each field maps to the upper-cased environment variable."""

    database_url: str = "postgresql://postgres@127.0.0.1:5432/monitoring"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    # The AMQP heartbeat asked of the broker (unless AMQP_URL names one): a silent broker is declared dead after
    # about three of them (libs/mq/connection.py).
    amqp_heartbeat_s: int = 5
    # Prefix for every exchange and queue name; tests use a unique one per test.
    mq_prefix: str = ""
    # Allows what production must refuse: the built-in development gateway secret, a short or placeholder
    # secret, and an ops API without a token. `make run` and the tests set it; deploy/k8s never does.
    dev_mode: bool = False
    gateway_jwt_secret: str = ""
    gateway_jwt_public_key: str = ""
    # The gateway's tokens must name this audience / issuer: required outside DEV_MODE (start-up refuses).
    gateway_jwt_audience: str = ""
    gateway_jwt_issuer: str = ""
    # Clock skew tolerated on exp/iat/nbf between the gateway and this service.
    gateway_jwt_leeway_seconds: int = 10
    # The longest lifetime accepted (exp - iat; a token without either is refused).
    gateway_jwt_max_lifetime_seconds: int = 3600
    # The gateway's keys as a JWKS, chosen by the token's `kid` (two live during a rotation): a file (re-read when
    # it changes) or a URL (cached GATEWAY_JWKS_CACHE_SECONDS). Either one replaces GATEWAY_JWT_SECRET/_PUBLIC_KEY.
    gateway_jwks_file: str = ""
    gateway_jwks_url: str = ""
    gateway_jwks_cache_seconds: int = 300
    # Bearer token for the coordinator's /api/ops/* routes (a Kubernetes Secret); unset: those routes refuse.
    ops_api_token: str = ""
    ingest_shards: int = 16
    http_host: str = "0.0.0.0"
    http_port: int = 0
    db_pool_min: int = 1
    db_pool_max: int = 4
    # Set on every pooled connection: no statement, lock wait or forgotten transaction holds a connection (and
    # what it locked) for long. 0 turns one off.
    db_statement_timeout_ms: int = 30_000
    db_lock_timeout_ms: int = 10_000
    db_idle_in_transaction_timeout_ms: int = 60_000
    # Every connection (pooled, LISTEN, leader, monitorctl) finds a dead peer in seconds, not after the kernel's
    # two hours: libpq TCP keepalives (probe after KEEPALIVES_IDLE s of silence, every INTERVAL s, COUNT times:
    # 4 + 2 * 3 = 10 s), TCP_USER_TIMEOUT for data sent and never acknowledged, and a deadline on connecting
    # (per host of a multi-host DATABASE_URL). What DATABASE_URL sets itself wins over these.
    db_connect_timeout_s: int = 5
    db_keepalives_idle_s: int = 4
    db_keepalives_interval_s: int = 2
    db_keepalives_count: int = 3
    db_tcp_user_timeout_ms: int = 10_000
    # The same four on the server's side of each session (Postgres' per-session tcp_keepalives_* and
    # tcp_user_timeout): the server ends the session of a client that went silent (a lost node) within ~10 s,
    # and with it that session's locks (the leader's advisory lock) and open transaction.
    db_server_keepalive: bool = True
    # A pool that lost its database retries every connection at most this far apart (with jitter), for as long
    # as the database is away: back within about this long of its return, never giving up.
    db_reconnect_max_delay_ms: int = 1000
    # Each database writer's write health for the coordinator's auto slow-down (libs/db/write_health.py): the
    # window its p95 and conflict rate cover, the fewest writes that make them count, how often it publishes.
    write_health_window_s: float = 60.0
    write_health_min_samples: int = 20
    write_health_publish_s: float = 5.0
    log_level: str = "INFO"
    instance_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
    shutdown_grace_seconds: float = 20.0
    # outbox-pump
    outbox_batch_size: int = 200
    outbox_poll_interval_ms: int = 1000
    outbox_listen: bool = True
    outbox_claim_lease_seconds: float = 30.0
    outbox_max_attempts: int = 10
    outbox_backoff_base_ms: int = 500
    outbox_backoff_max_ms: int = 300_000
    outbox_publish_timeout_seconds: float = 10.0
    outbox_retention_hours: int = 24
    outbox_concurrency: int = 2
    # dispatch-coordinator: it publishes its own high TaskAvailable rows right after its commit (claimed in
    # the writing transaction; libs/outbox/relay.py), instead of waiting for a pump's NOTIFY wake-up and
    # claim. The lease is how long a crashed coordinator's claimed rows wait before a pump reclaims them;
    # a relay publish waits half of it for the broker's confirm.
    coordinator_relay: bool = True
    coordinator_relay_lease_seconds: float = 5.0
    # collect-now-api: one tenant's clicks on a database connection in this process at most (keep it under the
    # pool's size, 4 to 6), how long more wait for a turn (holding no connection) and how long a click waits
    # for the tenant's lock (another replica's click); past either wait, 429 tenant_busy.
    collect_now_tenant_max_in_flight: int = 2
    collect_now_tenant_wait_ms: int = 1000
    collect_now_lock_wait_ms: int = 1000
    # collect-now's `Idempotency-Key`: how long a key's first answer is kept and replayed, and how often the
    # service deletes the expired ones (docs/api.md, Idempotency).
    collect_now_idempotency_key_ttl_hours: int = 24
    collect_now_idempotency_purge_s: float = 60.0
    # dispatch-hub / desktop
    lease_ttl_seconds: int = 120
    # Push-lease (docs/desktop-protocol.md "Push-lease"): a client that announces `push_lease` gets its executions
    # leased at dispatch, the token on `task_available`. The token is derived (HMAC of PUSH_LEASE_SECRET over task
    # and epoch), never stored or queued: the coordinator and every hub hold the same secret (a Kubernetes Secret).
    # Off by default (every client pulls) until both services hold the secret; enabled without a secret, outside
    # DEV_MODE, the service refuses to start. A pushed lease lasts PUSH_LEASE_TTL_SECONDS until the client's first
    # extend, so one that never arrives is requeued soon.
    push_lease_enabled: bool = False
    push_lease_secret: str = ""
    push_lease_ttl_seconds: int = 30
    heartbeat_timeout_seconds: int = 30
    max_body_bytes: int = 256 * 1024
    # WebSocket ping period, also the heartbeat period the hub announces to clients. from_env derives it
    # from HEARTBEAT_TIMEOUT_SECONDS when unset (a third of it, at least 1 s): 10 for the default 30.
    hub_ping_interval_s: float = 10.0
    # How often buffered client heartbeats are written to Postgres.
    hub_heartbeat_flush_s: float = 2.0
    # How long a result publish waits for the broker's confirm before the client is told to retry.
    hub_result_confirm_timeout_s: float = 5.0
    # Live WebSockets per client token on one hub; a newer one closes the oldest (close code 4409).
    hub_max_sockets_per_client: int = 2
    # WebSocket upgrades per client (after authentication) and per source address (before it), as token
    # buckets: a rate per second and a burst. An address can stand for a whole office behind NAT, or for an
    # ingress: keep its budget generous (a hub restart reconnects every client at once).
    hub_upgrades_per_client_per_s: float = 0.2
    hub_upgrade_burst_per_client: int = 5
    hub_upgrades_per_address_per_s: float = 200.0
    hub_upgrade_burst_per_address: int = 2000
    # Proxies whose X-Forwarded-For the hub believes, as comma-separated addresses or CIDRs (the ingress
    # controller's pods): an upgrade from one counts against the right-most X-Forwarded-For address that is
    # not a trusted proxy. Empty: trust none, the connection's own peer address counts.
    hub_trusted_proxies: str = ""
    # How often a hub looks for disabled clients and rotated tokens among its sockets (and closes them).
    hub_revocation_check_s: float = 2.0
    # Client-token lookups cached in each hub: known tokens briefly (a disabled client is refused within this),
    # unknown ones longer (a flood of made-up tokens costs no queries).
    hub_auth_cache_s: float = 5.0
    hub_auth_negative_cache_s: float = 30.0
    # How often a hub writes the safe-point intervals it received into the shared histogram.
    hub_safe_point_flush_s: float = 10.0
    # SIGTERM drain: every socket is closed with 4503 and a delay drawn from [0, spread] after which its client
    # reconnects (to another hub); close handshakes still open after the deadline are abandoned.
    hub_drain_reconnect_spread_ms: int = 10_000
    hub_drain_deadline_s: float = 5.0
    # Rebalancing: a hub holding more than (1 + this) x its fair share of the live replicas' sockets closes a few a
    # sweep with 4503 and a delay drawn from [0, HUB_DRAIN_RECONNECT_SPREAD_MS] (0: never).
    hub_rebalance_slack: float = 0.25
    # WebSocket handshakes (authentication, upgrade, attach, hello + replay) a hub runs at once; the rest wait their
    # turn in arrival order. In a reconnect storm an unbounded number shared the event loop with the live sockets'
    # events and lease calls, which waited behind thousands of half-done handshakes (docs/benchmarks.md, "What held
    # the coordinator's event loop, and the hub's").
    hub_handshake_concurrency: int = 64
    # The hub runs its full garbage collections itself, one every this many seconds when no storm is on (0: CPython's
    # automatic ones, which walked every socket's objects again and again through a storm; libs/gc_control.py).
    hub_gc_full_collection_s: float = 600.0
    # ingest-shard-workers
    # Results per ingest transaction (at most) and unacked deliveries per shard channel. Measured: 200/400
    # -> ~3,700-4,200 results/s with 2 workers, 500/1000 -> ~4,200-5,000 (fewer commits and round trips).
    ingest_batch_size: int = 500
    ingest_prefetch: int = 1000
    ingest_member_heartbeat_seconds: float = 2.0
    ingest_member_timeout_seconds: float = 10.0
    ingest_applied_retention_hours: int = 168
    # Longest database outage a shard holds its unacked deliveries through before giving them back (one delivery
    # of the quorum limit spent). Below RabbitMQ's consumer_timeout (30 min default), or the broker closes the channel.
    ingest_db_outage_hold_seconds: float = 1200.0
    # projection-worker
    projection_concurrency: int = 2
    projection_sweep_interval_ms: int = 1000
    projection_claim_lease_seconds: float = 30.0
    projection_max_attempts: int = 10
    # the event path: keys claimed per tenant-fair round; how long a refused (poison) key is left to the sweep
    projection_event_batch: int = 20
    projection_refused_hold_seconds: float = 60.0
    # merge mode while the coordinator reports auto slow-down (§12.4): every window, batches of at most
    # this many keys, one transaction each, until the queue is drained
    projection_merge_window_ms: int = 5000
    projection_merge_batch: int = 200

    @classmethod
    def from_env(cls, service: str | None = None, env: dict[str, str] | None = None) -> Settings:
        source = os.environ if env is None else env
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f.name.upper()
            if name in source:
                values[f.name] = _parse(name, source[name], hints[f.name])
        if "http_port" not in values and service is not None:
            port_var = f"{service.upper().replace('-', '_')}_PORT"
            if port_var in source:
                values["http_port"] = _parse(port_var, source[port_var], int)
            else:
                values["http_port"] = SERVICE_PORTS.get(service, 0)
        settings = cls(**values)
        if "hub_ping_interval_s" not in values:
            settings = replace(settings, hub_ping_interval_s=max(settings.heartbeat_timeout_seconds / 3, 1.0))
        for name in ("db_statement_timeout_ms", "db_lock_timeout_ms", "db_idle_in_transaction_timeout_ms",
                     "db_tcp_user_timeout_ms"):
            if getattr(settings, name) < 0:
                raise ConfigError(f"{name.upper()} must not be negative")
        for name in ("amqp_heartbeat_s", "db_connect_timeout_s", "db_keepalives_idle_s", "db_keepalives_interval_s",
                     "db_keepalives_count", "db_reconnect_max_delay_ms"):
            if getattr(settings, name) < 1:
                raise ConfigError(f"{name.upper()} must be at least 1")
        if settings.gateway_jwt_leeway_seconds < 0:
            raise ConfigError("GATEWAY_JWT_LEEWAY_SECONDS must not be negative")
        if not 60 <= settings.gateway_jwt_max_lifetime_seconds <= 7 * 86400:
            raise ConfigError("GATEWAY_JWT_MAX_LIFETIME_SECONDS must be from 60 to 604800 (a week)")
        if settings.gateway_jwks_cache_seconds < 1:
            raise ConfigError("GATEWAY_JWKS_CACHE_SECONDS must be at least 1")
        if settings.ingest_shards <= 0:
            raise ConfigError("INGEST_SHARDS must be positive")
        if not 0 < settings.ingest_db_outage_hold_seconds < 1800:
            raise ConfigError("INGEST_DB_OUTAGE_HOLD_SECONDS must be above 0 and below 1800 (RabbitMQ's default "
                              "consumer_timeout)")
        if settings.push_lease_enabled and not 5 <= settings.push_lease_ttl_seconds <= settings.lease_ttl_seconds:
            # Checked only where it is used: a pull-only deployment may run leases shorter than the push default.
            raise ConfigError("PUSH_LEASE_TTL_SECONDS must be from 5 to LEASE_TTL_SECONDS")
        if settings.hub_max_sockets_per_client < 1:
            raise ConfigError("HUB_MAX_SOCKETS_PER_CLIENT must be at least 1")
        if not 1 <= settings.hub_handshake_concurrency <= 10_000:
            raise ConfigError("HUB_HANDSHAKE_CONCURRENCY must be from 1 to 10000")
        if not (settings.hub_gc_full_collection_s == 0 or 5 <= settings.hub_gc_full_collection_s <= 3600):
            raise ConfigError("HUB_GC_FULL_COLLECTION_S must be 0 (CPython's automatic full collections) or from 5 "
                              "to 3600")
        if not (settings.hub_rebalance_slack == 0 or 0.05 <= settings.hub_rebalance_slack <= 10):
            raise ConfigError("HUB_REBALANCE_SLACK must be 0 (no rebalancing) or from 0.05 to 10")
        if not 0 <= settings.hub_drain_reconnect_spread_ms <= 600_000:
            raise ConfigError("HUB_DRAIN_RECONNECT_SPREAD_MS must be from 0 to 600000")
        if settings.hub_upgrade_burst_per_client < 1 or settings.hub_upgrade_burst_per_address < 1:
            raise ConfigError("HUB_UPGRADE_BURST_PER_CLIENT and HUB_UPGRADE_BURST_PER_ADDRESS must be at least 1")
        settings.trusted_proxy_networks()
        for name, low, high in (("collect_now_tenant_max_in_flight", 1, 64), ("collect_now_tenant_wait_ms", 1, 60_000),
                                ("collect_now_lock_wait_ms", 1, 60_000),
                                ("collect_now_idempotency_key_ttl_hours", 1, 24 * 30)):
            if not low <= getattr(settings, name) <= high:
                raise ConfigError(f"{name.upper()}={getattr(settings, name)} must be from {low} to {high}")
        for name in ("hub_ping_interval_s", "hub_heartbeat_flush_s", "hub_result_confirm_timeout_s",
                     "hub_upgrades_per_client_per_s", "hub_upgrades_per_address_per_s", "hub_revocation_check_s",
                     "hub_auth_cache_s", "hub_auth_negative_cache_s", "hub_safe_point_flush_s",
                     "hub_drain_deadline_s", "write_health_window_s", "write_health_publish_s",
                     "collect_now_idempotency_purge_s"):
            value = getattr(settings, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name.upper()}={value!r} must be a positive number of seconds")
        return settings

    def jwt_key(self) -> tuple[str, str]:
        """(key, algorithm) for gateway JWTs; raises ConfigError unless a real key is configured.

        A real key is an RS256 public key (PEM) or an HS256 secret of at least 32 bytes that is not a
        known placeholder. DEV_MODE accepts any secret and, when none is set, the development secret.
        """
        if self.gateway_jwt_public_key:
            return _checked_public_key(self.gateway_jwt_public_key), "RS256"
        secret = self.gateway_jwt_secret
        if secret:
            if not self.dev_mode:
                _check_secret(secret)
            return secret, "HS256"
        if not self.dev_mode:
            raise ConfigError("set GATEWAY_JWT_SECRET (HS256, at least 32 random bytes) or GATEWAY_JWT_PUBLIC_KEY "
                              "(RS256 PEM); DEV_MODE=1 allows the development secret")
        logging.getLogger("config").warning(
            "GATEWAY_JWT_SECRET is not set: DEV_MODE uses the development secret; never do this in production"
        )
        return DEV_JWT_SECRET, "HS256"

    def gateway_verifier(self) -> GatewayVerifier:
        """How gateway tokens are verified (collect-now-api, at start-up); raises ConfigError, so the service does
        not start, when the key is not a real one (`jwt_key`), a JWKS file is missing or invalid, both a file and a
        URL are set, or (outside DEV_MODE) GATEWAY_JWT_AUDIENCE or GATEWAY_JWT_ISSUER is unset."""
        from libs.auth import GatewayVerifier, JwksFile, JwksUrl, KeySource, StaticKey

        if self.gateway_jwks_file and self.gateway_jwks_url:
            raise ConfigError("set GATEWAY_JWKS_FILE or GATEWAY_JWKS_URL, not both")
        keys: KeySource
        if self.gateway_jwks_file:
            source = JwksFile(self.gateway_jwks_file)
            try:
                source.load()
            except (OSError, ValueError) as exc:
                raise ConfigError(f"GATEWAY_JWKS_FILE={self.gateway_jwks_file!r}: {exc}") from exc
            keys = source
        elif self.gateway_jwks_url:
            if not self.gateway_jwks_url.startswith(("https://", "http://")):
                raise ConfigError("GATEWAY_JWKS_URL must be an http(s) URL")
            if not self.dev_mode and not self.gateway_jwks_url.startswith("https://") and not _loopback_url(
                    self.gateway_jwks_url):
                raise ConfigError("GATEWAY_JWKS_URL must be https:// (keys fetched in clear could be replaced)")
            keys = JwksUrl(self.gateway_jwks_url, cache_s=self.gateway_jwks_cache_seconds)
        else:
            keys = StaticKey(*self.jwt_key())
        if not self.dev_mode:
            missing = [name for name, value in (("GATEWAY_JWT_AUDIENCE", self.gateway_jwt_audience),
                                                ("GATEWAY_JWT_ISSUER", self.gateway_jwt_issuer)) if not value]
            if missing:
                raise ConfigError(f"set {' and '.join(missing)}: outside DEV_MODE the gateway's tokens must name "
                                  "the audience and issuer this service expects")
        return GatewayVerifier(keys, audience=self.gateway_jwt_audience or None,
                               issuer=self.gateway_jwt_issuer or None, leeway_s=self.gateway_jwt_leeway_seconds,
                               max_lifetime_s=self.gateway_jwt_max_lifetime_seconds)

    def trusted_proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """HUB_TRUSTED_PROXIES parsed; raises ConfigError for an entry that is no address or CIDR (or a CIDR with
        host bits set, which usually means a typo)."""
        networks = []
        for entry in (part.strip() for part in self.hub_trusted_proxies.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry))
            except ValueError as exc:
                raise ConfigError(f"HUB_TRUSTED_PROXIES: {entry!r} is not an address or CIDR such as 10.0.0.0/8 "
                                  f"({exc})") from exc
        return tuple(networks)

    def push_lease_key(self) -> bytes | None:
        """The push-lease HMAC key, or None when push-lease is off (every client pulls). Fails closed: enabled with
        no secret, or a short or placeholder one, raises ConfigError unless DEV_MODE (which uses a fixed
        development key when none is set)."""
        if not self.push_lease_enabled:
            return None
        secret = self.push_lease_secret
        if not secret:
            if not self.dev_mode:
                raise ConfigError("PUSH_LEASE_ENABLED is on but PUSH_LEASE_SECRET is not set (at least 32 random "
                                  "bytes, the same for dispatch-coordinator and every dispatch-hub); set it, or "
                                  "PUSH_LEASE_ENABLED=0 for pull-lease only")
            return DEV_PUSH_LEASE_SECRET.encode()
        if not self.dev_mode:
            _check_secret(secret, "PUSH_LEASE_SECRET")
        return secret.encode()

    def ops_token(self) -> str:
        """OPS_API_TOKEN; raises ConfigError for a configured token that is short (under 32 bytes) or a known
        placeholder, as for the gateway secret, unless DEV_MODE. Empty: the ops API is disabled (403)."""
        token = self.ops_api_token
        if token and not self.dev_mode:
            _check_secret(token, "OPS_API_TOKEN")
        return token


def _loopback_url(url: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_secret(secret: str, name: str = "GATEWAY_JWT_SECRET") -> None:
    if len(secret.encode()) < MIN_JWT_SECRET_BYTES:
        raise ConfigError(f"{name} is {len(secret.encode())} bytes; at least {MIN_JWT_SECRET_BYTES} "
                          "random bytes are required (e.g. `openssl rand -hex 32`)")
    lowered = secret.lower()
    marker = next((m for m in PLACEHOLDER_MARKERS if m in lowered), None)
    if secret == DEV_JWT_SECRET or marker is not None:
        raise ConfigError(f"{name} looks like a placeholder (contains {marker!r}); set a random secret")


def _checked_public_key(pem: str) -> str:
    from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(pem.encode())
    except ValueError as exc:
        raise ConfigError(f"GATEWAY_JWT_PUBLIC_KEY is not a PEM public key: {exc}") from exc
    if not isinstance(key, RSAPublicKey):
        raise ConfigError("GATEWAY_JWT_PUBLIC_KEY must be an RSA public key (RS256)")
    return pem

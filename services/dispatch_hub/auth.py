"""Client-token authentication: `Authorization: Bearer <token>`, looked up by its sha256 hash."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeVar

from psycopg_pool import AsyncConnectionPool

from libs.auth import hash_token
from libs.db.pool import Conn
from libs.http import ApiError
from services.dispatch_hub import queries as q
from services.dispatch_hub.batching import Batcher
from services.dispatch_hub.logic import bearer_token

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class ClientPrincipal:
    client_id: uuid.UUID
    tenant_id: int
    workspace_id: int
    user_id: int
    # The hash of the token the client authenticated with: a rotated token closes the sockets opened with it.
    token_hash: str = ""


class ClientAuthenticator:
    """Resolves tokens to clients, with a short positive cache so the hot path skips a query, and a longer
    negative cache so made-up tokens cost no query after the first.

    A disabled client is refused within `cache_ttl_s` (the cache holds only enabled clients), and at once on
    the hub that holds its sockets (the revocation sweep calls `forget`). Lookups that miss the cache are
    batched: the tokens of every handshake that arrives while one lookup runs are looked up in the next one.
    """

    def __init__(self, pool: AsyncConnectionPool[Conn], *, cache_ttl_s: float = 5.0,
                 negative_ttl_s: float = 30.0, max_entries: int = 50_000):
        self._pool = pool
        self._ttl = cache_ttl_s
        self._negative_ttl = negative_ttl_s
        self._max = max_entries
        self._cache: dict[str, tuple[float, ClientPrincipal]] = {}
        self._unknown: dict[str, float] = {}
        self.lookups = 0
        self._batch: Batcher[str, dict[str, Any] | None] = Batcher(self._lookup, default=None, name="auth")

    async def authenticate(self, authorization: str | None) -> ClientPrincipal:
        token = bearer_token(authorization)
        if token is None:
            raise ApiError(401, "unauthorized", "send the client token as `Authorization: Bearer <token>`")
        token_hash = hash_token(token)
        now = time.monotonic()
        cached = self._cache.get(token_hash)
        if cached is not None and cached[0] > now:
            return cached[1]
        if self._unknown.get(token_hash, 0.0) > now:
            raise ApiError(401, "unauthorized", "unknown client token")
        self.lookups += 1
        row = await self._batch.submit(token_hash)
        if row is None:
            self._cache.pop(token_hash, None)
            _bounded_put(self._unknown, token_hash, now + self._negative_ttl, self._max)
            raise ApiError(401, "unauthorized", "unknown client token")
        if row["disabled_at"] is not None:
            self._cache.pop(token_hash, None)
            raise ApiError(401, "client_disabled", "this desktop client has been disabled")
        principal = ClientPrincipal(client_id=row["id"], tenant_id=int(row["tenant_id"]),
                                    workspace_id=int(row["workspace_id"]), user_id=int(row["user_id"]),
                                    token_hash=token_hash)
        _bounded_put(self._cache, token_hash, (now + self._ttl, principal), self._max)
        return principal

    async def _lookup(self, token_hashes: list[str]) -> dict[str, dict[str, Any]]:
        async with self._pool.connection() as conn:
            cur = await conn.execute(q.AUTHENTICATE_CLIENTS, {"token_hashes": token_hashes})
            return {row["token_hash"]: row for row in await cur.fetchall()}

    def forget(self, client_id: uuid.UUID) -> None:
        """Drop a client's cached tokens (it was disabled, or its token rotated)."""
        for token_hash, (_, principal) in list(self._cache.items()):
            if principal.client_id == client_id:
                del self._cache[token_hash]


def _bounded_put(cache: dict[str, V], key: str, value: V, max_entries: int) -> None:
    if len(cache) >= max_entries and key not in cache:
        cache.clear()
    cache[key] = value

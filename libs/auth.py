"""Credentials: desktop client tokens (stored hashed) and gateway-issued tenant JWTs (one key, or a JWKS by `kid`)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import jwt
from jwt import PyJWK, PyJWKClient, PyJWKSet

CLIENT_TOKEN_PREFIX = "dct_"


def new_client_token() -> str:
    return CLIENT_TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """sha256 hex of the whole token: what `desktop_clients.token_hash` and lease hashes store."""
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_match(token: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_token(token), stored_hash)


@dataclass(frozen=True, slots=True)
class TenantPrincipal:
    tenant_id: int
    workspace_id: int
    user_id: int


class AuthError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


MAX_ID = 2**63 - 1


def issue_gateway_jwt(key: Any, principal: TenantPrincipal, *, ttl_s: int = 3600, algorithm: str = "HS256",
                      audience: str | None = None, issuer: str | None = None, kid: str | None = None) -> str:
    """What the tenant-api gateway issues; used by tests, the demo and benchmarks. `kid`: the key's id in the
    gateway's JWKS (in the token's header)."""
    now = int(time.time())
    claims: dict[str, object] = {"tenant_id": principal.tenant_id, "workspace_id": principal.workspace_id,
                                 "user_id": principal.user_id, "iat": now, "exp": now + ttl_s}
    if audience:
        claims["aud"] = audience
    if issuer:
        claims["iss"] = issuer
    return jwt.encode(claims, key, algorithm=algorithm, headers={"kid": kid} if kid else None)


def verify_gateway_jwt(token: str, key: Any, algorithm: str, *, audience: str | None = None,
                       issuer: str | None = None, leeway_s: float = 0,
                       max_lifetime_s: int | None = None) -> TenantPrincipal:
    """The principal of a gateway token: signature, `exp` (required), `aud`/`iss` when configured, and with
    `max_lifetime_s` an `iat` (required) no more than that before `exp`.

    The identity claims must be JSON integers in 1..2^63-1: a string ("5"), a float, a boolean or zero is
    refused, so no two spellings of a claim can name the same tenant.
    """
    required = ["exp", *(["iat"] if max_lifetime_s is not None else []), *(["aud"] if audience else []),
                *(["iss"] if issuer else [])]
    try:
        claims = jwt.decode(token, key, algorithms=[algorithm], audience=audience or None, issuer=issuer or None,
                            leeway=leeway_s, options={"require": required, "verify_aud": bool(audience)})
    except jwt.ExpiredSignatureError as exc:
        raise AuthError("token_expired", "the gateway token has expired") from exc
    except jwt.PyJWTError as exc:
        raise AuthError("invalid_token", f"the gateway token is not valid: {exc}") from exc
    if max_lifetime_s is not None:
        lifetime = claims["exp"] - claims["iat"]
        if lifetime > max_lifetime_s:
            raise AuthError("token_lifetime_too_long", f"the gateway token is valid for {lifetime} s from its iat; "
                            f"at most {max_lifetime_s} s is accepted")
    ids = [claims.get(name) for name in ("tenant_id", "workspace_id", "user_id")]
    for name, value in zip(("tenant_id", "workspace_id", "user_id"), ids, strict=True):
        if type(value) is not int or not 0 < value <= MAX_ID:
            raise AuthError("invalid_token", f"the token's {name} must be a positive JSON integer")
    return TenantPrincipal(*ids)  # type: ignore[arg-type]


# ---- where the gateway's verification keys come from -------------------------------------------------------


class KeyUnavailable(Exception):
    """The gateway's key set cannot be had right now (its JWKS URL does not answer): a 503, not a 401."""


class KeySource(Protocol):
    async def key_for(self, token: str) -> tuple[Any, str]:
        """(key, algorithm) that must have signed `token`; AuthError when none may (an unknown `kid`)."""
        ...


@dataclass(frozen=True, slots=True)
class StaticKey:
    """One configured key (GATEWAY_JWT_SECRET, HS256, or GATEWAY_JWT_PUBLIC_KEY, RS256): whatever the `kid`."""

    key: str
    algorithm: str

    async def key_for(self, token: str) -> tuple[Any, str]:
        return self.key, self.algorithm


def _kid(token: str) -> str:
    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except jwt.PyJWTError as exc:
        raise AuthError("invalid_token", f"the gateway token is not valid: {exc}") from exc
    if not isinstance(kid, str) or not kid:
        raise AuthError("invalid_token", "the gateway token names no key (`kid` header): the gateway's key set "
                        "has several")
    return kid


def _by_kid(keys: PyJWKSet, kid: str) -> tuple[Any, str]:
    """The key the set names `kid`, with the one algorithm it signs with (the JWK's `alg`, else its type's): a
    token's own `alg` header chooses nothing."""
    for jwk in keys.keys:
        if jwk.key_id == kid:
            return jwk, jwk.algorithm_name
    raise AuthError("invalid_token", f"the gateway token's key {kid[:64]!r} is not one of the gateway's current "
                    "keys (unknown or retired)")


def load_jwks(text: str) -> PyJWKSet:
    """A JWKS document parsed; ValueError when it is none or a key has no `kid` (keys are chosen by it)."""
    try:
        keys = PyJWKSet.from_json(text)
    except (jwt.PyJWKSetError, jwt.InvalidKeyError, ValueError) as exc:
        raise ValueError(f"not a usable JWKS: {exc}") from exc
    missing = [jwk for jwk in keys.keys if not jwk.key_id]
    if missing:
        raise ValueError("every key of the JWKS needs a `kid`")
    return keys


@dataclass(slots=True)
class JwksFile:
    """A JWKS document on disk (a mounted Secret or ConfigMap): re-read when the file changes (looked at once a
    second at most), so a rotation is a file update, no restart. A file that turns unreadable or invalid keeps the
    last good set in use."""

    path: str
    _keys: PyJWKSet | None = None
    _mtime_ns: int = -1
    _checked: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> PyJWKSet:
        """Read the file now (start-up: a missing or invalid file is a ValueError)."""
        with self._lock:
            stat = os.stat(self.path)
            with open(self.path, encoding="utf-8") as handle:
                self._keys = load_jwks(handle.read())
            self._mtime_ns = stat.st_mtime_ns
            self._checked = time.monotonic()
            return self._keys

    def _current(self) -> PyJWKSet:
        now = time.monotonic()
        if self._keys is None:
            return self.load()
        if now - self._checked >= 1.0:
            self._checked = now
            try:
                if os.stat(self.path).st_mtime_ns != self._mtime_ns:
                    self.load()
            except (OSError, ValueError):
                pass  # the last good set stays in use; the next look is in a second
        return self._keys

    async def key_for(self, token: str) -> tuple[Any, str]:
        return _by_kid(self._current(), _kid(token))


@dataclass(slots=True)
class JwksUrl:
    """The gateway's JWKS endpoint, through PyJWT's PyJWKClient: the set cached for `cache_s`, fetched again at
    most every 30 s for a `kid` it does not have (a new key), in a worker thread (the client is blocking)."""

    url: str
    cache_s: float = 300.0
    timeout_s: float = 5.0
    _client: PyJWKClient | None = None

    def client(self) -> PyJWKClient:
        if self._client is None:
            self._client = PyJWKClient(self.url, cache_jwk_set=True, lifespan=self.cache_s, timeout=self.timeout_s)
        return self._client

    async def key_for(self, token: str) -> tuple[Any, str]:
        kid = _kid(token)
        try:
            jwk: PyJWK = await asyncio.to_thread(self.client().get_signing_key, kid)
        except jwt.PyJWKClientConnectionError as exc:
            raise KeyUnavailable(f"the gateway's JWKS could not be fetched: {exc}") from exc
        except jwt.PyJWKClientError as exc:
            raise AuthError("invalid_token", f"the gateway token's key {kid[:64]!r} is not one of the gateway's "
                            "current keys (unknown or retired)") from exc
        return jwk, jwk.algorithm_name


@dataclass(frozen=True, slots=True)
class GatewayVerifier:
    """Everything a gateway token is checked against: its key (by `kid` from a JWKS, or the one configured),
    `aud`, `iss`, the clock skew tolerated and the longest lifetime (`exp - iat`) accepted."""

    keys: KeySource
    audience: str | None
    issuer: str | None
    leeway_s: float
    max_lifetime_s: int

    async def verify(self, token: str) -> TenantPrincipal:
        key, algorithm = await self.keys.key_for(token)
        return verify_gateway_jwt(token, key, algorithm, audience=self.audience, issuer=self.issuer,
                                  leeway_s=self.leeway_s, max_lifetime_s=self.max_lifetime_s)

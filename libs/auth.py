"""Credentials: desktop client tokens (stored hashed) and gateway-issued tenant JWTs."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

import jwt

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


def issue_gateway_jwt(key: str, principal: TenantPrincipal, *, ttl_s: int = 3600, algorithm: str = "HS256") -> str:
    """What the tenant-api gateway issues; used by tests, the demo and benchmarks."""
    now = int(time.time())
    claims = {"tenant_id": principal.tenant_id, "workspace_id": principal.workspace_id,
              "user_id": principal.user_id, "iat": now, "exp": now + ttl_s}
    return jwt.encode(claims, key, algorithm=algorithm)


def verify_gateway_jwt(token: str, key: str, algorithm: str) -> TenantPrincipal:
    try:
        claims = jwt.decode(token, key, algorithms=[algorithm], options={"require": ["exp"]})
    except jwt.ExpiredSignatureError as exc:
        raise AuthError("token_expired", "the gateway token has expired") from exc
    except jwt.PyJWTError as exc:
        raise AuthError("invalid_token", f"the gateway token is not valid: {exc}") from exc
    try:
        principal = TenantPrincipal(int(claims["tenant_id"]), int(claims["workspace_id"]), int(claims["user_id"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise AuthError("invalid_token", "the token must carry integer tenant_id, workspace_id and user_id") from exc
    if isinstance(claims["tenant_id"], bool) or principal.tenant_id <= 0:
        raise AuthError("invalid_token", "tenant_id must be a positive integer")
    return principal

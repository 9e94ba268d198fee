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


MAX_ID = 2**63 - 1


def issue_gateway_jwt(key: str, principal: TenantPrincipal, *, ttl_s: int = 3600, algorithm: str = "HS256",
                      audience: str | None = None, issuer: str | None = None) -> str:
    """What the tenant-api gateway issues; used by tests, the demo and benchmarks."""
    now = int(time.time())
    claims: dict[str, object] = {"tenant_id": principal.tenant_id, "workspace_id": principal.workspace_id,
                                 "user_id": principal.user_id, "iat": now, "exp": now + ttl_s}
    if audience:
        claims["aud"] = audience
    if issuer:
        claims["iss"] = issuer
    return jwt.encode(claims, key, algorithm=algorithm)


def verify_gateway_jwt(token: str, key: str, algorithm: str, *, audience: str | None = None,
                       issuer: str | None = None, leeway_s: float = 0) -> TenantPrincipal:
    """The principal of a gateway token: signature, `exp` (required), `aud`/`iss` when configured.

    The identity claims must be JSON integers in 1..2^63-1: a string ("5"), a float, a boolean or zero is
    refused, so no two spellings of a claim can name the same tenant.
    """
    required = ["exp", *(["aud"] if audience else []), *(["iss"] if issuer else [])]
    try:
        claims = jwt.decode(token, key, algorithms=[algorithm], audience=audience or None, issuer=issuer or None,
                            leeway=leeway_s, options={"require": required, "verify_aud": bool(audience)})
    except jwt.ExpiredSignatureError as exc:
        raise AuthError("token_expired", "the gateway token has expired") from exc
    except jwt.PyJWTError as exc:
        raise AuthError("invalid_token", f"the gateway token is not valid: {exc}") from exc
    ids = [claims.get(name) for name in ("tenant_id", "workspace_id", "user_id")]
    for name, value in zip(("tenant_id", "workspace_id", "user_id"), ids, strict=True):
        if type(value) is not int or not 0 < value <= MAX_ID:
            raise AuthError("invalid_token", f"the token's {name} must be a positive JSON integer")
    return TenantPrincipal(*ids)  # type: ignore[arg-type]

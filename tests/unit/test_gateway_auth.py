"""Gateway JWTs fail closed: a real key or no service (outside DEV_MODE), strict identity claims,
`aud`/`iss` checked when configured, a small leeway."""

from __future__ import annotations

import time
from dataclasses import replace

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from libs.auth import AuthError, TenantPrincipal, issue_gateway_jwt, verify_gateway_jwt
from libs.config import DEV_JWT_SECRET, ConfigError, Settings

SECRET = "k3Jq9v2LmX8pQ1rT6wYz0aBcDeFgHiJk"  # 32 random-looking bytes
PRINCIPAL = TenantPrincipal(7, 70, 700)


def settings(**env: str) -> Settings:
    return Settings.from_env("collect-now-api", env=env)


@pytest.mark.parametrize("env", [
    {},
    {"GATEWAY_JWT_SECRET": ""},
    {"GATEWAY_JWT_SECRET": "short-secret"},
    {"GATEWAY_JWT_SECRET": DEV_JWT_SECRET},
    {"GATEWAY_JWT_SECRET": "REPLACE_ME_WITH_A_LONG_RANDOM_SECRET"},
    {"GATEWAY_JWT_SECRET": "local-demo-gateway-secret-change-me-0001"},
    {"GATEWAY_JWT_PUBLIC_KEY": "not a pem"},
], ids=["unset", "empty", "short", "dev-secret", "k8s-placeholder", "demo-placeholder", "bad-pem"])
def test_no_real_gateway_key_refuses(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        settings(**env).jwt_key()


def test_dev_mode_allows_the_development_secret_and_a_short_one() -> None:
    assert settings(DEV_MODE="1").jwt_key() == (DEV_JWT_SECRET, "HS256")
    assert settings(DEV_MODE="1", GATEWAY_JWT_SECRET="short").jwt_key() == ("short", "HS256")


def test_a_real_secret_is_accepted() -> None:
    assert settings(GATEWAY_JWT_SECRET=SECRET).jwt_key() == (SECRET, "HS256")


def _rsa_pair() -> tuple[str, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


def test_rs256_public_key_verifies_gateway_tokens() -> None:
    private, public = _rsa_pair()
    key, algorithm = settings(GATEWAY_JWT_PUBLIC_KEY=public).jwt_key()
    assert algorithm == "RS256"
    token = issue_gateway_jwt(private, PRINCIPAL, algorithm="RS256")
    assert verify_gateway_jwt(token, key, algorithm) == PRINCIPAL
    # an HS256 token signed with the public key text (algorithm confusion) is refused
    with pytest.raises(AuthError):
        verify_gateway_jwt(jwt.encode({"tenant_id": 7, "workspace_id": 70, "user_id": 700,
                                       "exp": int(time.time()) + 60}, "x" * 32, algorithm="HS256"), key, algorithm)


def test_a_non_rsa_public_key_is_refused() -> None:
    public = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with pytest.raises(ConfigError, match="RSA"):
        settings(GATEWAY_JWT_PUBLIC_KEY=public).jwt_key()


def _token(**claims: object) -> str:
    base: dict[str, object] = {"tenant_id": 7, "workspace_id": 70, "user_id": 700, "exp": int(time.time()) + 60}
    base.update(claims)
    return jwt.encode({k: v for k, v in base.items() if v is not None}, SECRET, algorithm="HS256")


@pytest.mark.parametrize("claims", [
    {"tenant_id": "7"}, {"tenant_id": 7.0}, {"tenant_id": True}, {"tenant_id": 0}, {"tenant_id": -1},
    {"workspace_id": "70"}, {"workspace_id": 0}, {"user_id": None}, {"user_id": 2**63}, {"user_id": [700]},
], ids=str)
def test_identity_claims_must_be_positive_json_integers(claims: dict[str, object]) -> None:
    with pytest.raises(AuthError) as info:
        verify_gateway_jwt(_token(**claims), SECRET, "HS256")
    assert info.value.code == "invalid_token"


def test_exp_is_required_and_leeway_is_small() -> None:
    with pytest.raises(AuthError):
        verify_gateway_jwt(_token(exp=None), SECRET, "HS256")
    just_expired = _token(exp=int(time.time()) - 5)
    assert verify_gateway_jwt(just_expired, SECRET, "HS256", leeway_s=10) == PRINCIPAL
    with pytest.raises(AuthError) as info:
        verify_gateway_jwt(just_expired, SECRET, "HS256", leeway_s=0)
    assert info.value.code == "token_expired"


def test_audience_and_issuer_are_checked_when_configured() -> None:
    good = issue_gateway_jwt(SECRET, PRINCIPAL, audience="monitoring", issuer="tenant-api")
    assert verify_gateway_jwt(good, SECRET, "HS256", audience="monitoring", issuer="tenant-api") == PRINCIPAL
    for token in (issue_gateway_jwt(SECRET, PRINCIPAL),  # neither claim
                  issue_gateway_jwt(SECRET, PRINCIPAL, audience="other", issuer="tenant-api"),
                  issue_gateway_jwt(SECRET, PRINCIPAL, audience="monitoring", issuer="someone-else")):
        with pytest.raises(AuthError):
            verify_gateway_jwt(token, SECRET, "HS256", audience="monitoring", issuer="tenant-api")
    # unconfigured: a token that carries them is still fine
    assert verify_gateway_jwt(good, SECRET, "HS256") == PRINCIPAL


def test_a_negative_leeway_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError):
        settings(GATEWAY_JWT_LEEWAY_SECONDS="-1")


def test_settings_replace_keeps_dev_mode_explicit() -> None:
    base = settings(GATEWAY_JWT_SECRET=SECRET)
    assert not base.dev_mode
    assert replace(base, dev_mode=True, gateway_jwt_secret="").jwt_key()[0] == DEV_JWT_SECRET

"""Gateway JWTs fail closed: a real key or no service (outside DEV_MODE), strict identity claims,
`aud`/`iss` checked when configured, a small leeway."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from libs.auth import AuthError, GatewayVerifier, TenantPrincipal, issue_gateway_jwt, verify_gateway_jwt
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


# ---- JWKS with `kid` selection, required aud/iss, the longest lifetime ------------------------------------

AUD, ISS = "collect-now-api", "tenant-api-gateway"


def _rsa_jwk(kid: str) -> tuple[object, dict[str, object]]:
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk = jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
    return private, {**jwk, "kid": kid, "alg": "RS256", "use": "sig"}


def _ec_jwk(kid: str) -> tuple[object, dict[str, object]]:
    private = ec.generate_private_key(ec.SECP256R1())
    jwk = jwt.algorithms.ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
    return private, {**jwk, "kid": kid, "alg": "ES256"}


def _write_jwks(path: Path, *jwks: dict[str, object]) -> None:
    # A new mtime for each write, however fast the writes (the file source looks at the mtime).
    stamp = path.stat().st_mtime_ns + 1_000_000_000 if path.exists() else time.time_ns()
    path.write_text(json.dumps({"keys": list(jwks)}))
    os.utime(path, ns=(stamp, stamp))


def _verifier(tmp_path: Path, **env: str) -> GatewayVerifier:
    return settings(GATEWAY_JWKS_FILE=str(tmp_path / "jwks.json"), GATEWAY_JWT_AUDIENCE=AUD,
                    GATEWAY_JWT_ISSUER=ISS, **env).gateway_verifier()


def _signed(private: object, algorithm: str, kid: str | None, **kw: Any) -> str:
    return issue_gateway_jwt(private, PRINCIPAL, algorithm=algorithm, kid=kid, audience=kw.pop("audience", AUD),
                             issuer=kw.pop("issuer", ISS), **kw)


async def _refused(verifier: GatewayVerifier, token: str) -> str:
    with pytest.raises(AuthError) as info:
        await verifier.verify(token)
    return info.value.code


async def test_a_rotation_keeps_two_keys_live_and_refuses_the_retired_one(tmp_path: Path) -> None:
    old_key, old = _rsa_jwk("2026-01")
    new_key, new = _ec_jwk("2026-02")
    _write_jwks(tmp_path / "jwks.json", old)
    verifier = _verifier(tmp_path)
    assert await verifier.verify(_signed(old_key, "RS256", "2026-01")) == PRINCIPAL
    assert await _refused(verifier, _signed(new_key, "ES256", "2026-02")) == "invalid_token"  # not published yet

    # The rotation: the new key is published beside the old; tokens signed by either are accepted.
    _write_jwks(tmp_path / "jwks.json", old, new)
    verifier.keys._checked = 0.0  # type: ignore[attr-defined]  # as a second later
    assert await verifier.verify(_signed(old_key, "RS256", "2026-01")) == PRINCIPAL
    assert await verifier.verify(_signed(new_key, "ES256", "2026-02")) == PRINCIPAL

    # The old key retired (removed from the set): its tokens are refused, the new key's still accepted.
    _write_jwks(tmp_path / "jwks.json", new)
    verifier.keys._checked = 0.0  # type: ignore[attr-defined]
    assert await _refused(verifier, _signed(old_key, "RS256", "2026-01")) == "invalid_token"
    assert await verifier.verify(_signed(new_key, "ES256", "2026-02")) == PRINCIPAL

    # A broken file write keeps the last good set.
    (tmp_path / "jwks.json").write_text("{not json")
    os.utime(tmp_path / "jwks.json", ns=(time.time_ns() + 5_000_000_000,) * 2)
    verifier.keys._checked = 0.0  # type: ignore[attr-defined]
    assert await verifier.verify(_signed(new_key, "ES256", "2026-02")) == PRINCIPAL


async def test_each_refusal_of_a_jwks_verifier(tmp_path: Path) -> None:
    key, public = _rsa_jwk("k1")
    _write_jwks(tmp_path / "jwks.json", public)
    verifier = _verifier(tmp_path)
    assert await verifier.verify(_signed(key, "RS256", "k1")) == PRINCIPAL
    now = int(time.time())
    claims = {"tenant_id": 7, "workspace_id": 70, "user_id": 700, "aud": AUD, "iss": ISS}
    refusals = {
        "no kid": _signed(key, "RS256", None),
        "unknown kid": _signed(key, "RS256", "k2"),
        "wrong audience": _signed(key, "RS256", "k1", audience="someone-else"),
        "no audience": _signed(key, "RS256", "k1", audience=""),
        "wrong issuer": _signed(key, "RS256", "k1", issuer="another-gateway"),
        "no issuer": _signed(key, "RS256", "k1", issuer=""),
        "no exp": jwt.encode({**claims, "iat": now}, key, algorithm="RS256", headers={"kid": "k1"}),
        "no iat": jwt.encode({**claims, "exp": now + 60}, key, algorithm="RS256", headers={"kid": "k1"}),
        "valid until 2100": jwt.encode({**claims, "iat": now, "exp": 4102444800}, key, algorithm="RS256",
                                       headers={"kid": "k1"}),
        "one second over the lifetime": _signed(key, "RS256", "k1", ttl_s=3601),
        # The key's own algorithm decides (RS256 for k1): a token that says HS256 is refused.
        "alg confusion": jwt.encode({**claims, "iat": now, "exp": now + 60}, "x" * 32, algorithm="HS256",
                                    headers={"kid": "k1"}),
        "unsigned": jwt.encode({**claims, "iat": now, "exp": now + 60}, None, algorithm="none",
                               headers={"kid": "k1"}),
    }
    codes = {name: await _refused(verifier, token) for name, token in refusals.items()}
    assert codes == {**dict.fromkeys(refusals, "invalid_token"), "valid until 2100": "token_lifetime_too_long",
                     "one second over the lifetime": "token_lifetime_too_long"}
    assert await verifier.verify(_signed(key, "RS256", "k1", ttl_s=3600)) == PRINCIPAL  # at the limit
    longer = _verifier(tmp_path, GATEWAY_JWT_MAX_LIFETIME_SECONDS="7200")
    assert await longer.verify(_signed(key, "RS256", "k1", ttl_s=7200)) == PRINCIPAL


@pytest.mark.parametrize("env", [
    {"GATEWAY_JWT_SECRET": SECRET},
    {"GATEWAY_JWT_SECRET": SECRET, "GATEWAY_JWT_AUDIENCE": AUD},
    {"GATEWAY_JWT_SECRET": SECRET, "GATEWAY_JWT_ISSUER": ISS},
    {"GATEWAY_JWKS_URL": "https://gateway.invalid/jwks.json", "GATEWAY_JWT_ISSUER": ISS},
], ids=["neither", "no-issuer", "no-audience", "jwks-no-audience"])
def test_start_up_refuses_without_audience_and_issuer(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"GATEWAY_JWT_(AUDIENCE|ISSUER)"):
        settings(**env).gateway_verifier()
    # DEV_MODE (the local stack, never deploy/k8s) may leave them unchecked.
    verifier = settings(DEV_MODE="1", **env).gateway_verifier()
    assert verifier.max_lifetime_s == 3600


@pytest.mark.parametrize("env,why", [
    ({"GATEWAY_JWKS_FILE": "/nonexistent/jwks.json"}, "GATEWAY_JWKS_FILE"),
    ({"GATEWAY_JWKS_URL": "http://gateway.example/jwks.json"}, "https"),
    ({"GATEWAY_JWKS_URL": "ftp://gateway.example/jwks.json"}, "http"),
    ({"GATEWAY_JWKS_URL": "https://a/jwks", "GATEWAY_JWKS_FILE": "/x"}, "not both"),
    ({"GATEWAY_JWT_SECRET": SECRET, "GATEWAY_JWT_MAX_LIFETIME_SECONDS": "4102444800"}, "MAX_LIFETIME"),
], ids=["missing-file", "clear-text-url", "not-http", "both", "lifetime-over-a-week"])
def test_start_up_refuses_a_bad_key_source(env: dict[str, str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        settings(GATEWAY_JWT_AUDIENCE=AUD, GATEWAY_JWT_ISSUER=ISS, **env).gateway_verifier()


def test_a_jwks_whose_key_has_no_kid_is_refused_at_start_up(tmp_path: Path) -> None:
    _, public = _rsa_jwk("k1")
    _write_jwks(tmp_path / "jwks.json", {k: v for k, v in public.items() if k != "kid"})
    with pytest.raises(ConfigError, match="kid"):
        _verifier(tmp_path)


async def test_a_static_key_verifier_checks_the_same_claims() -> None:
    verifier = settings(GATEWAY_JWT_SECRET=SECRET, GATEWAY_JWT_AUDIENCE=AUD, GATEWAY_JWT_ISSUER=ISS) \
        .gateway_verifier()
    assert await verifier.verify(issue_gateway_jwt(SECRET, PRINCIPAL, audience=AUD, issuer=ISS)) == PRINCIPAL
    assert await _refused(verifier, issue_gateway_jwt(SECRET, PRINCIPAL, audience=AUD, issuer=ISS,
                                                      ttl_s=86400)) == "token_lifetime_too_long"
    assert await _refused(verifier, issue_gateway_jwt(SECRET, PRINCIPAL)) == "invalid_token"

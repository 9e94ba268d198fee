"""collect-now-api verifying gateway tokens against the gateway's JWKS endpoint (a real HTTP server on loopback):
a rotation with two keys live, the retired key refused, the set cached, and an unreachable endpoint answered 503."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import jwt
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from libs.auth import issue_gateway_jwt
from libs.config import Settings
from tests.support.collect_now import GATEWAY_AUDIENCE, GATEWAY_ISSUER, api_client, make_world
from tests.support.wait import eventually


class Gateway:
    """The tenant-api gateway's side: its private keys and the JWKS it publishes."""

    def __init__(self) -> None:
        self.private: dict[str, tuple[Any, str]] = {}
        self.published: list[dict[str, Any]] = []
        self.fetches = 0

    def new_key(self, kid: str, kind: str) -> None:
        if kind == "RS256":
            private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            jwk = jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key(), as_dict=True)
        else:
            private = ec.generate_private_key(ec.SECP256R1())
            jwk = jwt.algorithms.ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
        self.private[kid] = (private, kind)
        self.published.append({**jwk, "kid": kid, "alg": kind, "use": "sig"})

    def retire(self, kid: str) -> None:
        self.published = [k for k in self.published if k["kid"] != kid]

    def token(self, kid: str, principal: Any) -> str:
        private, algorithm = self.private[kid]
        return issue_gateway_jwt(private, principal, algorithm=algorithm, kid=kid, audience=GATEWAY_AUDIENCE,
                                 issuer=GATEWAY_ISSUER)

    async def jwks(self, _: web.Request) -> web.Response:
        self.fetches += 1
        return web.json_response({"keys": self.published})


@contextlib.asynccontextmanager
async def serving(gateway: Gateway) -> AsyncIterator[TestServer]:
    app = web.Application()
    app.router.add_get("/.well-known/jwks.json", gateway.jwks)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_a_key_rotation_over_the_jwks_endpoint(settings: Settings, pool) -> None:
    async with pool.connection() as conn:
        world = await make_world(conn, questions=1)
    gateway = Gateway()
    gateway.new_key("2026-01", "RS256")
    principal = world.principal()
    status_path = f"/api/tenant/monitoring/collect-requests/{uuid.uuid4()}"  # 404 once the token is accepted

    async with serving(gateway) as server:
        configured = replace(settings, gateway_jwks_url=str(server.make_url("/.well-known/jwks.json")),
                             gateway_jwks_cache_seconds=1)
        async with api_client(configured) as http:
            async def answer(kid: str) -> tuple[int, str]:
                resp = await http.get(status_path, headers={"Authorization": f"Bearer {gateway.token(kid, principal)}"})
                return resp.status, (await resp.json())["error"]

            for _ in range(20):
                assert await answer("2026-01") == (404, "not_found")
            assert gateway.fetches == 1  # cached: one fetch for twenty requests

            # The new key is published beside the old: once the cache turns over, both sign accepted tokens.
            gateway.new_key("2026-02", "ES256")

            async def new_accepted() -> bool:
                return await answer("2026-02") == (404, "not_found")
            await eventually(new_accepted, timeout=10, message="the new key accepted")
            assert await answer("2026-02") == (404, "not_found")
            assert await answer("2026-01") == (404, "not_found")

            # The old key retired: refused (401) once the set is fetched again; the new one still accepted.
            gateway.retire("2026-01")

            async def old_refused() -> bool:
                return await answer("2026-01") == (401, "invalid_token")
            await eventually(old_refused, timeout=10, message="the retired key refused")
            assert await answer("2026-02") == (404, "not_found")
            fetches = gateway.fetches

    # The endpoint gone: no key set to check against, a 503 to retry, never an accepted token.
    async with api_client(replace(settings, gateway_jwks_url=f"{configured.gateway_jwks_url}-gone",
                                  gateway_jwks_cache_seconds=1)) as http:
        resp = await http.get(status_path, headers={"Authorization": f"Bearer {gateway.token('2026-02', principal)}"})
        problem = await resp.json()
        assert (resp.status, problem["error"]) == (503, "gateway_keys_unavailable"), problem
        assert resp.headers["Retry-After"] == "5"
    print(f"\nJWKS fetches over the rotation: {fetches}")

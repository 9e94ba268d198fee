"""libs.demo.seed_demo and `monitorctl seed-demo` / `client create`: the shape in docs/architecture.md, real rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from psycopg_pool import AsyncConnectionPool

from libs.auth import hash_token
from libs.db.pool import Conn
from libs.demo import create_client, seed_demo


async def test_seed_demo_shape_and_rows(pool: AsyncConnectionPool[Conn]) -> None:
    async with pool.connection() as conn:
        out = await seed_demo(conn, tenants=2, brands=2, questions=3, clients=2, keywords_per_brand=2)
        again = await seed_demo(conn, tenants=1, platforms=("openai", "claude"), due=False)

        codes = [p["code"] for p in out["platforms"]]
        assert codes == ["openai", "gemini", "perplexity"]
        assert again["platforms"][0] == out["platforms"][0]  # idempotent by code
        assert len(out["tenants"]) == 2
        tenant = out["tenants"][0]
        assert set(tenant) >= {"tenant_id", "workspace_id", "user_id", "brands", "clients"}
        assert len(tenant["brands"]) == 2 and len(tenant["clients"]) == 2
        brand = tenant["brands"][0]
        assert len(brand["keyword_ids"]) == 2 and len(brand["question_ids"]) == 3
        json.dumps(out)  # JSON-serialisable as printed by the CLI

        client = tenant["clients"][0]
        cur = await conn.execute("SELECT token_hash, tenant_id FROM desktop_clients WHERE id = %s",
                                 (uuid.UUID(client["client_id"]),))
        row = await cur.fetchone()
        assert row == {"token_hash": hash_token(client["token"]), "tenant_id": tenant["tenant_id"]}

        cur = await conn.execute(
            "SELECT count(*) AS n, bool_and(next_run_at <= now()) AS due FROM monitoring_plans WHERE tenant_id = %s",
            (tenant["tenant_id"],))
        plans = await cur.fetchone()
        assert plans == {"n": 2 * 3 * 3, "due": True}
        cur = await conn.execute("SELECT bool_and(next_run_at > now()) AS later FROM monitoring_plans "
                                 "WHERE tenant_id = %s", (again["tenants"][0]["tenant_id"],))
        assert (await cur.fetchone()) == {"later": True}

        cur = await conn.execute(
            "SELECT p.code, s.interrupt_soft_timeout_ms AS soft, s.interrupt_hard_timeout_ms AS hard "
            "FROM platform_settings s JOIN ai_platforms p ON p.id = s.ai_platform_id ORDER BY p.code")
        timeouts = {r["code"]: (r["soft"], r["hard"]) for r in await cur.fetchall()}
        assert timeouts == {"claude": (15000, 45000), "gemini": (30000, 90000), "openai": (15000, 45000),
                            "perplexity": (45000, 120000)}
        cur = await conn.execute("SELECT count(*) AS n FROM tenant_platforms WHERE tenant_id = %s",
                                 (tenant["tenant_id"],))
        assert (await cur.fetchone()) == {"n": 3}

        async with conn.transaction():
            client_id, token = await create_client(conn, tenant_id=tenant["tenant_id"], workspace_id=7, user_id=9,
                                                   max_concurrent_monitor=3)
        cur = await conn.execute("SELECT workspace_id, user_id, max_concurrent_monitor, token_hash "
                                 "FROM desktop_clients WHERE id = %s", (client_id,))
        assert (await cur.fetchone()) == {"workspace_id": 7, "user_id": 9, "max_concurrent_monitor": 3,
                                          "token_hash": hash_token(token)}


def test_monitorctl_seed_demo_and_client_create(database_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": database_url}
    seeded = subprocess.run([sys.executable, "-m", "tools.monitorctl", "seed-demo", "--json", "--questions", "1",
                             "--platforms", "openai,gemini"], env=env, capture_output=True, text=True, check=True)
    out = json.loads(seeded.stdout)
    assert [p["code"] for p in out["platforms"]] == ["openai", "gemini"]
    tenant = out["tenants"][0]
    assert len(tenant["brands"][0]["question_ids"]) == 1
    created = subprocess.run([sys.executable, "-m", "tools.monitorctl", "--json", "client", "create",
                              "--tenant", str(tenant["tenant_id"]), "--workspace", "1", "--user", "1"],
                             env=env, capture_output=True, text=True, check=True)
    client = json.loads(created.stdout)
    assert uuid.UUID(client["client_id"]) and client["token"].startswith("dct_")
    missing = subprocess.run([sys.executable, "-m", "tools.monitorctl", "client", "create", "--tenant", "999999",
                              "--workspace", "1", "--user", "1"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "does not exist" in missing.stderr

"""Demo data: tenants, brands, questions, platforms, plans and desktop clients in one call.

Used by `monitorctl seed-demo`, `make run`'s demo fleet, tests and benchmarks. Every call creates
new tenants (so runs never collide); platforms are shared and created idempotently by code.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from libs.auth import hash_token, new_client_token
from libs.db.pool import Conn

# Interrupt soft / hard timeouts per platform (docs/architecture.md §10.5), in milliseconds.
PLATFORM_INTERRUPT_TIMEOUTS_MS: dict[str, tuple[int, int]] = {
    "openai": (15_000, 45_000),
    "gemini": (30_000, 90_000),
    "perplexity": (45_000, 120_000),
}
DEFAULT_INTERRUPT_TIMEOUTS_MS = (15_000, 45_000)
# Per-mode values for platforms that run questions in more than one mode (§10.5; migration 063 has the same).
PLATFORM_MODE_TIMEOUTS_MS: dict[str, dict[str, tuple[int, int]]] = {
    "openai": {"quick": (15_000, 45_000), "deep_reasoning": (60_000, 180_000)},
}
_INSERT_MODE_SETTINGS = """
INSERT INTO platform_mode_settings (ai_platform_id, mode, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms)
VALUES (%(id)s, %(mode)s, %(soft)s, %(hard)s)
ON CONFLICT (ai_platform_id, mode) DO NOTHING
"""

PLATFORM_NAMES = {"openai": "OpenAI ChatGPT", "gemini": "Google Gemini", "perplexity": "Perplexity"}

_UPSERT_PLATFORM = """
INSERT INTO ai_platforms (code, name) VALUES (%(code)s, %(name)s)
ON CONFLICT (code) DO UPDATE SET code = EXCLUDED.code
RETURNING id
"""

_INSERT_PLATFORM_SETTINGS = """
INSERT INTO platform_settings (ai_platform_id, interrupt_soft_timeout_ms, interrupt_hard_timeout_ms, timeouts_dynamic)
VALUES (%(id)s, %(soft)s, %(hard)s, %(dynamic)s)
ON CONFLICT (ai_platform_id) DO NOTHING
"""

_INSERT_TENANT = """
INSERT INTO tenants (name, time_zone) VALUES (%(name)s, %(time_zone)s) RETURNING id
"""

_INSERT_TENANT_PLATFORM = """
INSERT INTO tenant_platforms (tenant_id, ai_platform_id) VALUES (%(tenant_id)s, %(ai_platform_id)s)
ON CONFLICT DO NOTHING
"""

_INSERT_BRAND = """
INSERT INTO brands (tenant_id, workspace_id, name) VALUES (%(tenant_id)s, %(workspace_id)s, %(name)s) RETURNING id
"""

_INSERT_KEYWORD = """
INSERT INTO monitoring_keywords (tenant_id, brand_id, text) VALUES (%(tenant_id)s, %(brand_id)s, %(text)s)
RETURNING id
"""

_INSERT_QUESTION = """
INSERT INTO monitoring_questions (tenant_id, brand_id, keyword_id, text)
VALUES (%(tenant_id)s, %(brand_id)s, %(keyword_id)s, %(text)s) RETURNING id
"""

_INSERT_PLAN = """
INSERT INTO monitoring_plans (tenant_id, workspace_id, brand_id, question_id, ai_platform_id, next_run_at)
VALUES (%(tenant_id)s, %(workspace_id)s, %(brand_id)s, %(question_id)s, %(ai_platform_id)s,
        CASE WHEN %(due)s THEN now() ELSE date_trunc('day', now()) + interval '1 day' END)
ON CONFLICT DO NOTHING
"""

_INSERT_CLIENT = """
INSERT INTO desktop_clients (id, tenant_id, workspace_id, user_id, name, token_hash,
                             max_concurrent_monitor, max_queue_depth)
VALUES (%(id)s, %(tenant_id)s, %(workspace_id)s, %(user_id)s, %(name)s, %(token_hash)s,
        %(max_concurrent_monitor)s, %(max_queue_depth)s)
"""

_QUESTION_TEMPLATES = (
    "What is the best {topic} for a small business?",
    "Which {topic} do experts recommend in 2025?",
    "Compare the top {topic} options and their prices.",
    "Is {brand} a good choice for {topic}?",
    "What are alternatives to {brand} for {topic}?",
)


async def ensure_platforms(conn: Conn, codes: Sequence[str]) -> list[dict[str, Any]]:
    """Create (or find) the platforms by code, each with its §10.5 interrupt timeouts: fixed for the platforms the
    specification gives values for, measured (dynamic) for the others."""
    platforms = []
    for code in codes:
        cur = await conn.execute(_UPSERT_PLATFORM, {"code": code, "name": PLATFORM_NAMES.get(code, code)})
        row = await cur.fetchone()
        assert row is not None
        soft, hard = PLATFORM_INTERRUPT_TIMEOUTS_MS.get(code, DEFAULT_INTERRUPT_TIMEOUTS_MS)
        await conn.execute(_INSERT_PLATFORM_SETTINGS, {"id": row["id"], "soft": soft, "hard": hard,
                                                       "dynamic": code not in PLATFORM_INTERRUPT_TIMEOUTS_MS})
        for mode, (mode_soft, mode_hard) in PLATFORM_MODE_TIMEOUTS_MS.get(code, {}).items():
            await conn.execute(_INSERT_MODE_SETTINGS, {"id": row["id"], "mode": mode, "soft": mode_soft,
                                                       "hard": mode_hard})
        platforms.append({"ai_platform_id": int(row["id"]), "code": code})
    return platforms


async def create_client(
    conn: Conn, *, tenant_id: int, workspace_id: int, user_id: int, name: str = "",
    max_concurrent_monitor: int = 2, max_queue_depth: int = 20,
) -> tuple[uuid.UUID, str]:
    """Register a desktop client; returns (client_id, token). Only the token's hash is stored."""
    client_id = uuid.uuid4()
    token = new_client_token()
    await conn.execute(_INSERT_CLIENT, {
        "id": client_id, "tenant_id": tenant_id, "workspace_id": workspace_id, "user_id": user_id,
        "name": name or f"desktop-{str(client_id)[:8]}", "token_hash": hash_token(token),
        "max_concurrent_monitor": max_concurrent_monitor, "max_queue_depth": max_queue_depth,
    })
    return client_id, token


async def seed_demo(
    conn: Conn, *, tenants: int = 1, brands: int = 1, questions: int = 2, clients: int = 1,
    platforms: Sequence[str] = ("openai", "gemini", "perplexity"), due: bool = True,
    keywords_per_brand: int = 1, time_zone: str = "UTC",
) -> dict[str, Any]:
    """Create demo data in one transaction and return the `seed-demo --json` shape (docs/architecture.md, Interfaces).

    Plans (one per question x platform) are due now when `due`, else at the next midnight UTC.
    Each tenant uses workspace_id = user_id = tenant_id (there is no users table here).
    """
    async with conn.transaction():
        platform_rows = await ensure_platforms(conn, platforms)
        out_tenants = []
        for t in range(tenants):
            cur = await conn.execute(_INSERT_TENANT, {"name": f"demo-tenant-{t + 1}", "time_zone": time_zone})
            row = await cur.fetchone()
            assert row is not None
            tenant_id = int(row["id"])
            workspace_id = user_id = tenant_id
            for platform in platform_rows:
                await conn.execute(_INSERT_TENANT_PLATFORM,
                                   {"tenant_id": tenant_id, "ai_platform_id": platform["ai_platform_id"]})
            out_brands = []
            for b in range(brands):
                out_brands.append(await _seed_brand(
                    conn, tenant_id=tenant_id, workspace_id=workspace_id, index=b, questions=questions,
                    keywords=keywords_per_brand, platforms=platform_rows, due=due))
            out_clients = []
            for c in range(clients):
                client_id, token = await create_client(
                    conn, tenant_id=tenant_id, workspace_id=workspace_id, user_id=user_id,
                    name=f"demo-desktop-{tenant_id}-{c + 1}")
                out_clients.append({"client_id": str(client_id), "token": token})
            out_tenants.append({"tenant_id": tenant_id, "workspace_id": workspace_id, "user_id": user_id,
                                "time_zone": time_zone, "brands": out_brands, "clients": out_clients})
    return {"platforms": platform_rows, "tenants": out_tenants}


async def _seed_brand(
    conn: Conn, *, tenant_id: int, workspace_id: int, index: int, questions: int, keywords: int,
    platforms: list[dict[str, Any]], due: bool,
) -> dict[str, Any]:
    brand_name = f"Brand {tenant_id}-{index + 1}"
    cur = await conn.execute(_INSERT_BRAND, {"tenant_id": tenant_id, "workspace_id": workspace_id,
                                             "name": brand_name})
    row = await cur.fetchone()
    assert row is not None
    brand_id = int(row["id"])
    keyword_ids: list[int] = []
    for k in range(keywords):
        cur = await conn.execute(_INSERT_KEYWORD, {"tenant_id": tenant_id, "brand_id": brand_id,
                                                   "text": f"topic {k + 1}"})
        row = await cur.fetchone()
        assert row is not None
        keyword_ids.append(int(row["id"]))
    question_ids: list[int] = []
    for q in range(questions):
        keyword_id = keyword_ids[q % len(keyword_ids)] if keyword_ids else None
        template = _QUESTION_TEMPLATES[q % len(_QUESTION_TEMPLATES)]
        text = template.format(topic=f"topic {q % max(keywords, 1) + 1}", brand=brand_name)
        if q >= len(_QUESTION_TEMPLATES):
            text += f" (variant {q + 1})"
        cur = await conn.execute(_INSERT_QUESTION, {"tenant_id": tenant_id, "brand_id": brand_id,
                                                    "keyword_id": keyword_id, "text": text})
        row = await cur.fetchone()
        assert row is not None
        question_id = int(row["id"])
        question_ids.append(question_id)
        for platform in platforms:
            await conn.execute(_INSERT_PLAN, {
                "tenant_id": tenant_id, "workspace_id": workspace_id, "brand_id": brand_id,
                "question_id": question_id, "ai_platform_id": platform["ai_platform_id"], "due": due})
    return {"brand_id": brand_id, "name": brand_name, "keyword_ids": keyword_ids, "question_ids": question_ids}

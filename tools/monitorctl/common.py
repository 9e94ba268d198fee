"""What every monitorctl command shares: settings, a database connection, output in text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from libs.config import Settings
from libs.db.pool import Conn, connect

Handler = Callable[[argparse.Namespace, "Context"], Awaitable[int]]


@dataclass
class Context:
    settings: Settings
    as_json: bool
    _conn: Conn | None = None

    async def conn(self) -> Conn:
        if self._conn is None:
            self._conn = await connect(self.settings.database_url, name="monitorctl", settings=self.settings)
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()

    def emit(self, value: Any, text: str | Callable[[Any], str] | None = None) -> None:
        """Print `value` as JSON with --json, else the human text (or a readable default)."""
        if self.as_json:
            print(json.dumps(value, default=_default, ensure_ascii=False))
            return
        if callable(text):
            print(text(value))
        elif text is not None:
            print(text)
        else:
            print(render_text(value))


def _default(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    raise TypeError(f"cannot render {type(value).__name__}")


def render_text(value: Any, indent: int = 0) -> str:
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:")
                lines.append(render_text(item, indent + 1))
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return "\n".join(lines)
    if isinstance(value, list):
        if not value:
            return f"{pad}(none)"
        if all(isinstance(v, dict) for v in value):
            return render_table(value, pad)
        return "\n".join(f"{pad}- {_scalar(v)}" for v in value)
    return f"{pad}{_scalar(value)}"


def render_table(rows: list[dict[str, Any]], pad: str = "") -> str:
    columns = list(rows[0])
    cells = [[_scalar(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    head = pad + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    body = [pad + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([head, *body])


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value, default=_default, ensure_ascii=False)
    try:
        return str(_default(value))
    except TypeError:
        return str(value)


def fail(message: str, code: int = 2) -> int:
    print(f"monitorctl: {message}", file=sys.stderr)
    return code

"""The committed API documents under `contracts/` (docs/api.md): each generated from the code that serves it, written
by `monitorctl contracts write`, checked by `monitorctl contracts check` and the tests (a committed document that is
not what the code serves fails them)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The repository's contracts/ folder (monitorctl runs from an editable install of the repository).
CONTRACTS_DIR = Path(__file__).resolve().parents[2] / "contracts"


def _collect_now() -> dict[str, Any]:
    from services.collect_now_api.openapi import openapi_document

    return openapi_document()


def _dispatch_hub() -> dict[str, Any]:
    from services.dispatch_hub.openapi import openapi_document

    return openapi_document()


# Path under contracts/ -> the document the code serves. (AsyncAPI documents join here under asyncapi/.)
DOCUMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "openapi/collect-now-api.json": _collect_now,
    "openapi/dispatch-hub.json": _dispatch_hub,
}


def render(document: dict[str, Any]) -> str:
    """The committed form: the JSON the service serves, indented for review, one trailing newline."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def stale(root: Path = CONTRACTS_DIR) -> list[str]:
    """The documents under `root` that are missing or differ from what the code serves."""
    return [name for name, build in DOCUMENTS.items()
            if not (root / name).is_file() or (root / name).read_text(encoding="utf-8") != render(build())]


def write(root: Path = CONTRACTS_DIR) -> list[str]:
    """Write every stale document; the ones written."""
    changed = stale(root)
    for name in changed:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(DOCUMENTS[name]()), encoding="utf-8")
    return changed

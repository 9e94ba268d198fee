"""The committed API documents (contracts/) are what the code serves, carry the APIs' real versions, and the checks
on them catch a broken one: `monitorctl contracts check` a stale document, @redocly/cli an invalid one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from libs.contracts.http import DESKTOP_HTTP_API_VERSION, TENANT_API_VERSION
from tools.contracts_docs import CONTRACTS_DIR, DOCUMENTS, render, stale, write

REDOCLY = CONTRACTS_DIR / "node_modules" / ".bin" / "redocly"


def test_the_committed_documents_are_what_the_code_serves() -> None:
    assert stale() == [], "run `make contracts` (monitorctl contracts write) and commit contracts/"
    versions = {name: json.loads((CONTRACTS_DIR / name).read_text())["info"]["version"] for name in DOCUMENTS}
    assert versions == {"openapi/collect-now-api.json": TENANT_API_VERSION,
                        "openapi/dispatch-hub.json": DESKTOP_HTTP_API_VERSION}


def test_the_check_catches_a_stale_or_missing_document(tmp_path: Path) -> None:
    shutil.copytree(CONTRACTS_DIR / "openapi", tmp_path / "openapi")
    assert stale(tmp_path) == []
    path = tmp_path / "openapi" / "collect-now-api.json"
    changed = json.loads(path.read_text())
    changed["paths"].pop(next(iter(changed["paths"])))  # an operation the code serves, left out
    path.write_text(render(changed))
    (tmp_path / "openapi" / "dispatch-hub.json").unlink()
    assert stale(tmp_path) == ["openapi/collect-now-api.json", "openapi/dispatch-hub.json"]
    assert write(tmp_path) == ["openapi/collect-now-api.json", "openapi/dispatch-hub.json"]
    assert stale(tmp_path) == []


def test_redocly_refuses_an_invalid_document(tmp_path: Path) -> None:
    # `make lint` installs it (scripts/ensure-node-tools.sh) before the tests run.
    assert REDOCLY.exists(), "run scripts/ensure-node-tools.sh"
    broken = json.loads((CONTRACTS_DIR / "openapi" / "collect-now-api.json").read_text())
    broken["paths"]["/api/tenant/monitoring/brands/{brand_id}/collect-now"]["post"]["responses"]["202"]["content"][
        "application/json"]["schema"] = {"$ref": "#/components/schemas/NoSuchSchema"}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    env = {**os.environ, "REDOCLY_TELEMETRY": "off", "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"}
    result = subprocess.run([str(REDOCLY), "lint", "--config", str(CONTRACTS_DIR / "redocly.yaml"),
                             "--format=summary", str(tmp_path / "broken.json")],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode != 0 and "no-unresolved-refs" in result.stdout + result.stderr

"""Comments and docs point inside the repository: docs/architecture.md carries the design.

Two checks over every tracked source and doc file: no reference to design documents outside the repository
(the old design notes, the source specification or its directory), and every section number cited anywhere
(`§10.2`) is a heading of docs/architecture.md, so a comment citing it can be followed there. The word "seed"
is fine where it means a random seed or demo seeding (`seed_demo`, `--seed`, `seed-demo`).

Applied migrations are exempt from the first check: `libs/db/migrate.py` refuses a migration file that changed after
it was applied (checksum), so their comments keep the old wording ("seed §12" there is §12 of docs/architecture.md,
as its "Older references" block says). Their section numbers are still checked.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
THIS_FILE = Path(__file__).resolve()
MIGRATIONS = ROOT / "migrations"

SUFFIXES = frozenset({".py", ".sql", ".md", ".yaml", ".yml", ".toml", ".sh", ".json", ".txt", ".cfg", ".ini"})
NAMES = frozenset({"Makefile", "Dockerfile", "Procfile"})
SKIP_DIRS = frozenset({".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".ruff_cache",
                       ".pytest_cache"})

OUTSIDE_REFERENCE = re.compile(
    r"DESIGN\.md"                   # the old design notes
    r"|\bDESIGN (?:§|contracts?\b)"  # "DESIGN §5", "DESIGN contract 5"
    r"|\.\./shared\b"                # the directory beside the repository
    r"|\bshared/(?:seeds|examples|DESIGN)"
    r"|\bseeds?/"                    # the specification's directory
    r"|\bseed ?§"                    # "seed §10.2", "Seed §15.2"
    r"|\bseed's\b"                   # "the seed's order"
    r"|\bthe seed\b(?![-_])"         # "the seed" (the document), not "the seed-demo command"
    r"|\bseed \d{3}\b",              # "seed 003" (the outbox rulebook)
    re.IGNORECASE,
)
# docs/architecture.md may name the old references once, in its "Older references" block.
OLDER_BLOCK = re.compile(r"<!-- older-references:begin -->.*?<!-- older-references:end -->", re.S)
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)\s", re.M)


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an image, an unpacked archive)
        paths = [p for p in ROOT.rglob("*") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]
    files = [p for p in paths if p.is_file() and (p.suffix in SUFFIXES or p.name in NAMES)]
    if ARCHITECTURE not in files and ARCHITECTURE.is_file():
        files.append(ARCHITECTURE)  # not committed yet: checked all the same
    return sorted(set(files))


def _text(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return OLDER_BLOCK.sub("", text) if path == ARCHITECTURE else text


def test_no_reference_to_design_documents_outside_the_repository() -> None:
    found = []
    for path in _tracked_files():
        if path == THIS_FILE or path.parent == MIGRATIONS:
            continue
        for number, line in enumerate(_text(path).splitlines(), 1):
            match = OUTSIDE_REFERENCE.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    assert not found, ("references to documents outside the repository; point to docs/architecture.md "
                       "instead:\n" + "\n".join(found))


def test_every_cited_section_is_a_heading_of_the_architecture_document() -> None:
    headings = set(HEADING.findall(ARCHITECTURE.read_text(encoding="utf-8")))
    missing: dict[str, list[str]] = {}
    for path in _tracked_files():
        if path == THIS_FILE:
            continue
        for number, line in enumerate(_text(path).splitlines(), 1):
            for section in SECTION.findall(line):
                if section not in headings:
                    missing.setdefault(section, []).append(f"{path.relative_to(ROOT)}:{number}")
    assert not missing, "sections cited but not headings of docs/architecture.md:\n" + "\n".join(
        f"§{section}: {', '.join(where[:5])}" for section, where in sorted(missing.items()))


@pytest.mark.parametrize("text", [
    "see DESIGN.md §6", "DESIGN contract 5", "(DESIGN §5)", "../shared/seeds/000_x.txt", "seeds/003_y.txt",
    "seed §10.2", "Seed §15.2 note 2", "the seed's order", "per the seed", "seed 003 rulebook",
])
def test_the_pattern_catches_outside_references(text: str) -> None:
    assert OUTSIDE_REFERENCE.search(text)


@pytest.mark.parametrize("text", [
    "monitorctl seed-demo --json", "libs.demo.seed_demo", "rng = random.Random(seed)", "--seed 7",
    "def _first(seed: dict[str, Any])", "seeds the demo", "the seed-demo shape", "test_observability_seed.py",
    'seed_section="15.2"', "name: seed-15.2", "docs/architecture.md §10.2",
])
def test_the_pattern_allows_random_seeds_and_demo_seeding(text: str) -> None:
    assert not OUTSIDE_REFERENCE.search(text)

"""Dockerfile and .dockerignore: one reproducible, unprivileged image for every service."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in _instructions():
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, rest))
    return stages


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_base_image_and_install_command() -> None:
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", DOCKERFILE, re.M)
    froms = [rest for keyword, rest in _instructions() if keyword == "FROM"]
    assert froms and all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    runs = " ".join(rest for keyword, rest in _instructions() if keyword == "RUN")
    assert re.search(r"pip install -c constraints\.txt \.(\s|$)", runs)


def test_runtime_stage_is_unprivileged_and_service_agnostic() -> None:
    runtime = _stages()[-1]
    keywords = [k for k, _ in runtime]
    assert "HEALTHCHECK" not in {k for k, _ in _instructions()}
    assert "ENTRYPOINT" not in keywords, "the console script is chosen per service by `command:`"
    user = [rest for k, rest in runtime if k == "USER"]
    assert user and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user[-1]), "numeric non-root user"
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k in ("COPY", "RUN"))


def test_migrations_are_shipped_where_monitorctl_looks() -> None:
    runtime = _stages()[-1]
    copies = [rest for k, rest in runtime if k == "COPY" and "--from" not in rest]
    assert "migrations ./migrations" in copies
    workdir = [rest for k, rest in runtime if k == "WORKDIR"][-1]
    env = " ".join(rest for k, rest in runtime if k == "ENV")
    assert f"MIGRATIONS_DIR={workdir}/migrations" in env


def test_build_context_contains_what_the_build_copies() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "allow-list: nothing enters the context unless named"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for keyword, rest in _instructions():
        if keyword == "COPY" and "--from" not in rest:
            for source in rest.split()[:-1]:
                assert source in allowed, f"COPY {source} is excluded by .dockerignore"
                assert (ROOT / source).exists(), source
    assert not {".venv", ".git", "tests"} & allowed


def test_constraints_pin_every_runtime_dependency() -> None:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        dependencies = tomllib.load(fh)["project"]["dependencies"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pins[_normalise(name)] = version
    for dependency in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]+\])?==(\S+)", dependency)
        assert match, f"{dependency} must be pinned exactly"
        assert pins.get(_normalise(match.group(1))) == match.group(2), dependency

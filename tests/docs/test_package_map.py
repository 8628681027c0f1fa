"""The package maps in README.md ("Map of the packages") and docs/design.md ("Package map")
match the tree: every `pipeline/<x>/` they name is a package, every sub-package of pipeline/ is
named, and every top-level folder they name exists."""

from __future__ import annotations

import re

import pytest

from tests.docs.commands import REPO

MAPS = [("README.md", "## Map of the packages"), ("docs/design.md", "## Package map")]
TOP_LEVEL = {"conf", "tokenizer", "datamodules", "models", "pipeline", "tests", "bench"}


def section(path: str, heading: str) -> str:
    text = (REPO / path).read_text(encoding="utf-8")
    assert heading in text, f"{path} has no section {heading!r}"
    body = text.split(heading, 1)[1]
    return re.split(r"^## ", body, maxsplit=1, flags=re.M)[0]


def pipeline_packages() -> set[str]:
    return {
        p.name
        for p in (REPO / "pipeline").iterdir()
        if p.is_dir() and (p / "__init__.py").is_file()
    }


@pytest.mark.parametrize(("path", "heading"), MAPS)
def test_package_map_matches_the_tree(path, heading):
    text = section(path, heading)
    named = set(re.findall(r"`pipeline/(\w+)/`", text))
    missing = sorted(n for n in named if not (REPO / "pipeline" / n / "__init__.py").is_file())
    assert not missing, f"{path} names pipeline/ sub-packages that do not exist: {missing}"
    unnamed = sorted(pipeline_packages() - named)
    assert not unnamed, f"{path} does not name these sub-packages of pipeline/: {unnamed}"
    folders = set(re.findall(r"^- `(\w+)/`", text, flags=re.M))
    assert folders == TOP_LEVEL, f"{path}: top-level folders named {sorted(folders)}"
    assert all((REPO / f).is_dir() for f in folders)

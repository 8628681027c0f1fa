"""The layout of the code keeps its promises: the folders and the sub-packages of `pipeline/` and
`datamodules/` import one way, no import hides inside a function to dodge a circle, and no file
outside `tests/` and `bench/` outgrows a reader (550 lines; 450 in `datamodules/`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenizer", "models", "datamodules", "pipeline")
# What each top-level package and each sub-package of `pipeline/` may import (besides itself).
MAY_IMPORT = {
    "tokenizer": set(),
    "models": set(),
    # datamodules/: the LightningDataModules (and the stores of a run) at the top, over
    # sub-packages by job, lowest first.
    "datamodules.corpora": {"tokenizer"},
    "datamodules.stores": {"tokenizer", "datamodules.corpora"},
    "datamodules.objectives": {"tokenizer", "datamodules.corpora", "datamodules.stores"},
    "datamodules.streaming": {
        "tokenizer",
        "datamodules.corpora",
        "datamodules.stores",
        "datamodules.objectives",
    },
    "datamodules.tasks": {"tokenizer", "datamodules.corpora"},
    "pipeline.run": {"tokenizer", "models", "datamodules"},
    "pipeline.training": {"pipeline.run"},
    "pipeline.checkpoint": {"pipeline.run", "pipeline.training"},
    "pipeline.finetune": {"pipeline.run", "pipeline.training", "pipeline.checkpoint"},
    "pipeline.pretrain": {
        "pipeline.run",
        "pipeline.training",
        "pipeline.checkpoint",
        "pipeline.infer",
        "pipeline.finetune",
    },
    "pipeline.suites": {
        "pipeline.run",
        "pipeline.training",
        "pipeline.checkpoint",
        "pipeline.finetune",
        "pipeline.pretrain",
        "pipeline.infer",
    },
    "pipeline.infer": {"pipeline.run", "pipeline.checkpoint"},
    "pipeline.report": {"pipeline.run", "pipeline.finetune", "pipeline.suites"},
    "pipeline.commands": {
        f"pipeline.{p}"
        for p in ("run", "training", "checkpoint", "finetune", "pretrain", "suites", "infer")
    }
    | {"pipeline.report"},
}
DATAMODULES = {name for name in MAY_IMPORT if name.startswith("datamodules.")}
MAY_IMPORT["datamodules"] = {"tokenizer"} | DATAMODULES
for name in list(MAY_IMPORT):  # everything under pipeline/ may use the lower folders
    if name.startswith("pipeline."):
        MAY_IMPORT[name] |= {"tokenizer", "models", "datamodules"} | DATAMODULES
MAX_LINES = 550
MAX_LINES_IN = {"datamodules": 450}  # folders held to less
LAYERED = ("pipeline", "datamodules")  # folders whose sub-packages are layers of their own


def unit(module: str) -> str:
    """The layer a module belongs to: its top-level package, or `pipeline.<sub-package>` and
    `datamodules.<sub-package>`."""
    parts = module.split(".")
    in_sub_package = len(parts) > 1 and (REPO / parts[0] / parts[1]).is_dir()
    return ".".join(parts[:2]) if parts[0] in LAYERED and in_sub_package else parts[0]


def modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found.append((module.removesuffix(".__init__"), path))
    return found


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function or class) for every import of our packages."""
    out = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.append((child.module, child.lineno, nested))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, nested) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return [(m, line, n) for m, line, n in out if m.split(".")[0] in PACKAGES]


def layering_errors(found: list[tuple[str, Path]]) -> list[str]:
    errors = []
    for module, path in found:
        here = unit(module)
        if module in LAYERED:  # pipeline/__init__.py, datamodules/__init__.py
            continue
        for target, line, nested in imports(path):
            there = unit(target)
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            where = f"{shown}:{line} imports {target}"
            if there != here and there not in MAY_IMPORT.get(here, set()):
                errors.append(f"{where}: {here} may not import {there}")
            if nested:
                errors.append(f"{where} inside a function")
    return errors


def test_packages_import_one_way_with_no_import_inside_a_function():
    assert layering_errors(modules()) == []


def test_the_check_catches_an_upward_import_and_a_lazy_one(tmp_path):
    """The check itself fails on what it is there to catch (a library module importing a
    command, an import inside a function)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from pipeline.commands.pretrain import main\n"
        "def f():\n    from pipeline.suites.glue import run_suite\n"
    )
    errors = layering_errors([("pipeline.run.bad", bad)])
    assert len(errors) == 3, errors
    assert "pipeline.run may not import pipeline.commands" in errors[0]
    assert "inside a function" in errors[-1]


@pytest.mark.parametrize("folder", LAYERED)
def test_every_sub_package_has_a_place_in_the_order(folder):
    subs = {p.name for p in (REPO / folder).iterdir() if (p / "__init__.py").is_file()}
    placed = {k for k in MAY_IMPORT if k.startswith(f"{folder}.")}
    assert {f"{folder}.{s}" for s in subs} == placed


@pytest.mark.parametrize("folder", LAYERED)
def test_every_sub_package_opens_by_saying_its_job(folder):
    for init in (REPO / folder).glob("*/__init__.py"):
        said = ast.get_docstring(ast.parse(init.read_text()))
        assert said, f"{init.relative_to(REPO)} has no opening docstring: say the package's job"


@pytest.mark.parametrize("path", [p for _, p in modules()], ids=lambda p: str(p.relative_to(REPO)))
def test_no_library_file_is_over_its_folders_cap(path):
    cap = MAX_LINES_IN.get(path.relative_to(REPO).parts[0], MAX_LINES)
    lines = len(path.read_text().splitlines())
    assert lines <= cap, (
        f"{path.relative_to(REPO)} has {lines} lines (at most {cap}); split it by job"
    )

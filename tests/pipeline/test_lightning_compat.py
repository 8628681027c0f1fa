"""Lightning's internals that the pipeline uses (pipeline/training/lightning_compat.py) exist in the
installed Lightning, and the check names what is missing when one does not."""

from __future__ import annotations

import lightning as L
import pytest

from pipeline.training import lightning_compat


def test_every_internal_the_pipeline_uses_exists():
    lightning_compat.check_internals()  # raises, naming each missing one
    assert L.__version__.startswith(lightning_compat.TESTED_WITH + ".")


def test_a_missing_internal_is_named_with_the_fix(monkeypatch):
    class Loop:
        def __init__(self) -> None:
            self.present = 1

    monkeypatch.setattr(
        lightning_compat, "INTERNALS", ((Loop, "present"), (Loop, "_gone"), (Loop, "_also_gone"))
    )
    with pytest.raises(RuntimeError, match=r"lacks Loop\._gone, Loop\._also_gone.*make setup"):
        lightning_compat.check_internals()


def test_no_other_module_reaches_into_lightning():
    """Private Lightning names appear only in the adapter."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    names = {name for _, name in lightning_compat.INTERNALS if name.startswith("_")}
    pattern = re.compile(r"\.(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    offenders = [
        f"{path.relative_to(repo)}:{number}"
        for folder in ("pipeline", "datamodules")
        for path in sorted((repo / folder).rglob("*.py"))
        if path.name != "lightning_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if pattern.search(line)
    ]
    assert offenders == []

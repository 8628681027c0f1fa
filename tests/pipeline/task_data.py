"""Small synthetic task files for fine-tuning tests that must run without ../shared/data."""

from __future__ import annotations

import random
from pathlib import Path

from datamodules.tasks.spec import TaskSpec

WORDS = [
    "the",
    "river",
    "city",
    "music",
    "garden",
    "winter",
    "train",
    "paper",
    "light",
    "stone",
    "market",
    "window",
    "story",
    "north",
    "summer",
    "house",
    "table",
    "field",
    "road",
    "bird",
]


# The task=custom overrides that read the files `write_pairs` writes into `folder`.
def pair_task(folder: Path) -> tuple[str, ...]:
    return (
        "task=custom",
        f"task.data_dir={folder}",
        "task.files={train: train.tsv, dev: dev.tsv}",
        "task.text_columns=[a,b]",
        "task.label_column=score",
        "task.kind=regression",
    )


def write_pairs(folder: Path, n_train: int, n_dev: int, seed: int = 0) -> None:
    """A sentence-pair regression task (train.tsv, dev.tsv with columns a, b, score): two
    texts of six words each, scored 0-5 by how many words they share."""
    rng = random.Random(seed)
    folder.mkdir()
    for split, n in (("train", n_train), ("dev", n_dev)):
        rows = ["a\tb\tscore"]
        for _ in range(n):
            a = rng.sample(WORDS, 6)
            shared = rng.randint(0, 6)
            b = a[:shared] + rng.sample([w for w in WORDS if w not in a], 6 - shared)
            rng.shuffle(b)
            rows.append(f"{' '.join(a)}\t{' '.join(b)}\t{shared / 6 * 5:.2f}")
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")


def write_task_split(spec: TaskSpec, split: str, rows: list[tuple[tuple[str, ...], str]]) -> None:
    """Write `rows` ((texts, label) each) into `spec`'s file of `split`, in the columns the
    spec reads (named, or by index with filler fields where the file has no header)."""
    columns = [*spec.text_columns, spec.label_column]
    if spec.id_column is not None:
        columns.append(spec.id_column)
    if spec.has_header:
        lines = ["\t".join(str(c) for c in columns)]
        order = list(range(len(columns)))
    else:
        width = max(int(c) for c in columns) + 1
        lines, order = [], [columns.index(i) if i in columns else None for i in range(width)]
    for number, (texts, label) in enumerate(rows):
        values = [*texts, label] + ([str(number)] if spec.id_column is not None else [])
        if spec.has_header:
            lines.append("\t".join(values))
        else:
            lines.append("\t".join("x" if i is None else values[i] for i in order))
    path = spec.path(split)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def task_label(spec: TaskSpec, n: int) -> str:
    return f"{n % 5}.0" if spec.is_regression else spec.labels[n % len(spec.labels)]


def write_task_texts(spec: TaskSpec, n_train: int = 7, n_dev: int = 3) -> dict[str, list[str]]:
    """Distinct texts per split ("<task> train 3 a", ...; no dev file when `n_dev` is 0);
    returns them per split."""
    written = {}
    for split, n in (("train", n_train), ("dev", n_dev)):
        if not n:
            continue
        rows = []
        for i in range(n):
            parts = "ab" if spec.is_pair else "a"
            rows.append((tuple(f"{spec.name} {split} {i} {p}" for p in parts), task_label(spec, i)))
        write_task_split(spec, split, rows)
        written[split] = [t for texts, _ in rows for t in texts]
    return written


QUICK_SUITE_TASKS = ("sst2", "mrpc", "stsb", "cola", "rte")


def write_quick_suite_texts(glue_dir: Path) -> None:
    """Small files for every task of the quick suite under `glue_dir`, laid out as its task
    configs (conf/task/) read them from $GLUE_DIR."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from tests.conftest import CONF

    for name in QUICK_SUITE_TASKS:
        node = OmegaConf.load(CONF / "task" / f"{name}.yaml")
        node.data_dir = str(glue_dir / Path(str(node.data_dir)).name)
        write_task_texts(instantiate(node))


def point_shipped_corpora_at(folder: Path, monkeypatch) -> None:
    """Make the shipped data configs that read ../shared/data (`data=wikitext2`, `glue_texts`,
    and the mixture of both) read small files under `folder` instead, through the environment
    variables they take (WIKITEXT2_DIR, GLUE_DIR), so that composing them needs no shared data."""
    write_quick_suite_texts(folder / "glue")
    monkeypatch.setenv("GLUE_DIR", str(folder / "glue"))
    (folder / "train.txt").write_text(" = A = \n one article .\n = B = \n another one .\n")
    monkeypatch.setenv("WIKITEXT2_DIR", str(folder))

"""Small synthetic task files for fine-tuning tests that must run without ../shared/data."""

from __future__ import annotations

import random
from pathlib import Path

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

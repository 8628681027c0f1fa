"""The label map of a classification task: its class names <-> ids (`LabelMap`), from
`task.labels` or collected from the training file (`build_label_map`, which refuses labels that
mix numbers and words), and the `labels.json` saved beside a fine-tuned model (`save_labels`,
`load_labels`). How a label is spelled (`label_text`) is with the task's settings, in
`datamodules.tasks.spec`."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from datamodules.tasks.spec import Example, TaskDataError, TaskSpec, label_number, label_text
from tokenizer import write_text_atomic


@dataclass(frozen=True)
class LabelMap:
    """Class names <-> ids of a task (regression tasks have none and one output)."""

    kind: str
    labels: tuple[str, ...] = ()

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "regression" else len(self.labels)

    @property
    def label_to_id(self) -> dict[str, int]:
        """Ids by class name as read from files (`label_text`): a map saved before equal
        numbers were one spelling (`1.0`) still finds its classes."""
        ids: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            ids.setdefault(label_text(label), i)
        return ids

    @property
    def id_to_label(self) -> dict[int, str]:
        return dict(enumerate(self.labels))


def collect_labels(examples: Sequence[Example]) -> list[str]:
    """The distinct labels, sorted (numbers by value, so "2" < "10", before words)."""
    distinct = {str(e.label) for e in examples if e.label is not None}

    def key(label: str) -> tuple:
        number = label_number(label)
        return (1, Decimal(0), label) if number is None else (0, number, "")

    return sorted(distinct, key=key)


def mixed_labels(spec: TaskSpec, examples: Sequence[Example], labels: list[str]) -> str | None:
    """Why the labels collected from the training file cannot be the classes: they mix numbers
    and words (`0`, `1` and `positive`: a row labelled by another scheme, or a word that means
    one of the numbers); None when they do not. The message counts each label's rows and
    gives both fixes, the rows or an explicit `task.labels`."""
    numbers = [label for label in labels if label_number(label) is not None]
    if not numbers or len(numbers) == len(labels):
        return None
    counts = Counter(str(e.label) for e in examples if e.label is not None)
    # as Hydra reads a list item: bare when it is one word, else in double quotes
    shown = [label if re.fullmatch(r"[\w.+-]+", label) else json.dumps(label) for label in labels]
    listed = ", ".join(
        f"{item} ({counts[label]} row{'s' * (counts[label] != 1)})"
        for item, label in zip(shown, labels, strict=True)
    )
    items = ",".join(shown)
    return (
        f"task {spec.name!r}: the labels of the {spec.train_split!r} file "
        f"{spec.path(spec.train_split)} (column {spec.label_column!r}) mix numbers and words: "
        f"{listed}. Equal numbers are one class (1 and 1.0), a word is a class of its own; fix "
        "the rows whose label is of the other kind, or, if each is a class, list them in id "
        f"order: {shlex.quote(f'task.labels=[{items}]')}"
    )


def build_label_map(spec: TaskSpec, train_examples: Sequence[Example] | None = None) -> LabelMap:
    """The task's label map: `spec.labels`, or the labels collected from `train_examples`."""
    if spec.is_regression:
        return LabelMap("regression")
    if spec.labels is not None:
        return LabelMap("classification", tuple(spec.labels))
    if train_examples is None:
        raise TaskDataError(
            f"task {spec.name!r}: task.labels is null, so the labels are collected from the "
            f"{spec.train_split!r} split; give its file, or list task.labels"
        )
    labels = collect_labels(train_examples)
    if refusal := mixed_labels(spec, train_examples, labels):
        raise TaskDataError(refusal)
    if len(labels) < 2:
        raise TaskDataError(
            f"task {spec.name!r}: the {spec.train_split!r} file {spec.path(spec.train_split)} "
            f"holds {len(labels)} distinct label(s) {labels}; a classification task needs at "
            "least two (or is this a regression task? set task.kind=regression)"
        )
    return LabelMap("classification", tuple(labels))


def save_labels(path: str | os.PathLike, label_map: LabelMap) -> None:
    """Write the label map as JSON (saved beside a fine-tuned model)."""
    payload = {"kind": label_map.kind, "labels": list(label_map.labels)}
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def load_labels(path: str | os.PathLike) -> LabelMap:
    """Read a label map written by `save_labels`."""
    try:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        return LabelMap(payload["kind"], tuple(payload["labels"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TaskDataError(
            f"{path}: not a label file written by save_labels ({err}); expected JSON with "
            '"kind" and "labels"'
        ) from err

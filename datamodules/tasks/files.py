"""Reading a task's labelled (or unlabelled) examples from its files: TSV, CSV or JSON Lines.

    train = read_examples(spec, "train")                # list[Example]
    dev = task_examples(spec, "dev", limit=500)         # with `dev_fraction`, carved from train

TSV files are read without quote handling (`csv.QUOTE_NONE`): the GLUE TSVs hold unbalanced `"`
inside texts, which a quote-aware reader would merge into one giant field. CSV files use the
standard CSV quoting. A UTF-8 byte order mark (MRPC has one) is dropped. The task definition
(`TaskSpec`) is in `datamodules.tasks.spec`, the label mapping in `datamodules.tasks.labels`.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from datamodules.tasks.spec import (
    CARVED_DEV,
    Column,
    Example,
    TaskDataError,
    TaskSpec,
    is_bare_name,
    is_column_name,
    label_text,
)

log = logging.getLogger(__name__)


def read_examples(
    spec: TaskSpec,
    split: str,
    *,
    labels: Sequence[str] | None = None,
    limit: int | None = None,
    labelled: bool = True,
) -> list[Example]:
    """Read the examples of one split of the task's files.

    Args:
        spec: the task.
        split: a key of `spec.files`.
        labels: the allowed class names (default `spec.labels`; None accepts any).
        limit: read at most this many examples (the first ones).
        labelled: False reads texts (and ids) only, for prediction; labels are None.

    Raises:
        TaskDataError: a missing file or column, a row with the wrong number of fields, a
            label outside `labels`, or a regression target that is not a number; the message
            names the file and line.
    """
    path = spec.path(split)
    if not path.is_file():
        raise TaskDataError(_missing_file(spec, split, path, labelled))
    known = spec.labels if labels is None else labels
    allowed = None if spec.is_regression or known is None else {label_text(k) for k in known}
    examples: list[Example] = []
    for line, record in _records(spec, path, spec.file_format(split), labelled):
        if limit is not None and len(examples) >= limit:
            break
        texts = tuple(_text(record.get(c)) for c in spec.text_columns)
        label = None
        if labelled:
            label = _parse_label(spec, record.get(spec.label_column), allowed, f"{path}:{line}")
        ident = record.get(spec.id_column) if spec.id_column is not None else None
        examples.append(Example(texts, label, str(ident if ident is not None else len(examples))))
    return examples


def _missing_file(spec: TaskSpec, split: str, path: Path, labelled: bool) -> str:
    """The error for a split's missing file, naming the settings that point to it (unlabelled
    files are those of `task.predict.files`, see `TaskSpec.prediction_spec`) with paths that
    work when pasted: a bare file name is looked up in `task.data_dir`, a path with a folder in
    it is read from the working directory (`datamodules.tasks.spec.task_file`)."""
    key = f"task.files.{split}" if labelled else f"task.predict.files.{split}"
    name = spec.files[split]
    if is_bare_name(name):
        hint = (
            f"give the folder that holds {name} with task.data_dir=DIR (now {spec.data_dir!r}), "
            f"or the file with {key}=FILE, a path with a folder in it, read from the working "
            f"directory (e.g. {key}=./{name})"
        )
        elsewhere, pasted = Path(name), f"./{name}"  # the file in the working directory
    else:
        hint = (
            f"{key}={name} is a path from the working directory (a bare file name is looked "
            f"up in task.data_dir); give the file with {key}=FILE"
        )
        elsewhere = Path(os.path.expanduser(spec.data_dir)) / name  # as read before: in data_dir
        pasted = elsewhere.as_posix()
    if not labelled:
        hint += ", or label a file of your own with predict.file=PATH"
    if elsewhere.is_file():
        hint += f"; {pasted} exists: {shlex.quote(f'{key}={pasted}')}"
    where = "" if path.is_absolute() else f" (relative to {os.getcwd()})"
    return f"task {spec.name!r}: the {split} file {path} does not exist{where}; {hint}"


def _wanted_columns(spec: TaskSpec, labelled: bool) -> tuple[list[Column], list[Column]]:
    """(required, optional) columns of a read. The id column is optional in unlabelled files
    (a file to predict on may have none: its examples are numbered by row)."""
    wanted = [*spec.text_columns, *([spec.label_column] if labelled else [])]
    if spec.id_column is None:
        return wanted, []
    return ([*wanted, spec.id_column], []) if labelled else (wanted, [spec.id_column])


def _records(spec: TaskSpec, path: Path, fmt: str, labelled: bool) -> Iterator[tuple[int, dict]]:
    """Yield (line number, {column: value}) per row; columns are names and/or indices; an
    optional column the file lacks is left out."""
    required, optional = _wanted_columns(spec, labelled)
    if fmt == "jsonl":
        yield from _json_records(path, required, optional)
        return
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if fmt == "tsv" else {}
    with open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle, **dialect)
        header = next(reader, None) if spec.has_header else None
        if spec.has_header and header is None:
            raise TaskDataError(f"{path}: the file is empty; expected a header line")
        index = (
            None
            if header is None
            else _column_index(path, 1, header, len(header), required, optional)
        )
        expected = len(header) if header is not None else None
        skipped = 0
        try:
            for row in reader:
                if not row:  # a blank line
                    continue
                if index is None:  # no header: the first row sets the field count
                    expected = len(row)
                    index = _column_index(path, reader.line_num, None, expected, required, optional)
                if len(row) != expected:
                    if spec.skip_bad_rows:
                        skipped += 1
                        continue
                    raise TaskDataError(
                        f"{path}:{reader.line_num}: {len(row)} fields, expected {expected} "
                        f"({'as in the header' if header else 'as in the first row'}); fix the "
                        "line (a tab or line break inside a text?), or set "
                        "task.skip_bad_rows=true to drop such rows"
                    )
                yield reader.line_num, {c: row[i] for c, i in index.items()}
        except csv.Error as err:
            raise TaskDataError(
                f"{path}:{reader.line_num}: unreadable {fmt.upper()} ({err}); check "
                "task.format and the file's quoting"
            ) from None
        if skipped:
            log.warning("%s: skipped %d rows with a wrong number of fields", path, skipped)


def _column_index(
    path: Path,
    line: int,
    header: list[str] | None,
    fields: int,
    required: list[Column],
    optional: list[Column],
) -> dict[Column, int]:
    """The field position of each column of a row of `fields` fields (named by `header`, or
    only by 0-based index when None); an optional column that is absent is left out."""
    index: dict[Column, int] = {}
    for column in [*required, *optional]:
        position = _position(column, header, fields)
        if position is not None:
            index[column] = position
        elif column in optional:
            _log_row_ids(path, column)
        elif is_column_name(column):
            raise TaskDataError(
                f"{path}:1: column {column!r} is not in the header {header}; set the task's "
                "text_columns/label_column/id_column to header names (or field indices)"
            )
        else:
            raise TaskDataError(
                f"{path}:{line}: column index {column} is out of range, the row has {fields} "
                "fields (0-based indices); fix the task's column settings"
            )
    return index


def _position(column: Column, header: list[str] | None, fields: int) -> int | None:
    if is_column_name(column):
        return header.index(column) if header is not None and column in header else None
    return int(column) if 0 <= int(column) < fields else None


def _log_row_ids(path: Path, column: Column) -> None:
    log.info("%s has no %r column: its examples are numbered by row, from 0", path, column)


def _json_records(
    path: Path, required: list[Column], optional: list[Column]
) -> Iterator[tuple[int, dict]]:
    absent: set[Column] = set()
    with open(path, encoding="utf-8-sig") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise TaskDataError(
                    f"{path}:{line}: not valid JSON ({err.msg}); each line must hold one JSON "
                    "object"
                ) from None
            if not isinstance(record, dict):
                raise TaskDataError(f"{path}:{line}: expected a JSON object, got {text.strip()!r}")
            missing = [c for c in required if str(c) not in record]
            if missing:
                raise TaskDataError(
                    f"{path}:{line}: field(s) {missing} missing (the record has {list(record)}); "
                    "set the task's text_columns/label_column/id_column to field names"
                )
            for column in optional:
                if str(column) not in record and column not in absent:
                    absent.add(column)
                    _log_row_ids(path, column)
            present = [c for c in [*required, *optional] if str(c) in record]
            yield line, {c: record[str(c)] for c in present}


def _parse_label(
    spec: TaskSpec, raw: object, allowed: set[str] | None, where: str
) -> str | float | None:
    if spec.is_regression:
        try:
            value = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise TaskDataError(
                f"{where}: regression target {raw!r} (column {spec.label_column!r}) is not a "
                "finite number; fix the row, or set task.kind=classification if the column "
                "holds class names"
            )
        return value
    label = label_text(raw)
    if allowed is not None and label not in allowed:
        raise TaskDataError(
            f"{where}: label {label!r} (column {spec.label_column!r}) is not one of "
            f"{sorted(allowed)}; fix the row, add it to task.labels, or set task.labels=null "
            "to collect the labels from the training file"
        )
    return label


def task_examples(
    spec: TaskSpec,
    split: str,
    *,
    labels: Sequence[str] | None = None,
    limit: int | None = None,
    sample: int | None = None,
) -> list[Example]:
    """The labelled examples of a split: `read_examples`, except that with `spec.dev_fraction`
    the training file is split (seeded, stratified) into the train split and a "dev" split.

    `limit` applies after the split, to each part; `sample` then keeps a fixed random subset of
    that many examples (`fixed_sample`)."""
    if spec.dev_fraction is None or split not in (spec.train_split, CARVED_DEV):
        return fixed_sample(read_examples(spec, split, labels=labels, limit=limit), sample)
    examples = read_examples(spec, spec.train_split, labels=labels)
    dev = set(stratified_holdout(examples, spec.dev_fraction, spec.split_seed).tolist())
    part = [e for i, e in enumerate(examples) if (i in dev) == (split == CARVED_DEV)]
    return fixed_sample(part if limit is None else part[:limit], sample)


def fixed_sample(examples: list[Example], size: int | None, seed: int = 0) -> list[Example]:
    """`size` of `examples` drawn at random (without replacement, in file order), the same draw
    for every run of the same file: runs that differ in their seed train on the same subset,
    and files sorted by topic or label (STS-B by genre) are not cut to their first part.
    None, or a size of at least `len(examples)`, keeps them all."""
    if size is None or size >= len(examples):
        return examples
    if size < 1:
        raise ValueError(f"a sample of {size} examples: use a positive size, or null for all")
    chosen = np.sort(np.random.default_rng(seed).choice(len(examples), size, replace=False))
    return [examples[i] for i in chosen]


def stratified_holdout(examples: Sequence[Example], fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a held-out `fraction` of `examples`, the same fraction of every label
    (rounded per label; at least one example of a label with two or more), seeded.

    Regression targets are stratified by quartile."""
    if not examples:
        return np.zeros(0, dtype=np.int64)
    values = [e.label for e in examples]
    if all(isinstance(v, float) for v in values):
        edges = np.quantile(np.asarray(values, dtype=np.float64), [0.25, 0.5, 0.75])
        values = np.searchsorted(edges, values).tolist()
    rng = np.random.default_rng(seed)
    held: list[int] = []
    for label in sorted({str(v) for v in values}):
        members = np.array([i for i, v in enumerate(values) if str(v) == label], dtype=np.int64)
        n = round(fraction * len(members))
        if len(members) >= 2:
            n = min(max(n, 1), len(members) - 1)  # the label stays in both parts
        held.extend(rng.permutation(members)[:n].tolist())
    return np.sort(np.asarray(held, dtype=np.int64))


def _text(value: object) -> str:
    return "" if value is None else str(value).strip()

"""Fine-tuning task definitions (`conf/task/*.yaml`) and how their labels are spelled; reading a
task's examples from its files is `datamodules.tasks.files`, its label map (class names <-> ids)
`datamodules.tasks.labels`.

A task is one `TaskSpec`: where its files are, how to read them (TSV, CSV or JSON Lines), which
column(s) hold the text (one for single-sentence tasks, two for sentence pairs), which the label,
whether the label is a class or a number (regression), and which metrics score it.

    spec = TaskSpec(name="rte", data_dir="glue/RTE", text_columns=["sentence1", "sentence2"],
                    label_column="label", labels=["entailment", "not_entailment"])
    train = read_examples(spec, "train")          # datamodules.tasks.files: list[Example]
    label_map = build_label_map(spec, train)      # datamodules.tasks.labels, saved with the model
    save_labels(run_dir / "labels.json", label_map)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from datamodules.tasks.long_text import LongTextSpec

log = logging.getLogger(__name__)

KINDS = ("classification", "regression")
CARVED_DEV = "dev"  # the split `dev_fraction` carves out of the training file
PREDICT_KEYS = {"files", "text_columns", "id_column", "has_header", "format", "submission"}
FORMATS = ("tsv", "csv", "jsonl")
CLASSIFICATION_METRICS = ("accuracy", "f1", "matthews")
REGRESSION_METRICS = ("pearson", "spearman")
# `task.metrics` null: these, by `task.kind`; the first is the main metric when
# `task.main_metric` is null (Spearman selects STS-B models in the BERT paper).
DEFAULT_METRICS = {"classification": ("accuracy",), "regression": ("spearman", "pearson")}
_SUFFIX_FORMAT = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}

Column = str | int
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class TaskDataError(ValueError):
    """Bad task data or task settings: the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Example:
    """One labelled example: its text(s), its label (class name, number, or None) and id."""

    texts: tuple[str, ...]
    label: str | float | None
    id: str


@dataclass
class TaskSpec:
    """A fine-tuning task: its files, columns, labels and metrics.

    Attributes:
        name: short task name (`cola`, `sst2`, ..., or a custom one); names the run's results.
        data_dir: folder holding the files (relative paths: from the working directory).
        text_columns: one column (single-sentence task) or two (sentence-pair task) holding the
            texts: header names, or 0-based field indices (required when `has_header` is false).
        label_column: the column holding the label (a name or an index).
        kind: "classification" (labels are class names) or "regression" (labels are numbers).
        files: file per split, e.g. `{train: train.tsv, dev: dev.tsv}`: a bare file name is
            a file in `data_dir`; a path with a folder in it (`./train.tsv`, `/data/train.tsv`)
            is used as given (`task_file`).
        train_split: which of `files` is trained on (and collects labels when `labels` is null).
        eval_splits: splits evaluated, in order, each reported separately; null means every split
            in `files` except `train_split` (MNLI: dev_matched then dev_mismatched).
        format: "tsv", "csv" or "jsonl"; null infers it from each file's suffix.
        has_header: whether TSV/CSV files start with a header line (ignored for JSON Lines).
        labels: the class names in id order; null collects the sorted distinct labels of the
            training file. Must be null for regression.
        id_column: a column with example ids (kept with predictions); null uses the row number
            (0-based, as GLUE's test files number their rows). A file to predict on that lacks
            the column gets the row numbers too.
        metrics: metric names reported: accuracy, f1, matthews (classification), pearson,
            spearman (regression); null: `DEFAULT_METRICS` of `kind` (accuracy; spearman and
            pearson).
        main_metric: the metric that selects the best checkpoint; one of `metrics`; null: the
            first of `metrics`.
        skip_bad_rows: drop rows with the wrong number of fields (logged) instead of failing.
        dev_fraction: carve a "dev" split out of the training file (a seeded split, stratified by
            label) for a task that has no labelled dev file; null uses `files`.
        split_seed: seed of that split.
        predict: the unlabelled splits of `make predict` and how to read them (GLUE test files
            have other columns than train/dev): `files` (split -> file), and optionally
            `text_columns`, `id_column`, `has_header`, `format` (default: as above) and
            `submission` (split -> output file name, e.g. the GLUE leaderboard's `SST-2.tsv`).
        long_text: sliding-window or truncation settings for documents longer than the model's
            window (`datamodules.tasks.long_text.LongTextSpec`); null encodes each text once, truncated.
    """

    name: str
    data_dir: str
    text_columns: list[Column]
    label_column: Column
    kind: str = "classification"
    files: dict[str, str] = field(default_factory=lambda: {"train": "train.tsv", "dev": "dev.tsv"})
    train_split: str = "train"
    eval_splits: list[str] | None = None
    format: str | None = None
    has_header: bool = True
    labels: list[str] | None = None
    id_column: Column | None = None
    metrics: list[str] | None = None
    main_metric: str | None = None
    skip_bad_rows: bool = False
    dev_fraction: float | None = None
    split_seed: int = 1234
    predict: dict[str, Any] | None = None
    long_text: LongTextSpec | None = None

    def __post_init__(self) -> None:
        # Hydra hands over ListConfig/DictConfig; keep plain containers from here on.
        self.text_columns = list(self.text_columns)
        # a split set to null has no file (task.files.dev=null beside task.dev_fraction)
        self.files = {str(k): str(v) for k, v in dict(self.files).items() if v is not None}
        if self.metrics is None:
            self.metrics = list(DEFAULT_METRICS.get(self.kind, ("accuracy",)))
        self.metrics = [str(m) for m in self.metrics]
        if self.main_metric is None and self.metrics:
            self.main_metric = self.metrics[0]
        if self.labels is not None:
            self.labels = [label_text(v) for v in self.labels]
        if self.eval_splits is not None:
            self.eval_splits = [str(s) for s in self.eval_splits]
        elif self.dev_fraction is not None:
            self.eval_splits = [CARVED_DEV]
        else:
            self.eval_splits = [s for s in self.files if s != self.train_split]
        if self.predict is not None:
            self.predict = _plain(self.predict)
        if self.long_text is not None and not isinstance(self.long_text, LongTextSpec):
            self.long_text = LongTextSpec(**_plain(self.long_text))
        self._validate()

    def _validate(self) -> None:
        where = f"task {self.name!r}"
        if self.kind not in KINDS:
            raise TaskDataError(f"{where}: task.kind={self.kind!r} is not one of {list(KINDS)}")
        if not 1 <= len(self.text_columns) <= 2:
            raise TaskDataError(
                f"{where}: task.text_columns={self.text_columns} must name one column (single "
                "sentence) or two (sentence pair)"
            )
        if self.format is not None and self.format not in FORMATS:
            raise TaskDataError(f"{where}: task.format={self.format!r} is not one of {FORMATS}")
        if not self.has_header:
            named = [
                c
                for c in [*self.text_columns, self.label_column, self.id_column]
                if is_column_name(c)
            ]
            if named:
                raise TaskDataError(
                    f"{where}: task.has_header=false, so columns must be 0-based field indices, "
                    f"got names {named}"
                )
        if self.dev_fraction is not None:
            if not 0 < self.dev_fraction < 1:
                raise TaskDataError(
                    f"{where}: task.dev_fraction={self.dev_fraction} must be in (0, 1), or null"
                )
            if CARVED_DEV in self.files:
                raise TaskDataError(
                    f"{where}: task.dev_fraction carves a {CARVED_DEV!r} split out of the "
                    f"training file, but task.files has one; set one or the other"
                )
        splits = [*self.files, *([CARVED_DEV] if self.dev_fraction is not None else [])]
        unknown = [s for s in self.eval_splits if s not in splits]
        if unknown:
            raise TaskDataError(
                f"{where}: task.eval_splits {unknown} are not in task.files {list(self.files)}"
                + (" (or the carved dev split)" if self.dev_fraction is not None else "")
            )
        allowed = REGRESSION_METRICS if self.is_regression else CLASSIFICATION_METRICS
        bad = [m for m in self.metrics if m not in allowed]
        if bad or not self.metrics:
            raise TaskDataError(
                f"{where}: task.metrics={self.metrics} must be a non-empty subset of "
                f"{list(allowed)} for a {self.kind} task"
            )
        if self.main_metric not in self.metrics:
            raise TaskDataError(
                f"{where}: task.main_metric={self.main_metric!r} is not in task.metrics "
                f"{self.metrics}"
            )
        if self.is_regression and self.labels is not None:
            raise TaskDataError(
                f"{where}: a regression task has no class labels; set task.labels=null"
            )
        if self.labels is not None and (
            len(self.labels) < 2 or len(set(self.labels)) != len(self.labels)
        ):
            raise TaskDataError(
                f"{where}: task.labels={self.labels} must list at least two distinct classes, "
                "or be null to collect them from the training file"
            )
        if "f1" in self.metrics and self.labels is not None and len(self.labels) != 2:
            raise TaskDataError(
                f"{where}: f1 is the binary F1 of the second label; it needs exactly two "
                f"labels, got {self.labels}"
            )

        if self.predict is not None:
            unknown_keys = set(self.predict) - PREDICT_KEYS
            if unknown_keys:
                raise TaskDataError(
                    f"{where}: task.predict has unknown key(s) {sorted(unknown_keys)}; it takes "
                    f"{sorted(PREDICT_KEYS)}"
                )

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def is_regression(self) -> bool:
        return self.kind == "regression"

    def path(self, split: str) -> Path:
        """The file of `split` (`task_file`)."""
        if split not in self.files:
            raise TaskDataError(
                f"task {self.name!r} has no split {split!r}; its splits are {list(self.files)}"
            )
        return task_file(self.data_dir, self.files[split])

    def source(self, split: str) -> Path:
        """The file `split`'s examples come from: its own, or for the split that `dev_fraction`
        carves out, the training file."""
        carved = self.dev_fraction is not None and split == CARVED_DEV
        return self.path(self.train_split if carved else split)

    @property
    def ordered_metrics(self) -> list[str]:
        """`metrics` with `main_metric` first (the order the metrics are computed and shown)."""
        return [self.main_metric, *(m for m in self.metrics if m != self.main_metric)]

    @property
    def predict_splits(self) -> list[str]:
        """The unlabelled splits `make predict` writes predictions for (GLUE: test)."""
        return list((self.predict or {}).get("files", {}))

    def submission_name(self, split: str) -> str:
        """File name of the predictions of `split` (the GLUE leaderboard's, for GLUE tasks)."""
        return (self.predict or {}).get("submission", {}).get(split, f"{self.name}_{split}.tsv")

    def prediction_spec(self, file: str | os.PathLike | None = None) -> TaskSpec:
        """The spec that reads the unlabelled files: `task.predict`'s, or the one `file` (split
        "input") read with the task's columns and the `task.predict` column settings."""
        settings = dict(self.predict or {})
        if file is not None:
            path = Path(os.path.expanduser(str(file)))
            if not path.is_file():
                raise TaskDataError(
                    f"predict.file={str(file)!r} does not exist (relative to {os.getcwd()}); "
                    "give the path of a TSV, CSV or JSON Lines file of texts to label"
                )
            settings["files"] = {"input": str(path.resolve())}
        elif not settings.get("files"):
            raise TaskDataError(
                f"task {self.name!r} names no unlabelled file to label (task.predict.files is "
                "not set): give one with predict.file=PATH, a TSV, CSV or JSON Lines file with "
                f"the column(s) {', '.join(map(str, self.text_columns))}"
            )
        columns = {
            k: settings[k] for k in ("text_columns", "id_column", "has_header") if k in settings
        }
        if "format" in settings or file is not None:
            columns["format"] = settings.get("format") if file is None else None
        return dataclasses.replace(
            self,
            files=dict(settings["files"]),
            eval_splits=[],
            dev_fraction=None,
            predict=None,
            **columns,
        )

    def file_format(self, split: str) -> str:
        if self.format is not None:
            return self.format
        path = self.path(split)
        fmt = _SUFFIX_FORMAT.get(path.suffix.lower())
        if fmt is None:
            raise TaskDataError(
                f"{path}: cannot infer the format from the suffix {path.suffix!r}; set "
                f"task.format to one of {list(FORMATS)}"
            )
        return fmt


def task_file(data_dir: str | os.PathLike, name: str) -> Path:
    """Where a file of `task.files` / `task.predict.files` is: a bare file name (`test.tsv`,
    as the task configs name them) is a file in `data_dir`; a path, one with a folder in it
    (`./test.tsv`, `data/test.tsv`, `/data/test.tsv`, `~/test.tsv`), is used as given, from
    the working directory like `task.data_dir` and `predict.file` (never from `data_dir`, so
    a path typed from where the command runs is not read as `data_dir/data/...`)."""
    if is_bare_name(name):
        return Path(os.path.expanduser(str(data_dir))) / name
    return Path(os.path.expanduser(name))


def is_bare_name(name: str) -> bool:
    """Whether `name` is a file name alone, without a folder (see `task_file`)."""
    return not name.startswith("~") and "/" not in name and os.sep not in name


def _plain(value: Any) -> Any:
    """Plain dicts and lists from (possibly nested) mappings and sequences such as Hydra's."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def label_text(value: object) -> str:
    """Class names are strings; JSON numbers/booleans and YAML numbers map to their text, and
    equal numbers to one spelling (`1`, `1.0`, `+1` and `1e0` are `1`; `0.50` is `0.5`), so
    that a column that spells a class two ways still holds one class. Every digit counts; a
    number whose written-out form would pad more than `LABEL_ZEROS` zeros is spelled with an
    exponent (`1e5000` and `10e4999` are `1e+5000`), not written out."""
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value).strip()
    number = label_number(text)
    return text if number is None else number_text(number)


# The most zeros a label's number is written out with (`1e100`); beyond, it keeps an exponent.
LABEL_ZEROS = 100


def number_text(number: Decimal) -> str:
    """One spelling per value, exact (no context rounding), from the digits alone: never a
    string of millions of zeros, nor Python's int-to-text digit limit (`1e5000`)."""
    sign, digits, exponent = number.as_tuple()
    shown = "".join(map(str, digits)).rstrip("0")
    if not shown:
        return "0"
    exponent += len(digits) - len(shown)  # int: label_number reads finite numbers only
    minus = "-" if sign else ""
    point = len(shown) + exponent  # where the point goes in `shown`
    if 0 <= exponent <= LABEL_ZEROS:
        return minus + shown + "0" * exponent
    if 0 < point < len(shown):
        return f"{minus}{shown[:point]}.{shown[point:]}"
    if exponent < 0 and -point <= LABEL_ZEROS:
        return f"{minus}0.{'0' * -point}{shown}"
    fraction = f".{shown[1:]}" if len(shown) > 1 else ""
    return f"{minus}{shown[0]}{fraction}e{point - 1:+d}"


def label_number(label: str) -> Decimal | None:
    """The number a label spells (digits, a sign, a point, an exponent), else None: words,
    `nan` or `inf`, and an exponent too large for a Decimal (`1e99999999999999999999`), are
    class names."""
    if not _NUMBER.fullmatch(label):
        return None
    try:
        return Decimal(label)
    except InvalidOperation:
        return None


def is_column_name(column: object) -> bool:
    return isinstance(column, str)

"""Task definitions: every conf/task file instantiates, the real GLUE files parse with the right
row counts and labels, custom CSV/JSONL tasks, label maps, and errors that name file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from datamodules.tasks.files import read_examples
from datamodules.tasks.labels import (
    LabelMap,
    build_label_map,
    collect_labels,
    load_labels,
    save_labels,
)
from datamodules.tasks.spec import TaskDataError, TaskSpec, label_text
from tests.conftest import CONF

GLUE_TASKS = ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"]


def task_spec(name: str, *overrides: str) -> TaskSpec:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(config_name=f"task/{name}", overrides=list(overrides))
    return instantiate(cfg.task)


def data_lines(path, has_header: bool) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip()) - int(has_header)


@pytest.mark.parametrize("name", GLUE_TASKS)
def test_every_glue_config_instantiates(name):
    spec = task_spec(name)
    assert spec.name == name and spec.main_metric in spec.metrics
    folders = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE", "WNLI")
    assert spec.data_dir.rsplit("/", 1)[1] in folders
    assert spec.is_pair == (name not in ("cola", "sst2"))
    assert spec.is_regression == (name == "stsb")


def test_glue_dir_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GLUE_DIR", "/data/glue")
    assert task_spec("rte").data_dir == "/data/glue/RTE"


def test_glue_metric_conventions():
    assert task_spec("cola").main_metric == "matthews"
    assert task_spec("mrpc").metrics == ["f1", "accuracy"] and task_spec("qqp").main_metric == "f1"
    stsb = task_spec("stsb")
    assert stsb.metrics == ["pearson", "spearman"] and stsb.labels is None
    mnli = task_spec("mnli")
    assert mnli.eval_splits == ["dev_matched", "dev_mismatched"]
    assert build_label_map(mnli).num_labels == 3


def test_custom_config_needs_its_values_then_instantiates(tmp_path):
    with pytest.raises(Exception, match="Missing mandatory value"):
        task_spec("custom")
    spec = task_spec(
        "custom",
        f"task.data_dir={tmp_path}",
        "task.files.train=train.csv",
        "task.files.dev=dev.jsonl",
        "task.text_columns=[review]",
        "task.label_column=stars",
    )
    assert spec.file_format("train") == "csv" and spec.file_format("dev") == "jsonl"
    assert spec.eval_splits == ["dev"] and not spec.is_pair


def test_the_custom_config_s_hint_for_a_carved_dev_split_instantiates(tmp_path):
    """conf/task/custom.yaml's hint for a task with only a training file, pasted as written:
    the dev file set to null, the dev split carved out of the training file."""
    hint = next(
        line.strip("# \n").split()
        for line in (CONF / "task" / "custom.yaml").read_text().splitlines()
        if "task.dev_fraction=" in line
    )
    spec = task_spec(
        "custom",
        f"task.data_dir={tmp_path}",
        "task.files.train=train.csv",
        "task.text_columns=[review]",
        "task.label_column=stars",
        *hint,
    )
    assert spec.files == {"train": "train.csv"} and spec.dev_fraction == 0.2
    assert spec.eval_splits == ["dev"] and spec.source("dev") == tmp_path / "train.csv"


# (task, split, folder, labels): every file of the shared GLUE copy.
GLUE_FILES = [
    ("cola", "train", "CoLA", {"0", "1"}),
    ("cola", "dev", "CoLA", {"0", "1"}),
    ("sst2", "train", "SST-2", {"0", "1"}),
    ("sst2", "dev", "SST-2", {"0", "1"}),
    ("mrpc", "train", "MRPC", {"0", "1"}),
    ("mrpc", "dev", "MRPC", {"0", "1"}),
    ("stsb", "train", "STS-B", None),
    ("stsb", "dev", "STS-B", None),
    ("qnli", "dev", "QNLI", {"entailment", "not_entailment"}),
    ("rte", "train", "RTE", {"entailment", "not_entailment"}),
    ("rte", "dev", "RTE", {"entailment", "not_entailment"}),
    ("wnli", "train", "WNLI", {"0", "1"}),
    ("wnli", "dev", "WNLI", {"0", "1"}),
]


@pytest.mark.parametrize(("name", "split", "folder", "labels"), GLUE_FILES)
def test_glue_file_parses_every_row(shared_data, name, split, folder, labels):
    spec = task_spec(name, f"task.data_dir={shared_data}/glue/{folder}")
    path = spec.path(split)
    examples = read_examples(spec, split)
    # QUOTE_NONE: a stray quote never swallows the following rows
    assert len(examples) == data_lines(path, spec.has_header)
    assert all(len(e.texts) == len(spec.text_columns) and all(e.texts) for e in examples)
    if labels is None:
        scores = [e.label for e in examples]
        assert all(isinstance(s, float) and 0.0 <= s <= 5.0 for s in scores)
        assert len(set(scores)) > 50  # a real spread of scores, not a class column
    else:
        assert set(collect_labels(examples)) == labels


def test_mrpc_header_with_byte_order_mark_and_quotes(shared_data):
    spec = task_spec("mrpc", f"task.data_dir={shared_data}/glue/MRPC")
    first = read_examples(spec, "train", limit=1)[0]
    assert first.label == "1"
    assert first.texts[0].startswith("Amrozi accused his brother") and '"' in first.texts[0]


def test_cola_without_header_uses_field_indices(shared_data):
    spec = task_spec("cola", f"task.data_dir={shared_data}/glue/CoLA")
    first = read_examples(spec, "dev", limit=1)[0]
    assert first.texts == ("The sailors rode the breeze clear of the rocks.",)


# --- custom tasks -----------------------------------------------------------------------------


def test_custom_csv_with_quotes_and_automatic_labels(tmp_path):
    (tmp_path / "train.csv").write_text(
        'id,review,stars\n1,"Great, really ""great""",5\n2,bad,1\n3,fine,10\n4,ok,5\n'
    )
    spec = TaskSpec(
        name="reviews",
        data_dir=str(tmp_path),
        files={"train": "train.csv"},
        text_columns=["review"],
        label_column="stars",
        id_column="id",
    )
    examples = read_examples(spec, "train")
    assert examples[0].texts == ('Great, really "great"',) and examples[0].id == "1"
    label_map = build_label_map(spec, examples)
    assert label_map.labels == ("1", "5", "10")  # numeric order, not "1" < "10" < "5"
    assert label_map.label_to_id == {"1": 0, "5": 1, "10": 2}


def test_custom_jsonl_pair_task(tmp_path):
    rows = [
        {"q": "Who?", "a": "Me.", "y": True},
        {"q": "Why?", "a": "Because.", "y": False},
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    spec = TaskSpec(
        name="qa",
        data_dir=str(tmp_path),
        files={"train": "train.jsonl"},
        text_columns=["q", "a"],
        label_column="y",
    )
    examples = read_examples(spec, "train")
    assert [e.texts for e in examples] == [("Who?", "Me."), ("Why?", "Because.")]
    assert [e.label for e in examples] == ["true", "false"]
    assert build_label_map(spec, examples).labels == ("false", "true")


def labelled_csv(folder: Path, values: list[str], **settings) -> TaskSpec:
    """A one-text CSV task whose rows hold the labels `values`, in order."""
    rows = "".join(f"text {number},{label}\n" for number, label in enumerate(values))
    (folder / "train.csv").write_text("text,label\n" + rows)
    files = {"train": "train.csv"}
    return TaskSpec("spelled", str(folder), ["text"], "label", files=files, **settings)


def test_equal_numbers_are_one_label_whatever_their_spelling(tmp_path):
    spec = labelled_csv(tmp_path, ["1", "1.0", "0", "0.0", "+1", " 0.00 ", "1e0", "10"])
    examples = read_examples(spec, "train")
    assert [e.label for e in examples] == ["1", "1", "0", "0", "1", "0", "1", "10"]
    assert build_label_map(spec, examples).labels == ("0", "1", "10")
    # a map saved with another spelling (before) still finds its classes; so do task.labels
    assert LabelMap("classification", ("0.0", "1.0")).label_to_id == {"0": 0, "1": 1}
    listed = labelled_csv(tmp_path, ["1.0", "0"], labels=[0.0, 1.0])
    assert listed.labels == ["0", "1"] and len(read_examples(listed, "train")) == 2
    old = read_examples(listed, "train", labels=["0.0", "1.0"])  # a model's saved labels
    assert [e.label for e in old] == ["1", "0"]


def test_numbers_too_long_to_write_out_are_one_label_each_not_a_traceback(tmp_path):
    """`1e5000` written out has more digits than Python turns into text (ValueError): a number
    whose written-out form would be long is spelled with an exponent, one spelling per value;
    an exponent too large for a number at all leaves the label a word. Every digit counts
    (no rounding to 28 digits), and a spelling reads back as itself (saved label maps)."""
    spelled = {
        "1e5000": "1e+5000",
        "10E4999": "1e+5000",
        "-2.50e-5000": "-2.5e-5000",
        "1e999999999999999999": "1e+999999999999999999",
        "1e9999999999999999999999999": "1e9999999999999999999999999",  # a word
        "1e100": "1" + "0" * 100,
        "1e-99": "0." + "0" * 98 + "1",
        "1.0000000000000000000000000000000001": "1.0000000000000000000000000000000001",
        "-0.0": "0",
        "12.50e1": "125",
    }
    assert {value: label_text(value) for value in spelled} == spelled
    assert all(label_text(label) == label for label in spelled.values())
    spec = labelled_csv(tmp_path, ["1e5000", "0", "10e4999", "1", "1e-5000"])
    examples = read_examples(spec, "train")
    assert [e.label for e in examples] == ["1e+5000", "0", "1e+5000", "1", "1e-5000"]
    assert build_label_map(spec, examples).labels == ("0", "1e-5000", "1", "1e+5000")


def test_labels_mixing_numbers_and_words_are_refused_with_counts_and_fixes(tmp_path):
    spec = labelled_csv(tmp_path, ["1", "1.0", "0", "0.0", "positive", "1"])
    examples = read_examples(spec, "train")
    with pytest.raises(TaskDataError) as refused:
        build_label_map(spec, examples)
    message = str(refused.value)
    assert "mix numbers and words: 0 (2 rows), 1 (3 rows), positive (1 row)" in message
    fix = re.search(r"list them in id order: (\S+)$", message)[1]
    assert fix == "'task.labels=[0,1,positive]'"
    listed = labelled_csv(
        tmp_path, ["1", "1.0", "0", "0.0", "positive", "1"], labels=[0, 1, "positive"]
    )
    assert build_label_map(listed, read_examples(listed, "train")).labels == ("0", "1", "positive")


def test_label_map_round_trips(tmp_path):
    for label_map in (
        LabelMap("classification", ("entailment", "neutral", "contradiction")),
        LabelMap("regression"),
    ):
        save_labels(tmp_path / "labels.json", label_map)
        restored = load_labels(tmp_path / "labels.json")
        assert restored == label_map
        assert restored.id_to_label == dict(enumerate(label_map.labels))
    assert load_labels(tmp_path / "labels.json").num_labels == 1
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TaskDataError, match="bad.json"):
        load_labels(tmp_path / "bad.json")


# --- errors -----------------------------------------------------------------------------------


def tsv_task(tmp_path, text: str, **kwargs) -> TaskSpec:
    (tmp_path / "train.tsv").write_text(text)
    settings = {
        "name": "t",
        "data_dir": str(tmp_path),
        "files": {"train": "train.tsv"},
        "text_columns": ["a", "b"],
        "label_column": "label",
        **kwargs,
    }
    return TaskSpec(**settings)


def test_missing_file_names_path_and_setting(tmp_path):
    spec = task_spec("rte", f"task.data_dir={tmp_path}/nowhere")
    with pytest.raises(TaskDataError, match=r"nowhere/train.tsv does not exist.*task.data_dir"):
        read_examples(spec, "train")


def test_a_bare_file_name_is_in_data_dir_and_a_path_is_from_the_working_directory(
    tmp_path, monkeypatch
):
    """`task.files` as the task configs name them (`train.tsv`) are under `task.data_dir`; a
    path with a folder in it is read from the working directory as typed, never joined onto
    data_dir (`mine/dev.tsv` is not `glue/RTE/mine/dev.tsv`)."""
    monkeypatch.chdir(tmp_path)
    rows = "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
    for path in ("glue/RTE/train.tsv", "mine/dev.tsv", "abs/test.tsv", "dev.tsv"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(rows)
    spec = task_spec(
        "rte",
        "task.data_dir=glue/RTE",
        "task.files.dev=mine/dev.tsv",
        f"+task.files.test={tmp_path}/abs/test.tsv",
        "+task.files.here=./dev.tsv",
    )
    assert spec.path("train") == Path("glue/RTE/train.tsv")
    assert spec.path("dev") == Path("mine/dev.tsv")
    assert spec.path("test") == tmp_path / "abs/test.tsv"
    assert spec.path("here") == Path("dev.tsv")
    for split in ("train", "dev", "test", "here"):
        assert [e.texts for e in read_examples(spec, split)] == [("a", "b")]


def test_missing_file_hints_paste_as_paths_that_read_the_file(tmp_path, monkeypatch):
    """The error for a missing test file points at a copy in the working directory with an
    override that reads it; a path typed from the working directory that is missing is named
    as such, with the file that the old reading (under data_dir) would have found."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "test.tsv").write_text("index\tsentence\n0\ta fine film\n")
    spec = task_spec("sst2", "task.data_dir=glue/SST-2")
    prediction = spec.prediction_spec()
    with pytest.raises(TaskDataError) as missing:
        read_examples(prediction, "test", labelled=False)
    message = str(missing.value)
    assert "glue/SST-2/test.tsv does not exist" in message and "task.data_dir=DIR" in message
    hint = re.search(r"\./test\.tsv exists: (\S+)$", message)
    assert hint is not None, message
    pasted = task_spec("sst2", "task.data_dir=glue/SST-2", hint[1]).prediction_spec()
    assert [e.texts for e in read_examples(pasted, "test", labelled=False)] == [("a fine film",)]

    (tmp_path / "glue/SST-2/sub").mkdir(parents=True)
    (tmp_path / "glue/SST-2/sub/test.tsv").write_text("index\tsentence\n0\tdull\n")
    spec = task_spec("sst2", "task.data_dir=glue/SST-2", "task.predict.files.test=sub/test.tsv")
    with pytest.raises(TaskDataError) as missing:
        read_examples(spec.prediction_spec(), "test", labelled=False)
    message = str(missing.value)
    assert "task.predict.files.test=sub/test.tsv is a path from the working directory" in message
    hint = re.search(r"glue/SST-2/sub/test\.tsv exists: (\S+)$", message)
    assert hint is not None, message
    pasted = task_spec("sst2", "task.data_dir=glue/SST-2", hint[1]).prediction_spec()
    assert [e.texts for e in read_examples(pasted, "test", labelled=False)] == [("dull",)]


def test_missing_column_names_header(tmp_path):
    spec = tsv_task(tmp_path, "a\tc\tlabel\nx\ty\t1\n")
    with pytest.raises(TaskDataError, match=r"train.tsv:1: column 'b' is not in the header"):
        read_examples(spec, "train")


def test_wrong_field_count_names_line_and_can_be_skipped(tmp_path):
    text = "a\tb\tlabel\nx\ty\t1\nx\ty\tz\t0\nu\tv\t0\n"
    with pytest.raises(TaskDataError, match=r"train.tsv:3: 4 fields, expected 3"):
        read_examples(tsv_task(tmp_path, text), "train")
    kept = read_examples(tsv_task(tmp_path, text, skip_bad_rows=True), "train")
    assert [e.texts for e in kept] == [("x", "y"), ("u", "v")]


def test_unknown_label_names_line(tmp_path):
    spec = tsv_task(tmp_path, "a\tb\tlabel\nx\ty\t1\nx\ty\tmaybe\n", labels=["0", "1"])
    with pytest.raises(TaskDataError, match=r"train.tsv:3: label 'maybe'.*task.labels"):
        read_examples(spec, "train")


def test_non_numeric_regression_target_names_line(tmp_path):
    spec = tsv_task(
        tmp_path,
        "a\tb\tlabel\nx\ty\t1.5\nx\ty\thigh\n",
        kind="regression",
        metrics=["pearson"],
        main_metric="pearson",
    )
    with pytest.raises(TaskDataError, match=r"train.tsv:3: regression target 'high'"):
        read_examples(spec, "train")


def test_jsonl_missing_field_names_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": 1}\n{"text": "b"}\n')
    spec = TaskSpec(
        name="j",
        data_dir=str(tmp_path),
        files={"train": "d.jsonl"},
        text_columns=["text"],
        label_column="label",
    )
    with pytest.raises(TaskDataError, match=r"d.jsonl:2: field\(s\) \['label'\] missing"):
        read_examples(spec, "train")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"text_columns": ["a", "b", "c"]}, "one column"),
        ({"kind": "multilabel"}, "task.kind"),
        ({"metrics": ["pearson"], "main_metric": "pearson"}, "task.metrics"),
        ({"main_metric": "f1"}, "main_metric"),
        ({"labels": ["0", "0"]}, "distinct"),
        ({"has_header": False}, "indices"),
        ({"eval_splits": ["test"]}, "eval_splits"),
        (
            {
                "kind": "regression",
                "metrics": ["pearson"],
                "main_metric": "pearson",
                "labels": ["0", "1"],
            },
            "labels=null",
        ),
    ],
)
def test_bad_settings_are_rejected(settings, message):
    base = {"name": "t", "data_dir": ".", "text_columns": ["a"], "label_column": "label"}
    with pytest.raises(TaskDataError, match=message):
        TaskSpec(**{**base, **settings})

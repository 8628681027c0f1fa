"""The fine-tuning record (`results.json`): one definition to write and read it."""

from __future__ import annotations

import json

import pytest

from pipeline.finetune.results import BestCheckpoint, FinalScores, FinetuneResults
from pipeline.run.errors import ResultsError

RECORD = FinetuneResults(
    task="mnli",
    seed=3,
    lr=1e-4,
    init="random",
    backbone="outputs/bert/wiki",
    main_metric="accuracy",
    main_split="dev_matched",
    overrides=["task=mnli", "seed=3"],
    best=BestCheckpoint(
        epoch=2,
        step=40,
        checkpoint="ckpt/best.ckpt",
        metrics={"dev_matched": {"accuracy": 0.7, "loss": 0.6}, "dev_mismatched": {"loss": 0.5}},
    ),
    final=FinalScores(step=60, metrics={"dev_matched": {"accuracy": 0.65}}),
)


def test_written_and_read_back_the_same_in_the_file_layout(tmp_path):
    RECORD.write(tmp_path / "results.json")
    assert FinetuneResults.read(tmp_path / "results.json") == RECORD
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert list(on_disk) == [
        "task", "seed", "lr", "init", "backbone", "main_metric", "main_split", "overrides",
        "best", "final",
    ]  # fmt: skip
    assert list(on_disk["best"]) == ["epoch", "step", "checkpoint", "metrics"]


def test_the_main_score_is_the_main_metric_on_the_main_split():
    assert RECORD.main_score() == 0.7 and RECORD.main_score("final") == 0.65
    assert RECORD.scores() == {"dev_matched": 0.7}  # the other split has no accuracy


def test_an_older_or_hand_written_file_reads_with_neutral_values():
    old = {"task": "rte", "main_metric": "f1", "best": {"metrics": {"dev": {"f1": 0.5}}}}
    record = FinetuneResults.from_dict(old)
    assert (record.main_split, record.overrides, record.final.metrics) == ("dev", [], {})
    assert record.main_score() == 0.5


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"main_metric": "f1", "best": {"metrics": {}}}, "no 'task' entry"),
        ({"task": "rte", "main_metric": "f1"}, "no 'metrics' entry"),
        ({"task": "rte", "main_metric": "f1", "best": {"metrics": {"dev": 3}}}, "malformed"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_a_broken_record_names_what_is_wrong(data, message, tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsError, match=message):
        FinetuneResults.read(path)

"""The records written and read back (pipeline/suites/record.py, pipeline/finetune/results.py):
files in the form earlier versions wrote read, and write back byte for byte; bad files are
errors that name them."""

from __future__ import annotations

import json

import pytest

from pipeline.finetune.results import Baselines, Evaluation
from pipeline.run.errors import ConfigError, ResultsError, SuiteRecordError
from pipeline.run.folder import RESULTS, SUITE_RECORD
from pipeline.suites.glue import SuiteTask, check_or_write_record, suite_record
from pipeline.suites.record import SuiteRecord
from tests.pipeline.test_finetune import compose_config

# glue_suite.json as `make glue ckpt=outputs/bert/run tasks=[rte,sst2] seeds=2` wrote it before
# the record was a dataclass (rte with the suite setting datamodule.max_examples=64).
OLD_SUITE_RECORD = """{
  "ckpt": "outputs/bert/run",
  "tasks": {
    "rte": {
      "datamodule.max_examples": 64
    },
    "sst2": {}
  },
  "seeds": [
    1,
    2
  ],
  "finetune": {
    "datamodule": {
      "max_seq_len": 128,
      "batch_size": 32,
      "eval_batch_size": 64,
      "num_workers": 0,
      "max_examples": null,
      "train_examples": null
    },
    "head": {
      "dropout": 0.1,
      "pooling": null,
      "siamese": null,
      "pair_score": null
    },
    "optim": {
      "_target_": "torch.optim.AdamW",
      "_partial_": true,
      "lr": null,
      "betas": [
        0.9,
        0.999
      ],
      "eps": 1e-06,
      "weight_decay": 0.01
    },
    "schedule": {
      "_target_": "pipeline.training.schedules.warmup_linear_decay",
      "_partial_": true,
      "warmup_steps": null,
      "warmup_ratio": 0.1
    },
    "trainer": {
      "max_epochs": null,
      "max_steps": -1,
      "accumulate_grad_batches": 1,
      "gradient_clip_val": 1.0,
      "precision": null
    }
  }
}
"""
TASKS = [SuiteTask("rte", {"datamodule.max_examples": 64}), SuiteTask("sst2", {})]


def test_an_old_suite_record_reads_and_writes_back_byte_for_byte(tmp_path):
    path = tmp_path / SUITE_RECORD
    path.write_text(OLD_SUITE_RECORD)
    record = SuiteRecord.read(path)
    assert record.ckpt == "outputs/bert/run" and record.seeds == [1, 2]
    assert record.tasks == {"rte": {"datamodule.max_examples": 64}, "sst2": {}}
    assert record.finetune["optim"]["betas"] == [0.9, 0.999]
    again = tmp_path / "again.json"
    record.write(again)
    assert again.read_text() == OLD_SUITE_RECORD
    assert SuiteRecord.read(again) == record


def test_the_suite_writes_its_record_in_the_old_form(tmp_path):
    """The record `make glue` builds from its config is the file earlier versions wrote."""
    record = suite_record(
        compose_config("glue", "ckpt=outputs/bert/run"), "outputs/bert/run", TASKS, [1, 2]
    )
    folder = tmp_path / "suite"
    assert check_or_write_record(folder, record) is False
    assert (folder / SUITE_RECORD).read_text() == OLD_SUITE_RECORD


def test_a_suite_folder_of_an_old_record_resumes_and_refuses_other_settings(tmp_path):
    folder = tmp_path / "suite"
    (folder / "rte" / "pretrained-seed1").mkdir(parents=True)
    (folder / "rte" / "pretrained-seed1" / RESULTS).write_text("{}")  # one fine-tune finished
    (folder / SUITE_RECORD).write_text(OLD_SUITE_RECORD)
    cfg = compose_config("glue", "ckpt=outputs/bert/run")
    assert check_or_write_record(folder, suite_record(cfg, str(cfg.ckpt), TASKS, [1, 2])) is True
    with pytest.raises(ConfigError, match="started with other seeds"):
        check_or_write_record(folder, suite_record(cfg, str(cfg.ckpt), TASKS, [1, 2, 3]))
    assert (folder / SUITE_RECORD).read_text() == OLD_SUITE_RECORD


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not readable JSON"),
        ('{"ckpt": "x", "tasks": {}}', "lacks seeds, finetune"),
        ("[1, 2]", "lacks ckpt, tasks, seeds, finetune"),
        ('{"ckpt": "x", "tasks": [], "seeds": [1], "finetune": {}}', "malformed"),
    ],
)
def test_a_bad_suite_record_is_an_error_naming_the_file(tmp_path, text, message):
    path = tmp_path / SUITE_RECORD
    path.write_text(text)
    with pytest.raises(SuiteRecordError, match=message) as caught:
        SuiteRecord.read(path)
    assert str(path) in str(caught.value)


def test_a_folder_without_a_suite_record_is_not_a_suite(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a `make glue` folder"):
        SuiteRecord.in_folder(tmp_path)


def test_baselines_read_as_written_and_name_the_best(tmp_path):
    scores = {
        "majority": {"accuracy": 0.5, "f1": 0.0},
        "word overlap": {"accuracy": 0.6, "f1": 0.7},
    }
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(scores, indent=2) + "\n")  # as suites always wrote it
    baselines = Baselines.read(path)
    assert baselines.best(lambda m: m["accuracy"] + m["f1"]) == ("word overlap", 0.6 + 0.7)
    again = tmp_path / "again.json"
    baselines.write(again)
    assert again.read_text() == path.read_text()
    path.write_text('{"majority": 0.5}')
    with pytest.raises(ResultsError, match="malformed"):
        Baselines.read(path)


def test_an_evaluation_reads_as_written_and_writes_back_byte_for_byte(tmp_path):
    written = {
        "task": "sst2",
        "checkpoint": "outputs/finetune/sst2/checkpoints/best.ckpt",
        "metrics": {"dev": {"accuracy": 0.81, "loss": 0.45}},
        "examples": {"dev": 872},
        "max_examples": None,
        "settings": {"task": {"name": "sst2", "labels": ["0", "1"]}, "max_seq_len": 128},
    }
    path = tmp_path / "eval_sst2.json"
    path.write_text(json.dumps(written, indent=2) + "\n")  # as make evaluate always wrote it
    evaluation = Evaluation.read(path)
    assert evaluation.metrics["dev"]["accuracy"] == 0.81 and evaluation.examples == {"dev": 872}
    again = tmp_path / "again.json"
    evaluation.write(again)
    assert again.read_text() == path.read_text()
    path.write_text('{"task": "sst2"}')
    with pytest.raises(ResultsError, match="no 'metrics' entry"):
        Evaluation.read(path)

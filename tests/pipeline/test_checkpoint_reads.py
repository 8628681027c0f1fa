"""Each checkpoint file is read once per command: a `ckpt=` or `resume=` is resolved once into a
`CheckpointSource` (pipeline/checkpoint/source.py) whose contents every later step shares.

`torch.load`, the one low-level read under `read_checkpoint` and Lightning's own restore, is
counted per file: a file is its path and its modification time, so the `last.ckpt` a resumed
run writes (and exports from at its end) is not the `last.ckpt` it resumed beside."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from pipeline.commands import fill_mask, generate
from pipeline.finetune.evaluation import evaluate, predict
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import train
from pipeline.suites.glue import run_suite
from tests.conftest import CONF, SHARED_DATA, compose_pretrain
from tests.pipeline.test_finetune import compose_config, run_finetune
from tests.pipeline.test_glue import load_task
from tests.pipeline.tiny_models import write_run

GLUE = SHARED_DATA / "glue"
needs_glue = pytest.mark.skipif(not GLUE.is_dir(), reason=f"GLUE data not found at {GLUE}")
TINY = ("datamodule.max_examples=24", "trainer.max_epochs=1")


def file_of(path: str | os.PathLike) -> tuple[str, int]:
    """A checkpoint file: its path and when it was written (a rewritten name is a new file)."""
    path = Path(path).resolve()
    return str(path), path.stat().st_mtime_ns


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """How often each checkpoint file is read with `torch.load`."""
    counted: Counter = Counter()
    real_load = torch.load

    def counting_load(f, *args, **kwargs):
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        counted[file_of(name) if name is not None else repr(f)] += 1
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    return counted


def assert_read_once(reads: Counter, *files: str | os.PathLike) -> None:
    """`files`, and nothing else, were each read exactly once."""
    assert sorted(reads) == sorted(file_of(f) for f in files), reads
    assert set(reads.values()) == {1}, reads
    reads.clear()


@needs_glue
def test_finetune_evaluate_and_predict_each_read_a_file_once(tmp_path, reads):
    """`make finetune` from a pretraining run folder reads its checkpoint once (backbone,
    tokenizer, wandb run) and its own best checkpoint once; `make evaluate` and `make predict`
    of the fine-tuning run read that checkpoint once."""
    write_run(tmp_path / "bert", "bert")
    reads.clear()
    results, run_dir = run_finetune(
        tmp_path, tmp_path / "bert", "task=rte", *TINY, data_dir=GLUE / "RTE"
    )
    assert_read_once(reads, tmp_path / "bert/checkpoints/last.ckpt", results.best.checkpoint)
    for command in (evaluate, predict):
        overrides = [f"ckpt={run_dir}", "datamodule.max_examples=8"]
        if command is predict:
            overrides.append(f"predict.file={GLUE / 'RTE' / 'dev.tsv'}")
            overrides.append(f"predict.out_dir={tmp_path / 'predicted'}")
        command(compose_config(command.__name__, *overrides))
        assert_read_once(reads, results.best.checkpoint)


@needs_glue
def test_a_suite_of_two_tasks_reads_its_checkpoint_once(tmp_path, reads, monkeypatch):
    """`make glue`: the pretrained checkpoint once for all its fine-tunes (pretrained and from
    scratch), and each fine-tune's best checkpoint once."""
    write_run(tmp_path / "bert", "bert")
    reads.clear()
    cfg = compose_config(
        "glue",
        f"ckpt={tmp_path / 'bert'}",
        "tasks=[rte,sst2]",
        "seeds=1",
        *TINY,
        run_dir=tmp_path / "suite",
    )
    cfg.task = None
    monkeypatch.setenv("GLUE_DIR", str(GLUE))
    run_suite(cfg, load_task)
    best = sorted((tmp_path / "suite").glob("*/*/checkpoints/best.ckpt"))
    assert len(best) == 4  # two tasks, pretrained and from scratch
    assert_read_once(reads, tmp_path / "bert/checkpoints/last.ckpt", *best)


@pytest.mark.parametrize(
    ("command", "family", "settings"),
    [
        (generate, "gpt", ["prompt=The", "max_new_tokens=3"]),
        (fill_mask, "bert", ["text='The [MASK] reads.'"]),
    ],
)
def test_inference_commands_read_their_checkpoint_once(
    command, family, settings, tmp_path, reads, capsys
):
    write_run(tmp_path / family, family)
    reads.clear()
    name = command.__name__.rsplit(".", 1)[-1]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=[f"ckpt={tmp_path / family}", "device=cpu", *settings])
    command.main(cfg)
    assert_read_once(reads, tmp_path / family / "checkpoints" / "last.ckpt")


def test_a_resumed_run_reads_each_checkpoint_of_its_folder_once(tmp_path, reads):
    """resume=auto: choosing the newest checkpoint reads each file of the run folder once;
    checking the chosen one against the config, Lightning's restore and the adoption of the
    best checkpoint's score share those reads. At its end the run reads the `last.ckpt` it
    wrote, once, for the HF export."""

    def config(*overrides: str):
        cfg = compose_pretrain(
            "model=bert-tiny",
            "debug=smoke",
            "trainer.accelerator=cpu",
            "trainer.val_check_interval=2",
            "checkpoint.every_n_steps=2",
            "checkpoint.keep_best=1",
            "logger=csv",
            "+trainer.enable_progress_bar=false",
            f"paths.cache_dir={tmp_path / 'cache'}",
            *overrides,
        )
        cfg.paths.output_dir = str(tmp_path / "run")
        return cfg

    first = config("trainer.max_steps=4")
    (tmp_path / "run").mkdir()  # as Hydra makes it
    train(first, check_config(first))
    checkpoints = tmp_path / "run" / "checkpoints"
    before = [file_of(p) for p in checkpoints.glob("*.ckpt")]
    assert any("best-" in path for path, _ in before), before
    reads.clear()
    again = config("trainer.max_steps=6", "resume=auto")
    train(again, check_config(again))
    assert (checkpoints / "step0000006.ckpt").is_file()  # it did resume
    assert sorted(reads) == sorted([*before, file_of(checkpoints / "last.ckpt")]), reads
    assert set(reads.values()) == {1}, reads

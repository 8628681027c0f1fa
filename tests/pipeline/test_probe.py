"""Downstream probes during pretraining (pipeline/pretrain/probe.py): they read what a linear model can
from frozen features, they leave the model and the random number generators as they were, and
a run with `probe=glue` logs them before the first step, every N steps and at the end."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
import torch

from datamodules.tasks.spec import TaskSpec
from pipeline.finetune.baselines import fit_linear
from pipeline.pretrain.probe import Probe
from tests.conftest import run_pretrain
from tests.pipeline.task_data import write_pairs
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer

POSITIVE, NEGATIVE = ("wonderful", "superb", "excellent"), ("terrible", "awful", "dreadful")
FILLER = [
    "the",
    "film",
    "was",
    "a",
    "story",
    "of",
    "one",
    "town",
    "and",
    "its",
    "people",
    "over",
    "many",
    "years",
]


def write_probe_tasks(folder: Path, n: int = 120, seed: int = 0) -> dict[str, Path]:
    """SST-2- and STS-B-shaped TSV files (the columns of conf/task/sst2.yaml and stsb.yaml):
    a keyword decides the sentiment; the words two sentences share decide the score."""
    rng = random.Random(seed)

    def sentence(*extra: str) -> str:
        words = [rng.choice(FILLER) for _ in range(6)] + list(extra)
        rng.shuffle(words)
        return " ".join(words)

    folders = {"sst2": folder / "SST-2", "stsb": folder / "STS-B"}
    for split in ("train", "dev"):
        rows = ["sentence\tlabel"]
        for i in range(n):
            positive = i % 2 == 0
            rows.append(
                f"{sentence(rng.choice(POSITIVE if positive else NEGATIVE))}\t{int(positive)}"
            )
        folders["sst2"].mkdir(parents=True, exist_ok=True)
        (folders["sst2"] / f"{split}.tsv").write_text("\n".join(rows) + "\n")
        rows = ["sentence1\tsentence2\tscore"]
        for _ in range(n):
            first = [rng.choice(FILLER) for _ in range(8)]
            shared = rng.randint(0, 8)
            second = first[:shared] + [rng.choice(POSITIVE + NEGATIVE) for _ in range(8 - shared)]
            rows.append(f"{' '.join(first)}\t{' '.join(second)}\t{shared * 5 / 8:.3f}")
        folders["stsb"].mkdir(parents=True, exist_ok=True)
        (folders["stsb"] / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return folders


def keyword_task(folder: Path) -> TaskSpec:
    return TaskSpec(
        name="sst2",
        data_dir=str(folder),
        text_columns=["sentence"],
        label_column="label",
        labels=["0", "1"],
    )


def test_logistic_regression_fits_labels_linear_in_the_features():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(600, 16, generator=generator)
    y = (x @ torch.randn(16, generator=generator) > 0).long()
    weight, bias = fit_linear(x[:400], y[:400], num_labels=2)
    accuracy = ((x[400:] @ weight + bias).argmax(1) == y[400:]).float().mean()
    assert accuracy > 0.95


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_probe_reads_a_keyword_from_random_features_and_changes_nothing(family, tmp_path):
    folders = write_probe_tasks(tmp_path)
    kind = "wordpiece" if family == "bert" else "bpe"
    tokenizer = trained_tokenizer(kind)
    model = tiny_model(family, tokenizer).train()
    probe = Probe(
        [keyword_task(folders["sst2"])],
        tokenizer,
        seq_len=64,
        train_examples=100,
        dev_examples=100,
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    scores = probe.scores(model, torch.device("cpu"))
    # mean token states of even a random model carry which words a text holds
    assert scores["probe/sst2/accuracy"] > 0.9
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_a_pair_probe_reads_the_two_texts_apart(family, tmp_path):
    """The score is how many of its six words a text shares with the other (the same words,
    reordered, with others of the same vocabulary). The cosine of the two texts' mean states,
    each encoded alone, tracks it even in a random model; read as one sequence (the probe
    before), a pair's mean state holds which words occur, not which occur twice."""
    assert overlap_probe(family, "regression", tmp_path)["probe/overlap/spearman"] > 0.6


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_a_classification_pair_probe_reads_how_the_texts_tokens_align(family, tmp_path):
    """A classification pair is probed as the fine-tuning head reads it by default, by its
    token alignment scores: with random weights, equal words have equal embeddings, so the
    alignment says how many words the texts share (here 7 overlap levels as classes: chance
    is about 1/7, the majority class about 0.17)."""
    scores = overlap_probe(family, "classification", tmp_path)
    assert scores["probe/overlap/accuracy"] > 0.55  # [u, v, |u-v|, u*v]: 0.45 and 0.29


def overlap_probe(family: str, kind: str, tmp_path: Path) -> dict[str, float]:
    """The probe scores of a random `family` model on the word-overlap pairs (`write_pairs`)
    as a task of `kind`."""
    write_pairs(tmp_path / "pairs", n_train=300, n_dev=150)
    task = TaskSpec(
        name="overlap",
        data_dir=str(tmp_path / "pairs"),
        kind=kind,
        text_columns=["a", "b"],
        label_column="score",
    )
    tokenizer = trained_tokenizer("wordpiece" if family == "bert" else "bpe")
    probe = Probe([task], tokenizer, seq_len=64)
    return probe.scores(tiny_model(family, tokenizer), torch.device("cpu"))


def probe_steps(run_dir: Path, column: str = "probe/sst2/accuracy") -> dict[int, dict[str, str]]:
    """step -> the CSV log's row of that step's probe (the rows where `column` is logged)."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {int(r["step"]): r for r in csv.DictReader(handle) if r.get(column)}


def probe_overrides(folders: dict[str, Path]) -> list[str]:
    return [
        "probe=glue",
        f"probe.tasks.sst2.data_dir={folders['sst2']}",
        f"probe.tasks.stsb.data_dir={folders['stsb']}",
        "probe.train_examples=64",
        "probe.dev_examples=64",
    ]


def test_a_run_logs_probes_at_init_every_n_steps_and_at_the_end(tmp_path):
    folders = write_probe_tasks(tmp_path / "data")
    done = run_pretrain(
        tmp_path,
        "model=bert-tiny",
        "objective.batch_size=8",
        # 5 steps, a probe every 2 and a validation between two of them: probes at the start,
        # at two multiples and at an end that is not one, as 12 steps, every 5 and a
        # validation at 6 would show (each step and probe costs a second or more)
        "trainer.max_steps=5",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "logger=csv",
        "run_name=probed",
        *probe_overrides(folders),
        "probe.every_n_steps=2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = probe_steps(tmp_path / "out/bert-tiny/probed")
    assert sorted(rows) == [0, 2, 4, 5]
    for row in rows.values():
        assert 0.0 <= float(row["probe/sst2/accuracy"]) <= 1.0
        assert -1.0 <= float(row["probe/stsb/spearman"]) <= 1.0
        assert float(row["probe/seconds"]) > 0


def test_a_missing_probe_file_stops_the_run_before_training(tmp_path):
    done = run_pretrain(
        tmp_path,
        "model=bert-tiny",
        "trainer.max_steps=3",
        "logger=csv",
        *probe_overrides({"sst2": tmp_path / "nowhere", "stsb": tmp_path / "nowhere"}),
    )
    assert done.returncode == 2
    assert "probe:" in done.stderr and "drop probe=... from the command" in done.stderr

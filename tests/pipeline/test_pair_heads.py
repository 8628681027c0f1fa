"""Fine-tuning head settings end to end on a synthetic pair regression task (no shared data):
regression targets standardized by the training split, a siamese head that learns word
overlap where a fresh cross-encoder does not, and a fine-tuned siamese model that evaluates and
predicts as it was trained."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint.load import load_finetuned
from pipeline.finetune.evaluation import evaluate, predict
from pipeline.finetune.run import finetune
from pipeline.run.errors import ConfigError
from tests.pipeline.task_data import pair_task, write_pairs
from tests.pipeline.test_finetune import compose_config
from tests.pipeline.tiny_models import write_run


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    write_run(folder / "bert", "bert")
    write_pairs(folder / "data", n_train=300, n_dev=100)
    return folder


def tune(folder: Path, run: str, *overrides: str):
    cfg = compose_config(
        "finetune",
        f"ckpt={folder / 'bert'}",
        *pair_task(folder / "data"),
        "from_scratch=true",
        "datamodule.batch_size=16",
        *overrides,
        run_dir=folder / run,
    )
    return finetune(cfg, announce=False), folder / run


# One training batch of the epoch (then the epoch's evaluation, as after a whole one): for runs
# whose checks do not depend on how far training got (a rate of 1e-12 that moves nothing, a
# head fitted or standardized on the whole training split before the first step, an evaluation
# that must give a run's own scores again).
ONE_BATCH = "+trainer.limit_train_batches=1"


def train_scores(folder: Path) -> list[float]:
    with open(folder / "data" / "train.tsv") as handle:
        return [float(row["score"]) for row in csv.DictReader(handle, delimiter="\t")]


def test_a_fresh_regression_head_predicts_the_training_targets_mean(setup):
    """Before any step the model predicts the mean of the training targets (so the dev loss
    starts near their variance, not near mean^2 + variance)."""
    results, run_dir = tune(
        setup,
        "standardized",
        "trainer.max_epochs=1",
        ONE_BATCH,
        "optim.lr=1e-12",
        "head.pair_score=features",
    )
    scores = torch.tensor(train_scores(setup))
    tuned = load_finetuned(run_dir)
    expected = (float(scores.mean()), float(scores.std(correction=0)))
    assert tuned.head.target == pytest.approx(expected, rel=1e-5)
    ids = torch.randint(5, 100, (4, 9))
    with torch.no_grad():
        predicted = tuned.model(ids, attention_mask=torch.ones_like(ids))
    # a fresh head is ~0.02-scaled: its standardized output is near 0, so near the mean
    assert predicted.squeeze(-1).sub(scores.mean()).abs().max() < 0.5 * scores.std()
    assert results.best.metrics["dev"]["loss"] < 1.5 * float(scores.var())


def test_a_siamese_head_learns_word_overlap_that_a_fresh_cross_encoder_does_not(setup):
    """From random weights, 10 epochs of 300 pairs: both siamese scores of mean-pooled states,
    the linear layer on [u, v, |u - v|, u * v] and the standardized cosine, pick up how many
    words the texts share (the label); one sequence `A [SEP] B` through an untrained encoder
    does not. Over seeds 1234 and 1-3 (fp32, one AVX-512 machine) the dev Spearman was 0.49-0.56
    for the linear layer, 0.93-0.95 for the cosine and -0.00 to 0.10 for the one sequence. At
    4 epochs the linear layer had reached only 0.16-0.31, within noise of the one sequence on
    some seeds and machines."""
    # fp32: precision null picks bf16 or fp32 by timing both on this machine, which varies with
    # its load, and so would the learning measured here
    common = ("trainer.max_epochs=10", "head.pooling=mean", "trainer.precision=32")
    joint, _ = tune(setup, "joint", *common, "head.siamese=false")
    joint_score = joint.best.metrics["dev"]["spearman"]
    for score in ("features", "cosine"):
        siamese, run_dir = tune(
            setup, score, *common, "head.siamese=true", f"head.pair_score={score}"
        )
        assert load_finetuned(run_dir).head.pair_score == score
        assert siamese.best.metrics["dev"]["spearman"] > 0.35, score
        assert siamese.best.metrics["dev"]["spearman"] > joint_score + 0.25, score


def test_a_siamese_model_evaluates_and_predicts_as_it_was_trained(setup, tmp_path):
    results, run_dir = tune(
        setup, "siamese-eval", "trainer.max_epochs=1", ONE_BATCH, "head.siamese=true"
    )
    head = load_finetuned(run_dir).head
    assert head.siamese and head.pair_score == "cosine"  # the default for a regression pair
    cfg = compose_config("evaluate", f"ckpt={run_dir}", run_dir=tmp_path / "eval")
    again = evaluate(cfg)
    for name, value in results.best.metrics["dev"].items():
        assert again["dev"][name] == pytest.approx(value, abs=1e-5), name
    cfg = compose_config(
        "predict",
        f"ckpt={run_dir}",
        f"predict.file={setup / 'data' / 'dev.tsv'}",
        run_dir=tmp_path / "predict",
    )
    (written,) = predict(cfg)
    with open(written) as handle:
        assert len(list(csv.DictReader(handle, delimiter="\t"))) == 100
    one_text = [o.replace("[a,b]", "[a]") for o in pair_task(setup / "data")]
    single = compose_config("evaluate", f"ckpt={run_dir}", *one_text, run_dir=tmp_path / "e2")
    with pytest.raises(ConfigError, match="reads pairs of texts apart"):
        evaluate(single)


def test_pairs_are_read_apart_by_default_up_to_mini_width():
    """head.siamese null: siamese (with mean pooling) for widths up to 256, one sequence above;
    single-text tasks never; an explicit setting wins."""
    from datamodules.tasks.spec import TaskSpec
    from pipeline.finetune.settings import SIAMESE_UP_TO_WIDTH, reads_pairs_apart

    def task(columns):
        return TaskSpec(
            name="t",
            data_dir=".",
            files={"train": "a", "dev": "b"},
            text_columns=columns,
            label_column="y",
        )

    pair, single = task(["a", "b"]), task(["a"])
    cfg = compose_config("finetune")
    assert cfg.head.siamese is None
    assert reads_pairs_apart(cfg, pair, SIAMESE_UP_TO_WIDTH)
    assert not reads_pairs_apart(cfg, pair, SIAMESE_UP_TO_WIDTH + 1)
    assert not reads_pairs_apart(cfg, single, 64)
    cfg.head.siamese = False
    assert not reads_pairs_apart(cfg, pair, 64)
    cfg.head.siamese = True
    assert reads_pairs_apart(cfg, pair, 768)


def test_the_cosine_pair_score_needs_a_regression_pair_read_apart(setup):
    with pytest.raises(ConfigError, match="head.pair_score=cosine scores a regression pair"):
        tune(setup, "cos-joint", "head.siamese=false", "head.pair_score=cosine")
    with pytest.raises(ConfigError, match="head.pair_score='dot' is not known"):
        tune(setup, "cos-bad", "head.pair_score=dot")


def test_an_unknown_pooling_is_a_config_error(setup):
    with pytest.raises(ConfigError, match="head.pooling='max'"):
        tune(setup, "bad", "head.pooling=max")


def test_a_head_record_round_trips_and_refuses_an_unknown_pair_score():
    from datamodules.tasks.labels import LabelMap
    from pipeline.checkpoint.head import HeadSpec

    spec = HeadSpec(
        "stsb",
        LabelMap("regression"),
        ("spearman", "pearson"),
        pooling="mean",
        siamese=True,
        pair_score="cosine",
        target=(2.5, 1.5),
        special_ids=(0, 2, 3),
    )
    assert HeadSpec.from_record(spec.record()) == spec
    older = {k: v for k, v in spec.record().items() if k not in ("pair_score", "special_ids")}
    assert HeadSpec.from_record(older).pair_score == "features"  # written before it existed
    assert HeadSpec.from_record(older).special_ids == ()
    with pytest.raises(ValueError, match="unknown pair_score 'dot'"):
        HeadSpec.from_record({**spec.record(), "pair_score": "dot"})


@pytest.mark.parametrize("kind", ["regression", "classification"])
def test_an_alignment_head_reads_word_overlap_before_its_first_step(setup, kind):
    """pair_score=alignment: the head's linear layer is fitted on the frozen model's alignment
    scores of the training pairs before training, so from random weights and with a rate too
    small to move anything (1e-12), the model already predicts how many words the texts share
    (random word embeddings match equal words exactly): ridge regression for a regression,
    logistic regression for classes (here the 7 overlap levels as labels). Classes read apart
    get this head by default (`head.pair_score` null); a regression asks for it."""
    results, run_dir = tune(
        setup,
        f"align-{kind}",
        "trainer.max_epochs=1",
        ONE_BATCH,
        "optim.lr=1e-12",
        "head.siamese=true",
        *(["head.pair_score=alignment"] if kind == "regression" else []),
        f"task.kind={kind}",
    )
    scores = torch.tensor(train_scores(setup))
    dev = results.best.metrics["dev"]
    if kind == "regression":
        assert dev["loss"] < 0.3 * float(scores.var())
        assert dev["spearman"] > 0.8
    else:
        majority = max(torch.unique(scores, return_counts=True)[1]).item() / len(scores)
        assert dev["accuracy"] > 2 * majority
    head = load_finetuned(run_dir).head
    assert head.pair_score == "alignment" and head.special_ids  # [CLS], [SEP]... left out


def test_an_alignment_model_evaluates_as_it_was_trained(setup, tmp_path):
    """The fitted standardization is saved with the weights, and the special token ids with
    the head: `make evaluate` of the run gives its best scores again."""
    results, run_dir = tune(
        setup,
        "align-eval",
        "trainer.max_epochs=1",
        ONE_BATCH,
        "head.siamese=true",
        "head.pair_score=alignment",
    )
    again = evaluate(compose_config("evaluate", f"ckpt={run_dir}", run_dir=tmp_path / "eval"))
    for name, value in results.best.metrics["dev"].items():
        assert again["dev"][name] == pytest.approx(value, abs=1e-5), name


def test_the_alignment_score_needs_a_pair_read_apart(setup):
    with pytest.raises(ConfigError, match="use head.pair_score=null or head.siamese=true"):
        tune(setup, "align-joint", "head.siamese=false", "head.pair_score=alignment")
    with pytest.raises(ConfigError, match="alignment"):
        tune(setup, "bad-score", "head.pair_score=overlap")

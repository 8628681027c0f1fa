"""The non-neural baselines of `make glue` (pipeline/finetune/baselines.py) on synthetic tasks whose
answer a bag of words or the word overlap of a pair determines, and on one they cannot."""

from __future__ import annotations

import random

import pytest
import torch

from datamodules.tasks.spec import Example, TaskSpec
from pipeline.finetune.baselines import bag_features, bag_vocabulary, baseline_scores, fit_linear

FILLER = [
    "the",
    "a",
    "of",
    "river",
    "stone",
    "cloud",
    "paper",
    "window",
    "green",
    "slow",
    "bright",
    "music",
    "table",
    "garden",
]


def sentence(rng: random.Random, *extra: str, n: int = 8) -> str:
    words = [rng.choice(FILLER) for _ in range(n)] + list(extra)
    rng.shuffle(words)
    return " ".join(words)


def single_task(**overrides) -> TaskSpec:
    settings = dict(name="toy", data_dir="unused", text_columns=["text"], label_column="label")
    return TaskSpec(**{**settings, **overrides})


def pair_task(**overrides) -> TaskSpec:
    return single_task(text_columns=["a", "b"], **overrides)


def test_bag_of_words_learns_a_keyword_task_and_majority_is_the_label_share():
    rng = random.Random(0)

    # positive texts contain "excellent" or "superb", negatives "awful" or "dreadful"; 60% are
    # negative, so always answering negative scores 0.6
    def example(i: int) -> Example:
        positive = i % 5 < 2
        word = rng.choice(["excellent", "superb"] if positive else ["awful", "dreadful"])
        return Example((sentence(rng, word),), "1" if positive else "0", str(i))

    train = [example(i) for i in range(400)]
    dev = [example(i) for i in range(200)]
    scores = baseline_scores(single_task(labels=["0", "1"]), train, dev)
    assert scores["majority"]["accuracy"] == pytest.approx(0.6)
    assert scores["bag-of-words"]["accuracy"] == 1.0
    assert set(scores) == {"majority", "bag-of-words"}


def test_bag_of_words_cannot_beat_chance_on_labels_unrelated_to_the_words():
    rng = random.Random(1)
    train = [Example((sentence(rng),), rng.choice("01"), str(i)) for i in range(400)]
    dev = [Example((sentence(rng),), rng.choice("01"), str(i)) for i in range(400)]
    scores = baseline_scores(single_task(labels=["0", "1"], metrics=["matthews"]), train, dev)
    assert scores["majority"]["matthews"] == 0.0  # one class predicted: MCC is 0 by definition
    assert abs(scores["bag-of-words"]["matthews"]) < 0.15


def test_word_overlap_predicts_similarity_from_shared_words():
    rng = random.Random(2)

    def pair(i: int) -> Example:
        first = [rng.choice(FILLER) + str(k) for k in range(10)]  # ten distinct words
        shared = rng.randint(0, 10)
        second = first[:shared] + [f"other{i}x{k}" for k in range(10 - shared)]
        rng.shuffle(second)
        return Example((" ".join(first), " ".join(second)), shared / 2, str(i))  # score 0-5

    train = [pair(i) for i in range(300)]
    dev = [pair(1000 + i) for i in range(300)]
    scores = baseline_scores(pair_task(kind="regression"), train, dev)
    assert set(scores) == {"word overlap"}  # no majority class for a regression task
    assert scores["word overlap"]["pearson"] > 0.95
    assert scores["word overlap"]["spearman"] > 0.95


def test_word_overlap_of_a_pair_classification_task():
    rng = random.Random(3)

    def pair(i: int) -> Example:
        first = sentence(rng, n=10)
        paraphrase = i % 2 == 0
        second = first if paraphrase else sentence(rng, n=10)
        return Example((first, second), "1" if paraphrase else "0", str(i))

    train = [pair(i) for i in range(200)]
    dev = [pair(i) for i in range(200)]
    scores = baseline_scores(pair_task(labels=["0", "1"], metrics=["f1", "accuracy"]), train, dev)
    assert scores["word overlap"]["accuracy"] > 0.95
    assert scores["majority"]["accuracy"] == pytest.approx(0.5)


def test_vocabulary_keeps_words_of_two_texts_and_features_mark_presence():
    examples = [Example(("Good good film",), "1", "0"), Example(("good plot",), "0", "1")]
    vocabulary = bag_vocabulary(examples)
    assert vocabulary == {"good": 0}  # "film" and "plot" are in one text each
    features = bag_features(examples, vocabulary).to_dense()
    assert features.tolist() == [[1.0], [1.0]]  # presence, not counts


def test_ridge_regression_recovers_a_linear_rule():
    x = torch.randn(500, 3, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([2.0, -1.0, 0.5]) + 3.0
    weight, bias = fit_linear(x, y, num_labels=1)
    assert weight.squeeze(1).tolist() == pytest.approx([2.0, -1.0, 0.5], abs=0.05)
    assert float(bias) == pytest.approx(3.0, abs=0.05)


def test_empty_split_is_refused():
    with pytest.raises(ValueError, match="baselines need training and dev examples"):
        baseline_scores(single_task(labels=["0", "1"]), [], [Example(("x",), "0", "0")])

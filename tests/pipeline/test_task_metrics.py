"""GLUE metrics against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.finetune.metrics import main_metric, task_metrics


def _logits(classes: list[int], num_labels: int = 2) -> torch.Tensor:
    """Logits (B, C) whose argmax is `classes`, with non-trivial values elsewhere."""
    logits = torch.randn(len(classes), num_labels, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(classes)), torch.tensor(classes)] = 10.0
    return logits


def _score(names: list[str], preds: torch.Tensor, target: list, num_labels: int = 2) -> dict:
    metrics = task_metrics(names, num_labels)
    metrics.update(preds, torch.tensor(target))
    return {k: v.item() for k, v in metrics.compute().items()}


def _mcc(preds: list[int], target: list[int]) -> float:
    return _score(["matthews"], torch.tensor(preds), target)["matthews"]


def test_accuracy_binary_from_logits() -> None:
    preds = [1, 0, 1, 1, 0]
    target = [1, 0, 0, 1, 1]
    assert _score(["accuracy"], _logits(preds), target)["accuracy"] == pytest.approx(3 / 5)


def test_accuracy_mnli_three_classes() -> None:
    preds = [0, 1, 2, 2, 1, 0]
    target = [0, 1, 1, 2, 2, 0]
    score = _score(["accuracy"], _logits(preds, 3), target, num_labels=3)
    assert score["accuracy"] == pytest.approx(4 / 6)


def test_f1_worked_example() -> None:
    # TP = 3 (0, 2, 5), FP = 1 (1), FN = 1 (3), TN = 1 (4): F1 = 2TP / (2TP + FP + FN) = 6/8.
    preds = [1, 1, 1, 0, 0, 1]
    target = [1, 0, 1, 1, 0, 1]
    score = _score(["f1", "accuracy"], _logits(preds), target)
    assert score["f1"] == pytest.approx(0.75)
    assert score["accuracy"] == pytest.approx(4 / 6)


def test_f1_positive_class_is_one() -> None:
    # class 1: TP=1 (0), FP=1 (1), FN=1 (5) -> 2/4; class 0: TP=3, FP=1, FN=1 -> 6/8.
    preds = [1, 1, 0, 0, 0, 0]
    target = [1, 0, 0, 0, 0, 1]
    assert _score(["f1"], _logits(preds), target)["f1"] == pytest.approx(0.5)
    # swapping the labels swaps which class is scored
    swapped = _score(["f1"], _logits([1 - p for p in preds]), [1 - t for t in target])["f1"]
    assert swapped == pytest.approx(0.75)


def test_matthews_worked_example() -> None:
    # TP=3, TN=2, FP=1, FN=1: (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = 5/12.
    preds = [1, 1, 1, 1, 0, 0, 0]
    target = [1, 1, 1, 0, 1, 0, 0]
    assert _mcc(preds, target) == pytest.approx(5 / 12)
    # logits give the same
    assert _score(["matthews"], _logits(preds), target)["matthews"] == pytest.approx(5 / 12)


@pytest.mark.parametrize(
    ("preds", "target", "expected"),
    [
        ([0, 0, 0, 0, 0], [0, 0, 0, 1, 1], 0.0),  # all one class (torchmetrics' own: 1/sqrt(30))
        ([1, 1, 1, 1, 1], [0, 0, 0, 1, 1], 0.0),
        ([1, 1, 1], [0, 0, 0], 0.0),  # all wrong but one class only (torchmetrics' own: -1)
        ([0, 0, 0], [0, 0, 0], 0.0),  # undefined, sklearn returns 0
        ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1], 1.0),  # perfect
        ([1, 0, 0, 1, 0], [0, 1, 1, 0, 1], -1.0),  # perfectly inverted
    ],
)
def test_matthews_edge_cases(preds: list[int], target: list[int], expected: float) -> None:
    assert _mcc(preds, target) == pytest.approx(expected, abs=1e-6)


def test_matthews_multiclass_matches_formula() -> None:
    preds = [0, 1, 2, 2, 1, 0, 2]
    target = [0, 1, 1, 2, 2, 0, 0]
    # Gorodkin: (c*s - sum_k t_k p_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2))
    t = [3, 2, 2]  # true counts per class
    p = [2, 2, 3]  # predicted counts per class
    c, s = 4, 7
    num = c * s - sum(a * b for a, b in zip(t, p, strict=True))
    den = math.sqrt((s * s - sum(x * x for x in p)) * (s * s - sum(x * x for x in t)))
    score = _score(["matthews"], torch.tensor(preds), target, num_labels=3)["matthews"]
    assert score == pytest.approx(num / den)


def test_pearson_small_example() -> None:
    # deviations x: -1.5 -0.5 0.5 1.5; y: -1.75 0.25 1.25 0.25 -> cov 3.5, var 5 and 4.75
    preds = torch.tensor([1.0, 2.0, 3.0, 4.0])
    score = _score(["pearson"], preds, [2.0, 4.0, 5.0, 4.0], num_labels=1)
    assert score["pearson"] == pytest.approx(3.5 / math.sqrt(5 * 4.75), abs=1e-6)


def test_spearman_with_ties_uses_average_ranks() -> None:
    preds = torch.tensor([[1.0], [2.0], [2.0], [3.0], [5.0]])  # (B, 1) as a regression head gives
    target = [2.0, 1.0, 3.0, 3.0, 4.0]
    # average ranks: preds 1, 2.5, 2.5, 4, 5; target 2, 1, 3.5, 3.5, 5 (both mean 3)
    # deviations: -2 -0.5 -0.5 1 2 and -1 -2 0.5 0.5 2 -> cov 7.25, both variances 9.5
    score = _score(["spearman", "pearson"], preds, target, num_labels=1)
    assert score["spearman"] == pytest.approx(7.25 / 9.5, abs=1e-5)
    # ranking ties by position (1..5 and 2 1 3 4 5) would give 0.9 instead
    assert abs(score["spearman"] - 0.9) > 0.1


def test_update_twice_equals_one_update_on_concatenation() -> None:
    gen = torch.Generator().manual_seed(1)
    cls_a, cls_b = torch.randn(7, 2, generator=gen), torch.randn(5, 2, generator=gen)
    y_a, y_b = torch.randint(0, 2, (7,), generator=gen), torch.randint(0, 2, (5,), generator=gen)
    reg_a, reg_b = torch.randn(7, 1, generator=gen), torch.randn(5, 1, generator=gen)
    t_a, t_b = torch.rand(7, generator=gen) * 5, torch.rand(5, generator=gen) * 5
    cases = [
        (["matthews", "f1", "accuracy"], 2, (cls_a, y_a), (cls_b, y_b)),
        (["pearson", "spearman"], 1, (reg_a, t_a), (reg_b, t_b)),
    ]
    for names, num_labels, (pa, ta), (pb, tb) in cases:
        split = task_metrics(names, num_labels)
        split.update(pa, ta)
        split.update(pb, tb)
        whole = task_metrics(names, num_labels)
        whole.update(torch.cat([pa, pb]), torch.cat([ta, tb]))
        got, want = split.compute(), whole.compute()
        assert set(got) == set(names)
        for name in names:
            torch.testing.assert_close(got[name], want[name], msg=name)


def test_clones_per_split_keep_separate_state() -> None:
    base = task_metrics(["accuracy"], 3)
    matched, mismatched = base.clone(prefix="matched_"), base.clone(prefix="mismatched_")
    matched.update(_logits([0, 1, 2], 3), torch.tensor([0, 1, 2]))
    mismatched.update(_logits([0, 1, 2], 3), torch.tensor([1, 1, 1]))
    assert matched.compute()["matched_accuracy"].item() == pytest.approx(1.0)
    assert mismatched.compute()["mismatched_accuracy"].item() == pytest.approx(1 / 3)


def test_main_metric_is_first() -> None:
    assert main_metric(["f1", "accuracy"]) == "f1"
    assert main_metric(["pearson", "spearman"]) == "pearson"
    with pytest.raises(ValueError, match="at least one"):
        main_metric([])


@pytest.mark.parametrize(
    ("names", "num_labels", "match"),
    [
        (["bleu"], 2, "unknown metric 'bleu'"),
        (["f1"], 3, "num_labels=2"),
        (["accuracy"], 1, "classification task"),
        (["pearson"], 2, "regression task"),
        (["accuracy", "accuracy"], 2, "duplicates"),
        ([], 2, "at least one"),
    ],
)
def test_bad_configuration_raises(names: list[str], num_labels: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        task_metrics(names, num_labels)


def test_regression_shape_error_is_clear() -> None:
    metrics = task_metrics(["pearson"], 1)
    with pytest.raises(ValueError, match="num_labels=1"):
        metrics.update(torch.randn(4, 2), torch.randn(4))

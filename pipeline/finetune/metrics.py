"""GLUE metrics, computed as GLUE computes them (scikit-learn / scipy), accumulated with torchmetrics.

Shapes: B examples, C classes.

| name       | GLUE tasks         | inputs                                      |
|------------|--------------------|---------------------------------------------|
| accuracy   | all classification | logits (B, C) or class ids (B,); C from `num_labels` (3 for MNLI) |
| f1         | MRPC, QQP          | binary F1 of the positive class 1 (num_labels = 2)            |
| matthews   | CoLA               | Matthews correlation, multi-class formula (sklearn)           |
| pearson    | STS-B              | float predictions (B,) or (B, 1) vs float targets (B,)        |
| spearman   | STS-B              | as pearson; ties get their average rank (scipy)               |

Every metric of a collection takes the same `(preds, target)`: the raw head output and the labels.
Classification metrics take the argmax of logits themselves, so the caller never post-processes.

Main metric convention (`main_metric`): a task lists its metrics with the main one first; the
best checkpoint is the one with the highest main metric on the dev set (all GLUE metrics are
"higher is better").

Why not the stock torchmetrics MCC: on degenerate confusion matrices torchmetrics returns values
other than scikit-learn's (the GLUE reference). If all predictions are one class, sklearn returns
0 (zero denominator), whereas torchmetrics 1.9 returns 1/sqrt(30) for tn=3, fn=2, -1 when every
prediction is wrong and 1 when every prediction is right (all of one class). `_Matthews` keeps torchmetrics' confusion-matrix state (so it syncs
across processes) and only replaces the final reduction.
"""

from __future__ import annotations

import warnings

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (
    BinaryF1Score,
    MulticlassAccuracy,
    MulticlassMatthewsCorrCoef,
)
from torchmetrics.regression import PearsonCorrCoef, SpearmanCorrCoef

from datamodules.tasks.spec import CLASSIFICATION_METRICS, REGRESSION_METRICS

__all__ = ["CLASSIFICATION_METRICS", "REGRESSION_METRICS", "main_metric", "task_metrics"]


def class_predictions(preds: torch.Tensor) -> torch.Tensor:
    """Logits (B, C) -> class ids (B,) by argmax; class ids (B,) pass through."""
    if preds.ndim == 2:
        return preds.argmax(dim=-1)
    if preds.ndim == 1 and not preds.is_floating_point():
        return preds
    raise ValueError(
        f"classification metrics expect logits (B, C) or integer class ids (B,), got a "
        f"{tuple(preds.shape)} {preds.dtype} tensor"
    )


def regression_predictions(preds: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, 1) -> float (B,)."""
    if preds.ndim == 2 and preds.shape[1] == 1:
        preds = preds.squeeze(1)
    if preds.ndim != 1:
        raise ValueError(
            f"regression metrics expect predictions (B,) or (B, 1), got {tuple(preds.shape)}; "
            f"a regression task needs num_labels=1"
        )
    return preds.float()


class _ClassInputs:
    """Mixin: argmax logits, integer targets, before the torchmetrics update."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(class_predictions(preds), target.long())  # type: ignore[misc]


class _RegressionInputs:
    """Mixin: flatten (B, 1) predictions, float targets, before the torchmetrics update."""

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        super().update(regression_predictions(preds), target.reshape(-1).float())  # type: ignore[misc]


class _Accuracy(_ClassInputs, MulticlassAccuracy):
    """Share of correct predictions (micro average over all examples)."""


class _F1(_ClassInputs, BinaryF1Score):
    """F1 of class 1 (the positive class of MRPC "equivalent" and QQP "duplicate")."""


class _Matthews(_ClassInputs, MulticlassMatthewsCorrCoef):
    """Matthews correlation as `sklearn.metrics.matthews_corrcoef` (what GLUE reports for CoLA)."""

    def compute(self) -> torch.Tensor:
        """Multi-class MCC (Gorodkin 2004) from the confusion matrix; 0 when it is undefined.

        Counts are divided by the total first so that float32 stays exact enough on large dev
        sets (the products of raw counts would reach 1e18).
        """
        confmat = self.confmat.float()
        total = confmat.sum()
        if total == 0:
            return torch.tensor(0.0, device=confmat.device)
        confmat = confmat / total
        true_share = confmat.sum(dim=1)  # rows are targets
        pred_share = confmat.sum(dim=0)
        cov_true_pred = torch.trace(confmat) - (true_share * pred_share).sum()
        var_pred = 1.0 - (pred_share * pred_share).sum()
        var_true = 1.0 - (true_share * true_share).sum()
        denom = var_pred * var_true
        if denom <= 0:  # all predictions (or all targets) one class: sklearn returns 0
            return torch.tensor(0.0, device=confmat.device)
        return cov_true_pred / denom.sqrt()


class _Pearson(_RegressionInputs, PearsonCorrCoef):
    """Pearson correlation of predictions and targets."""


class _Spearman(_RegressionInputs, SpearmanCorrCoef):
    """Spearman rank correlation; tied values share their average rank, as in scipy."""

    def __init__(self) -> None:
        # Ranks need every prediction, so the state is all of them; torchmetrics warns about
        # that on every construction. A GLUE dev set is at most a few thousand floats.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*will save all targets and predictions")
            super().__init__()


def _build(name: str, num_labels: int) -> Metric:
    if name in CLASSIFICATION_METRICS and num_labels < 2:
        raise ValueError(
            f"metric {name!r} needs a classification task (num_labels >= 2), got "
            f"num_labels={num_labels}; use pearson/spearman for regression"
        )
    if name in REGRESSION_METRICS and num_labels != 1:
        raise ValueError(
            f"metric {name!r} needs a regression task (num_labels=1), got num_labels={num_labels}"
        )
    if name == "accuracy":
        return _Accuracy(num_classes=num_labels, average="micro")
    if name == "f1":
        if num_labels != 2:
            raise ValueError(
                f"metric 'f1' is the binary F1 of class 1 and needs num_labels=2, got {num_labels}"
            )
        return _F1()
    if name == "matthews":
        return _Matthews(num_classes=num_labels)
    if name == "pearson":
        return _Pearson()
    if name == "spearman":
        return _Spearman()
    raise ValueError(
        f"unknown metric {name!r}; choose from {[*CLASSIFICATION_METRICS, *REGRESSION_METRICS]}"
    )


def task_metrics(metric_names: list[str], num_labels: int) -> MetricCollection:
    """The metrics of a task, keyed by name, all updated with `(preds, target)`.

    Args:
        metric_names: names from `CLASSIFICATION_METRICS` or `REGRESSION_METRICS`, main one first.
        num_labels: C for classification (2 for binary, 3 for MNLI), 1 for regression.

    Returns:
        A `MetricCollection`; `update(preds, target)` with preds logits (B, C) or class ids (B,)
        for classification, predictions (B,) or (B, 1) for regression; target (B,).
        `compute()` gives `{name: scalar tensor}`. Clone it per split (`clone(prefix="val_")`)
        so that, e.g., MNLI matched and mismatched never share state.

    Raises:
        ValueError: an empty list, a repeated or unknown name, or a name that does not fit
            `num_labels`.
    """
    if not metric_names:
        raise ValueError("a task needs at least one metric; metric_names is empty")
    if len(set(metric_names)) != len(metric_names):
        raise ValueError(f"metric_names has duplicates: {metric_names}")
    # compute_groups=False: the metrics have different states, so there is nothing to share.
    return MetricCollection(
        {name: _build(name, num_labels) for name in metric_names}, compute_groups=False
    )


def main_metric(metric_names: list[str]) -> str:
    """The metric that selects the best checkpoint: by convention the first one listed."""
    if not metric_names:
        raise ValueError("a task needs at least one metric; metric_names is empty")
    return metric_names[0]

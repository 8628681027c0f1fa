"""A fine-tuned checkpoint's task head: what it predicts (`HeadSpec`, stored as the checkpoint's
`finetune` entry) and the task model built from it on a backbone (`build_head`).

Here, below `pipeline/finetune/`, because loading a fine-tuned checkpoint
(pipeline/checkpoint/load.py) builds the task model from the entry, and fine-tuning builds the
same model for a new head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from datamodules.tasks.labels import LabelMap
from models.heads import PAIR_SCORES, DocumentClassifier, SequenceClassifier

__all__ = ["HeadSpec", "build_head", "task_backbone"]


@dataclass(frozen=True)
class HeadSpec:
    """What the head predicts: the task's labels and metrics, and how documents are pooled.

    Attributes:
        task: the task name.
        label_map: class names <-> ids (regression: one output).
        metrics: metric names, main one first (the one that selects the best checkpoint).
        aggregate: for sliding-window documents, "mean", "max" or "attention"; None for
            single sequences.
        dropout: dropout before the output layer.
        pooling: the sequence features: None for the family's own, "mean" for the mean
            token state (`models.heads.SequenceClassifier`).
        siamese: a pair task whose two texts are encoded apart (batches of 2B rows).
        pair_score: how a siamese head scores a pair, "features", "cosine" or "alignment"
            (`models.heads.PAIR_SCORES`).
        special_ids: the tokenizer's special token ids, which an alignment head leaves out.
        target: regression only: (mean, std) of the training targets, which the head's
            output is scaled by (`models.heads.SequenceClassifier`).
    """

    task: str
    label_map: LabelMap
    metrics: tuple[str, ...]
    aggregate: str | None = None
    dropout: float = 0.1
    pooling: str | None = None
    siamese: bool = False
    pair_score: str = "features"
    target: tuple[float, float] = (0.0, 1.0)
    special_ids: tuple[int, ...] = ()

    def record(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "kind": self.label_map.kind,
            "labels": list(self.label_map.labels),
            "metrics": list(self.metrics),
            "aggregate": self.aggregate,
            "dropout": self.dropout,
            "pooling": self.pooling,
            "siamese": self.siamese,
            "pair_score": self.pair_score,
            "target": list(self.target),
            "special_ids": list(self.special_ids),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> HeadSpec:
        pair_score = record.get("pair_score", "features")  # older checkpoints: features
        if pair_score not in PAIR_SCORES:
            raise ValueError(f"unknown pair_score {pair_score!r} (known: {PAIR_SCORES})")
        return cls(
            task=record["task"],
            label_map=LabelMap(record["kind"], tuple(record["labels"])),
            metrics=tuple(record["metrics"]),
            aggregate=record.get("aggregate"),
            dropout=float(record.get("dropout", 0.1)),
            pooling=record.get("pooling"),  # older checkpoints: the family's own, joint pairs
            siamese=bool(record.get("siamese", False)),
            pair_score=pair_score,
            target=tuple(float(t) for t in record.get("target", (0.0, 1.0))),
            special_ids=tuple(int(i) for i in record.get("special_ids", ())),
        )


def build_head(backbone: nn.Module, head: HeadSpec) -> SequenceClassifier | DocumentClassifier:
    """The task model on `backbone` (a pretraining model's LM heads are dropped)."""
    classifier = SequenceClassifier(
        backbone,
        head.label_map.num_labels,
        dropout=head.dropout,
        pooling=head.pooling,
        siamese=head.siamese,
        pair_score=head.pair_score,
        target=head.target,
        special_ids=head.special_ids,
    )
    if head.aggregate is None:
        return classifier
    return DocumentClassifier(classifier, head.aggregate)


def task_backbone(model: SequenceClassifier | DocumentClassifier) -> nn.Module:
    """The backbone under a task model (a document model's under its sequence classifier)."""
    classifier = model.classifier if isinstance(model, DocumentClassifier) else model
    return classifier.backbone

"""The fine-tuning LightningModule: a pretrained backbone with a sequence head, trained on one
task and scored with the task's GLUE metrics, one metric set per evaluation split.

Thin, like the pretraining modules: the head math is `models.heads` (`SequenceClassifier`,
`DocumentClassifier` for sliding-window documents), the batches come from
`datamodules.finetune.FinetuneDataModule`, the metrics from `pipeline.finetune.metrics`.

Logged: `train/loss` and `train/lr` per step; per evaluation split `val/<split>/loss` and
`val/<split>/<metric>` (e.g. `val/dev_matched/accuracy`).

A fine-tuned checkpoint holds, besides Lightning's entries, `model_config` (the backbone's
architecture), `tokenizer`, `config` (the resolved run config) and `finetune` (task, labels,
head settings: `pipeline.checkpoint.head.HeadSpec`), so `pipeline.checkpoint.load.load_finetuned`
rebuilds the model from the file alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import lightning as L
import torch
from torch import nn

from models.config import ModelConfig, require_probability
from models.heads import DocumentClassifier, SequenceClassifier, sequence_loss
from pipeline.checkpoint.head import HeadSpec, task_backbone
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.finetune.metrics import task_metrics
from pipeline.run.errors import ConfigError
from pipeline.training.optim import build_optimizer

log = logging.getLogger(__name__)


class TaskModule(L.LightningModule):
    """Fine-tunes a task model (a backbone under a head) on a task.

    Args:
        model: the task model, `build_head(backbone, head)` (pipeline/checkpoint/head.py) on a
            `BertForPreTraining`/`BertModel` or `GPT`/`GPTModel` with trained (or fresh) weights.
        head: the task's labels, metrics and document pooling.
        eval_splits: names of the evaluation splits, in `val_dataloader()` order.
        optimizer: a partial optimizer (`conf/optim/`), bound here with weight-decay groups.
        scheduler: a partial schedule (`conf/schedule/`), bound with the optimizer and the
            run's total optimizer steps.
    """

    def __init__(
        self,
        model: SequenceClassifier | DocumentClassifier,
        head: HeadSpec,
        eval_splits: list[str],
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        # train mode: a loaded backbone comes in eval mode, and Lightning keeps modes as found
        self.model = model.train()
        self.head = head
        self.model_config: ModelConfig = task_backbone(model).config
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.set_eval_splits(eval_splits)

    def set_eval_splits(self, eval_splits: list[str]) -> None:
        """Evaluate on these splits (in `val_dataloader()` order), each with its own metrics."""
        if not eval_splits:
            raise ValueError("a task needs at least one evaluation split")
        self.eval_splits = list(eval_splits)
        metrics = task_metrics(list(self.head.metrics), self.head.label_map.num_labels)
        self.val_metrics = nn.ModuleList([metrics.clone() for _ in self.eval_splits])
        self._val_loss: list[list[tuple[float, int]]] = [[] for _ in self.eval_splits]

    @property
    def main_metric_key(self) -> str:
        """The logged key that selects the best checkpoint: the main metric on the first split."""
        return f"val/{self.eval_splits[0]}/{self.head.metrics[0]}"

    def scores(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores to train on with their labels, scores per sequence or document) of a batch.

        Sliding-window "mean"/"max" trains on each chunk with its document's label; everything
        else trains on the per-sequence (per-document) scores."""
        inputs = {k: batch[k] for k in ("attention_mask", "token_type_ids")}
        labels = batch["labels"]
        if "chunk_doc" not in batch:
            scores = self.model(batch["input_ids"], **inputs)
            return scores, scores
        chunk_scores, doc_scores = self.model(
            batch["input_ids"], batch["chunk_doc"], len(labels), **inputs
        )
        return (doc_scores if chunk_scores is None else chunk_scores), doc_scores

    def training_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labels of the trained-on scores: per chunk for "mean"/"max" windows."""
        per_chunk = "chunk_doc" in batch and self.head.aggregate in ("mean", "max")
        return batch["labels"][batch["chunk_doc"]] if per_chunk else batch["labels"]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        train_scores, _ = self.scores(batch)
        labels = self.training_labels(batch)
        loss = sequence_loss(train_scores, labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(labels))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        _, scores = self.scores(batch)
        labels = batch["labels"]
        if "scored" in batch:  # a DDP rank's repeated examples (datamodules.tasks.batches.Repeat)
            scores, labels = scores[batch["scored"]], labels[batch["scored"]]
            if not len(labels):
                return
        loss = sequence_loss(scores, labels)
        self._val_loss[dataloader_idx].append((float(loss), len(labels)))
        self.val_metrics[dataloader_idx].update(scores.float(), labels)

    def on_validation_epoch_end(self) -> None:
        """Log each split's loss (per example, over every process's examples) and metrics
        (torchmetrics gathers every process's state). Both are the same on every process, so
        `sync_dist`'s mean leaves them as they are; it keeps Lightning from warning."""
        for index, split in enumerate(self.eval_splits):
            losses = self._val_loss[index]
            loss_sum, count = sum(v * n for v, n in losses), sum(n for _, n in losses)
            if self.trainer.world_size > 1:
                totals = torch.tensor([loss_sum, count], device=self.device)
                loss_sum, count = self.trainer.strategy.reduce(totals, reduce_op="sum").tolist()
            if count:
                self.log(f"val/{split}/loss", loss_sum / count, sync_dist=True)
            for name, value in self.val_metrics[index].compute().items():
                self.log(f"val/{split}/{name}", value, prog_bar=index == 0, sync_dist=True)
            self.val_metrics[index].reset()
            losses.clear()

    def predict_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, torch.Tensor]:
        _, scores = self.scores(batch)
        return {"example_index": batch["example_index"], "scores": scores.float().cpu()}

    def configure_optimizers(self):
        if self.optimizer_factory is None or self.scheduler_factory is None:
            raise RuntimeError("TaskModule was built without an optimizer and schedule")
        optimizer = build_optimizer(self.model, self.optimizer_factory)
        schedule = self.scheduler_factory(
            optimizer, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        CheckpointRecord(
            model_config=CheckpointRecord.describe_model(self.model_config),
            finetune=self.head.record(),
        ).write_into(checkpoint)


def reinitialize(backbone: nn.Module) -> nn.Module:
    """The same architecture with fresh weights (the from-scratch baseline)."""
    return type(backbone)(backbone.config)


DROPOUT_RATES = ("dropout", "attn_dropout")  # the model configs' rates fine-tuning may set


def with_dropout(backbone: nn.Module, **rates: float | None) -> nn.Module:
    """The backbone with its dropout rates replaced (`dropout=`, and `attn_dropout=` for BERT),
    weights kept; a rate given as None keeps the backbone's own. Fine-tuning a model that was
    pretrained without dropout may want it back (`backbone.*` in conf/finetune.yaml).

    Raises:
        ConfigError: a rate the backbone's family does not have, or one outside [0, 1).
    """
    given = {name: rate for name, rate in rates.items() if rate is not None}
    if not given:
        return backbone
    config = backbone.config
    known = [f.name for f in fields(config) if f.name in DROPOUT_RATES]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"backbone.{unknown[0]} is not a setting of a {type(config).__name__} (its rates: "
            f"{', '.join(known) or 'none'}); remove backbone.{unknown[0]}=... from the command"
        )
    try:
        for name, rate in given.items():
            require_probability(f"backbone.{name}", rate)
    except ValueError as err:
        raise ConfigError(f"{err} (or null to keep the checkpoint's)") from err
    with torch.device("meta"):  # no init to run: the weights are the backbone's own
        rebuilt = type(backbone)(replace(config, **{k: float(v) for k, v in given.items()}))
    rebuilt.load_state_dict(backbone.state_dict(), assign=True)  # dtype and device kept
    return rebuilt


__all__ = [
    "TaskModule",
    "reinitialize",
    "with_dropout",
]

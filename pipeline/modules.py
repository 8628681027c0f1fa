"""LightningModules of the two pre-training objectives. Thin: the model math lives in `models/`,
the batches come from `datamodules/`; here are the losses' bookkeeping, metrics, optimizer and
schedule, and the guard against non-finite steps.

- `BertPretraining`: masked LM on the gathered masked positions + next-sentence prediction;
  loss = MLM + NSP, each logged.
- `GPTPretraining`: causal LM on packed windows (optionally with document masking).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from models.bert import BertForPreTraining, pretraining_loss
from models.config import BertConfig, GPTConfig
from models.flops import flops_per_token, param_count
from models.gpt import GPT
from pipeline.optim import build_optimizer

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class PretrainModule(L.LightningModule):
    """What both objectives share: optimizer and per-step schedule, the non-finite guard, and
    validation metrics averaged over predicted tokens.

    Args:
        model_config: `BertConfig` or `GPTConfig` with the tokenizer's vocabulary size.
        optimizer: a partial optimizer (`conf/optim/`), bound here with weight-decay groups.
        scheduler: a partial schedule (`conf/schedule/`), bound with the optimizer and the
            run's total optimizer steps.
        max_nonfinite_steps: stop after this many consecutive skipped steps.
    """

    perplexity_of = "loss"  # the validation loss whose exp is the perplexity

    def __init__(
        self,
        model_config: BertConfig | GPTConfig,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any],
        max_nonfinite_steps: int = 10,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.model = self.build_model(model_config)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.val_metrics = torch.nn.ModuleDict(
            {name: MeanMetric() for name in self.validation_metric_names()}
        )

    # subclasses --------------------------------------------------------------------------------

    def build_model(self, config):
        raise NotImplementedError

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        """Named (mean loss, count) pairs; "loss" is what is optimized."""
        raise NotImplementedError

    def validation_metric_names(self) -> list[str]:
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens processed by a batch (for throughput and MFU)."""
        return int(batch["input_ids"].numel())

    # shared ------------------------------------------------------------------------------------

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config)

    def parameter_count(self) -> int:
        return param_count(self.model_config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int):
        results = self.losses(batch)
        loss = results["loss"][0]
        if not torch.isfinite(loss):
            self._count_nonfinite(f"loss is {loss.item()}")
            return None  # Lightning skips backward and the optimizer step
        for name, (value, _) in results.items():
            self.log(f"train/{name}", value.detach(), prog_bar=name == "loss")
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        if not torch.isfinite(norm):
            # Dropping the gradients makes AdamW skip every parameter: no update, no decay, no
            # moment change, so one bad batch leaves no trace in the weights.
            optimizer.zero_grad(set_to_none=True)
            self._count_nonfinite("gradient norm is not finite")
            return
        self.nonfinite_in_a_row = 0
        self.log("train/grad_norm", norm)
        self.log("train/lr", optimizer.param_groups[0]["lr"], prog_bar=True)

    def _count_nonfinite(self, why: str) -> None:
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        self.log("train/skipped_steps", float(self.nonfinite_total))
        log.warning("step %d skipped: %s", self.global_step, why)
        if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                f"(last: {why}); lower optim.lr, raise schedule warmup, or use trainer.precision=32"
            )

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        for name, (value, count) in self.losses(batch).items():
            if name in self.val_metrics and count > 0:
                self.val_metrics[name].update(value.detach().float(), weight=count)

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():
            if metric.update_called:
                value = metric.compute()
                # MeanMetric already reduced over processes in compute()
                self.log(f"val/{name}", value, prog_bar=name == "loss")
                if name == self.perplexity_of:
                    self.log("val/perplexity", torch.exp(value.clamp(max=50)))
            metric.reset()

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optimizer_factory)
        total = self.trainer.max_steps
        if total is None or total <= 0:
            raise ValueError("trainer.max_steps must be set: the schedule needs the run length")
        scheduler = self.scheduler_factory(optimizer, total_steps=total)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = {
            "family": "bert" if isinstance(self.model_config, BertConfig) else "gpt",
            **dataclasses.asdict(self.model_config),
        }


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == targets).float().mean()


class BertPretraining(PretrainModule):
    """BERT masked LM + next-sentence prediction (total loss = MLM + NSP)."""

    perplexity_of = "mlm_loss"

    def build_model(self, config: BertConfig) -> BertForPreTraining:
        return BertForPreTraining(config)

    def validation_metric_names(self) -> list[str]:
        return ["loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"]

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config, mlm_fraction=0.15)

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        out = self.model(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
            masked_positions=batch["masked_positions"],
        )
        nsp_labels = batch.get("nsp_labels")
        loss = pretraining_loss(out, batch["mlm_labels"], nsp_labels)
        n_masked, n_seq = int(batch["mlm_labels"].numel()), int(batch["input_ids"].shape[0])
        results = {
            "loss": (loss.total, n_masked),
            "mlm_loss": (loss.mlm, n_masked),
            "mlm_accuracy": (_accuracy(out.mlm_logits, batch["mlm_labels"]), n_masked),
        }
        if nsp_labels is not None:
            results["nsp_loss"] = (loss.nsp, n_seq)
            results["nsp_accuracy"] = (_accuracy(out.nsp_logits, nsp_labels), n_seq)
        return results


class GPTPretraining(PretrainModule):
    """GPT causal language modelling on packed windows."""

    def build_model(self, config: GPTConfig) -> GPT:
        return GPT(config)

    def validation_metric_names(self) -> list[str]:
        return ["loss"]

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        out = self.model(
            batch["input_ids"],
            targets=batch["targets"],
            doc_ids=batch.get("doc_ids"),
            position_ids=batch.get("position_ids"),
        )
        return {"loss": (out.loss, int((batch["targets"] != -100).sum()))}


def module_for(family: str) -> type[PretrainModule]:
    return {"bert": BertPretraining, "gpt": GPTPretraining}[family]

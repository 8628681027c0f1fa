"""LightningModules of the two pre-training objectives. Thin: the model math lives in `models/`,
the batches come from `datamodules/`; here are the losses' bookkeeping, metrics, optimizer and
schedule, and the guard against non-finite steps.

- `BertPretraining`: masked LM on the gathered masked positions + next-sentence prediction;
  loss = MLM + NSP, each logged.
- `GPTPretraining`: causal LM on packed windows (optionally with document masking).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torchmetrics import MeanMetric

from datamodules.objectives.batches import STEP_TOTAL, LossCount
from datamodules.objectives.mixed import VAL_SOURCE
from datamodules.validation import VAL_SET
from models.bert import BertForPreTraining, pretraining_loss
from models.config import BertConfig, GPTConfig, ModelConfig
from models.flops import flops_per_token, param_count
from models.gpt import GPT
from pipeline.run.errors import NonFiniteLossError
from pipeline.training.optim import apply_hyperparameters, build_optimizer, group_hyperparameters

log = logging.getLogger(__name__)


class PretrainModule(L.LightningModule):
    """What both objectives share: optimizer and per-step schedule, the non-finite guard, and
    validation metrics averaged over predicted tokens.

    Args:
        model_config: `BertConfig` or `GPTConfig` with the tokenizer's vocabulary size.
        optimizer: a partial optimizer (`conf/optim/`), bound here with weight-decay groups.
        scheduler: a partial schedule (`conf/schedule/`), bound here with the optimizer and
            `schedule_steps`.
        max_nonfinite_steps: stop after this many consecutive skipped steps.
        schedule_steps: the schedule's length in optimizer steps: the run's
            `RunLength.max_steps` (pipeline/pretrain/budget.py), which a budgeted run's pace
            maps its steps onto. Needed by a module that trains.
    """

    # The language model's loss: its exp is the perplexity, and its held-out value
    # (`held_out_figure`) is the run's figure of merit: the best checkpoints are kept by it and
    # the end of a run checks it for a rise. A side task's loss (BERT's next-sentence
    # prediction) is not: it can rise on held-out text while the language model still learns.
    language_model_loss = "loss"
    # loss term -> the count it averages over (`datamodules.objectives.batches` `loss_counts` names)
    loss_terms: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        model_config: ModelConfig,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any],
        max_nonfinite_steps: int = 10,
        schedule_steps: int | None = None,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.model = self.build_model(model_config)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.schedule_steps = schedule_steps
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self._losses_finite: torch.Tensor | None = None  # in the current step so far
        self._totals: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, totals)
        self._configured_hyperparameters: list[dict] = []  # the optimizer's, as this run built it
        # No NaN screening in the metrics (it syncs the GPU on every update): a non-finite
        # training step is dropped whole in `on_before_optimizer_step`.
        names = self.metric_names()
        self.train_metrics = torch.nn.ModuleDict(
            {name: MeanMetric(nan_strategy="disable") for name in names}
        )
        self.val_metrics = torch.nn.ModuleDict({name: MeanMetric() for name in names})
        # a mixture's validation metrics per source (`setup`), logged as val/<source>/<name>
        self.source_names: list[str] = []
        self.source_val_metrics = torch.nn.ModuleList()
        # the extra validation sets' metrics (`setup`), logged as val/<set>/<name> only
        self.extra_names: list[str] = []
        self.extra_val_metrics = torch.nn.ModuleList()

    # subclasses --------------------------------------------------------------------------------

    def build_model(self, config):
        raise NotImplementedError

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        """Named (mean, count) pairs: losses and accuracies of the batch; "loss" is the sum of
        the `loss_terms`."""
        raise NotImplementedError

    def metric_names(self) -> list[str]:
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        """Tokens processed by a batch (for throughput and MFU)."""
        return int(batch["input_ids"].numel())

    # shared ------------------------------------------------------------------------------------

    @classmethod
    def held_out_figure(cls) -> str:
        """The logged name of the run's held-out figure of merit (lower is better)."""
        return f"val/{cls.language_model_loss}"

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config)

    def parameter_count(self) -> int:
        return param_count(self.model_config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        results = self.losses(batch)
        for name, (value, count) in results.items():
            if name in self.train_metrics and count > 0:
                self.train_metrics[name].update(value.detach().float(), weight=count)
        # Checked once per step, in `on_before_optimizer_step` (backward still runs: every
        # process must join the gradient all-reduce).
        finite = torch.isfinite(results["loss"][0].detach())
        if self._losses_finite is not None:
            finite = finite & self._losses_finite
        self._losses_finite = finite
        return self.step_loss(batch, results)

    def step_loss(
        self, batch: dict[str, torch.Tensor], results: dict[str, tuple[torch.Tensor, int]]
    ) -> torch.Tensor:
        """This micro-batch's share of its optimizer step's loss.

        Each loss term is a mean over its predictions (masked tokens, sequences, next
        tokens). Over a step of k micro-batches on W processes, the optimized loss is that mean
        over all the step's predictions: sum(mean_i * n_i) / N, with N counted over every
        micro-batch (`step_total_<count>` in the batch) and every process. It is not the mean of
        micro-batch means, which weighs a micro-batch with few masked tokens like a full one.
        Lightning divides the returned loss by k and DDP averages gradients over W; the
        factor k * W undoes both.
        """
        trainer = self.trainer
        scale = trainer.accumulate_grad_batches * trainer.world_size
        totals = self._step_totals(batch)
        loss = torch.zeros((), device=self.device)
        for name, count_name in self.loss_terms.items():
            if name not in results or results[name][1] == 0:
                continue
            mean, count = results[name]
            loss = loss + mean * (count * scale / totals[count_name])
        return loss

    def _step_totals(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's prediction counts summed over processes: one all-reduce per optimizer
        step (every micro-batch of a step carries the same local totals)."""
        if self._totals is not None and self._totals[0] == self.global_step:
            return self._totals[1]
        names = sorted(k[len(STEP_TOTAL) :] for k in batch if k.startswith(STEP_TOTAL))
        if not names:
            raise ValueError(
                "training batches carry no step totals (step_total_* keys): they must come from "
                "datamodules.pretrain.PretrainDataModule, whose loader hands out whole steps"
            )
        stacked = torch.stack([batch[STEP_TOTAL + n] for n in names]).to(self.device, torch.float64)
        if self.trainer.world_size > 1:
            torch.distributed.all_reduce(stacked)  # a sum, without Lightning's extra barrier
        totals = {n: stacked[i].float() for i, n in enumerate(names)}
        self._totals = (self.global_step, totals)
        return totals

    def on_train_start(self) -> None:
        self._totals = None
        micro = getattr(self.trainer.datamodule, "micro_batches", None)
        if micro is not None and micro != self.trainer.accumulate_grad_batches:
            raise ValueError(
                f"the datamodule groups {micro} micro-batches per step but the trainer "
                f"accumulates {self.trainer.accumulate_grad_batches}; pass the same number "
                "(pipeline.pretrain.run.assemble does)"
            )
        # After a resume the optimizer and schedule hold the checkpoint's hyperparameters; this
        # run's config wins (on every rank; said once).
        if self.trainer.ckpt_path is not None and self._configured_hyperparameters:
            scheduler = self.trainer.lr_scheduler_configs[0].scheduler
            changes = apply_hyperparameters(
                self.trainer.optimizers[0], scheduler, self._configured_hyperparameters
            )
            if self.trainer.is_global_zero:
                for change in changes:
                    log.warning("resumed with this run's optimizer setting, optim.%s", change)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["nonfinite_steps"] = {
            "in_a_row": self.nonfinite_in_a_row,
            "total": self.nonfinite_total,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        counts = checkpoint.get("nonfinite_steps", {})
        self.nonfinite_in_a_row = counts.get("in_a_row", 0)
        self.nonfinite_total = counts.get("total", 0)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once per optimizer step, after the last micro-batch's backward (and after
        mixed-precision unscaling, before clipping): skip a non-finite step, log the step."""
        norm = self._gradient_norm()
        # With a loss scaler (16-mixed), overflowing gradients are routine: the scaler skips
        # that step and lowers the scale itself. Only a non-finite loss counts then.
        scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
        finite = (
            torch.ones((), dtype=torch.bool, device=norm.device) if scaled else torch.isfinite(norm)
        )
        if self._losses_finite is not None:
            finite = finite & self._losses_finite
        self._losses_finite = None
        bad = self.trainer.strategy.reduce_boolean_decision(not bool(finite), all=False)
        if bad:
            # Dropping the gradients makes AdamW skip every parameter: no update, no decay, no
            # moment change, so one bad batch leaves no trace in the weights.
            optimizer.zero_grad(set_to_none=True)
            for metric in self.train_metrics.values():
                metric.reset()
            self._count_nonfinite("loss or gradient norm is not finite")
            return
        self.nonfinite_in_a_row = 0
        self.log("train/skipped_steps", float(self.nonfinite_total))
        self._log_metrics("train", self.train_metrics)
        self.log("train/grad_norm", norm)
        self.log("train/lr", optimizer.param_groups[0]["lr"], prog_bar=True)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # Lightning's FSDP precision plugin refuses norm clipping; FSDP's own clip_grad_norm_
        # computes the norm over every shard.
        if isinstance(self.trainer.strategy, FSDPStrategy) and gradient_clip_val:
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError("under FSDP only norm clipping is supported")
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _gradient_norm(self) -> torch.Tensor:
        """L2 norm of all gradients (before clipping); over every shard under FSDP."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        if isinstance(self.trainer.strategy, FSDPStrategy):
            # FSDP knows which gradients are sharded, replicated (NO_SHARD, HYBRID_SHARD) or
            # offloaded; an infinite max norm measures without clipping.
            return self.trainer.strategy.model.clip_grad_norm_(float("inf"))
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))

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

    def setup(self, stage: str) -> None:
        """A mixture's sources (`PretrainDataModule.source_names`) and the extra validation
        sets (`datamodules.validation.ExtraValidation`) get validation metrics of their own;
        created here, before the strategy moves the module to its device."""
        datamodule = self.trainer.datamodule
        sources = getattr(datamodule, "source_names", None) or []
        if sources and not len(self.source_val_metrics):
            self.source_names = list(sources)
            self.source_val_metrics.extend(self._metric_group() for _ in sources)
        extra = getattr(getattr(datamodule, "extra_validation", None), "names", None) or []
        if extra and not len(self.extra_val_metrics):
            self.extra_names = list(extra)
            self.extra_val_metrics.extend(self._metric_group() for _ in extra)

    def _metric_group(self) -> torch.nn.ModuleDict:
        # kept in a list: any source or set name will do, none is a module's key
        return torch.nn.ModuleDict({name: MeanMetric() for name in self.metric_names()})

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        groups = [self.val_metrics]
        if VAL_SOURCE in batch:  # a mixture's validation batch, from one source
            groups.append(self.source_val_metrics[int(batch[VAL_SOURCE])])
        if VAL_SET in batch:  # an extra validation set's batch: its own metrics only
            groups = [self.extra_val_metrics[int(batch[VAL_SET])]]
        for name, (value, count) in self.losses(batch).items():
            for metrics in groups:
                if name in metrics and count > 0:
                    metrics[name].update(value.detach().float(), weight=count)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.val_metrics)
        named = zip(
            self.source_names + self.extra_names,
            [*self.source_val_metrics, *self.extra_val_metrics],
            strict=True,
        )
        for name, metrics in named:
            self._log_metrics(f"val/{name}", metrics, prog_bar=False)

    def _log_metrics(self, split: str, metrics: torch.nn.ModuleDict, prog_bar: bool = True) -> None:
        """Log and reset prediction-weighted means (MeanMetric.compute() reduces over
        processes), and the perplexity of `language_model_loss`."""
        values = {name: m.compute() for name, m in metrics.items() if m.update_called}
        if values and "loss" not in values:  # the loss is a sum of terms (MLM + NSP)
            values["loss"] = sum(values[term] for term in self.loss_terms if term in values)
        for name, value in values.items():
            self.log(f"{split}/{name}", value, prog_bar=prog_bar and name == "loss")
        if self.language_model_loss in values:
            perplexity = torch.exp(values[self.language_model_loss].clamp(max=50))
            self.log(f"{split}/perplexity", perplexity)
        for metric in metrics.values():
            metric.reset()

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optimizer_factory)
        self._configured_hyperparameters = group_hyperparameters(optimizer)
        total = self.schedule_steps
        if total is None or total <= 0:
            raise ValueError(
                f"schedule_steps={total}: the schedule needs the run's length in optimizer steps "
                "(trainer.max_steps)"
            )
        scheduler = self.scheduler_factory(optimizer, total_steps=total)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == targets).float().mean()


class BertPretraining(PretrainModule):
    """BERT masked LM + next-sentence prediction (total loss = MLM + NSP)."""

    language_model_loss = "mlm_loss"
    loss_terms: ClassVar[dict[str, str]] = {
        "mlm_loss": LossCount.MASKED,
        "nsp_loss": LossCount.SEQUENCES,
    }

    def build_model(self, config: BertConfig) -> BertForPreTraining:
        return BertForPreTraining(config)

    def metric_names(self) -> list[str]:
        return ["mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"]

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model_config, predicted_fraction=0.15)

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

    loss_terms: ClassVar[dict[str, str]] = {"loss": LossCount.TARGETS}

    def build_model(self, config: GPTConfig) -> GPT:
        return GPT(config)

    def metric_names(self) -> list[str]:
        return ["loss", "bits_per_byte"]

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        out = self.model(
            batch["input_ids"],
            targets=batch["targets"],
            doc_ids=batch.get("doc_ids"),
            position_ids=batch.get("position_ids"),
        )
        predicted = batch["targets"].numel()
        results = {"loss": (out.loss, predicted)}
        if "target_bytes" in batch:  # validation batches: weighted by bytes, the mean over
            # batches is all nats / all bytes / ln 2 (loss / ln 2 x tokens per byte)
            text_bytes = batch["target_bytes"].sum()
            bits = out.loss * predicted / (text_bytes.clamp(min=1) * math.log(2))
            results["bits_per_byte"] = (bits, text_bytes)
        return results

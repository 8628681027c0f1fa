"""Downstream probes while pretraining: is the model learning features a task can use?

    make pretrain experiment=bert-mini-wikitext2 probe=glue

Every `every_n_steps` optimizer steps, at the end of training, and once before the first step
(the reference: the starting weights, random or with `word_vectors=ppmi` the counted word
vectors), `Probe` encodes a labelled task's texts with the model being
trained, frozen, and fits a linear model on the mean of each text's last-layer token states
(`models.heads.mean_token_states`; no trained pooler needed). A pair's two texts are encoded
apart and read as a mini model's fine-tuning head reads them by default
(`models.heads.default_pair_score`): a regression pair by the cosine of the two, a
classification pair by how their tokens align (`models.heads.alignment_scores`); read as one
sequence, their mean state says little of how the two relate. The linear model: logistic regression for classes,
ridge regression for numbers (`pipeline.finetune.baselines.fit_linear`), on a fixed sample of the
task's training examples, scored on a fixed sample of its dev split with the task's own
metrics. With the defaults (500 + 500 examples of two tasks, every 200 steps) a probe of BERT mini
takes a few seconds on a CPU, a few percent of a 20-minute run. The values go
to every logger as `probe/<task>/<metric>` (and `probe/seconds`, the time the probes took) and
`make report` plots them over steps, with the step-0 value as the random-init line.

A probe changes nothing in training: the model is put back in the mode it was in, the random
number generators are restored (`torch.random.fork_rng`), and it reads its own data, not the
training loader; an interrupted run resumed from its checkpoint continues bit for bit as
without probes. Every process of a multi-process run computes the probe (it is cheap, and a
forward pass of a sharded model needs all of them); the first one logs it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import lightning as L
import torch
from torch.utils.data import DataLoader

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks.spec import TaskSpec
from models.heads import (
    alignment_scores,
    backbone_of,
    default_pair_score,
    encode_pair_sides,
    mean_token_states,
    pair_cosine,
    pair_features,
)
from pipeline.finetune.baselines import dev_scores, fit_linear, predict_linear, standardize
from pipeline.pretrain.checks import WITHOUT_PROBES
from tokenizer import InputTemplate, special_ids

log = logging.getLogger(__name__)

PREFIX = "probe"


@dataclass
class _ProbeData:
    """One task's encoded examples: the loaders of its training sample and its dev split."""

    task: TaskSpec
    num_labels: int
    train: DataLoader
    dev: DataLoader
    special_ids: torch.Tensor

    def features(self, backbone, batch: dict[str, torch.Tensor], device) -> torch.Tensor:
        """(B, F) fp32 features of a batch's B examples (a pair's texts: rows 2i and 2i + 1):
        a text's mean token state; a pair read as the fine-tuning head reads it by default."""
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        types = batch.get("token_type_ids")
        types = None if types is None else types.to(device)
        score = default_pair_score(self.task.is_regression) if self.task.is_pair else None
        if score == "alignment":
            return alignment_scores(backbone, ids, mask, types, self.special_ids).float()
        encode = partial(mean_token_states, backbone)
        if score is None:
            return encode(ids, mask, types).float()
        states_ND = encode_pair_sides(encode, ids, mask, types).float()
        return (pair_cosine if score == "cosine" else pair_features)(states_ND)


class StepProbe(L.Callback):
    """Measures the model being trained before the first step, every `every_n_steps` optimizer
    steps and at the end, and logs what `scores` returns (plus `probe/seconds`) to every
    logger; a subclass says what `scores` measures."""

    def __init__(self, every_n_steps: int) -> None:
        if every_n_steps < 1:
            raise ValueError(f"probe.every_n_steps={every_n_steps}: use 1 or more")
        self.every_n_steps = every_n_steps
        self._last_step: int | None = None

    def scores(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        raise NotImplementedError

    # --- when -----------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 0:  # the random-init reference (a resumed run has it)
            self._probe(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self._probe(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self._probe(trainer, pl_module)

    def _probe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        started = time.perf_counter()
        metrics = self.scores(pl_module.model, pl_module.device)
        metrics[f"{PREFIX}/seconds"] = time.perf_counter() - started
        self._last_step = trainer.global_step
        if trainer.is_global_zero:
            for (
                logger
            ) in trainer.loggers:  # they number steps from one (pipeline/training/loggers.py)
                logger.log_metrics(metrics, step=trainer.global_step - 1)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            log.info("probe at step %d: %s", trainer.global_step, shown)
            self.logged(trainer, metrics)

    def logged(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        """After the first process logged `metrics` (a subclass may keep more)."""


class Probe(StepProbe):
    """Linear probes of the model's features on labelled tasks, during pretraining.

    Args:
        tasks: the probed tasks (`conf/task/*.yaml`), single texts or pairs.
        tokenizer: the run's tokenizer.
        seq_len: tokens per probed text (the run's training length).
        every_n_steps: probe after every this many optimizer steps (and at the end).
        train_examples: the probe's training sample per task (a fixed random sample).
        dev_examples: the sample of the task's dev split it is scored on.
        batch_size: examples per forward pass (a pair task's are twice as many rows).
    """

    def __init__(
        self,
        tasks: list[TaskSpec],
        tokenizer,
        *,
        seq_len: int,
        every_n_steps: int = 200,
        train_examples: int = 500,
        dev_examples: int = 500,
        batch_size: int = 64,
        template: InputTemplate | None = None,
    ) -> None:
        super().__init__(every_n_steps)
        if not tasks:
            raise ValueError(f"probe.tasks is empty: name at least one task, or {WITHOUT_PROBES}")
        self.data: list[_ProbeData] = []
        for task in tasks:
            module = FinetuneDataModule(
                task,
                tokenizer,
                max_seq_len=seq_len,
                eval_batch_size=batch_size,
                train_examples=train_examples,
                eval_examples=dev_examples,
                siamese=task.is_pair,
                template=template,
            )
            module.setup("fit")
            self.data.append(
                _ProbeData(
                    task,
                    module.num_labels,
                    module.eval_loader(task.train_split),
                    module.eval_loader(task.eval_splits[0]),
                    torch.tensor(special_ids(tokenizer).ordered()),
                )
            )

    @torch.no_grad()
    def scores(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """`probe/<task>/<metric>` of every task for `model` (any BERT or GPT, as it is now)."""
        backbone = backbone_of(model)
        training = backbone.training
        backbone.eval()
        devices = [device] if device.type == "cuda" else []
        out: dict[str, float] = {}
        try:
            with torch.random.fork_rng(devices=devices):
                for data in self.data:
                    x_train, y_train = _features(backbone, data, data.train, device)
                    x_dev, y_dev = _features(backbone, data, data.dev, device)
                    x_train, x_dev = standardize(x_train, x_dev)
                    with torch.enable_grad():
                        weight, bias = fit_linear(x_train, y_train, data.num_labels)
                    scores = dev_scores(
                        list(data.task.ordered_metrics),
                        data.num_labels,
                        predict_linear(x_dev, weight, bias),
                        y_dev,
                    )
                    for name, value in scores.items():
                        out[f"{PREFIX}/{data.task.name}/{name}"] = value
        finally:
            backbone.train(training)
        return out


def _features(backbone, data: _ProbeData, loader: DataLoader, device: torch.device):
    """(N, F) features (fp32, on the CPU; `_ProbeData.features`) and (N,) labels of a
    loader's N examples."""
    features, labels = [], []
    for batch in loader:
        features.append(data.features(backbone, batch, device).cpu())
        labels.append(batch["labels"])
    return torch.cat(features), torch.cat(labels)

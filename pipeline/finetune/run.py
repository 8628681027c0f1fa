"""`make finetune`: GLUE-style tasks on a pretrained model (`make evaluate` and `make predict`
of the fine-tuned model: pipeline/finetune/evaluation.py).

    python -m pipeline.commands.finetune task=sst2 ckpt=outputs/bert/<run>        # train + evaluate

Fine-tuning loads the backbone and its tokenizer (`pipeline.checkpoint.load.load_backbone`: our
checkpoint or run folder, an HF folder, or a fine-tuned model), puts a task head on it, trains
with AdamW, warmup then linear decay, evaluates every split after each epoch, keeps the best
checkpoint by the task's main metric on the first evaluation split, and writes `results.json`
(best and final metrics per split) and `labels.json` into the run folder
`outputs/finetune/<task>/<run_name>/`.

A sweep (`-m optim.lr=2e-5,3e-5 seed=1,2,3`) runs one job per combination;
`pipeline.suites.sweep.SweepSummary` then prints the median and spread over seeds.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer
from torch import nn

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks.labels import save_labels
from datamodules.tasks.spec import TaskSpec
from models.config import ModelConfig
from pipeline.checkpoint.head import HeadSpec, build_head
from pipeline.checkpoint.load import load_backbone
from pipeline.checkpoint.saving import AtomicCheckpointIO, CheckpointExtras
from pipeline.checkpoint.source import CheckpointSource, read_checkpoint, resolve_checkpoint
from pipeline.finetune.results import BestCheckpoint, FinalScores, FinetuneResults
from pipeline.finetune.settings import (
    build_datamodule,
    check_finetune_keys,
    check_fits,
    default_epochs,
    fit_alignment_head,
    head_spec,
    optimizer_factory,
    reads_pairs_apart,
    task_from,
    warn_untrained_positions,
)
from pipeline.finetune.task_module import TaskModule, reinitialize, with_dropout
from pipeline.run.errors import ConfigError
from pipeline.run.folder import CHECKPOINT_DIR, RESULTS, refuse_overwrite
from pipeline.run.launcher import command_overrides
from pipeline.training.loggers import (
    build_loggers,
    log_run_end,
    log_run_start,
    log_table,
    progress_bar,
    tokenizer_fingerprint,
)
from pipeline.training.precision import best_precision

log = logging.getLogger(__name__)


# --- make finetune -------------------------------------------------------------------------------


def finetune(
    cfg: DictConfig, source: CheckpointSource | None = None, *, announce: bool = True
) -> FinetuneResults:
    """Train on the task, evaluate, write results.json; returns the results.

    `source`: `cfg.ckpt` already read (`resolve_checkpoint`), for a caller that fine-tunes
    the same checkpoint many times (`make glue`); None reads it here. `announce`: print what
    is fine-tuned before, and the best scores, files and next commands after (a caller that
    runs many, `make glue`, prints one line of its own per run instead)."""
    task, run_dir = check_run(cfg)
    L.seed_everything(cfg.seed, workers=True)
    # resolved and read once; below, only `source` names the checkpoint
    source = source or resolve_checkpoint(cfg.ckpt)
    start = prepare_start(cfg, task, source)
    module, head, lr = build_module(cfg, task, start)
    cfg, epochs = with_resolved_epochs(cfg, start.backbone.config)
    best = best_checkpoint_callback(run_dir, module)
    trainer = build_trainer(cfg, run_dir, task, source, start, best)
    record_start(trainer, cfg, run_dir, task, module, start)
    if trainer.is_global_zero and announce:
        announce_run(cfg, task, source, start, lr, epochs, run_dir)
    trainer.fit(module, datamodule=start.datamodule)
    results = score_best(trainer, module, best, cfg, task, source, head, lr, start.datamodule)
    if trainer.is_global_zero:
        record_results(trainer, results, run_dir, announce)
    return results


@dataclass
class Start:
    """What a fine-tune starts from: the backbone (pretrained, or its random twin; dropout as
    set), its tokenizer and family, the task's data set up for training, and the longest
    sequence its positions will have been trained on (None: unknown, an HF folder)."""

    backbone: nn.Module
    tokenizer: Tokenizer
    family: str
    datamodule: FinetuneDataModule
    trained_seq_len: int | None


def check_run(cfg: DictConfig) -> tuple[TaskSpec, Path]:
    """The task and run folder, once every key is checked and the folder is free."""
    if cfg.get("ckpt") is None:
        raise ConfigError(
            "ckpt is not set: give the pretrained model, e.g. ckpt=outputs/bert/<run> (a run "
            "folder, a *.ckpt or an HF folder); with from_scratch=true only its architecture "
            "and tokenizer are used"
        )
    check_finetune_keys(cfg)
    run_dir = Path(cfg.paths.output_dir)
    refuse_overwrite("finetune", run_dir)
    return task_from(cfg.get("task")), run_dir


def prepare_start(cfg: DictConfig, task: TaskSpec, source: CheckpointSource) -> Start:
    pretrained = load_backbone(source)
    backbone, tokenizer, family = pretrained.model, pretrained.tokenizer, pretrained.family
    check_fits(cfg.datamodule.max_seq_len, backbone.config)
    if cfg.from_scratch:
        backbone = reinitialize(backbone)
    backbone = with_dropout(backbone, **(cfg.get("backbone") or {}))
    datamodule = build_datamodule(
        task,
        tokenizer,
        dict(cfg.datamodule),
        cfg.seed,
        siamese=reads_pairs_apart(cfg, task, backbone.config.d_model),
        family=family,
    )
    length = datamodule.sequence_length
    if cfg.from_scratch:  # every position starts random; this run trains up to `length`
        trained = length
    else:
        warn_untrained_positions(length, pretrained.trained_seq_len, source.argument)
        trained = (
            None if pretrained.trained_seq_len is None else max(pretrained.trained_seq_len, length)
        )
    datamodule.setup("fit")
    return Start(backbone, tokenizer, family, datamodule, trained)


def build_module(
    cfg: DictConfig, task: TaskSpec, start: Start
) -> tuple[TaskModule, HeadSpec, float]:
    """The task module (the head on the backbone, an alignment head fitted), its head and the
    peak learning rate."""
    width = start.backbone.config.d_model
    head = head_spec(cfg, task, start.datamodule, width, start.tokenizer)
    optimizer, lr = optimizer_factory(cfg, start.backbone.config)
    module = TaskModule(
        build_head(start.backbone, head),
        head,
        start.datamodule.eval_splits,
        optimizer,
        instantiate(cfg.schedule),
    )
    if head.pair_score == "alignment":
        fit_alignment_head(module.model, start.datamodule, task)
    return module, head, lr


def with_resolved_epochs(cfg: DictConfig, config: ModelConfig) -> tuple[DictConfig, int]:
    """`trainer.max_epochs`, null resolved to the width's default and recorded as resolved
    (checkpoint, loggers)."""
    epochs = cfg.trainer.max_epochs
    if epochs is None:
        epochs = default_epochs(config)
        cfg = OmegaConf.merge(cfg, {"trainer": {"max_epochs": epochs}})
    return cfg, epochs


def best_checkpoint_callback(run_dir: Path, module: TaskModule) -> ModelCheckpoint:
    """`checkpoints/best.ckpt` by the task's main metric (and `last.ckpt`)."""
    return ModelCheckpoint(
        dirpath=run_dir / CHECKPOINT_DIR,
        filename="best",
        monitor=module.main_metric_key,
        mode="max",
        save_top_k=1,
        save_last=True,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )


def build_trainer(
    cfg: DictConfig,
    run_dir: Path,
    task: TaskSpec,
    source: CheckpointSource,
    start: Start,
    best: ModelCheckpoint,
) -> L.Trainer:
    config = OmegaConf.to_container(cfg, resolve=True)
    # fine-tunes of a checkpoint join its wandb project and group
    pretraining = source.record.wandb
    loggers = build_loggers(
        cfg,
        run_dir,
        project=pretraining.get("project"),
        group=pretraining.get("group") or Path(source.argument).name,
        name=f"{task.name}-{run_dir.name}",
        job_type="finetune",
    )
    trained = start.trained_seq_len
    return instantiate(
        cfg.trainer,
        precision=cfg.trainer.precision or best_precision(),
        logger=loggers or False,
        callbacks=[
            CheckpointExtras(start.tokenizer, config, trained_seq_len=lambda steps: trained),
            best,
            *progress_bar(cfg.trainer),
        ],
        plugins=[AtomicCheckpointIO()],
    )


def record_start(
    trainer: L.Trainer,
    cfg: DictConfig,
    run_dir: Path,
    task: TaskSpec,
    module: TaskModule,
    start: Start,
) -> None:
    """On the first process: the run folder, its labels and the loggers' run start."""
    if not trainer.is_global_zero:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    save_labels(run_dir / "labels.json", start.datamodule.label_map)
    log_run_start(
        trainer.loggers,
        cfg,
        parameters=sum(p.numel() for p in module.parameters()),
        tokenizer_fingerprint=tokenizer_fingerprint(start.tokenizer),
        task=task.name,
    )


def announce_run(
    cfg: DictConfig,
    task: TaskSpec,
    source: CheckpointSource,
    start: Start,
    lr: float,
    epochs: int,
    run_dir: Path,
) -> None:
    named = source.argument
    origin = f"random init ({start.family} as in {named})" if cfg.from_scratch else named
    datamodule = start.datamodule
    print(
        f"fine-tuning {start.family} ({origin}) on {task.name}: "
        f"{len(datamodule.examples(task.train_split)):,} training examples, "
        f"eval on {', '.join(datamodule.eval_splits)}; lr {lr:g}, {epochs} epochs; "
        f"run folder {run_dir}"
    )


def score_best(
    trainer: L.Trainer,
    module: TaskModule,
    best: ModelCheckpoint,
    cfg: DictConfig,
    task: TaskSpec,
    source: CheckpointSource,
    head: HeadSpec,
    lr: float,
    datamodule: FinetuneDataModule,
) -> FinetuneResults:
    """The results: the final metrics, and the best checkpoint's, scored again with its
    weights loaded (the file read once: weights, epoch and step)."""
    final = split_metrics(trainer.callback_metrics, datamodule.eval_splits)
    best_path = best.best_model_path or best.last_model_path
    best_checkpoint = read_checkpoint(best_path)
    module.load_state_dict(best_checkpoint["state_dict"])
    loggers, trainer.loggers = trainer.loggers, []  # the history already holds these values
    scores = trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.loggers = loggers
    return FinetuneResults(
        task=task.name,
        seed=cfg.seed,
        lr=lr,
        init="random" if cfg.from_scratch else source.argument,
        backbone=source.argument,
        main_metric=head.metrics[0],
        main_split=datamodule.eval_splits[0],
        overrides=command_overrides(),
        best=BestCheckpoint(
            # numbered from 1, as every logger numbers them (pipeline.training.loggers.numbered_from_one)
            epoch=int(best_checkpoint.get("epoch", 0)) + 1,
            step=int(best_checkpoint.get("global_step", 0)),
            checkpoint=str(best_path),
            metrics=split_metrics(merge(scores), datamodule.eval_splits),
        ),
        final=FinalScores(step=trainer.global_step, metrics=final),
    )


def record_results(
    trainer: L.Trainer, results: FinetuneResults, run_dir: Path, announce: bool
) -> None:
    """results.json, the loggers' results table and run end, and (announced) the summary."""
    results.write(run_dir / RESULTS)
    rows = [
        [results.task, split, name, value, results.seed, results.lr, results.init]
        for split, values in results.best.metrics.items()
        for name, value in values.items()
    ]
    columns = ["task", "split", "metric", "value", "seed", "lr", "init"]
    log_table(trainer.loggers, "results", columns, rows)
    tracking = log_run_end(trainer.loggers, results=str(run_dir / RESULTS))
    if announce:
        print_finetune_summary(results, run_dir, tracking)


def merge(results: list[dict[str, float]]) -> dict[str, float]:
    """`trainer.validate` returns one dict per dataloader (with shared keys); one dict."""
    merged: dict[str, float] = {}
    for entry in results:
        merged.update(entry)
    return merged


def split_metrics(logged: dict[str, Any], splits: list[str]) -> dict[str, dict[str, float]]:
    """{split: {metric: value}} from logged `val/<split>/<metric>` keys (Lightning appends
    `/dataloader_idx_<i>` to keys logged under a dataloader; those are folded back)."""
    out: dict[str, dict[str, float]] = {split: {} for split in splits}
    for key, value in logged.items():
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] == "val" and parts[1] in out:
            out[parts[1]][parts[2]] = float(value)
    return out


def print_finetune_summary(
    results: FinetuneResults, run_dir: Path, tracking: dict[str, str] | None = None
) -> None:
    best = results.best
    print(
        f"\nbest at epoch {best.epoch} (step {best.step}), chosen by "
        f"{results.main_split} {results.main_metric}:"
    )
    for split, metrics in best.metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "loss")
        print(f"  {split:<15} {shown}")
    print(f"  results     {run_dir / RESULTS}")
    print(f"  checkpoint  {best.checkpoint}")
    for name, where in (tracking or {}).items():
        print(f"  {name:<11} {where}")
    print(f"next: {shlex.join(['make', 'evaluate', f'ckpt={run_dir}'])}")
    print(
        f"      {shlex.join(['make', 'predict', f'ckpt={run_dir}'])}"
        "   (the task's test split, or predict.file=PATH)"
    )

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
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks import LabelMap, TaskSpec, save_labels
from models.config import ModelConfig
from models.heads import PAIR_SCORES, POOLINGS, SequenceClassifier, default_pair_score
from pipeline.checkpoint.head import HeadSpec, build_head
from pipeline.checkpoint.load import load_backbone
from pipeline.checkpoint.saving import AtomicCheckpointIO, CheckpointExtras
from pipeline.checkpoint.source import CheckpointSource, read_checkpoint, resolve_checkpoint
from pipeline.finetune.baselines import fit_linear
from pipeline.finetune.results import BestCheckpoint, FinalScores, FinetuneResults
from pipeline.finetune.task_module import TaskModule, reinitialize, with_dropout
from pipeline.run.config_keys import (
    OPTIMIZER_ARGUMENTS,
    SCHEDULE_ARGUMENTS,
    TRAINER_ARGUMENTS,
    check_keys,
    check_seed,
)
from pipeline.run.errors import ConfigError
from pipeline.run.families import family_named
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
from tokenizer import special_ids

log = logging.getLogger(__name__)


# Widths up to this are the mini and tiny BERTs (and GPT mini): their own fine-tuning defaults.
MINI_WIDTH = 256


def default_lr(config: ModelConfig) -> float:
    """The fine-tuning learning rate when `optim.lr` is null, by model width: 2e-5 for large,
    3e-5 for base (the BERT paper's grid is 2e-5..5e-5), 5e-5 for small/medium and 1e-4 for
    mini/tiny models (Turc et al. 2019 found the small BERTs want the top of 3e-5..1e-4)."""
    width = config.d_model
    if width <= MINI_WIDTH:
        return 1e-4
    if width <= 512:
        return 5e-5
    if width <= 768:
        return 3e-5
    return 2e-5


def default_epochs(config: ModelConfig) -> int:
    """The fine-tuning epochs when `trainer.max_epochs` is null, by model width: 10 for
    mini/tiny models, whose 3-epoch fine-tunes stopped before they had learned the quick suite's
    2,000-example tasks (README, "Fine-tuning settings for mini widths": 3 seeds of the quick
    suite on a 20-minute BERT mini), and the BERT paper's 3 for wider ones."""
    return 10 if config.d_model <= MINI_WIDTH else 3


# The settings read one by one from the `head` node (`head_spec`).
HEAD_KEYS = ("dropout", "pooling", "siamese", "pair_score")
# What `build_datamodule` passes to the datamodule besides the `datamodule` settings.
DATAMODULE_ARGUMENTS = ("task", "tokenizer", "seed", "label_map", "predict_task", "siamese")


def check_finetune_keys(cfg: DictConfig) -> None:
    """Every key of the nodes that a fine-tuning run builds its parts from is one that their
    constructor takes (`pipeline.run.config_keys.check_keys`): a misspelled `+optim.lrr=1` is a
    `ConfigError` before anything is loaded or trained (the task: `task_from`)."""
    check_keys("optim", cfg.optim, supplied=OPTIMIZER_ARGUMENTS)
    check_keys("schedule", cfg.schedule, supplied=SCHEDULE_ARGUMENTS)
    check_keys("trainer", cfg.trainer, supplied=TRAINER_ARGUMENTS)
    check_datamodule_keys(cfg)
    check_keys("head", cfg.get("head"), accepted=HEAD_KEYS)
    check_keys("logger", cfg.get("logger"))
    check_seed(cfg.seed)
    dropout = OmegaConf.select(cfg, "head.dropout")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(f"head.dropout={dropout!r}: use a number in [0, 1), e.g. 0.1")


def check_datamodule_keys(cfg: DictConfig) -> None:
    check_keys("datamodule", cfg.datamodule, FinetuneDataModule, supplied=DATAMODULE_ARGUMENTS)


def optimizer_factory(cfg: DictConfig, config: ModelConfig):
    lr = cfg.optim.lr if cfg.optim.get("lr") is not None else default_lr(config)
    return instantiate(cfg.optim, lr=lr), lr


def check_fits(max_seq_len: int, config: ModelConfig) -> None:
    """Sequences must fit the model's positions (BERT's learned ones, GPT's trained context)."""
    if max_seq_len > config.max_seq_len:
        raise ConfigError(
            f"datamodule.max_seq_len={max_seq_len} exceeds the model's {config.max_seq_len} "
            f"positions; use datamodule.max_seq_len={config.max_seq_len} or less"
        )


def warn_untrained_positions(sequence_length: int, trained: int | None, source: object) -> None:
    """Warn when batches reach positions the model was never trained at (`trained`, recorded
    in its checkpoint; None, e.g. an HF folder: unknown, no warning)."""
    if trained is not None and sequence_length > trained:
        log.warning(
            "sequences of up to %d tokens, but %s was trained on at most %d: positions %d-%d "
            "start untrained; use datamodule.max_seq_len=%d (long texts: sliding windows, "
            "task=imdb_long) unless you mean to train them now",
            sequence_length,
            source,
            trained,
            trained,
            sequence_length - 1,
            trained,
        )


def task_from(node: DictConfig | None) -> TaskSpec:
    """The `TaskSpec` of a `task` config node; a bad setting is a one-line `ConfigError`."""
    if node is None:
        raise ConfigError("no task: choose one with task=<name> (conf/task/), e.g. task=sst2")
    plain = OmegaConf.create(OmegaConf.to_container(node, resolve=False))  # keys from `task`
    missing = sorted(f"task.{key}" for key in OmegaConf.missing_keys(plain))
    if missing:
        name = OmegaConf.select(node, "name", default="task")
        raise ConfigError(
            f"task {name}: required value(s) not set: {', '.join(missing)}; give them on the "
            f"command line (conf/task/{name}.yaml shows how)"
        )
    check_keys("task", node)
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError):  # TaskDataError, LongTextSpec's checks
            raise ConfigError(str(cause)) from cause
        if isinstance(cause, TypeError):  # a misspelled task.* key (TaskSpec has no such field)
            raise ConfigError(
                f"task: {cause}; check the field names under task (conf/task/custom.yaml lists "
                "them all)"
            ) from cause
        raise


def build_datamodule(
    task: TaskSpec,
    tokenizer,
    settings: dict[str, Any],
    seed: int,
    *,
    label_map: LabelMap | None = None,
    predict_task: TaskSpec | None = None,
    siamese: bool = False,
    family: str,
) -> FinetuneDataModule:
    """The task's datamodule with the `datamodule` settings of the config, its texts put in
    the model family's input template; `siamese`: a pair task's texts encoded apart, for a
    siamese head."""
    return FinetuneDataModule(
        task,
        tokenizer,
        seed=seed,
        label_map=label_map,
        predict_task=predict_task,
        siamese=siamese,
        template=family_named(family).input_template,
        **settings,
    )


# Widths up to this (BERT mini and tiny) read pair tasks with a siamese head by default: in a
# one-seed screen of a 20-minute BERT mini (README, "Is the pretrained model any good?") it beat
# the cross-encoder on STS-B, MRPC and RTE, pretrained and from scratch.
SIAMESE_UP_TO_WIDTH = MINI_WIDTH


def head_spec(
    cfg: DictConfig,
    task: TaskSpec,
    datamodule: FinetuneDataModule,
    width: int,
    tokenizer: Tokenizer,
) -> HeadSpec:
    """The head of `cfg.head` for `task` on a backbone of `width` (`reads_pairs_apart`), with
    the labels and regression target of the datamodule's training split. `head.pooling`
    null: mean pooling for pairs read apart, the model's own features otherwise;
    `head.pair_score` null: for a pair read apart, the cosine score for a regression and the
    alignment score for classes; the features otherwise."""
    aggregate = None
    if task.long_text is not None and task.long_text.mode == "window":
        aggregate = task.long_text.aggregate
    pooling = cfg.head.get("pooling")
    if pooling not in POOLINGS:
        raise ConfigError(f"head.pooling={pooling!r} is not known; use head.pooling=null or mean")
    siamese = reads_pairs_apart(cfg, task, width)
    regression = task.is_regression
    pair_score = cfg.head.get("pair_score")
    if pair_score is None:
        pair_score = default_pair_score(regression) if siamese else "features"
    if pair_score not in PAIR_SCORES:
        raise ConfigError(
            f"head.pair_score={pair_score!r} is not known; use head.pair_score=null, features, "
            "cosine or alignment"
        )
    if pair_score == "alignment" and not siamese:
        raise ConfigError(
            f"head.pair_score=alignment compares two texts read apart; task {task.name} is "
            f"{'read as one sequence' if task.is_pair else 'not a pair task'}: use "
            "head.pair_score=null" + (" or head.siamese=true" if task.is_pair else "")
        )
    if pair_score == "cosine" and not (siamese and regression):
        raise ConfigError(
            f"head.pair_score=cosine scores a regression pair read apart; task {task.name} "
            f"is {'not a regression' if not regression else 'not read apart'}: use "
            "head.pair_score=null"
        )
    return HeadSpec(
        task.name,
        datamodule.label_map,
        tuple(task.ordered_metrics),
        aggregate,
        cfg.head.dropout,
        pooling="mean" if pooling is None and siamese else pooling,
        siamese=siamese,
        pair_score=pair_score,
        target=datamodule.regression_target(),
        special_ids=special_ids(tokenizer).ordered(),
    )


ALIGNMENT_FIT_EXAMPLES = 4000  # the head's fit before training reads at most this many


@torch.no_grad()
def fit_alignment_head(
    model: SequenceClassifier, datamodule: FinetuneDataModule, task: TaskSpec
) -> None:
    """Fit an alignment head's linear layer (`models.heads`, pair_score="alignment") on the
    frozen model's alignment scores of the training examples (all, or a fixed random sample
    of `ALIGNMENT_FIT_EXAMPLES`), before the first step: logistic regression for
    classes, ridge regression on the standardized targets for a regression
    (`pipeline.finetune.baselines.fit_linear`). Every process of a multi-process run computes the same
    fit from the same examples (before the processes meet; DDP then starts them all from the
    first one's weights)."""
    training = model.training
    model.eval()
    scores, labels = [], []
    try:
        for batch in datamodule.eval_loader(task.train_split, sample=ALIGNMENT_FIT_EXAMPLES):
            scores.append(
                model.alignment_scores(
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    token_type_ids=batch.get("token_type_ids"),
                ).cpu()
            )
            labels.append(batch["labels"])
    finally:
        model.train(training)
    x, y = torch.cat(scores), torch.cat(labels)
    mean, std = x.mean(0), x.std(0).nan_to_num(1.0).clamp_min(1e-6)  # one example: no spread
    regression = model.n_outputs == 1
    if regression:
        y = (y.float() - model.target_mean) / model.target_std
    with torch.enable_grad():
        weight, bias = fit_linear((x - mean) / std, y, 1 if regression else model.n_outputs)
    model.fit_alignment(mean, std, weight.detach(), bias.detach())


def reads_pairs_apart(cfg: DictConfig, task: TaskSpec, width: int) -> bool:
    """Whether the task's texts are encoded apart: a pair task with `head.siamese` true, or
    null and a backbone no wider than `SIAMESE_UP_TO_WIDTH`."""
    siamese = cfg.head.get("siamese")
    if siamese is None:
        siamese = width <= SIAMESE_UP_TO_WIDTH
    return bool(siamese) and task.is_pair


# --- make finetune -------------------------------------------------------------------------------


def finetune(
    cfg: DictConfig, source: CheckpointSource | None = None, *, announce: bool = True
) -> FinetuneResults:
    """Train on the task, evaluate, write results.json; returns the results.

    `source`: `cfg.ckpt` already read (`resolve_checkpoint`), for a caller that fine-tunes
    the same checkpoint many times (`make glue`); None reads it here. `announce`: print what
    is fine-tuned before, and the best scores, files and next commands after (a caller that
    runs many, `make glue`, prints one line of its own per run instead)."""
    if cfg.get("ckpt") is None:
        raise ConfigError(
            "ckpt is not set: give the pretrained model, e.g. ckpt=outputs/bert/<run> (a run "
            "folder, a *.ckpt or an HF folder); with from_scratch=true only its architecture "
            "and tokenizer are used"
        )
    check_finetune_keys(cfg)
    run_dir = Path(cfg.paths.output_dir)
    refuse_overwrite("finetune", run_dir)
    task = task_from(cfg.get("task"))
    L.seed_everything(cfg.seed, workers=True)
    # resolved and read once; below, only `source` names the checkpoint
    source = source or resolve_checkpoint(cfg.ckpt)
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
    head = head_spec(cfg, task, datamodule, backbone.config.d_model, tokenizer)
    optimizer, lr = optimizer_factory(cfg, backbone.config)
    module = TaskModule(
        build_head(backbone, head),
        head,
        datamodule.eval_splits,
        optimizer,
        instantiate(cfg.schedule),
    )
    if head.pair_score == "alignment":
        fit_alignment_head(module.model, datamodule, task)
    checkpoint = ModelCheckpoint(
        dirpath=run_dir / CHECKPOINT_DIR,
        filename="best",
        monitor=module.main_metric_key,
        mode="max",
        save_top_k=1,
        save_last=True,
        auto_insert_metric_name=False,
        enable_version_counter=False,
    )
    epochs = cfg.trainer.max_epochs
    if epochs is None:  # the width's default, recorded as resolved (checkpoint, loggers)
        epochs = default_epochs(backbone.config)
        cfg = OmegaConf.merge(cfg, {"trainer": {"max_epochs": epochs}})
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
    trainer = instantiate(
        cfg.trainer,
        precision=cfg.trainer.precision or best_precision(),
        logger=loggers or False,
        callbacks=[
            CheckpointExtras(tokenizer, config, trained_seq_len=lambda steps: trained),
            checkpoint,
            *progress_bar(cfg.trainer),
        ],
        plugins=[AtomicCheckpointIO()],
    )
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_labels(run_dir / "labels.json", datamodule.label_map)
        log_run_start(
            trainer.loggers,
            cfg,
            parameters=sum(p.numel() for p in module.parameters()),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
            task=task.name,
        )
    if trainer.is_global_zero and announce:
        named = source.argument
        origin = f"random init ({family} as in {named})" if cfg.from_scratch else named
        print(
            f"fine-tuning {family} ({origin}) on {task.name}: "
            f"{len(datamodule.examples(task.train_split)):,} training examples, "
            f"eval on {', '.join(datamodule.eval_splits)}; lr {lr:g}, {epochs} epochs; "
            f"run folder {run_dir}"
        )
    trainer.fit(module, datamodule=datamodule)
    final = split_metrics(trainer.callback_metrics, datamodule.eval_splits)
    best_path = checkpoint.best_model_path or checkpoint.last_model_path
    best_checkpoint = read_checkpoint(best_path)  # once: its weights, epoch and step
    module.load_state_dict(best_checkpoint["state_dict"])
    loggers, trainer.loggers = trainer.loggers, []  # the history already holds these values
    best = trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.loggers = loggers
    results = FinetuneResults(
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
            metrics=split_metrics(merge(best), datamodule.eval_splits),
        ),
        final=FinalScores(step=trainer.global_step, metrics=final),
    )
    if trainer.is_global_zero:
        results.write(run_dir / RESULTS)
        rows = [
            [task.name, split, name, value, cfg.seed, lr, results.init]
            for split, values in results.best.metrics.items()
            for name, value in values.items()
        ]
        columns = ["task", "split", "metric", "value", "seed", "lr", "init"]
        log_table(trainer.loggers, "results", columns, rows)
        tracking = log_run_end(trainer.loggers, results=str(run_dir / RESULTS))
        if announce:
            print_finetune_summary(results, run_dir, tracking)
    return results


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

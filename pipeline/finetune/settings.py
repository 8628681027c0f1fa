"""What a fine-tuning run is made of, chosen from its config and the pretrained model before
anything trains: the checked keys, the task, its datamodule (in the family's input template),
the head (siamese or joint pairs, pooling, pair score, fitted alignment), the optimizer, and the
defaults that follow the model's width (learning rate, epochs). `make finetune`, `make
evaluate` and `make glue` share them."""

from __future__ import annotations

import logging
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks.labels import LabelMap
from datamodules.tasks.spec import TaskSpec
from models.config import ModelConfig
from models.heads import PAIR_SCORES, POOLINGS, SequenceClassifier, default_pair_score
from pipeline.checkpoint.head import HeadSpec
from pipeline.finetune.baselines import fit_linear
from pipeline.run.config_keys import (
    OPTIMIZER_ARGUMENTS,
    SCHEDULE_ARGUMENTS,
    TRAINER_ARGUMENTS,
    check_keys,
    check_seed,
)
from pipeline.run.errors import ConfigError
from pipeline.run.families import family_named
from pipeline.training.optim import check_optimizer_values
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
    2,000-example tasks (docs/results/quick-suite.md, "Fine-tuning settings for mini widths": 3 seeds of the quick
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
    check_optimizer_values(cfg.optim, lr_by_default=True)
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
# one-seed screen of a 20-minute BERT mini (docs/results/quick-suite.md, "Head settings for mini widths") it beat
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

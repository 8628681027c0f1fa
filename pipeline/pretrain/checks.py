"""Check a composed run config before any work starts, and build its parts.

Every component config is instantiated here, so a wrong value fails in a fraction of a second with
a message that names the config key; nothing has been trained, tokenized or written yet.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT, which the checks ask for)
from datamodules.corpora.corpus import CorpusError
from datamodules.corpora.mixture import source_keys
from datamodules.objectives.objective import Objective, longest_seq_len, phase_plan
from datamodules.pretrain import PretrainDataModule
from datamodules.streaming.loader import streaming_refusal
from models.config import ModelConfig
from pipeline.pretrain.budget import RunLength
from pipeline.pretrain.corpus_init import OUTPUT_BIAS_CHOICES
from pipeline.run.config_keys import (
    OPTIMIZER_ARGUMENTS,
    SCHEDULE_ARGUMENTS,
    TRAINER_ARGUMENTS,
    check_keys,
    check_run_name,
    check_seed,
)
from pipeline.run.errors import ConfigError, UnknownFamilyError
from pipeline.run.families import Family, family_of_config, family_of_target
from pipeline.run.launcher import GroupChoices
from pipeline.run.recipes import (
    ADAMW,
    MUON,
    optimizer_option,
    recipe_optimizer,
    recipe_with,
    recipes_of,
)
from pipeline.training.optim import check_optimizer_values
from pipeline.training.schedules import resolve_warmup
from tokenizer import TokenizerSpec

log = logging.getLogger(__name__)

# The longest position table allowed, as a multiple of the trained sequence length (BERT: 512/128).
UNTRAINED_POSITIONS_RATIO = 4
PRECISIONS = (None, "32", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


@dataclass
class RunPlan:
    """The checked parts of a pretraining run."""

    family: str
    model: ModelConfig
    tokenizer: TokenizerSpec
    objective: Objective
    corpus: Any
    length: RunLength  # trainer.max_steps and trainer.budget, parsed once


def build(key: str, node: DictConfig, **kwargs: Any) -> Any:
    """Instantiate config node `key`, turning a constructor's complaint into a ConfigError."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, CorpusError)):
            raise ConfigError(_nested(key, node, err, str(cause))) from cause
        if isinstance(cause, TypeError):  # an unknown or misspelled field
            raise ConfigError(f"{key}: {cause}; check the field names under {key}.") from cause
        raise ConfigError(f"{key}: cannot build {node.get('_target_')}: {err}") from err


def _nested(key: str, node: DictConfig, err: InstantiationException, message: str) -> str:
    """`message`, the complaint of a corpus nested in the `data` node (a mixture's source,
    at `data.sources.<name>`), with its hints' keys moved under that node (`source_keys`):
    Hydra names the node that failed in its error (`full_key`)."""
    failed = re.search(r"^full_key: (\S+)$", str(err), re.MULTILINE)
    if key != "data" or failed is None or not failed[1].startswith("data."):
        return message
    inner = OmegaConf.select(node, failed[1].removeprefix("data."))
    settings = [k for k in inner if not k.startswith("_")] if isinstance(inner, DictConfig) else []
    return source_keys(message, failed[1], settings)


def check_config(cfg: DictConfig, choices: GroupChoices | None = None) -> RunPlan:
    """Validate a composed pretraining config and build its parts. `choices` (the option of each
    config group, `pipeline.run.launcher.group_choices`) lets an error name the option to change.

    Raises:
        ConfigError: a missing required value, an invalid value, or parts that do not fit
            together (e.g. a BERT model with a BPE tokenizer).
    """
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
    if missing:
        raise ConfigError(
            f"required config value(s) not set: {', '.join(missing)}; give them on the command "
            f"line, e.g. make pretrain data=text_files data.paths='corpus/*.txt'"
        )
    _check_recipe(cfg.get("recipe"), cfg.model.get("_target_"))
    _check_setting_keys(cfg)
    model = build("model", cfg.model)
    tokenizer = build("tokenizer", cfg.tokenizer)
    objective = build("objective", cfg.objective)
    try:
        family = family_of_config(model)
    except UnknownFamilyError as err:
        raise ConfigError(f"model: {err}") from err
    if tokenizer.kind != family.tokenizer_kind:
        raise ConfigError(
            f"tokenizer.kind={tokenizer.kind!r} does not fit a {family.name} model, which needs "
            f"{family.tokenizer_kind!r}; drop the tokenizer override or choose "
            f"tokenizer={family.tokenizer_kind}"
        )
    if not isinstance(objective, family.objective_class):
        raise ConfigError(
            f"objective {type(objective).__name__} does not fit a {family.name} model; drop the "
            "objective override (model=... selects the matching objective)"
        )
    _check_phases(objective, model.max_seq_len, cfg.trainer)
    check_optimizer_values(cfg.optim)
    _check_muon(cfg.optim, cfg.trainer, family, cfg.get("recipe"), choices or GroupChoices())
    _check_probe(cfg.get("probe"), cfg.trainer)
    _check_word_vectors(cfg.get("word_vectors"), cfg.trainer)
    _check_output_bias(cfg.get("output_bias", "zeros"), family, cfg.trainer, cfg.get("recipe"))
    _check_trainer(cfg.trainer)
    length = _check_budget(cfg.trainer, cfg.schedule)
    _check_run(cfg)
    try:
        resolve_warmup(length.max_steps, cfg.schedule.warmup_steps, cfg.schedule.warmup_ratio)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    corpus = build("data", cfg.data)
    if cfg.datamodule.get("streaming") and (refusal := streaming_refusal(corpus, objective)):
        raise ConfigError(refusal)
    return RunPlan(family.name, model, tokenizer, objective, corpus, length)


# The settings read one by one from the `checkpoint` and `module` nodes of a pretraining config.
CHECKPOINT_KEYS = ("every_n_steps", "keep_last", "keep_best")
MODULE_KEYS = ("max_nonfinite_steps", "compile")
# What `pipeline.pretrain.run.build_datamodule` passes to the datamodule besides `datamodule.*`.
DATAMODULE_ARGUMENTS = (
    "corpus",
    "tokenizer",
    "objective",
    "cache_dir",
    "seed",
    "micro_batches",
    "max_steps",
)


def _check_recipe(recipe: DictConfig | None, model_target: str | None) -> None:
    """The recipe (conf/recipe/, whose `recipe.family` names the family it is for) fits the
    model: a GPT given `recipe=bert-fast` would otherwise fail on a BERT-only key
    (`model.attn_dropout`) or train with the other family's rates. Checked before the keys, from
    the model's `_target_`, so that this is the error named. A family with no recipe of its own
    (one registered outside the pipeline, built on another family's preset) may train with any."""
    if recipe is None or recipe.get("family") is None or not model_target:
        return
    family = family_of_target(model_target)
    if family is None or recipe.family == family.name:
        return
    own = recipes_of(family.name)
    if own:
        raise ConfigError(
            f"recipe={recipe.get('name')} is a recipe for {recipe.family} models, not for a "
            f"{family.name} model; choose one of its family's "
            f"({' or '.join(f'recipe={name}' for name in own)}, conf/recipe/) or drop the "
            "recipe override"
        )


def _check_setting_keys(cfg: DictConfig) -> None:
    """Every key of the nodes a pretraining run builds its parts from is one that their
    constructor takes (`check_keys`)."""
    for key in ("model", "tokenizer", "objective", "data", "logger"):
        check_keys(key, cfg.get(key))
    check_keys("optim", cfg.optim, supplied=OPTIMIZER_ARGUMENTS)
    check_keys("schedule", cfg.schedule, supplied=SCHEDULE_ARGUMENTS)
    check_keys(
        "trainer",
        cfg.trainer,
        supplied=(*TRAINER_ARGUMENTS, "reload_dataloaders_every_n_epochs"),
        extra=("budget",),
    )
    check_keys("datamodule", cfg.datamodule, PretrainDataModule, supplied=DATAMODULE_ARGUMENTS)
    check_keys("checkpoint", cfg.checkpoint, accepted=CHECKPOINT_KEYS)
    check_keys("module", cfg.module, accepted=MODULE_KEYS)
    check_keys("probe", cfg.get("probe"))  # its tasks


def _check_phases(objective: Objective, max_seq_len: int, trainer: DictConfig) -> None:
    """Every phase of the objective fits the model's positions and gets steps; phases split
    `trainer.max_steps`, which a time budget leaves open."""
    if objective.phases and trainer.get("budget") is not None:
        raise ConfigError(
            f"objective.phases split trainer.max_steps, but trainer.budget={trainer.budget} "
            "decides the steps as the run goes; give the run a step count "
            "(trainer.budget=null trainer.max_steps=N) or drop the phases (objective.phases=null)"
        )
    try:
        phases = phase_plan(objective, trainer.max_steps)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    for phase in phases:
        seq_len = phase.objective.seq_len
        if seq_len > max_seq_len:
            where = f"objective.phases[{phase.index}]" if objective.phases else "objective"
            raise ConfigError(
                f"{where}.seq_len={seq_len} exceeds model.max_seq_len={max_seq_len}; lower the "
                "first or raise the second"
            )
    _check_positions(max_seq_len, longest_seq_len(objective))


def _check_positions(max_seq_len: int, seq_len: int) -> None:
    """Warn about a position table far longer than the sequences trained: its rows past
    `seq_len` are parameters (BERT) or a context (GPT) that training never reaches.

    Up to `UNTRAINED_POSITIONS_RATIO` times the trained length passes quietly, as BERT's recipe
    builds a 512-position table and trains it at 128 tokens before a short 512-token phase (and
    `objective.seq_len=64` on a preset is a common small-budget choice); fine-tuning warns
    beyond the length trained, which checkpoints record.
    """
    if max_seq_len > UNTRAINED_POSITIONS_RATIO * seq_len:
        log.warning(
            "model.max_seq_len=%d is more than %dx the objective.seq_len=%d tokens trained: "
            "positions %d-%d will never be trained; set "
            "model.max_seq_len=%d, or train longer sequences with objective.seq_len=%d",
            max_seq_len,
            UNTRAINED_POSITIONS_RATIO,
            seq_len,
            seq_len,
            max_seq_len - 1,
            seq_len,
            max_seq_len,
        )


def _check_budget(trainer: DictConfig, schedule: DictConfig) -> RunLength:
    """The run's length, its budget parsed. A time budget paces the schedule
    (pipeline/pretrain/budget.py): it replaces `max_time`, and the warmup must be a fraction of
    the run, whose length in steps is not known in advance."""
    try:
        length = RunLength.of(trainer)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if length.budget_s is None:
        return length
    if trainer.max_time is not None:
        raise ConfigError(
            f"trainer.budget={trainer.budget} and trainer.max_time={trainer.max_time} are both "
            "set; keep one: the budget also stops the run at its deadline (trainer.max_time=null)"
        )
    if schedule.get("warmup_steps") is not None:
        raise ConfigError(
            f"schedule.warmup_steps={schedule.warmup_steps} is a step count, but a run with "
            "trainer.budget does not know its steps in advance; give the warmup as a fraction "
            "of the run: schedule.warmup_steps=null schedule.warmup_ratio=0.05"
        )
    return length


def _check_muon(
    optim: DictConfig,
    trainer: DictConfig,
    family: Family,
    recipe: DictConfig | None,
    choices: GroupChoices,
) -> None:
    """Muon orthogonalizes whole weight matrices, which FSDP shards (pipeline/training/muon.py).
    Where the run's `optim=` option was chosen apart from its recipe (typed, or an experiment's),
    another recipe would not remove Muon, so the fix names the AdamW option to put in its place."""
    if optim.get("_target_") != MUON:
        return
    if _shards_weights(trainer):
        adamw = optimizer_option(ADAMW, family.name)
        from_recipe = recipe is not None and not choices.apart_from(
            "optim", recipe_optimizer(recipe.get("name"))
        )
        instead = _fsdp_recipe(recipe, family) if from_recipe else None
        instead = instead or f"an AdamW optimizer (optim={adamw})"
        raise ConfigError(
            "Muon needs whole weight matrices, which trainer=fsdp shards; use "
            f"trainer=ddp, or with FSDP {instead}"
        )
    if optim.get("momentum", 0) < 0 or optim.get("momentum", 0) >= 1:
        raise ConfigError(f"optim.momentum must be in [0, 1), got {optim.momentum}")
    if optim.get("adjust_lr_fn") not in (None, "original", "match_rms_adamw"):
        raise ConfigError(
            f"optim.adjust_lr_fn={optim.adjust_lr_fn!r} is not one of match_rms_adamw (Muon's "
            "update at AdamW's RMS: the same lr works), original, or null"
        )


def _fsdp_recipe(recipe: DictConfig | None, family: Family) -> str | None:
    """The fix for a setting that FSDP refuses and that came with the run's recipe (Muon, the
    unigram bias of a fast recipe): the family's AdamW recipe, which has neither; None where the
    run's recipe is that one already (the setting was chosen apart from it)."""
    adamw = recipe_with(ADAMW, family.name)
    if recipe is None or adamw is None or recipe.get("name") == adamw:
        return None
    return f"the AdamW recipe (recipe={adamw})"


def _shards_weights(trainer: DictConfig) -> bool:
    """Whether the trainer's strategy is FSDP (each process holds a shard of every weight)."""
    strategy = trainer.get("strategy")
    return isinstance(strategy, DictConfig) and "fsdp" in str(strategy.get("_target_", ""))


def _refuse_sharded(trainer: DictConfig, setting: str, drop: str) -> None:
    """A ConfigError for `setting`, which needs whole weights on each process, under FSDP."""
    if _shards_weights(trainer):
        raise ConfigError(
            f"{setting} is not supported with trainer=fsdp (sharded weights); use trainer=ddp, "
            f"or {drop}"
        )


def _check_word_vectors(node: DictConfig | None, trainer: DictConfig) -> None:
    """Word vectors overwrite the whole embedding matrix on each process
    (pipeline/pretrain/word_vectors.py)."""
    if node is None:
        return
    _refuse_sharded(trainer, "word_vectors=ppmi", "drop it (word_vectors=null)")
    window = node.get("window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"word_vectors.window={window!r}: use a positive integer, e.g. 5")


def _check_output_bias(
    choice: object, family: Family, trainer: DictConfig, recipe: DictConfig | None
) -> None:
    """`output_bias=unigram` sets BERT's masked-LM bias, whole, on each process
    (pipeline/pretrain/corpus_init.py)."""
    if choice not in OUTPUT_BIAS_CHOICES:
        raise ConfigError(
            f"output_bias={choice!r}: use one of {', '.join(OUTPUT_BIAS_CHOICES)}, e.g. "
            "output_bias=unigram"
        )
    if choice == "zeros":
        return
    if not family.output_bias:
        raise ConfigError(
            f"output_bias={choice} needs an output bias, and a {family.name} model's output layer has "
            "none (the Llama layout); drop it (output_bias=zeros)"
        )
    if not _shards_weights(trainer):  # the hint below reads the recipe files: only when refusing
        return
    instead = _fsdp_recipe(recipe, family)
    drop = "drop it (output_bias=zeros)" + (f", or take {instead}" if instead else "")
    _refuse_sharded(trainer, f"output_bias={choice}", drop)


# How to run without the probes a command asked for (they are off unless `probe=` is given;
# Hydra refuses `probe=null` for a config group).
WITHOUT_PROBES = "drop probe=... from the command to run without probes"


def _check_probe(probe: DictConfig | None, trainer: DictConfig) -> None:
    """Probes run a forward pass of the whole model outside Lightning's loop (pipeline/pretrain/probe.py)."""
    if probe is None:
        return
    _refuse_sharded(trainer, "probe=...", WITHOUT_PROBES)
    if "blimp" in probe:
        for key, value in (
            ("every_n_steps", probe.get("every_n_steps")),
            ("blimp.pairs", probe.blimp.get("pairs")),
            ("blimp.batch_size", probe.blimp.get("batch_size")),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"probe.{key}={value!r}: use a positive integer")
        return
    if not probe.get("tasks"):
        raise ConfigError(f"probe.tasks is empty: name at least one task, or {WITHOUT_PROBES}")
    for key in ("every_n_steps", "train_examples", "dev_examples", "batch_size"):
        value = probe.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"probe.{key}={value!r}: use a positive integer")


def _check_run(cfg: DictConfig) -> None:
    """Checkpointing, the non-finite guard and resume."""
    at_least = {
        "checkpoint.every_n_steps": (cfg.checkpoint.every_n_steps, 1),
        "checkpoint.keep_last": (cfg.checkpoint.keep_last, 1),
        "checkpoint.keep_best": (cfg.checkpoint.keep_best, 0),
        "module.max_nonfinite_steps": (cfg.module.max_nonfinite_steps, 1),
    }
    for key, (value, low) in at_least.items():
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")
    check_seed(cfg.seed)
    check_run_name(cfg.run_name)
    if cfg.resume is not None and not str(cfg.resume):
        raise ConfigError("resume is empty; use resume=auto, a *.ckpt file or a run folder")


def _check_trainer(trainer: DictConfig) -> None:
    if not isinstance(trainer.max_steps, int) or trainer.max_steps <= 0:
        raise ConfigError(
            f"trainer.max_steps must be a positive integer (the schedule needs the run length), "
            f"got {trainer.max_steps}"
        )
    if trainer.accumulate_grad_batches < 1:
        raise ConfigError(
            f"trainer.accumulate_grad_batches must be >= 1, got {trainer.accumulate_grad_batches}"
        )
    interval = trainer.val_check_interval
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(
            f"trainer.val_check_interval must be a whole number of optimizer steps, got "
            f"{interval!r}; e.g. trainer.val_check_interval=100"
        )
    if isinstance(trainer.get("strategy"), DictConfig):  # a strategy factory (trainer=fsdp)
        build("trainer.strategy", trainer.strategy)
    precision = None if trainer.precision is None else str(trainer.precision)
    if precision not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={trainer.precision!r} is not one of "
            f"{[p for p in PRECISIONS if p]} (or null for the best on this hardware)"
        )

"""Pretraining a BERT or GPT on a corpus (the library behind `make pretrain`,
pipeline/commands/pretrain.py).

`train(cfg, plan)` gets the tokenizer (cached), builds the token store (cached), trains with
Lightning, checkpoints atomically, exports the final model in Hugging Face format and prints
where everything is; `assemble` builds the LightningModule, datamodule and Trainer of a run.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import math
import shlex
from datetime import timedelta
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from datamodules.objectives.objective import trained_seq_len
from datamodules.pretrain import PretrainDataModule
from models.hf import export_refusal, write_hf_export
from pipeline.checkpoint.interrupt import GracefulStop, signals_abort
from pipeline.checkpoint.load import Pretrained, load_pretrained
from pipeline.checkpoint.saving import (
    AtomicCheckpointIO,
    CheckpointExtras,
    best_checkpoint,
    check_compatible,
    checkpoint_callbacks,
)
from pipeline.checkpoint.source import CheckpointSource, resolve_resume
from pipeline.checkpoint.space import file_system
from pipeline.finetune.settings import task_from
from pipeline.pretrain.blimp_probe import BlimpProbe
from pipeline.pretrain.budget import RunLength, TimeBudget
from pipeline.pretrain.checks import WITHOUT_PROBES, RunPlan, build
from pipeline.pretrain.corpus_init import CorpusInit
from pipeline.pretrain.modules import PretrainModule
from pipeline.pretrain.passes import ManyPassesWarning
from pipeline.pretrain.probe import Probe, StepProbe
from pipeline.run.cli import make_command
from pipeline.run.errors import ConfigError, DiskFullError
from pipeline.run.families import family_named
from pipeline.run.folder import HF_DIR, LOG_DIR, attempt_record, first_process
from pipeline.run.launcher import (
    command_overrides,
    launcher_rank,
    override_key,
    relaunch_command,
)
from pipeline.training.callbacks import SourceProgress, Throughput, ValidateLastStep
from pipeline.training.loggers import (
    build_loggers,
    log_run_end,
    log_run_start,
    progress_bar,
    tokenizer_fingerprint,
)
from pipeline.training.precision import best_precision
from pipeline.training.strategies import PeerDirectory, peers_lost_as_error
from tokenizer import get_tokenizer, warn_if_short_vocabulary

log = logging.getLogger(__name__)

# How far above its lowest the run's last held-out language-model loss may end before the
# summary says the model got worse on held-out text (relative: 1% of the loss). Neighbouring
# validations of a run still learning differ by less; GPT mini's 10-minute runs on tiny
# Shakespeare (13 passes) ended 10-20% (AdamW) and 44-61% (Muon) above
# (docs/results/recipes.md).
HELD_OUT_ROSE_BY = 0.01


def trainer_arguments(trainer: DictConfig) -> dict:
    """The `trainer` config as Lightning's Trainer takes it (`budget` is the run's own)."""
    arguments = OmegaConf.to_container(trainer, resolve=True)
    arguments.pop("budget", None)
    return arguments


def build_trainer(
    cfg: DictConfig,
    run_dir: Path,
    extras: L.Callback,
    *,
    best_by: str,
    budget: TimeBudget | None = None,
    probe: StepProbe | None = None,
    corpus_init: CorpusInit | None = None,
    resumed: CheckpointSource | None = None,
) -> L.Trainer:
    """The Trainer of a run; `budget`: the callback that sizes a run with a time budget;
    `probe`: downstream probes; `corpus_init`: the weights a fresh run counts from its corpus
    (word vectors, output bias); `resumed`: the checkpoint the run resumes from, already read
    (Lightning gets its contents instead of reading the file again; its wandb run is
    continued, pipeline/training/loggers.py); `best_by`: the held-out figure the best
    checkpoints are kept by (`PretrainModule.held_out_figure`)."""
    resume_id = resumed.record.wandb.get("id") if resumed is not None else None
    accumulate = cfg.trainer.accumulate_grad_batches
    # optimizer steps -> the micro-batches Lightning counts
    val_every = cfg.trainer.val_check_interval * accumulate
    loggers = build_loggers(cfg, run_dir, job_type="pretrain", resume_id=resume_id)
    return instantiate(
        trainer_arguments(cfg.trainer),
        precision=cfg.trainer.precision or best_precision(),
        val_check_interval=val_every,
        # an objective phase ends its epoch at its last step; the next epoch's loader is the
        # next phase's (datamodules/pretrain.py)
        reload_dataloaders_every_n_epochs=1 if cfg.objective.get("phases") else 0,
        # a backstop: the budget's plan ends the run before it
        max_time=timedelta(seconds=budget.seconds) if budget else cfg.trainer.max_time,
        logger=loggers or False,
        callbacks=[
            Throughput(),
            SourceProgress(),
            extras,
            *([budget] if budget else []),
            ManyPassesWarning(budget),  # after the budget: it reads the budget's plan
            *([corpus_init] if corpus_init else []),
            *([probe] if probe else []),
            ValidateLastStep(),
            GracefulStop(),
            # names a lost process by rank and host (pipeline/training/strategies.py)
            PeerDirectory(OmegaConf.select(cfg, "trainer.strategy.timeout_s", default=None)),
            *progress_bar(cfg.trainer),
            *checkpoint_callbacks(run_dir, **cfg.checkpoint, best_by=best_by, resumed=resumed),
        ],
        plugins=[AtomicCheckpointIO(already_read=resumed)],
    )


def sized_model_config(plan: RunPlan, tokenizer: Tokenizer):
    """The run's model config with the vocabulary size its tokenizer needs."""
    return dataclasses.replace(
        plan.model,
        vocab_size=family_named(plan.family).model_vocab_size(tokenizer.get_vocab_size()),
    )


def build_datamodule(cfg: DictConfig, plan: RunPlan, tokenizer: Tokenizer) -> PretrainDataModule:
    """The run's datamodule: its corpus and objective, batches of whole optimizer steps, and
    the corpora of its extra validation sets (`datamodule.extra_validation`)."""
    options = dict(cfg.datamodule)
    extra = options.pop("extra_validation", None) or {}
    return PretrainDataModule(
        plan.corpus,
        tokenizer,
        plan.objective,
        cfg.paths.cache_dir,
        seed=cfg.seed,
        micro_batches=cfg.trainer.accumulate_grad_batches,
        max_steps=plan.length.max_steps,
        extra_validation={
            name: build(f"datamodule.extra_validation.{name}", node) for name, node in extra.items()
        },
        **options,
    )


def assemble(
    cfg: DictConfig,
    plan: RunPlan,
    tokenizer: Tokenizer,
    run_dir: Path,
    *,
    resumed: CheckpointSource | None = None,
) -> tuple[PretrainModule, PretrainDataModule, L.Trainer]:
    """The LightningModule, datamodule and Trainer of a run, as the config describes them
    (`resumed`: the checkpoint a resumed run continues, already read)."""
    model_config = sized_model_config(plan, tokenizer)
    datamodule = build_datamodule(cfg, plan, tokenizer)
    # a run with a time budget paces its schedule by the steps the budget holds
    length = plan.length
    pace = length.pace()
    module = family_named(plan.family).module_class(
        model_config,
        optimizer=instantiate(cfg.optim),
        scheduler=instantiate(cfg.schedule, pace=pace),
        max_nonfinite_steps=cfg.module.max_nonfinite_steps,
        schedule_steps=length.max_steps,
    )
    if cfg.module.compile:
        module.model.compile()  # in place: parameter names (and checkpoints) stay the same
    extras = CheckpointExtras(
        tokenizer,
        OmegaConf.to_container(cfg, resolve=True),
        trained_seq_len=functools.partial(trained_seq_len, datamodule.phases),
    )
    budget = TimeBudget(length.budget_s, pace) if pace is not None else None
    probe = build_probe(cfg.get("probe"), tokenizer, plan, run_dir)
    corpus_init = build_corpus_init(cfg) if resumed is None else None  # else the checkpoint's
    trainer = build_trainer(
        cfg,
        run_dir,
        extras,
        budget=budget,
        probe=probe,
        corpus_init=corpus_init,
        resumed=resumed,
        best_by=module.held_out_figure(),
    )
    return module, datamodule, trainer


def build_corpus_init(cfg: DictConfig) -> CorpusInit | None:
    """The weights a fresh run counts from its training documents (`word_vectors=ppmi`,
    `output_bias=unigram`, pipeline/pretrain/corpus_init.py); None when it counts none."""
    vectors = cfg.get("word_vectors")
    window = vectors.window if vectors is not None else None
    unigram_bias = cfg.get("output_bias", "zeros") == "unigram"
    return CorpusInit(window, unigram_bias) if window is not None or unigram_bias else None


def build_probe(
    node: DictConfig | None, tokenizer: Tokenizer, plan: RunPlan, run_dir: Path
) -> StepProbe | None:
    """The run's probes (`probe=glue`: linear probes of tasks; `probe=blimp`: zero-shot
    grammar), their data read (and encoded) now, so that a missing file stops the run before
    it trains; None without `probe`."""
    if node is None:
        return None
    try:
        if "blimp" in node:
            return BlimpProbe(
                plan.family,
                tokenizer,
                node.blimp.dir,
                run_dir / LOG_DIR,
                every_n_steps=node.every_n_steps,
                pairs=node.blimp.pairs,
                pll=node.blimp.pll,
                batch_size=node.blimp.batch_size,
            )
        return Probe(
            [task_from(task) for task in node.tasks.values()],
            tokenizer,
            seq_len=plan.objective.seq_len,
            every_n_steps=node.every_n_steps,
            train_examples=node.train_examples,
            dev_examples=node.dev_examples,
            batch_size=node.batch_size,
            template=family_named(plan.family).input_template,
        )
    except ValueError as err:  # TaskDataError (a missing file, a bad column), ConfigError
        raise ConfigError(f"probe: {err}; or {WITHOUT_PROBES}") from err


def resumed_tokenizer(resumed: CheckpointSource | None, cfg: DictConfig) -> Tokenizer | None:
    """The tokenizer a resumed checkpoint was trained with, when this run's tokenizer and data
    settings are those it records (else None: the run gets its tokenizer as a fresh one would,
    and `check_compatible` names any difference). Retraining it could differ: WordPiece
    training breaks ties differently between processes, and caches may have been cleared."""
    record = resumed.record if resumed is not None else None
    if record is None or record.tokenizer is None:
        return None
    ours = OmegaConf.to_container(cfg, resolve=True)
    if any(record.config.get(key) != ours.get(key) for key in ("tokenizer", "data")):
        return None
    log.info("resuming with the tokenizer stored in the checkpoint")
    return record.stored_tokenizer(resumed.path)


def train(cfg: DictConfig, plan: RunPlan) -> None:
    L.seed_everything(cfg.seed, workers=True)
    run_dir = Path(cfg.paths.output_dir)
    # read once: the compatibility checks below and Lightning's restore share its contents
    resumed = resolve_resume(cfg.resume, run_dir, first_process=first_process())
    resume_from = resumed.path if resumed is not None else None
    tokenizer = resumed_tokenizer(resumed, cfg)
    if tokenizer is None:
        tokenizer = get_tokenizer(
            plan.tokenizer, plan.corpus, cfg.paths.cache_dir, may_train=launcher_rank() == 0
        )
    elif first_process() and plan.tokenizer.path is None:  # trained for this run's settings
        warn_if_short_vocabulary(plan.tokenizer, tokenizer)
    if resumed is not None:
        model_config = sized_model_config(plan, tokenizer)
        check_compatible(resumed.contents, model_config, tokenizer, cfg.optim._target_)
        ended = ended_by(resumed, plan.length)
        if ended is not None:  # a finished run given resume= again
            refuse_another_runs_end(resumed, ended, run_dir)
            report_ended(resumed, ended, run_dir, plan.family)
            return
    module, datamodule, trainer = assemble(cfg, plan, tokenizer, run_dir, resumed=resumed)
    if first_process():
        # a corpus too small for the run fails here, before the run folder holds anything
        datamodule.check_documents(trainer.world_size)
    if trainer.is_global_zero:
        tokenizer.save(str(run_dir / "tokenizer.json"))
        log_run_start(
            trainer.loggers,
            cfg,
            parameters=module.parameter_count(),
            flops_per_token=module.flops_per_token,
            data_fingerprint=plan.corpus.fingerprint(),
            tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        )
        print(f"{plan.family} model, {module.parameter_count():,} parameters; run folder {run_dir}")
        if resumed is not None:
            print(f"resuming from {resumed.path} (step {resumed.contents['global_step']})")
    # A signal ends `fit` with `TrainingInterrupted` or `TrainingAborted`
    # (pipeline/checkpoint/interrupt.py), for the command.
    with signals_abort(), peers_lost_as_error(trainer):
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from, weights_only=True)
    if trainer.is_global_zero:
        # From the final checkpoint, which holds the whole model under any strategy (under
        # FSDP each process only holds a shard of `module.model`); the one resumed from when
        # the run trained no step.
        export_dir, exported = None, "none: the family has no Hugging Face mapping"
        if family_named(plan.family).hf_auto_class is not None:  # a family with an HF mapping
            last = Path(trainer.checkpoint_callback.last_model_path or resume_from)
            final = load_pretrained(last)
            refusal = export_refused(final)
            if refusal is None:
                export_dir = exported = run_dir / HF_DIR
                write_export(final, export_dir, last, trainer.global_step)
            else:
                exported = f"none: {refusal}"
        tracking = log_run_end(trainer.loggers, hf_export=str(exported))
        print_summary(trainer, run_dir, export_dir, plan.family, tracking)


def ended_by(resumed: CheckpointSource, length: RunLength) -> str | None:
    """What ended the run whose checkpoint `resumed` is, when it is the run's end (resuming it
    would train nothing): `trainer.max_steps`, or the last step its time budget planned; None
    when there is more to train."""
    step = int(resumed.contents.get("global_step", 0))
    if step >= length.max_steps:
        return f"trainer.max_steps={length.max_steps}"
    planned = TimeBudget.planned_end(resumed.contents) if length.budget_s is not None else None
    if planned is not None and step >= planned:
        return "the last step its trainer.budget planned"
    return None


def refuse_another_runs_end(resumed: CheckpointSource, ended: str, run_dir: Path) -> None:
    """Refuse `resume=` of another run's checkpoint that is at its run's end (`ended`, from
    `ended_by`) into `run_dir`: only a checkpoint in `run_dir` is this run's, which has then
    finished; the other is refused with the command that trains it further.

    Raises:
        ConfigError: the checkpoint is not in `run_dir`.
    """
    if resumed.path.resolve().is_relative_to(run_dir.resolve()):
        return
    step = int(resumed.contents.get("global_step", 0))
    further = [f"trainer.max_steps={2 * step}"]
    fix = "give a larger trainer.max_steps"
    if not ended.startswith("trainer.max_steps"):  # a time budget's end
        further.insert(0, "trainer.budget=null")
        fix = "resume it without a budget and with a larger trainer.max_steps"
    keys = {override_key(override) for override in further}
    overrides = [o for o in command_overrides() if override_key(o) not in keys]
    overrides += further
    command = make_command("pretrain", overrides)
    command = relaunch_command(command, "pipeline.commands.pretrain", overrides)
    raise ConfigError(
        f"resume={resumed.argument} is at step {step}, already at {ended}: there is nothing "
        f"to train into {run_dir}. To train it further, {fix}: {command}"
    )


def export_refused(final: Pretrained) -> str | None:
    """Why `final` has no HF twin to export to (a BERT with rotary positions or pre-norm
    blocks), also printed in one line that says the checkpoint holds the model; None when it
    has one."""
    refusal = export_refusal(final.model)
    if refusal is not None:
        print(f"no Hugging Face export: {refusal}")
    return refusal


def write_export(
    final: Pretrained, export: Path, checkpoint: Path, step: int, why: str = ""
) -> bool:
    """Write the HF export of `final` (loaded from `checkpoint`, at `step`) to `export` unless
    it holds it already (`write_hf_export`: whether it wrote); `why`: words on why it is
    written, for the error.

    Raises:
        DiskFullError: no space (or quota) left for it; `export` and the checkpoint are as
            they were.
    """
    try:
        return write_hf_export(final.model, export, tokenizer=final.tokenizer)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        reason = "the disk quota is used up" if err.errno == errno.EDQUOT else "no space left"
        raise DiskFullError(
            f"{reason} on {file_system(export.parent)} to write the Hugging Face export {export}"
            f"{why}; the checkpoint {checkpoint} (step {step}) is intact. Free space on that disk"
        ) from err


def report_ended(resumed: CheckpointSource, ended: str, run_dir: Path, family: str) -> None:
    """A finished run given `resume=` again: nothing is trained or overwritten; its HF export
    is written again when it does not hold the checkpoint's model (missing, or cut short by a
    kill during the end-of-run export), and one line says where everything is."""
    if not first_process():
        return
    step = resumed.contents["global_step"]
    places = f"checkpoint {resumed.path}"
    final = None
    if family_named(family).hf_auto_class is not None:  # a family with an HF mapping
        final = load_pretrained(resumed)
    if final is not None and export_refused(final) is None:
        export = run_dir / HF_DIR
        was = (
            "was missing"
            if not export.is_dir()
            else "did not match it, cut short or of an earlier step"
        )
        places += f", HF export {export}"
        why = f" again from the checkpoint (it {was})"
        if write_export(final, export, resumed.path, step, why):
            places += f" (written again from the checkpoint: it {was})"
    further = ""
    if ended.startswith("trainer.max_steps"):
        further = ". To train it further, give a larger trainer.max_steps with resume=auto"
    said = f"the run in {run_dir} has finished: step {step} ({ended}), nothing to train"
    print(f"{said}; {places}{further}")


def print_summary(
    trainer: L.Trainer,
    run_dir: Path,
    export_dir: Path | None,
    family: str,
    tracking: dict[str, str] | None = None,
) -> None:
    """Where everything is and what to run next; `tracking`: from `log_run_end` (the wandb
    run's URL, or the command that uploads an offline run)."""
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()) if k.startswith("val/"))
    last = trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else ""
    print(f"\nfinished {trainer.global_step} steps" + (f": {shown}" if shown else ""))
    places = {
        "checkpoint": Path(last) if last else None,
        "HF export": export_dir,
        "metrics": run_dir / LOG_DIR / "metrics.csv",
        "config": attempt_record(run_dir),
    }
    for label, path in places.items():
        if path is not None and path.exists():  # e.g. no metrics file when loggers are off
            print(f"  {label:<11} {path}")
    for label, value in (tracking or {}).items():
        print(f"  {label:<11} {value}")
    target, example = family_named(family).try_command
    print(f"next: {shlex.join(['make', target, f'ckpt={run_dir}', example])}")
    if export_dir is not None:
        print(f"      or load {export_dir} with transformers.{family_named(family).hf_auto_class}")
    if places["metrics"].exists():
        print(f"report: {shlex.join(['make', 'report', f'run={run_dir}'])}")
    rose = held_out_rise(trainer, metrics)
    if rose:
        print(f"\n{rose}")


def held_out_rise(trainer: L.Trainer, metrics: dict[str, float]) -> str | None:
    """What to say when the run's held-out figure (the one its best checkpoints are kept by,
    `PretrainModule.held_out_figure`) ended more than `HELD_OUT_ROSE_BY` above its lowest (the
    model memorized its training text, and `ckpt=<run>`, which loads the last checkpoint, is
    not the run's best model); None otherwise. `metrics`: the run's last logged values."""
    lowest = best_checkpoint(trainer)
    if lowest is None:
        return None
    last = metrics.get(lowest.figure)
    if last is None or not math.isfinite(last) or last <= lowest.score * (1 + HELD_OUT_ROSE_BY):
        return None
    shorter = "a shorter run (trainer.max_steps)"
    if lowest.step is not None:
        shorter = f"a run as long as its best: trainer.max_steps={lowest.step}"
    return (
        f"held-out loss ({lowest.figure}) rose {last / lowest.score - 1:.0%} above its lowest: "
        f"{lowest.score:.4g} at {lowest.path.name}, {last:.4g} at the end. The model has "
        f"memorized its training text since then, and ckpt=<run> loads the last checkpoint: "
        f"evaluate the best one with ckpt={lowest.path}. Next time, give it more text, "
        f"model.dropout=0.1, or {shorter}"
    )

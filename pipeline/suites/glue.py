"""`make glue`: a pretrained model against its from-scratch twin and non-neural baselines, on a
suite of fine-tuning tasks, over seeds.

    make glue ckpt=outputs/bert/<run>                      # suite=quick, seeds=3
    make glue ckpt=... suite=full seeds=[1,2,3,4,5]
    make glue ckpt=... tasks=[sst2,rte] datamodule.max_examples=64 trainer.max_epochs=1
    make glue ckpt=... jobs=2        # two fine-tunes at once (runners.py)

For every task of the suite (`conf/suite/*.yaml`: task config names, each with the fine-tuning
settings it needs, e.g. a cap on training examples) and every seed, it fine-tunes the checkpoint
(`pipeline.finetune.run.finetune`) and its twin: the same architecture, tokenizer and recipe with
random weights (`from_scratch=true`). Per task it also fits the non-neural baselines
(`pipeline.finetune.baselines`) on the same training examples. The suite folder
`outputs/glue/<run_name>/` holds one fine-tuning run folder per job,
`<task>/<pretrained|scratch>-seed<k>/`, each task's `baselines.json`, the suite's settings
(`glue_suite.json`) and its summary (`glue_summary.md` / `.json`).

A task's score is the mean of its metrics on its main dev split, as GLUE averages them (MRPC:
F1 and accuracy; STS-B: Pearson and Spearman), times 100; the suite's average is the mean over
tasks. The difference pretrained - scratch is paired over seeds, with a t interval.

A suite resumes: the same command with the same `run_name` (printed when a suite is cut short)
skips every job whose `results.json` exists, moves an unfinished job's folder aside to
`<job>.interrupted`, and refuses settings that differ from those the folder was started with
once one of its fine-tunes has finished.

On several devices (`trainer.devices=2 trainer.strategy=ddp`) every job is one DDP fine-tune.
Every process runs this loop; the first one alone checks and writes the suite's files and
prints. The others plan the same jobs: they read which are done before their first fine-tune,
and no job can finish before every process has joined it.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from datamodules.tasks.files import task_examples
from pipeline.checkpoint.load import load_backbone
from pipeline.checkpoint.source import resolve_checkpoint
from pipeline.finetune.baselines import baseline_scores
from pipeline.finetune.results import Baselines, FinetuneResults
from pipeline.finetune.settings import check_finetune_keys, task_from
from pipeline.finetune.task_module import with_dropout
from pipeline.run.errors import ConfigError, SuiteRecordError
from pipeline.run.folder import RESULTS, SUITE_RECORD, first_process
from pipeline.run.launcher import override_key
from pipeline.suites.record import SuiteRecord
from pipeline.suites.runners import InThisProcess, SideBySide, check_jobs
from pipeline.suites.summary import BASELINES, INITS, SCRATCH, Job, SuiteSummary, summarize_suite

log = logging.getLogger(__name__)


# --- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: its config name and the fine-tuning settings (dotted config key ->
    value) its jobs run with, unless the command line sets the same key."""

    name: str
    settings: dict[str, Any]


def seeds_of(value: Any) -> list[int]:
    """`seeds=3` -> [1, 2, 3]; `seeds=[1,5]` -> [1, 5].

    Raises:
        ConfigError: not a positive count or a list of distinct integers.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return list(range(1, value + 1))
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list | tuple) else None
    integers = items and all(isinstance(s, int) and not isinstance(s, bool) for s in items)
    if integers and len(set(items)) == len(items):
        return [int(s) for s in items]
    raise ConfigError(
        f"seeds={value!r}: give a count (seeds=3 runs seeds 1, 2, 3) or a list of distinct "
        "integers (seeds=[1,2,3])"
    )


def suite_tasks(cfg: DictConfig) -> list[SuiteTask]:
    """The tasks to run: `tasks=[...]` if given (each with the suite's settings for it, if it
    has any), else the suite's tasks in their order.

    Raises:
        ConfigError: no task, or a suite entry that is not a mapping of settings.
    """
    if "suite" in cfg and "tasks" not in cfg.suite:
        raise ConfigError(
            f"suite={cfg.suite.get('name')} is not a suite of fine-tuning tasks (make evaluate-lm "
            "runs it); choose suite=quick or suite=full"
        )
    listed = OmegaConf.to_container(cfg.suite.tasks, resolve=True) if "suite" in cfg else {}
    if not isinstance(listed, dict):
        raise ConfigError(
            "suite.tasks must map task config names to their settings, e.g. "
            "suite.tasks={sst2:{},rte:{}}"
        )
    chosen = cfg.get("tasks")
    if isinstance(chosen, str):  # tasks=sst2: one task
        chosen = [chosen]
    names = list(chosen) if chosen is not None else list(listed)
    if not names:
        raise ConfigError("no task to run: choose a suite (suite=quick) or tasks=[sst2,rte]")
    tasks = []
    for name in names:
        settings = listed.get(name) or {}
        if not isinstance(settings, dict):
            raise ConfigError(
                f"suite.tasks.{name} must be a mapping of settings (or {{}}), got {settings!r}"
            )
        tasks.append(SuiteTask(str(name), {str(k): v for k, v in settings.items()}))
    return tasks


def plan(tasks: Sequence[SuiteTask], seeds: Sequence[int]) -> list[Job]:
    """Every job, task by task (a suite cut short has whole tasks), pretrained before scratch."""
    return [Job(t.name, init, seed) for t in tasks for seed in seeds for init in INITS]


def job_config(
    cfg: DictConfig, task_node: DictConfig, task: SuiteTask, job: Job, folder: Path, given: set[str]
) -> DictConfig:
    """The `make finetune` config of one job: the suite's config with the task's node, its
    settings (except those the command line set: `given`), the job's seed and init."""
    job_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    OmegaConf.set_struct(job_cfg, False)
    for key in ("suite", "tasks", "seeds", "jobs"):
        job_cfg.pop(key, None)
    job_cfg.task = task_node
    for key, value in task.settings.items():
        if key not in given:
            OmegaConf.update(job_cfg, key, value, force_add=True)
    job_cfg.seed = job.seed
    job_cfg.from_scratch = job.init == SCRATCH
    job_cfg.paths.output_dir = str(folder)
    return job_cfg


# --- running ----------------------------------------------------------------------------------


def suite_record(
    cfg: DictConfig, ckpt: str, tasks: Sequence[SuiteTask], seeds: Sequence[int]
) -> SuiteRecord:
    """What a suite folder was started with (`ckpt`: the checkpoint argument as given); a
    resumed suite must match it."""
    return SuiteRecord(
        ckpt=ckpt,
        tasks={t.name: t.settings for t in tasks},
        seeds=list(seeds),
        finetune={
            key: OmegaConf.to_container(cfg[key], resolve=True)
            for key in ("datamodule", "head", "optim", "schedule")
        }
        | {"trainer": _trainer_record(cfg)}
        | _backbone_record(cfg),
    )


def _backbone_record(cfg: DictConfig) -> dict:
    """The backbone's fine-tuning settings, left out while all are null (the checkpoint's own),
    as in the records of suites started before they existed, which then still resume."""
    node = cfg.get("backbone")
    settings = OmegaConf.to_container(node, resolve=True) if node else {}
    return {"backbone": settings} if any(v is not None for v in settings.values()) else {}


def _trainer_record(cfg: DictConfig) -> dict:
    kept = ("max_epochs", "max_steps", "accumulate_grad_batches", "gradient_clip_val", "precision")
    return {k: OmegaConf.select(cfg, f"trainer.{k}") for k in kept}


def check_or_write_record(folder: Path, record: SuiteRecord) -> bool:
    """Write the suite's record into a new folder, or check a resumed folder's; returns
    whether the folder was resumed. A folder where no fine-tune has finished takes the new
    settings (a command corrected after its first fine-tune refused a setting keeps its
    run_name); its baselines, fitted for the old settings, are fitted again.

    Raises:
        ConfigError: the folder was started with other settings, or its record is unreadable.
    """
    path = folder / SUITE_RECORD
    if path.exists() and not any(folder.glob(f"*/*/{RESULTS}")):
        for stale in folder.glob(f"*/{BASELINES}"):
            stale.unlink()
        path.unlink()
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        record.write(path)
        return False
    try:
        started = SuiteRecord.read(path)
    except SuiteRecordError as err:
        raise ConfigError(str(err)) from err
    changed = record.changed(started)
    if changed:
        raise ConfigError(
            f"{folder} holds a suite started with other {', '.join(changed)} (see {path}); "
            "repeat that suite's command to resume it, or choose a new run_name= for these "
            "settings"
        )
    return True


def task_baselines(job_cfg: DictConfig) -> Baselines:
    """The baselines' dev metrics on the main split, fitted on the examples the task's jobs
    train on (the same `max_examples` and `train_examples`)."""
    spec = task_from(job_cfg.task)
    limit = job_cfg.datamodule.get("max_examples")
    train = task_examples(
        spec, spec.train_split, limit=limit, sample=job_cfg.datamodule.get("train_examples")
    )
    dev = task_examples(spec, spec.eval_splits[0], limit=limit)
    return Baselines(baseline_scores(spec, train, dev))


def prepare_job(job_cfg: DictConfig, task_dir: Path, job_dir: Path, done: bool) -> None:
    """Before a job: its task's baselines fitted once, and the folder of a run of the job that
    was cut short (its checkpoints are not results) moved aside."""
    if not (task_dir / BASELINES).is_file():
        print(f"{task_dir.name}: fitting the non-neural baselines")
        task_dir.mkdir(parents=True, exist_ok=True)
        task_baselines(job_cfg).write(task_dir / BASELINES)
    if not done and job_dir.exists():
        aside = job_dir.with_name(job_dir.name + ".interrupted")
        shutil.rmtree(aside, ignore_errors=True)
        job_dir.rename(aside)
        log.warning("%s was not finished; moved to %s and run again", job_dir, aside)


def print_scores(ended: Sequence[tuple[Path, FinetuneResults]]) -> None:
    """The line that ends each fine-tune of the suite: its main score and its folder."""
    for job_dir, results in ended:
        score = results.main_score()
        print(
            f"  {results.main_split} {results.main_metric} "
            f"{'n/a' if score is None else f'{score:.4f}'} "
            f"(best at epoch {results.best.epoch}); {job_dir}"
        )


def run_suite(
    cfg: DictConfig,
    load_task: Callable[[str], DictConfig],
    overrides: Sequence[str] = (),
) -> SuiteSummary | None:
    """Run (or resume) the suite of `cfg` into `cfg.paths.output_dir`; returns its summary
    (None in the processes of a multi-device suite other than the first).

    Args:
        cfg: the composed `conf/glue.yaml`.
        load_task: task config name -> its `task` node (conf/task/<name>.yaml).
        overrides: the command line's overrides; the keys they set beat the suite's settings.
    """
    if cfg.get("ckpt") is None:
        raise ConfigError(
            "ckpt is not set: give the pretrained model, e.g. make glue ckpt=outputs/bert/<run>"
        )
    check_finetune_keys(cfg)  # before the suite's record: as each job would
    folder = Path(cfg.paths.output_dir)
    tasks, seeds = suite_tasks(cfg), seeds_of(cfg.seeds)
    at_once = check_jobs(cfg.get("jobs", 1), cfg)
    nodes = {t.name: load_task(t.name) for t in tasks}  # every name checked before any job
    source = resolve_checkpoint(cfg.ckpt)  # read once for every job
    rates = {k: v for k, v in (cfg.get("backbone") or {}).items() if v is not None}
    if rates:  # a rate the jobs would refuse fails here, before the record is written
        with_dropout(load_backbone(source).model, **rates)
    first = first_process()  # the others of a multi-device suite only join its fine-tunes
    resumed = first and check_or_write_record(
        folder, suite_record(cfg, source.argument, tasks, seeds)
    )
    given = {override_key(o) for o in overrides}  # `+key=`, `~key` and `key=` alike
    planned = plan(tasks, seeds)
    done = [j for j in planned if (folder / j.folder / RESULTS).is_file()]
    if resumed:
        print(f"resuming the suite in {folder}: {len(done)} of {len(planned)} runs are done")
    by_name = {t.name: t for t in tasks}
    started = time.monotonic()
    runner = SideBySide(source, at_once) if at_once > 1 else InThisProcess(source)
    try:
        for number, job in enumerate(planned, start=1):
            job_dir = folder / job.folder
            job_cfg = job_config(cfg, nodes[job.task], by_name[job.task], job, job_dir, given)
            if first:
                prepare_job(job_cfg, folder / job.task, job_dir, done=job in done)
            if job in done:
                continue
            ended = runner.make_room()
            if first:
                print_scores(ended)
                elapsed = time.monotonic() - started
                print(
                    f"\n[{number}/{len(planned)}] {job.task}, {job.init}, seed {job.seed} "
                    f"({elapsed:.0f} s)"
                )
            ended = runner.start(job_dir, job_cfg)
            if first:
                print_scores(ended)
        if first:
            print_scores(runner.drain())
    finally:
        runner.stop()  # those still running, after a fine-tune failed or Ctrl-C
    if not first:
        return None
    summary = summarize_suite(folder)
    summary.write(folder)
    return summary


__all__ = ["SuiteTask", "plan", "run_suite", "seeds_of", "suite_tasks", "summarize_suite"]

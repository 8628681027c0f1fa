"""A run folder's record is never overwritten by an attempt that is refused.

Hydra writes `.hydra/config.yaml`, `overrides.yaml` and starts the job's log file before the
command's own code runs, so a check made there (a re-run into a folder that holds checkpoints,
say) would come after the folder's record of what its checkpoints were trained with was
overwritten. `RunFolderGuard`, a Hydra callback of `make pretrain` and `make finetune`, makes the
checks that need nothing but the command line before Hydra writes anything:

- the folder is taken for this run (`pipeline/run/lock.py`): a second command for a folder
  in use stops with one line naming the other's pid and host; a sweep holds its sweep folder
  and the job folders already there for the whole sweep (a job folder that the sweep makes is
  held from its job's start, just after Hydra writes its record there);
- a process of a multi-node run other than the first writes no record and logs to a file of
  its own (`own_log_file`);
- `run_name` is one folder name (no `/`, `..`), so a run stays under `outputs/<model>/`;
- `paths.output_dir=DIR` names the run folder itself: Hydra's folder follows it
  (`follow_output_dir`); a sweep, whose jobs each have a folder, refuses it;
- a fresh run into a folder that holds a run is refused (`refuse_overwrite`, which the commands
  also call themselves, for runs started without Hydra), and so is a fresh sweep into a sweep
  folder whose job folders hold runs, before any job;
- a resumed pretraining run (or `make glue` suite, or pretraining sweep) keeps the first
  attempt's `.hydra/` record and writes its own into `.hydra/resume-<time>/`, so a resume
  refused later (a checkpoint that does not fit the config) leaves the record of the trained
  run in place.

An attempt refused after Hydra made its folder (a checkpoint that does not exist, a config value
that the command's own checks refuse) leaves no empty folder behind: `remove_unused_run_folder`,
called on such an error, removes a folder this attempt created while it holds nothing but
Hydra's record and the attempt's log.
"""

from __future__ import annotations

import os
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from pipeline.run.config_keys import check_run_name
from pipeline.run.errors import ConfigError, RunFolderBusyError
from pipeline.run.launcher import launcher_rank, override_key
from pipeline.run.lock import LOCK_FILE, lock_run_folder, release_run_folder
from tokenizer.cache import write_text_atomic

Command = Literal["pretrain", "finetune", "glue"]
RESULTS = "results.json"
SUITE_RECORD = "glue_suite.json"  # a `make glue` suite folder (pipeline/suites/glue.py)
CHECKPOINT_DIR = "checkpoints"
HF_DIR = "hf"  # a pretraining run's Hugging Face export
LOG_DIR = "logs"  # the CSV log (conf/logger/csv.yaml) and the probes' records
RECORD_DIR = ".hydra"

# The run folder this process's attempt created (set before Hydra writes into it), if any,
# and the outermost folder the attempt created for it (`outputs/<model>/` on a first run).
_created_run_dir: Path | None = None
_created_top: Path | None = None


def refuse_overwrite(command: Command, run_dir: Path, resume: Any = None) -> None:
    """Refuse a fresh run into a folder that already holds one, naming what is there.

    Pretraining continues a run with `resume`; a fine-tuning run folder is never reused.
    """
    other = another_folder()
    if command == "pretrain":
        if resume is not None:
            return
        existing = sorted((run_dir / CHECKPOINT_DIR).glob("*.ckpt"))
        if existing:
            raise ConfigError(
                f"run folder {run_dir} already has checkpoints ({existing[-1].name}, ...): pass "
                f"resume=auto to continue that run, or choose another {other}"
            )
        return
    if (run_dir / RESULTS).exists() or (run_dir / CHECKPOINT_DIR).exists():
        raise ConfigError(
            f"{run_dir} already holds a fine-tuning run; choose another {other} (or delete "
            "the folder) so that its checkpoints and results are not mixed with a new run's"
        )


def another_folder() -> str:
    """The key that names another run folder in the fix of a refusal: `hydra.sweep.dir=` for a
    sweep's job (its folder is `<sweep dir>/<job number>`), `paths.output_dir=` when the
    command line named the folder itself (`follow_output_dir`), else `run_name=`."""
    if sweep_folder() is not None:
        return "hydra.sweep.dir="
    try:
        hydra = HydraConfig.get()
    except ValueError:  # not in a Hydra job
        return "run_name="
    return "run_name=" if output_dir_given(hydra) is None else "paths.output_dir="


def sweep_folder() -> str | None:
    """The folder of the sweep this Hydra job belongs to, or None outside a sweep."""
    try:
        hydra = HydraConfig.get()
    except ValueError:  # not in a Hydra job
        return None
    return str(hydra.sweep.dir) if hydra.mode == RunMode.MULTIRUN else None


def resume_record_dir() -> str:
    """Where a resumed attempt writes its Hydra record: beside the first attempt's."""
    return f"{RECORD_DIR}/resume-{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"


def resumes_a_run(run_dir: Path, resume: Any) -> bool:
    """Whether a pretraining attempt continues the run recorded in `run_dir`."""
    return resume is not None and (run_dir / RECORD_DIR / "config.yaml").is_file()


class RunFolderGuard(Callback):
    """Hydra callback: the checks above, before Hydra writes into the run folder.

    Args:
        command: which command's folder this is ("pretrain" or "finetune").
    """

    def __init__(self, command: Command) -> None:
        self.command = command

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep runs each job in a folder of its own, `<hydra.sweep.dir>/<job number>`.
        A fresh sweep into a sweep folder whose jobs hold runs is refused here, before any
        job: Hydra writes a job's record before the job's own checks could refuse it."""
        folder = output_dir_given(config)
        if folder is not None:
            there = folder if folder and "," not in folder else "DIR"
            print(
                "error: paths.output_dir names one run's folder, but a sweep runs each of its "
                "jobs in a folder of its own, under hydra.sweep.dir: leave paths.output_dir "
                f"out (and, to put the jobs' folders in {there}, give hydra.sweep.dir={there})",
                file=sys.stderr,
            )
            sys.exit(2)
        if not first_process():  # the other processes of a run leave its folder to the first
            return
        HydraConfig.instance().set_config(config)  # resolves ${hydra:...} in the folder name
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir()) if sweep_dir.is_dir() else []
        resume = config.get("resume")
        try:
            for job_dir in jobs:  # refused before the locks too, leaving the folder as it was
                refuse_overwrite(self.command, job_dir, resume)
            # the sweep folder and the job folders there, for the whole sweep: a second sweep
            # into it, or a run in one of its jobs' folders, stops it before Hydra writes there
            for folder in (sweep_dir, *jobs):
                lock_run_folder(folder, self.command, "hydra.sweep.dir=")
            for job_dir in jobs:  # and again: a run that held a job's folder may have trained
                refuse_overwrite(self.command, job_dir, resume)
        except (ConfigError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if self.command == "pretrain" and any(resumes_a_run(job, resume) for job in jobs):
            # each job is composed again from the sweep's Hydra overrides: with this one, a
            # resumed job writes its record beside the first attempt's, as a resumed run does
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.overrides.hydra.append(f"hydra.output_subdir={resume_record_dir()}")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep's job holds its folder while it runs (a folder made by the sweep was not
        there to be locked before it). A job that a resumed sweep starts afresh keeps its
        record as a first attempt's, in `.hydra/`."""
        if config.hydra.mode != RunMode.MULTIRUN or not first_process():
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        try:
            lock_run_folder(job_dir, self.command, "hydra.sweep.dir=")
        except (RunFolderBusyError, OSError) as err:  # a run that took a new job's folder
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        subdir = config.hydra.output_subdir
        first = job_dir / RECORD_DIR
        if subdir not in (None, RECORD_DIR) and not (first / "config.yaml").exists():
            # config.yaml last: its presence says the record is whole
            for name in ("overrides.yaml", "hydra.yaml", "config.yaml"):
                write_text_atomic(first / name, (job_dir / subdir / name).read_text())

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN and first_process():
            release_run_folder(Path(config.hydra.runtime.output_dir))

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            follow_output_dir(config)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if config.hydra.output_subdir is None:  # a command that keeps no run record
            return
        if not first_process():  # the other processes of a run leave its record to the first
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = None
                own_log_file(config.hydra)
            return
        HydraConfig.instance().set_config(config)  # resolves ${hydra:...} in the folder name
        global _created_run_dir, _created_top
        try:
            check_run_name(config.get("run_name"))
            run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir")))
            missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
            # refused before the lock too, so that a refused attempt leaves the folder as it was
            refuse_overwrite(self.command, run_dir, config.get("resume"))
            # before anything is read or written there
            lock_run_folder(run_dir, self.command, another_folder())
            _created_run_dir = run_dir if missing else None
            _created_top = missing[-1] if missing else None
            # and again: a run that held the folder until now may have written a run there
            refuse_overwrite(self.command, run_dir, config.get("resume"))
        except ConfigError as err:
            if not isinstance(err, RunFolderBusyError):  # the folder is the other run's
                remove_unused_run_folder()
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if (self.command == "pretrain" and resumes_a_run(run_dir, config.get("resume"))) or (
            self.command == "glue" and (run_dir / SUITE_RECORD).is_file()
        ):
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.output_subdir = resume_record_dir()


def output_dir_given(hydra: DictConfig) -> str | None:
    """`paths.output_dir`'s value as the command line gives it, or None where it is not given
    (`hydra`: the Hydra config, or a config that holds it)."""
    for override in (hydra.hydra if "hydra" in hydra else hydra).overrides.task:
        if override_key(override) == "paths.output_dir" and not override.startswith("~"):
            return override.split("=", 1)[1]
    return None


def follow_output_dir(config: DictConfig) -> None:
    """`paths.output_dir=DIR` on the command line names the run folder itself (`paths.output_root`
    names the folder that runs go under): Hydra's run folder, which takes the lock and the
    record and log of the run, becomes DIR too. Otherwise the run would write its checkpoints
    into DIR, which nothing made, and its record into `outputs/<model>/<run_name>`."""
    if output_dir_given(config) is None:
        return
    folder = OmegaConf.select(config, "paths.output_dir")
    if not folder:
        raise ConfigError(
            f"paths.output_dir={folder!r}: give the run's folder, e.g. "
            "paths.output_dir=/data/runs/first, or leave it out (runs go to "
            "outputs/<model>/<run_name>, and paths.output_root=DIR moves outputs/)"
        )
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.run.dir = str(folder)


def own_log_file(hydra: DictConfig) -> None:
    """Give a process that torchrun or srun started (rank > 0) a log file of its own in the
    run folder, `<command>_rank<r>.log`: processes on other nodes appending to one file over
    NFS would overwrite each other's lines. (Lightning's own launcher names its processes'
    jobs, and so their files, itself.)"""
    handler = OmegaConf.select(hydra, "job_logging.handlers.file")
    if launcher_rank() > 0 and handler is not None and "filename" in handler:
        handler.filename = (
            f"${{hydra.runtime.output_dir}}/${{hydra.job.name}}_rank{launcher_rank()}.log"
        )


def remove_unused_run_folder() -> Path | None:
    """Remove the run folder that this attempt created, if it holds only what Hydra and the
    command write before any work (`.hydra/`, `*.log`, a suite's record); returns it if removed.
    Called when the attempt ends on an error in the user's input."""
    global _created_run_dir, _created_top
    run_dir, _created_run_dir = _created_run_dir, None
    top, _created_top = _created_top, None
    if run_dir is None or not run_dir.is_dir():
        return None
    unused = {RECORD_DIR, SUITE_RECORD, LOCK_FILE}
    for entry in run_dir.iterdir():
        if entry.name not in unused and entry.suffix != ".log":
            return None  # the attempt did some work there: keep it
    release_run_folder(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:  # the folders made for it, while nothing else is there
        if top is None or not parent.is_relative_to(top):
            break
        try:
            parent.rmdir()
        except OSError:  # another run's folder is there now
            break
    return run_dir


def run_folder_of(source: Path) -> Path:
    """The run folder a checkpoint file or a run's HF export belongs to, where what is measured
    of it is written: `<run>/checkpoints/x.ckpt` and `<run>/hf` give `<run>`; another HF
    folder is its own, another file's folder is the file's."""
    if source.is_dir():
        return (
            source.parent
            if source.name == HF_DIR and (source.parent / CHECKPOINT_DIR).is_dir()
            else source
        )
    return source.parent.parent if source.parent.name == CHECKPOINT_DIR else source.parent


def first_process() -> bool:
    """Whether this is the first process of a run (or its only one), the one that writes the
    run's record and moves damaged files aside: global rank 0 of an external launcher
    (torchrun, SLURM) and not a process that Lightning's launcher started (LOCAL_RANK > 0)."""
    return launcher_rank() == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def attempt_record(run_dir: Path) -> Path:
    """The config record of this attempt at the run: `.hydra/config.yaml`, or a resumed
    attempt's `.hydra/resume-<time>/config.yaml` (outside a Hydra job: the first)."""
    try:
        subdir = HydraConfig.get().output_subdir or RECORD_DIR
    except ValueError:
        subdir = RECORD_DIR
    return run_dir / subdir / "config.yaml"

"""Run tracking: the loggers of a run (CSV, Weights & Biases, TensorBoard), what is logged about
a run besides its metrics, and the wandb run that a resumed run continues.

The `logger` config group (conf/logger/) holds one node per logger, keyed by its name;
`logger=[csv,wandb,tensorboard]` selects several, `logger=[]` none. An entry point uses:

    loggers = build_loggers(cfg, run_dir, resume_id=CheckpointRecord.of(checkpoint).wandb.get("id"))
    trainer = L.Trainer(..., logger=loggers or False)
    log_run_start(trainer.loggers, cfg, parameters=..., flops_per_token=...,
                  data_fingerprint=..., tokenizer_fingerprint=tokenizer_fingerprint(tok))
    trainer.fit(...)
    tracking = log_run_end(trainer.loggers, hf_export=str(export_dir))  # finishes the wandb run
    # tracking: {"wandb": "<url>"} or, offline, {"wandb": "offline; upload: wandb sync <dir>"}

Fine-tuning (pipeline/finetune/run.py) makes the same calls, for any run config with a `logger`
group and `paths`, and passes `group=` (and `project=`) from the pretraining checkpoint,
`CheckpointRecord.of(checkpoint).wandb` = {"id", "project", "group", "name"}
(pipeline/checkpoint/record.py), so that the fine-tunes of a checkpoint share its wandb group;
`log_table(loggers, "results", columns, rows)` adds a results table. `job_type=` ("pretrain",
"finetune") and `name=` are optional.

wandb mode (`logger.wandb.mode`, see `wandb_mode`): `auto` is online when credentials exist
(`wandb login` wrote ~/.netrc, or WANDB_API_KEY is set) and offline otherwise: the run is written
under `<run dir>/wandb/` and `wandb sync <dir>` uploads it later. A set WANDB_MODE wins over
`auto`. No login prompt is ever shown: `online` without credentials is refused with a message.
WANDB_MODE=disabled (or `mode: disabled`) leaves the wandb logger out altogether.

What is logged: the resolved run config as the run config (wandb) / `logs/hparams.yaml` (CSV),
with a `run` section holding the git commit and dirty flag and the facts passed to
`log_run_start` (data and tokenizer fingerprints, parameter count, FLOPs per token); metrics are
logged by the LightningModule and callbacks; `log_run_end` adds final values (the HF export
path) to the wandb summary and to `logs/hparams.yaml`.

Only rank 0 logs: Lightning's loggers write on global rank 0 only, and the functions here do
nothing on other ranks. A checkpoint records the wandb run (`wandb_run_record`, written by
`pipeline.checkpoint.saving.CheckpointExtras`), and a run resumed from it continues that wandb run,
offline too (its new offline folder carries the same run id).
"""

from __future__ import annotations

import hashlib
import logging
import netrc
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hydra.utils import instantiate
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer

from pipeline.run.errors import ConfigError
from pipeline.run.launcher import group_choices
from pipeline.training.lightning_compat import AppendingCSVLogger as AppendingCSVLogger

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
WANDB_MODES = ("auto", "online", "offline", "disabled")
# WANDB_MODE values wandb also accepts, by the mode they mean
WANDB_MODE_ALIASES = {"dryrun": "offline", "run": "online"}
DEFAULT_WANDB_HOST = "https://api.wandb.ai"


# CSV: `AppendingCSVLogger` (conf/logger/csv.yaml) lives with the other uses of Lightning's
# internals, in pipeline/training/lightning_compat.py; it is importable from here too.

# wandb mode and credentials --------------------------------------------------------------------


def wandb_credentials() -> bool:
    """Whether wandb can log in without asking: WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE is
    set, or the netrc file (`NETRC`, else ~/.netrc, where `wandb login` writes) has an entry
    for the wandb host (`WANDB_BASE_URL`, else api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_HOST).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(requested: str = "auto") -> str:
    """The wandb mode a run uses: "online", "offline" or "disabled"; never one that prompts.

    Args:
        requested: `logger.wandb.mode`. "auto": WANDB_MODE when set, else online with
            credentials (`wandb_credentials`) and offline without.

    Raises:
        ConfigError: an unknown mode, or "online" without credentials (wandb would ask for a
            login, which blocks a batch job).
    """
    if requested not in WANDB_MODES:
        raise ConfigError(f"logger.wandb.mode={requested!r} is not one of {', '.join(WANDB_MODES)}")
    mode = requested
    if mode == "auto":
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        env = WANDB_MODE_ALIASES.get(env, env)
        if env and env not in WANDB_MODES[1:]:
            raise ConfigError(f"WANDB_MODE={env!r} is not one of online, offline, disabled")
        mode = env or ("online" if wandb_credentials() else "offline")
    if mode == "online" and not wandb_credentials():
        raise ConfigError(
            "logger.wandb.mode=online but no wandb credentials were found (run `wandb login` "
            "or set WANDB_API_KEY); or log offline with logger.wandb.mode=offline and upload "
            "later with `wandb sync`"
        )
    return mode


def wandb_logger(
    save_dir: str | os.PathLike,
    *,
    mode: str = "auto",
    project: str | None = None,
    group: str | None = None,
    name: str | None = None,
    id: str | None = None,
    tags: Sequence[str] = (),
    log_system_metrics: bool = True,
    **init_kwargs: Any,
) -> WandbLogger:
    """Lightning's `WandbLogger` in a mode that never prompts (see `wandb_mode`), writing under
    `<save_dir>/wandb/`. wandb starts on first use, on rank 0 only.

    Args:
        save_dir: the run folder.
        mode: "auto", "online", "offline" or "disabled".
        project, group, name: where the run appears (None: project "lmpipe", no group, a name
            wandb makes up); `build_loggers` fills them from the run.
        id: the wandb run id; a run with an existing id continues that run.
        tags: wandb tags.
        log_system_metrics: sample CPU, GPU and memory use every 15 s.
        **init_kwargs: passed on to `wandb.init` (e.g. `job_type`).
    """
    settings = {
        "x_disable_stats": not log_system_metrics,
        # The git commit and dirty flag are logged in the run config (`git_state`); wandb's own
        # git calls would also diff the checkout while other processes may be committing.
        "disable_git": True,
    }
    return WandbLogger(
        save_dir=os.fspath(save_dir),
        mode=wandb_mode(mode),
        project=project or "lmpipe",
        group=group,
        name=name,
        id=id,
        tags=list(tags),
        settings=settings,
        **init_kwargs,
    )


# building the loggers --------------------------------------------------------------------------


def _is_wandb(node: DictConfig) -> bool:
    return node.get("_target_") == f"{wandb_logger.__module__}.{wandb_logger.__name__}"


def default_placement(cfg: DictConfig, run_dir: Path) -> dict[str, str]:
    """Where a run appears in wandb unless `logger.wandb` says otherwise: project
    `lmpipe-<model preset>`, group the experiment (else the run name), name the run name (a
    numbered multirun job: `<sweep folder>-<job number>`)."""
    choices = group_choices().options
    model = choices.get("model")
    name = run_dir.name
    if name.isdigit():  # a multirun job folder
        name = f"{run_dir.parent.name}-{name}"
    return {
        "project": f"lmpipe-{model}" if model else "lmpipe",
        "group": choices.get("experiment") or str(cfg.get("run_name") or run_dir.name),
        "name": name,
    }


def build_loggers(
    cfg: DictConfig,
    run_dir: str | os.PathLike,
    *,
    project: str | None = None,
    group: str | None = None,
    name: str | None = None,
    job_type: str | None = None,
    resume_id: str | None = None,
) -> list[Logger]:
    """The loggers `cfg.logger` selects, in its order (CSV first by default).

    Args:
        cfg: a run config with a `logger` group (may be empty or missing: no loggers).
        run_dir: the run folder (names the wandb run by default).
        project, group, name: the wandb run's place; each overrides `logger.wandb.<key>`, which
            overrides `default_placement`.
        job_type: the wandb job type, e.g. "pretrain" or "finetune".
        resume_id: the wandb run id to continue (a resumed run's, from its checkpoint).

    Raises:
        ConfigError: a wandb mode that cannot work (see `wandb_mode`).
    """
    run_dir = Path(run_dir)
    loggers: list[Logger] = []
    for key, node in (cfg.get("logger") or {}).items():
        if not _is_wandb(node):
            loggers.append(numbered_from_one(instantiate(node)))
            continue
        mode = wandb_mode(node.get("mode", "auto"))
        if mode == "disabled":
            log.info("wandb is disabled (logger.%s.mode or WANDB_MODE)", key)
            continue
        defaults = default_placement(cfg, run_dir)
        extra = {"job_type": job_type} if job_type else {}
        logger = instantiate(
            node,
            mode=mode,
            project=project or node.get("project") or defaults["project"],
            group=group or node.get("group") or defaults["group"],
            name=name or node.get("name") or defaults["name"],
            id=resume_id or node.get("id"),
            **extra,
        )
        loggers.append(numbered_from_one(logger))
    return loggers


class EpochFromOneProgressBar(TQDMProgressBar):
    """Lightning's progress bar, naming the epoch as every record does: from 1."""

    def on_train_epoch_start(self, trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch + 1}")


def progress_bar(trainer_cfg: DictConfig) -> list[TQDMProgressBar]:
    """The progress bar callback of a Trainer config (none when it turns the bar off)."""
    return [EpochFromOneProgressBar()] if trainer_cfg.get("enable_progress_bar", True) else []


def numbered_from_one(logger: Logger) -> Logger:
    """`logger`, logging every row at the optimizer steps done and the epoch counted from 1.

    One numbering everywhere a user reads a step or an epoch: step N is the state after N
    optimizer steps (checkpoint `step000000N.ckpt`, results.json, the console, and now every
    logger), epoch E the E-th pass over the data. Lightning hands loggers the 0-based index of
    the step in progress (a validation after 100 steps: 99) and of the epoch; they are shifted
    here, once, for every logger a run builds.
    """
    log_metrics = logger.log_metrics

    def log_numbered(metrics: dict[str, float], step: int | None = None) -> None:
        if "epoch" in metrics:
            metrics = {**metrics, "epoch": metrics["epoch"] + 1}
        log_metrics(metrics, None if step is None else step + 1)

    logger.log_metrics = log_numbered  # type: ignore[method-assign]
    return logger


# what is logged about a run --------------------------------------------------------------------


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """{"git_commit": HEAD's hash, "git_dirty": tracked files differ from it}, both None when
    `repo` is not a git checkout (or git is missing). Read-only: takes no index lock."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit.strip(), "git_dirty": None if status is None else bool(status)}


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of a tokenizer's full JSON (vocabulary, merges, normalizer, special tokens)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def log_run_start(loggers: Iterable[Logger], cfg: DictConfig, **facts: Any) -> dict[str, Any]:
    """Log the resolved config as the run config, with a `run` section: the git state and
    `facts` (e.g. parameters, flops_per_token, data_fingerprint, tokenizer_fingerprint).

    Returns the `run` section (empty on ranks other than 0, where nothing is logged).
    """
    if rank_zero_only.rank != 0:
        return {}
    run = {**git_state(), **facts}
    params = {**OmegaConf.to_container(cfg, resolve=True), "run": run}
    for logger in loggers:
        logger.log_hyperparams(params)
        logger.save()
    return run


def log_run_end(loggers: Iterable[Logger], **values: Any) -> dict[str, str]:
    """Log final values (e.g. hf_export=path) and finish the wandb run.

    The values go to the wandb run's summary and to the other loggers' hyperparameters (CSV:
    `logs/hparams.yaml`). Call once, at the end, on rank 0 (elsewhere it does nothing).

    Returns:
        What to tell the user: {"wandb": the online run's URL, or, offline, the `wandb sync`
        command that uploads the run}; {} without wandb.
    """
    tracking: dict[str, str] = {}
    if rank_zero_only.rank != 0:
        return tracking
    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            logger.log_hyperparams(values)
            logger.save()
            continue
        run = logger.experiment
        run.summary.update(values)
        if run.settings.mode in ("offline", "dryrun"):
            tracking["wandb"] = f"offline; upload: wandb sync {run.settings.sync_dir}"
        elif run.url:
            tracking["wandb"] = run.url
        run.finish()
    return tracking


def log_table(
    loggers: Iterable[Logger], key: str, columns: list[str], rows: list[list[Any]]
) -> None:
    """A table (e.g. fine-tuning results: task, seed, metric) in the wandb run; the other
    loggers have no tables (the run folder's own files hold them)."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.log_table(key=key, columns=columns, data=rows)


# the wandb run in checkpoints ------------------------------------------------------------------


def wandb_run_record(loggers: Iterable[Logger]) -> dict[str, str] | None:
    """{"id", "project", "group", "name"} of the run's wandb run, for its checkpoints; None
    without wandb or on ranks other than 0 (which do not write checkpoints)."""
    if rank_zero_only.rank != 0:
        return None
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            return {
                "id": run.id,
                "project": run.project,
                "group": run.group or "",
                "name": run.name or "",
            }
    return None

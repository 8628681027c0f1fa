"""What a pretraining checkpoint holds, how it is written, which ones are kept, and resuming
(which checkpoint a `resume=` names: pipeline/checkpoint/source.py).

A checkpoint (`<run dir>/checkpoints/*.ckpt`, a Lightning checkpoint) holds the model, optimizer,
schedule, precision scaler, loop counters and data position (Lightning's own keys), plus the
pipeline's `CheckpointRecord` (pipeline/checkpoint/record.py: architecture, tokenizer, resolved
config, longest trained length, wandb run, RNG states), written by `CheckpointExtras`. Everything
in it is plain data, so it loads with `torch.load(weights_only=True)`.

Kept: the last `keep_last` periodic checkpoints (`stepNNNNNNN.ckpt`), the `keep_best` best by
the held-out language-model loss (`best-stepNNNNNNN.ckpt`; `PretrainModule.held_out_figure`:
`val/loss` for GPT, `val/mlm_loss` for BERT), and `last.ckpt`. Each file is written to a temporary
name, fsynced and renamed, so a crash never leaves a half-written checkpoint under a real name
(the temporary file a kill leaves is removed when the run resumes: `remove_partial_saves`), and a
save that finds the disk full ends the run with one line saying so (pipeline/checkpoint/space.py).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from tokenizers import Tokenizer

from models.config import ModelConfig
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.checkpoint.source import CheckpointSource, read_checkpoint
from pipeline.checkpoint.space import disk_full_error, free_space
from pipeline.run.errors import CheckpointLoadError
from pipeline.run.folder import CHECKPOINT_DIR
from pipeline.run.recipes import (
    ADAMW,
    optimizer_class,
    optimizer_option,
    recipe_optimizer,
    recipe_with,
)
from pipeline.training.lightning_compat import (
    ResumeFileRankedCheckpoint,
    last_saved_step,
    mark_saved,
    remove_checkpoint,
    save_now,
    saved_now_not_deferred,
    set_logging_step,
    step_boundary,
)
from pipeline.training.loggers import wandb_run_record
from tokenizer import atomic_path

log = logging.getLogger(__name__)

BEST_PREFIX = "best-step"  # a best checkpoint's file name, before its step


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file, fsyncs it, then renames it into place.

    `already_read`: a checkpoint the command has read (the one a run resumes from); Lightning's
    request to load that file gets those contents, once, instead of a second read. (FSDP's
    strategy reads a checkpoint itself, without asking this class: there it is read twice.)"""

    def __init__(self, already_read: CheckpointSource | None = None) -> None:
        super().__init__()
        self.already_read = already_read

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        free = free_space(Path(path))
        try:
            with atomic_path(path) as tmp:
                torch.save(checkpoint, tmp)
        except (OSError, RuntimeError) as err:  # torch says "disk full" as a RuntimeError
            full = disk_full_error(Path(path), checkpoint, err, free)
            if full is None:
                raise
            raise full from err

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        read, self.already_read = self.already_read, None
        if read is not None and read.contents is not None and Path(path) == read.path:
            return read.contents
        where = {} if map_location is None else {"map_location": map_location}
        return super().load_checkpoint(path, weights_only=weights_only, **where)


class StepCheckpoint(ResumeFileRankedCheckpoint):
    """A ModelCheckpoint that saves only between optimizer steps, and always at the end.

    Lightning's saves a step when its first micro-batch ends (with gradient accumulation that
    is mid-step, in particular right after a resume, as it does not remember which step it last
    saved), and at the end only when nothing was saved during the run, so a run stopped by
    `max_time` or with `max_steps` not a multiple of `every_n_steps` would lose its last steps.

    On resume, each callback's restored record of its files is made to match the disk: files
    gone since (moved aside as damaged, deleted by hand) are forgotten, so that `keep_last` and
    `keep_best` count the files that exist; and the callback that keeps the best checkpoints
    adopts its files that the restored state does not know (a periodic checkpoint is saved
    before the validation of its step, so the best file that validation wrote is newer than
    the state resumed from), reading each file's score from `already_read` (the checkpoints a
    `resume=auto` read while choosing, `CheckpointSource.beside`) when it is there.
    """

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        mark_saved(self, trainer.global_step)  # resumed from it: on disk already
        self._align_log_step = trainer.global_step > 0
        if trainer.global_step > 0:
            self._match_files_on_disk(trainer, adopt=self.monitor != "step")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Lightning's logging step is saved before a batch is counted
        # and given +1 when restored; the end-of-run checkpoint is saved after the count, so a
        # run resumed from it would log every step one too high. One logged step per optimizer
        # step: the first batch after a resume logs at the global step.
        if self._align_log_step:
            set_logging_step(trainer, trainer.global_step)
            self._align_log_step = False

    def __init__(
        self,
        *,
        every_n_train_steps: int | None = None,
        already_read: dict[Path, dict[str, Any]] | None = None,
        **settings,
    ) -> None:
        super().__init__(every_n_train_steps=every_n_train_steps, **settings)
        self.every_n_steps = every_n_train_steps or 0
        self.already_read = already_read or {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not step_boundary(trainer):
            return  # mid-step: the gradients of the step so far are in no checkpoint
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # On an epoch's last batch Lightning puts the save off to the validation it expects
        # next, which a run validating every N steps does not make there (an epoch, or an
        # objective phase, ending between validations): that step would have no checkpoint.
        due = self.every_n_steps and trainer.global_step % self.every_n_steps == 0
        if due and self.monitor == "step" and last_saved_step(self) != trainer.global_step:
            save_now(self, trainer)
            saved_now_not_deferred(self)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save_step(trainer)
        super().on_train_end(trainer, pl_module)

    def save_step(self, trainer) -> Path | None:
        """Save the current step's periodic checkpoint and `last.ckpt`, unless this step is
        saved already (only the callback that keeps `last.ckpt` saves); returns `last.ckpt`."""
        if not self.save_last:
            return None
        if last_saved_step(self) != trainer.global_step:
            save_now(self, trainer)
        return Path(self.last_model_path) if self.last_model_path else None

    def _match_files_on_disk(self, trainer, *, adopt: bool) -> None:
        """Forget the files of this callback's top-k record that are gone; with `adopt`, add
        its files on disk that the record lacks (each file holds its own score). Then keep
        only the best `save_top_k` of them."""
        for gone in [p for p in self.best_k_models if not Path(p).exists()]:
            del self.best_k_models[gone]  # moved aside as damaged, or deleted by hand
        prefix = self.filename.split("{")[0]
        for path in sorted(Path(self.dirpath).glob(f"{prefix}*.ckpt")) if adopt else []:
            if str(path) in self.best_k_models:
                continue
            score = saved_score(path, self, self.already_read.get(path.resolve()))
            if score is not None:
                self.best_k_models[str(path)] = score
        if not self.best_k_models:
            self.best_model_path = self.kth_best_model_path = ""
            self.best_model_score = None
            self.kth_value = torch.tensor(float("inf") if self.mode == "min" else float("-inf"))
            return
        best_first = sorted(
            self.best_k_models,
            key=lambda p: float(self.best_k_models[p]),
            reverse=self.mode == "max",
        )
        for path in best_first[self.save_top_k :]:
            del self.best_k_models[path]
            if Path(path).exists():
                log.info("keeping %d by %s: removing %s", self.save_top_k, self.monitor, path)
                remove_checkpoint(self, trainer, path)
        kept = best_first[: self.save_top_k]
        self.best_model_path, self.kth_best_model_path = kept[0], kept[-1]
        self.best_model_score = self.best_k_models[kept[0]]
        self.kth_value = self.best_k_models[kept[-1]]


def saved_score(
    path: Path, callback: ModelCheckpoint, contents: dict[str, Any] | None = None
) -> torch.Tensor | None:
    """The score by `callback`'s figure that a best-k checkpoint file was saved with (None:
    unreadable, or kept by another figure); `contents`: the file's, when already read."""
    try:
        states = (contents or read_checkpoint(path))["callbacks"]
        if callback.state_key not in states and other_best_states(states, callback.monitor):
            # a run that kept its best by another figure (BERT before val/mlm_loss):
            # `forget_other_best` said so once
            log.info("not counting %s among the best by %s", path, callback.monitor)
            return None
        state = states[callback.state_key]
        return state["best_k_models"].get(str(path), state["current_score"])
    except (CheckpointLoadError, KeyError, TypeError) as err:  # not one of ours to rank
        log.warning("not counting %s among the best checkpoints: %s", path, err)
        return None


def other_best_states(states: dict[str, Any], best_by: str) -> dict[str, str]:
    """Of the checkpoint callbacks' `states` (a checkpoint's "callbacks"), those that kept best
    checkpoints by another figure than `best_by` (not the periodic checkpoints' "step"): state
    key -> that figure."""
    monitors = {key: s.get("monitor") for key, s in states.items() if isinstance(s, dict)}
    return {
        key: m for key, m in monitors.items() if isinstance(m, str) and m not in ("step", best_by)
    }


def forget_other_best(resumed: CheckpointSource | None, best_by: str) -> None:
    """Drop, from the checkpoint a run resumes from, the state of best checkpoints it kept by
    another figure than `best_by` (a BERT run begun before `val/mlm_loss`), saying so once:
    Lightning would restore it into no callback and ask for that callback back. The files
    stay where they are, not ranked or removed (`saved_score`)."""
    states = (resumed.contents or {}).get("callbacks", {}) if resumed is not None else {}
    for key, figure in other_best_states(states, best_by).items():
        log.warning(
            "this run kept its best checkpoints by %s until now, and keeps them by %s from "
            "here on: the best-step files it kept stay as they are, not ranked or removed",
            figure,
            best_by,
        )
        del states[key]


def checkpoint_callbacks(
    run_dir: Path,
    every_n_steps: int,
    keep_last: int,
    keep_best: int,
    best_by: str,
    resumed: CheckpointSource | None = None,
) -> list[ModelCheckpoint]:
    """The periodic checkpoints (the last `keep_last`, plus `last.ckpt`) and the best ones by
    the logged figure `best_by` (lower is better); `resumed`: the checkpoint the run resumes
    from, with the folder's others already read."""
    directory = run_dir / CHECKPOINT_DIR
    already_read = resumed.beside if resumed is not None else {}
    forget_other_best(resumed, best_by)
    periodic = StepCheckpoint(
        dirpath=directory,
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=every_n_steps,
        save_last=True,
        # "step" ranks checkpoints by recency (Lightning puts the global step among the
        # monitored values), so keeping the top k keeps the last k.
        monitor="step",
        mode="max",
        save_top_k=keep_last,
        # A run folder holds one `last.ckpt`, the newest: Lightning's version counter would
        # write `last-v1.ckpt` beside it whenever a resumed run's restored state does not name
        # the file on disk (a run resumed from a periodic checkpoint, then stopped again), and
        # `ckpt=<run>` would load the stale one. Files are replaced atomically (AtomicCheckpointIO)
        # and a folder is written by one run at a time (pipeline/run/lock.py), so a name that
        # exists is this run's own earlier save of that name.
        enable_version_counter=False,
    )
    callbacks = [periodic]
    if keep_best:
        callbacks.append(
            StepCheckpoint(
                dirpath=directory,
                filename=BEST_PREFIX + "{step:07d}",
                auto_insert_metric_name=False,
                monitor=best_by,
                mode="min",
                save_top_k=keep_best,
                enable_version_counter=False,
                already_read=already_read,
            )
        )
    return callbacks


@dataclass(frozen=True)
class BestCheckpoint:
    """The kept checkpoint with the run's lowest held-out figure.

    Attributes:
        path: the file.
        figure: the logged figure it was kept by (`checkpoint_callbacks`' `best_by`).
        score: its value of that figure.
        step: its step, from its file name (None: a name the run did not write, such as a
            copy a resume took in).
    """

    path: Path
    figure: str
    score: float
    step: int | None


def best_checkpoint(trainer: L.Trainer) -> BestCheckpoint | None:
    """The run's best kept checkpoint; None: the run keeps none (`checkpoint.keep_best=0`), or
    has not validated."""
    for callback in trainer.checkpoint_callbacks:
        found = callback.best_model_path and callback.best_model_score is not None
        if callback.filename.startswith(BEST_PREFIX) and found:
            path = Path(callback.best_model_path)
            named = re.fullmatch(rf"{BEST_PREFIX}(\d+)", path.stem)
            step = int(named.group(1)) if named else None
            return BestCheckpoint(path, callback.monitor, float(callback.best_model_score), step)
    return None


class CheckpointExtras(L.Callback):
    """Writes the pipeline's `CheckpointRecord` into every checkpoint (architecture, tokenizer,
    resolved config, longest trained length, wandb run, RNG states), and restores the RNG
    states on resume (dropout then draws the same masks as in the uninterrupted run).

    The RNG states of every rank are gathered into the checkpoint (a list indexed by rank), as
    ranks draw different amounts (BERT batches differ in width), and each rank gets its own
    back. The wandb run is recorded (`pipeline.training.loggers.wandb_run_record`) so that a run
    resumed from the checkpoint continues it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict[str, Any],
        trained_seq_len: Callable[[int], int | None] = lambda steps: None,
    ):
        """`trained_seq_len`: the longest sequence trained after a number of optimizer steps
        (the objective's phases may lengthen it as a run goes on; None: unknown)."""
        self.tokenizer = CheckpointRecord.describe_tokenizer(tokenizer)
        self.config = config
        self.seq_len_at = trained_seq_len
        self.resumed_seq_len: int | None = None  # what the checkpoint resumed from had trained

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        lengths = [self.resumed_seq_len, self.seq_len_at(trainer.global_step)]
        known = [n for n in lengths if n is not None]
        states = rng_states()
        if trainer.world_size > 1:  # this hook runs on every rank; only rank 0 writes
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, states)
        else:
            gathered = [states]
        CheckpointRecord(
            model_config=CheckpointRecord.describe_model(pl_module.model_config),
            tokenizer=self.tokenizer,
            config=self.config,
            trained_seq_len=max(known) if known else None,
            wandb=wandb_run_record(trainer.loggers) or {},
            rng=gathered,
        ).write_into(checkpoint)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        record = CheckpointRecord.of(checkpoint)
        self.resumed_seq_len = record.trained_seq_len  # a resumed run trained the longer of both
        if trainer.global_rank < len(record.rng):
            restore_rng_states(record.rng[trainer.global_rank])
        else:
            log.warning("the checkpoint has no RNG state for rank %d", trainer.global_rank)


def rng_states() -> dict[str, Any]:
    """This process's global RNG states (CUDA: its current device), as plain data."""
    numpy_state = np.random.get_state(legacy=False)
    version, python_state, gauss = random.getstate()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "key": numpy_state["state"]["key"].tolist(),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "python": {"version": version, "state": list(python_state), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    numpy_state = states["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np.array(numpy_state["key"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
    python = states["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def check_compatible(
    checkpoint: dict[str, Any],
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    optimizer: str | None = None,
) -> None:
    """Raise `CheckpointLoadError` listing every model field (and the tokenizer, and the
    optimizer class `optimizer`, this run's `optim._target_`, whose state the checkpoint holds)
    that differs between a checkpoint and this run."""
    record = CheckpointRecord.of(checkpoint)
    saved = record.model_config
    if saved is None:
        raise CheckpointLoadError(
            "the checkpoint has no model_config: it was not written by this pipeline's pretraining"
        )
    current = CheckpointRecord.describe_model(model_config)
    differing = [key for key, value in current.items() if saved.get(key) != value]
    mismatched = [
        f"model.{key}: checkpoint {saved.get(key)!r}, this run {current[key]!r}"
        for key in differing
    ]
    if record.tokenizer is not None and record.tokenizer.get("json") != tokenizer.to_str():
        mismatched.append(
            "tokenizer: the checkpoint was trained with a different tokenizer (its settings are "
            "in the checkpoint's 'config' entry)"
        )
    fixes = []
    saved_optimizer = (record.config.get("optim") or {}).get("_target_")
    if optimizer is not None and saved_optimizer is not None and saved_optimizer != optimizer:
        mismatched.append(f"optim._target_: checkpoint {saved_optimizer}, this run {optimizer}")
        fix = _optimizer_fix(record.config, saved.get("family"))
        fixes += [fix] if fix else []
    if mismatched:
        # vocab_size follows the tokenizer (not a setting); values as Hydra reads them
        fix = " ".join(
            [
                f"model.{key}={_hydra_value(saved.get(key))}"
                for key in differing
                if key not in ("family", "vocab_size")
            ]
            + fixes
        )
        raise CheckpointLoadError(
            "the checkpoint does not fit this run's config:\n  "
            + "\n  ".join(mismatched)
            + (f"\nresume with the settings it was trained with: {fix}" if fix else "")
        )


def _optimizer_fix(config: dict[str, Any], family: str | None) -> str | None:
    """The overrides that train with a checkpoint's optimizer again: its recipe (conf/recipe/),
    or for a checkpoint written before recipes (when every preset trained with its family's
    AdamW recipe) that one, plus the `optim=` option of the checkpoint's optimizer where it was
    chosen apart from the recipe (`model=gpt optim=adamw_gpt`)."""
    saved = (config.get("optim") or {}).get("_target_")
    recipe = (config.get("recipe") or {}).get("name") or (
        recipe_with(ADAMW, family) if family else None
    )
    if recipe and optimizer_class(recipe_optimizer(recipe)) == saved:
        return f"recipe={recipe}"
    option = optimizer_option(saved, family) if saved else None
    overrides = ([f"recipe={recipe}"] if recipe else []) + ([f"optim={option}"] if option else [])
    return " ".join(overrides) or None


def _hydra_value(value: Any) -> str:
    """`value` as a command-line override spells it (None is `null`, booleans lower case)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)

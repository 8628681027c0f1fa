"""What a `ckpt=` or `resume=` argument names, resolved once into a `CheckpointSource` and read
once; every loader (pipeline/checkpoint/load.py) and Lightning's restore share its contents.

The two arguments turn a folder into a file by different rules, on purpose:

- `ckpt=` (`resolve_checkpoint`: fine-tune, evaluate, predict, glue, generate, fill-mask, ...)
  wants a finished model: the first of `FOLDER_CANDIDATES` that exists (a fine-tuning run's
  best checkpoint, an HF folder, a pretraining run's `last.ckpt`, its HF export).
- `resume=` (`resolve_resume`: pretraining) wants the newest training state: the readable
  checkpoint with the highest global step (`newest_checkpoint`), whatever its name, skipping
  (and, in the run's own folder, moving aside) damaged files; the other files it read on the way
  are kept in the source (`CheckpointSource.beside`), for the best checkpoints' scores.

Checkpoints are read with `torch.load(weights_only=True)` (`read_checkpoint`), so a file cannot
run code on load.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.checkpoint.record import CheckpointRecord
from pipeline.run.errors import CheckpointLoadError, ConfigError, DamagedCheckpointError
from pipeline.run.folder import CHECKPOINT_DIR, another_folder, refuse_overwrite
from tokenizer.cache import partial_writes

__all__ = [
    "FOLDER_CANDIDATES",
    "CheckpointSource",
    "newest_checkpoint",
    "read_checkpoint",
    "remove_partial_saves",
    "resolve_checkpoint",
    "resolve_resume",
    "set_aside",
]

log = logging.getLogger(__name__)

# `ckpt=`: where a folder's model is looked for, in order; the first that exists wins: a
# fine-tuning run's best checkpoint, an HF folder, a pretraining run's last checkpoint, its HF
# export. (`resume=` takes a folder's newest checkpoint instead: `newest_checkpoint`.)
FOLDER_CANDIDATES = (
    "checkpoints/best.ckpt",
    "config.json",
    "checkpoints/last.ckpt",
    "last.ckpt",
    "hf/config.json",
)


@dataclass(frozen=True)
class CheckpointSource:
    """What a `ckpt=` or `resume=` argument names, resolved once and read once: every loader
    takes one, so a command reads each file once.

    Attributes:
        path: the checkpoint file, or the HF folder.
        contents: the checkpoint's contents (memory-mapped); None for an HF folder.
        given: the argument as the command line gave it, for messages and records (None: the
            source was not named by an argument).
        beside: `resume=` of a folder: every checkpoint of the folder read while choosing
            this one (resolved path -> contents), so that nothing reads them again.
    """

    path: Path
    contents: dict[str, Any] | None
    given: str | None = None
    beside: dict[Path, dict[str, Any]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def argument(self) -> str:
        """The argument as given (the path, for a source no argument named)."""
        return str(self.path) if self.given is None else self.given

    @property
    def record(self) -> CheckpointRecord:
        """The pipeline's entries of the checkpoint (all empty for an HF folder)."""
        return CheckpointRecord.of(self.contents)

    @property
    def kind(self) -> str:
        """ "hf", "finetuned" (a task model) or "pretrained"."""
        if self.contents is None:
            return "hf"
        return "finetuned" if self.record.finetune is not None else "pretrained"


# ----------------------------------------------------------------------------------------------
# ckpt=: a finished model


def resolve_checkpoint(
    given: str | os.PathLike | CheckpointSource, *, fine_tuned: bool = False
) -> CheckpointSource:
    """The checkpoint file or HF folder that `given` names (a file, a pretraining or
    fine-tuning run folder, an HF folder), read. `fine_tuned`: the command wants a fine-tuned
    model (`make evaluate`, `make predict`), and a missing path or a run folder without
    checkpoints is told what to give for one.

    Raises:
        CheckpointLoadError: nothing loadable there, or an unreadable checkpoint.
    """
    if isinstance(given, CheckpointSource):
        return given
    path = Path(given).expanduser()
    if not path.exists() and fine_tuned:
        raise CheckpointLoadError(
            f"ckpt={str(given)!r} does not exist; give a fine-tuning run folder "
            "(outputs/finetune/<task>/<run>/) or its checkpoints/best.ckpt"
        )
    if not path.exists():
        raise CheckpointLoadError(
            f"ckpt={str(path)!r} does not exist; give a checkpoint file (*.ckpt), a run folder "
            "(outputs/<model>/<stamp>/) or a Hugging Face export folder (with config.json)"
        )
    if path.is_dir() and fine_tuned and not list(path.glob(f"{CHECKPOINT_DIR}/*.ckpt")):
        raise CheckpointLoadError(
            f"{given} holds no checkpoints/best.ckpt or last.ckpt: the fine-tuning run did "
            "not finish an epoch; give a finished run folder or a *.ckpt file"
        )
    if path.is_dir():
        path = _resolve_folder(path)
    if path.name == "config.json":
        return CheckpointSource(path.parent, None, str(given))
    return CheckpointSource(path, read_checkpoint(path), str(given))


def _resolve_folder(folder: Path) -> Path:
    for name in FOLDER_CANDIDATES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointLoadError(
        f"ckpt={str(folder)!r} is a folder without a model: looked for "
        f"{', '.join(FOLDER_CANDIDATES)}; give a run folder, its checkpoint file or an HF export"
    )


# ----------------------------------------------------------------------------------------------
# resume=: the newest training state


def resolve_resume(
    resume: str | None, run_dir: Path, *, first_process: bool = True
) -> CheckpointSource | None:
    """The checkpoint to resume from, read.

    Args:
        resume: None (start fresh; refused when the run folder already has checkpoints, which
            the run would overwrite), "auto" (the newest complete checkpoint of this run folder,
            or a fresh start when there is none), a checkpoint file, or a run folder.
        run_dir: this run's folder.
        first_process: whether this process may move damaged checkpoints aside and remove
            the partial files of interrupted saves in `run_dir` (only one of a multi-process
            run does).
    """
    if resume is None:
        refuse_overwrite("pretrain", run_dir)
    if first_process:  # the run's own folder, about to be written to
        remove_partial_saves(run_dir)
    if resume is None:
        return None
    if resume == "auto":
        existed = sorted(p.name for p in (run_dir / CHECKPOINT_DIR).glob("*.ckpt"))
        found = newest_checkpoint(run_dir, set_aside_damaged=first_process, given=resume)
        if found is None and existed:
            raise ConfigError(
                f"resume=auto: none of the checkpoints in {run_dir / CHECKPOINT_DIR} can be read "
                f"({', '.join(existed)}; see the warnings above); rather than start the run over "
                "in its own folder, this stops: resume from a copy with resume=PATH, or start "
                f"afresh with another {another_folder()}"
            )
        if found is None:
            log.info("resume=auto: no checkpoint in %s yet, starting from scratch", run_dir)
        return found
    path = Path(resume)
    if path.is_dir():
        found = newest_checkpoint(path, given=resume)
        if found is None:
            raise ConfigError(f"resume={resume}: no readable checkpoint in {path / CHECKPOINT_DIR}")
        return found
    if not path.is_file():
        raise ConfigError(
            f"resume={resume}: no such checkpoint file or run folder; use resume=auto, a "
            "*.ckpt file or a run folder"
        )
    return CheckpointSource(path, read_checkpoint(path), str(resume))


def newest_checkpoint(
    run_dir: Path, *, set_aside_damaged: bool = False, given: str | None = None
) -> CheckpointSource | None:
    """The checkpoint of a run folder with the highest global step, read (its contents are
    kept, and those of the folder's other checkpoints in `beside`, so that nothing reads them
    again), or None when it has none.

    Of equal steps, a periodic `stepNNNNNNN.ckpt` comes first: `last.ckpt` holds the same state
    but is overwritten as the resumed run goes on (the path a run prints as resumed from must
    keep naming that state), and a best-by-validation one is saved after its step's validation.

    Files are atomic, so a file under a checkpoint name is complete unless damaged afterwards;
    a damaged one is skipped with a warning and, with `set_aside_damaged` (the run's own
    folder, about to be written to, by its first process only), renamed to `<name>.damaged`
    so that the run's next `last.ckpt` takes its place instead of a `last-v1.ckpt` beside it.
    """
    ranked = []
    contents = {}
    for path in (run_dir / CHECKPOINT_DIR).glob("*.ckpt"):
        try:
            contents[path] = read_checkpoint(path)
            step = int(contents[path].get("global_step", -1))
        except DamagedCheckpointError as err:
            if set_aside_damaged:
                err = f"{err}; moved aside to {set_aside(path).name}"
            log.warning("skipping %s", err)
            continue
        except CheckpointLoadError as err:  # the system failed to read it: it may read later
            log.warning("skipping %s", err)
            continue
        kind = 0 if path.name.startswith("best-") else 1 if path.name == "last.ckpt" else 2
        ranked.append((step, kind, path.stat().st_mtime, path))
    if not ranked:
        return None
    newest = max(ranked)[-1]
    beside = {path.resolve(): read for path, read in contents.items()}
    return CheckpointSource(newest, contents[newest], given, beside)


def remove_partial_saves(run_dir: Path) -> list[Path]:
    """Delete the temporary files of checkpoint saves that a kill interrupted (each checkpoint
    is written under a temporary name, then renamed: such a file is never a complete
    checkpoint, which has its own name); returns them. Called before this run's folder is
    written to, by its first process, while no save of the run can be going on."""
    partial = partial_writes(run_dir / CHECKPOINT_DIR, "*.ckpt")
    for path in partial:
        log.info("removing %s, a checkpoint save interrupted before it was complete", path)
        path.unlink(missing_ok=True)
    return partial


def set_aside(path: Path) -> Path:
    """Rename a damaged file to `<name>.damaged` (`.damaged-2`, ... if taken); never deletes."""
    target = path.with_name(f"{path.name}.damaged")
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{path.name}.damaged-{number}")
    with contextlib.suppress(FileNotFoundError):  # another process of the run moved it first
        path.rename(target)
    return target


# ----------------------------------------------------------------------------------------------
# Reading a file


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A Lightning checkpoint's contents, memory-mapped (tensors are read when used), plain
    data only; `CheckpointLoadError` naming the file and the fix when it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointLoadError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise CheckpointLoadError(
                f"{path} holds Python objects ({found[1]}) besides tensors and plain values, and "
                "they are not loaded (loading them could run code); use a checkpoint written by "
                "`make pretrain`, or an HF folder written by models.hf.export_hf"
            ) from err
        raise _unreadable(path, err) from err
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise _unreadable(path, err) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise CheckpointLoadError(
            f"{path} is not a Lightning checkpoint (no 'state_dict' entry); give a checkpoint "
            "written by `make pretrain`, its run folder or an HF export folder"
        )
    return checkpoint


def _unreadable(path: Path, err: Exception) -> CheckpointLoadError:
    """`DamagedCheckpointError` when the file's bytes read but torch cannot make a checkpoint of
    them, `CheckpointLoadError` when the system fails to read the bytes themselves. (torch's own
    error does not tell: a file truncated below the zip footer fails its memory map with
    OSError EINVAL, a bad disk read with OSError EIO.)"""
    try:
        with open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass
    except OSError as failed:
        return CheckpointLoadError(
            f"{path} could not be read ({failed}); if the disk or network file system is "
            "back, try again, else use another checkpoint of the run"
        )
    reason = (str(err).strip().splitlines() or [""])[0].split(". ")[0]  # torch's are long
    if isinstance(err, pickle.UnpicklingError):  # torch's text here suggests weights_only=False
        reason = "its bytes are not a PyTorch checkpoint"
    return DamagedCheckpointError(
        f"{path} is not a readable checkpoint ({type(err).__name__}: {reason}); the file may be "
        "truncated or corrupt (e.g. copied while it was being written): use another checkpoint "
        "of the run or copy it again"
    )

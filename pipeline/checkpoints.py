"""What a pretraining checkpoint holds, how it is written, which ones are kept, and resuming.

A checkpoint (`<run dir>/checkpoints/*.ckpt`, a Lightning checkpoint) holds the model, optimizer,
schedule, precision scaler, loop counters and data position (Lightning's own keys), plus:

    model_config  {"family": "bert"|"gpt", **BertConfig|GPTConfig fields}
    tokenizer     {"kind": "wordpiece"|"bpe", "json": the tokenizer's JSON}
    config        the resolved run config (plain dict)
    rng           torch (CPU and CUDA), numpy and Python RNG states

Everything in it is plain data, so it loads with `torch.load(weights_only=True)`.

Kept: the last `keep_last` periodic checkpoints (`stepNNNNNNN.ckpt`), the `keep_best` best by
validation loss (`best-stepNNNNNNN.ckpt`), and `last.ckpt`. Each file is written to a temporary
name, fsynced and renamed, so a crash never leaves a half-written checkpoint under a real name.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from tokenizers import Tokenizer

from models.config import BertConfig, GPTConfig
from pipeline.config import ConfigError
from pipeline.load import CheckpointLoadError, read_checkpoint
from tokenizer import atomic_path

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file, fsyncs it, then renames it into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)


def checkpoint_callbacks(
    run_dir: Path, every_n_steps: int, keep_last: int, keep_best: int
) -> list[ModelCheckpoint]:
    """The periodic checkpoints (the last `keep_last`, plus `last.ckpt`) and the best ones."""
    directory = run_dir / CHECKPOINT_DIR
    periodic = ModelCheckpoint(
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
    )
    callbacks = [periodic]
    if keep_best:
        callbacks.append(
            ModelCheckpoint(
                dirpath=directory,
                filename="best-step{step:07d}",
                auto_insert_metric_name=False,
                monitor="val/loss",
                mode="min",
                save_top_k=keep_best,
            )
        )
    return callbacks


def family_of(config: BertConfig | GPTConfig) -> str:
    return "bert" if isinstance(config, BertConfig) else "gpt"


def model_config_record(config: BertConfig | GPTConfig) -> dict[str, Any]:
    return {"family": family_of(config), **dataclasses.asdict(config)}


class CheckpointExtras(L.Callback):
    """Adds the tokenizer, resolved config and RNG states to every checkpoint, and restores the
    RNG states on resume (dropout then draws the same masks as in the uninterrupted run).

    Only rank 0 writes checkpoints, so every rank resumes with rank 0's RNG state; ranks start
    from the same seed and draw alike, so that is the state each of them had.
    """

    def __init__(self, tokenizer: Tokenizer, tokenizer_kind: str, config: dict[str, Any]):
        self.tokenizer = {"kind": tokenizer_kind, "json": tokenizer.to_str()}
        self.config = config

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        checkpoint["model_config"] = model_config_record(pl_module.model_config)
        checkpoint["tokenizer"] = self.tokenizer
        checkpoint["config"] = self.config
        checkpoint["rng"] = rng_states()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if "rng" in checkpoint:
            restore_rng_states(checkpoint["rng"])


def rng_states() -> dict[str, Any]:
    """The global RNG states, as plain data (tensors, lists, ints)."""
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
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
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
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run folder that loads, or None when it has none.

    Files are atomic, so a file under a checkpoint name is complete unless damaged afterwards;
    a damaged one is skipped with a warning.
    """
    directory = run_dir / CHECKPOINT_DIR
    candidates = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            read_checkpoint(path)
        except CheckpointLoadError as err:
            log.warning("skipping %s", err)
            continue
        return path
    return None


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint to resume from.

    Args:
        resume: None (start fresh; refused when the run folder already has checkpoints, which
            the run would overwrite), "auto" (the newest complete checkpoint of this run folder,
            or a fresh start when there is none), a checkpoint file, or a run folder.
        run_dir: this run's folder.
    """
    if resume is None:
        existing = sorted((run_dir / CHECKPOINT_DIR).glob("*.ckpt"))
        if existing:
            raise ConfigError(
                f"run folder {run_dir} already has checkpoints ({existing[-1].name}, ...): pass "
                "resume=auto to continue that run, or choose another run_name"
            )
        return None
    if resume == "auto":
        found = newest_checkpoint(run_dir)
        if found is None:
            log.info("resume=auto: no checkpoint in %s yet, starting from scratch", run_dir)
        return found
    path = Path(resume)
    if path.is_dir():
        found = newest_checkpoint(path)
        if found is None:
            raise ConfigError(f"resume={resume}: no readable checkpoint in {path / CHECKPOINT_DIR}")
        return found
    if not path.is_file():
        raise ConfigError(
            f"resume={resume}: no such checkpoint file or run folder; use resume=auto, a "
            "*.ckpt file or a run folder"
        )
    return path


def check_compatible(
    checkpoint: dict[str, Any], model_config: BertConfig | GPTConfig, tokenizer: Tokenizer
) -> None:
    """Raise `CheckpointLoadError` listing every model field (and the tokenizer) that differs
    between a checkpoint and this run."""
    saved = checkpoint.get("model_config")
    if saved is None:
        raise CheckpointLoadError(
            "the checkpoint has no model_config: it was not written by this pipeline's pretraining"
        )
    current = model_config_record(model_config)
    mismatched = [
        f"model.{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in current.items()
        if saved.get(key) != value
    ]
    saved_tokenizer = checkpoint.get("tokenizer")
    if saved_tokenizer is not None and saved_tokenizer["json"] != tokenizer.to_str():
        mismatched.append("tokenizer: the checkpoint was trained with a different tokenizer")
    if mismatched:
        raise CheckpointLoadError(
            "the checkpoint does not fit this run's config:\n  "
            + "\n  ".join(mismatched)
            + "\nresume with the config it was trained with (its .hydra/config.yaml)"
        )

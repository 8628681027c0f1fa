"""Load a trained model with its tokenizer, for generation, fill-mask and fine-tuning.

`load_pretrained(path)` accepts what the pipeline writes:

- a Lightning checkpoint (`*.ckpt`) of `make pretrain`: the weights under `state_dict` (prefix
  `model.`), the architecture under `model_config` (`{"family": ..., **asdict(config)}`) and the
  tokenizer under `tokenizer` (`{"kind": ..., "json": tokenizer.to_str()}`);
- a run folder (`outputs/<model>/<stamp>/`): its `checkpoints/last.ckpt`;
- a Hugging Face folder (`config.json` + weights + `tokenizer.json` or `vocab.txt`), such as a
  run's `hf/` export.

Checkpoints are read with `torch.load(weights_only=True)`, so a file cannot run code on load.

Also here, shared by the inference commands (`make generate`, `make fill-mask`): the device and
its autocast, and required keys.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tokenizers import Tokenizer
from torch import nn

from models.config import BertConfig, GPTConfig
from models.hf import UnsupportedCheckpointError, load_hf
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.run.errors import (
    CheckpointLoadError,
    ConfigError,
    DamagedCheckpointError,
    WrongFamilyError,
)
from pipeline.run.families import family_named, family_of_model
from tokenizer import (
    TokenizerLoadError,
    UnsupportedTokenizerError,
    load_tokenizer,
    tokenizer_kind,
)

__all__ = [
    "CheckpointSource",
    "Pretrained",
    "expect_family",
    "inference_autocast",
    "load_pretrained",
    "model_state",
    "read_checkpoint",
    "require_keys",
    "resolve_checkpoint",
    "resolve_device",
]

log = logging.getLogger(__name__)

STATE_PREFIX = "model."  # the LightningModule holds the model as `self.model`
# Where a folder's model is looked for, in order; the first that exists wins: a fine-tuning
# run's best checkpoint, an HF folder, a pretraining run's last checkpoint, its HF export.
FOLDER_CANDIDATES = (
    "checkpoints/best.ckpt",
    "config.json",
    "checkpoints/last.ckpt",
    "last.ckpt",
    "hf/config.json",
)


@dataclass
class Pretrained:
    """A trained model, in eval mode on the CPU, with the tokenizer it was trained with.

    Attributes:
        family: "bert" or "gpt".
        model: `BertForPreTraining` (or `BertModel` from a head-less HF export) or `GPT`.
        tokenizer: the `tokenizers.Tokenizer` of the run (its kind: `tokenizer_kind`).
        source: the file or folder the model was read from (a run folder resolves to its
            checkpoint file).
        trained_seq_len: the longest sequence it was trained on (None: unknown, an HF folder).
    """

    family: str
    model: nn.Module
    tokenizer: Tokenizer
    source: Path
    trained_seq_len: int | None = None


@dataclass(frozen=True)
class CheckpointSource:
    """What a `ckpt=` argument names, resolved once and read once: every loader below takes
    one (or the argument itself, which it resolves), so a command reads each file once.

    Attributes:
        path: the checkpoint file, or the HF folder.
        contents: the checkpoint's contents (memory-mapped); None for an HF folder.
    """

    path: Path
    contents: dict[str, Any] | None

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


def resolve_checkpoint(given: str | os.PathLike | CheckpointSource) -> CheckpointSource:
    """The checkpoint file or HF folder that `given` names (a file, a pretraining or
    fine-tuning run folder, an HF folder), read.

    Raises:
        CheckpointLoadError: nothing loadable there, or an unreadable checkpoint.
    """
    if isinstance(given, CheckpointSource):
        return given
    path = Path(given).expanduser()
    if not path.exists():
        raise CheckpointLoadError(
            f"ckpt={str(path)!r} does not exist; give a checkpoint file (*.ckpt), a run folder "
            "(outputs/<model>/<stamp>/) or a Hugging Face export folder (with config.json)"
        )
    if path.is_dir():
        path = _resolve_folder(path)
    if path.name == "config.json":
        return CheckpointSource(path.parent, None)
    return CheckpointSource(path, read_checkpoint(path))


def load_pretrained(given: str | os.PathLike | CheckpointSource) -> Pretrained:
    """Load a model and its tokenizer from a checkpoint file, a run folder or an HF folder.

    Raises:
        CheckpointLoadError: nothing loadable at `given`, an unreadable or foreign checkpoint,
            or weights that do not fit the stored architecture.
    """
    source = resolve_checkpoint(given)
    if source.contents is None:
        pretrained = _load_hf_folder(source.path)
    else:
        pretrained = _load_lightning_checkpoint(source.path, source.contents)
    pretrained.model.eval()
    log.info("loaded a %s model from %s", pretrained.family, pretrained.source)
    return pretrained


def expect_family(pretrained: Pretrained, family: str, instead: str | None = None) -> None:
    """Raise `WrongFamilyError` unless `pretrained` is a `family` model; `instead` names what to
    use for the model's own family (default: its family's `try_command`, e.g. "make fill-mask")."""
    if pretrained.family != family:
        instead = instead or f"make {family_named(pretrained.family).try_command[0]}"
        raise WrongFamilyError(
            f"{pretrained.source} holds a {pretrained.family.upper()} model, but this command "
            f"needs a {family.upper()}; for a {pretrained.family.upper()} use {instead}"
        )


# ----------------------------------------------------------------------------------------------
# Sources


def _resolve_folder(folder: Path) -> Path:
    for name in FOLDER_CANDIDATES:
        if (folder / name).is_file():
            return folder / name
    raise CheckpointLoadError(
        f"ckpt={str(folder)!r} is a folder without a model: looked for "
        f"{', '.join(FOLDER_CANDIDATES)}; give a run folder, its checkpoint file or an HF export"
    )


def _load_lightning_checkpoint(path: Path, checkpoint: dict[str, Any]) -> Pretrained:
    for key in ("model_config", "tokenizer"):
        if key not in checkpoint:
            raise CheckpointLoadError(
                f"{path} has no {key!r} entry: it predates this checkpoint format or was not "
                "written by `make pretrain`; load the run's HF export instead (the hf/ folder "
                "next to checkpoints/), or re-train with the current pipeline"
            )
    record = CheckpointRecord.of(checkpoint)
    family, config = record.model(path)
    tokenizer = record.stored_tokenizer(path)
    state = model_state(checkpoint)
    model = _build_model(path, family, config, state)
    _check_vocab(path, tokenizer, config.vocab_size)
    return Pretrained(family, model, tokenizer, path, record.trained_seq_len)


def model_state(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's weights in a Lightning checkpoint, with the LightningModule's `model.` prefix
    removed (metric states and other module attributes left out)."""
    return {
        key.removeprefix(STATE_PREFIX): value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(STATE_PREFIX)
    }


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


def _build_model(
    path: Path, family: str, config: BertConfig | GPTConfig, state: dict[str, torch.Tensor]
) -> nn.Module:
    """The model of `config` holding a copy of the weights of `state` (no random init is run:
    the model is built on the meta device and the copies are assigned to it).

    A copy, not the checkpoint's tensors themselves: a `CheckpointSource` is read once and
    shared by every model built from it (`make glue` builds one per fine-tune), and training on
    a CPU changes a model's weights in place, so a model holding the source's tensors would hand
    its training on to the next model built from that source (a move to a GPU copies them
    anyway). The cost: the weights are read into memory at load, once per model."""
    with torch.device("meta"):
        model = family_named(family).model_class(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    misshapen = [
        f"{name} {tuple(state[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    if missing or unexpected or misshapen:
        problems = {"missing": missing, "unexpected": unexpected, "wrong shape": misshapen}
        listed = "; ".join(
            f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            for what, names in problems.items()
            if names
        )
        raise CheckpointLoadError(
            f"{path}: the weights do not match the {family} architecture in model_config "
            f"({listed}); the checkpoint's model_config and state_dict disagree, so it was "
            "edited or written by a different version of the model code"
        )
    # deepcopy keeps tensors that share storage (tied weights) sharing it in the copy
    model.load_state_dict(copy.deepcopy(state), assign=True)
    return model


def _check_vocab(path: Path, tokenizer: Tokenizer, model_vocab: int) -> None:
    if tokenizer.get_vocab_size() > model_vocab:
        raise CheckpointLoadError(
            f"{path}: the tokenizer has {tokenizer.get_vocab_size()} tokens but the model only "
            f"{model_vocab} embeddings; the tokenizer does not belong to this model"
        )


def _load_hf_folder(folder: Path) -> Pretrained:
    try:
        model = load_hf(folder)
    except (UnsupportedCheckpointError, FileNotFoundError, OSError) as err:
        raise CheckpointLoadError(f"{folder}: cannot load the HF checkpoint ({err})") from err
    except (json.JSONDecodeError, RuntimeError, KeyError) as err:
        raise CheckpointLoadError(
            f"{folder}: config.json or the weights are unreadable ({type(err).__name__}: {err}); "
            "export the model again with models.hf.export_hf"
        ) from err
    if not any((folder / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        raise CheckpointLoadError(
            f"{folder} has no tokenizer.json or vocab.txt; copy the run's tokenizer.json into it"
        )
    try:
        tokenizer = load_tokenizer(folder, lowercase=_hf_lowercase(folder))
    except TokenizerLoadError as err:
        raise CheckpointLoadError(f"{folder}: {err}") from err
    try:
        kind = tokenizer_kind(tokenizer)
    except UnsupportedTokenizerError as err:
        raise CheckpointLoadError(f"{folder}: {err}") from err
    family = family_of_model(model)
    if kind != family.tokenizer_kind:
        raise CheckpointLoadError(
            f"{folder}: the model is a {family.name} model, which reads {family.tokenizer_kind} "
            f"tokens, but the folder's tokenizer is a {kind} one; put the tokenizer the model "
            "was trained with (its tokenizer.json) in the folder"
        )
    _check_vocab(folder, tokenizer, model.config.vocab_size)
    return Pretrained(family.name, model, tokenizer, folder)


def _hf_lowercase(folder: Path) -> bool:
    """Whether a `vocab.txt` is uncased, as `tokenizer_config.json` says (default: yes)."""
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return True
    try:
        return bool(json.loads(config_path.read_text()).get("do_lower_case", True))
    except (json.JSONDecodeError, AttributeError):
        return True


# ----------------------------------------------------------------------------------------------
# Running a loaded model


def resolve_device(name: str) -> torch.device:
    """`auto` -> the GPU when there is one, else the CPU; anything else as `torch.device` reads
    it ("cpu", "cuda", "cuda:1").

    Raises:
        ConfigError: `name` is not a device, or names a GPU that is not there.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu or cuda[:N]") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA GPU is available; use device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"device={name!r} but there are {torch.cuda.device_count()} GPUs; use device=cuda:0"
        )
    return device


def inference_autocast(device: torch.device) -> AbstractContextManager[Any]:
    """bf16 autocast on GPUs that support it (the precision models are trained in), else none."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# The command line of the inference commands


def require_keys(cfg: DictConfig, usage: str, *keys: str) -> None:
    """Raise `ConfigError` naming the first of `keys` left at `???`, with a usage example."""
    for key in keys:
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{key} is required: {usage}")

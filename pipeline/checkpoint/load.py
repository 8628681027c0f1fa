"""Every load of a model from a `CheckpointSource` (pipeline/checkpoint/source.py: what a
`ckpt=` names, resolved and read once): a pretrained model with its tokenizer, for generation,
fill-mask and scoring (`load_pretrained`); the backbone to fine-tune (`load_backbone`); a
fine-tuned task model (`load_finetuned`). Each is built by one meta-device builder
(`build_model`) that lists every weight that does not fit.

`load_pretrained(path)` accepts what the pipeline writes:

- a Lightning checkpoint (`*.ckpt`) of `make pretrain`: the weights under `state_dict` (prefix
  `model.`), the architecture under `model_config` (`{"family": ..., **asdict(config)}`) and the
  tokenizer under `tokenizer` (`{"kind": ..., "json": tokenizer.to_str()}`);
- a run folder (`outputs/<model>/<stamp>/`): its `checkpoints/last.ckpt`;
- a Hugging Face folder (`config.json` + weights + `tokenizer.json` or `vocab.txt`), such as a
  run's `hf/` export.

Also here, shared by the inference commands (`make generate`, `make fill-mask`): the device and
its autocast, and required keys.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shlex
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tokenizers import Tokenizer
from torch import nn
from yaml import YAMLError

from models.heads import DocumentClassifier, SequenceClassifier
from models.hf import UnsupportedCheckpointError, load_hf
from pipeline.checkpoint.head import HeadSpec, build_head, task_backbone
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.checkpoint.source import CheckpointSource, resolve_checkpoint
from pipeline.run.errors import (
    CheckpointLoadError,
    ConfigError,
    WrongFamilyError,
)
from pipeline.run.families import (
    INFERENCE,
    INFERENCE_COMMAND,
    families,
    family_named,
    family_of_model,
)
from pipeline.run.folder import RECORD_DIR, run_folder_of
from tokenizer import (
    TokenizerLoadError,
    UnsupportedTokenizerError,
    load_tokenizer,
    tokenizer_kind,
)

__all__ = [
    "Finetuned",
    "Pretrained",
    "build_model",
    "expect_inference",
    "inference_autocast",
    "load_backbone",
    "load_finetuned",
    "load_pretrained",
    "model_state",
    "require_keys",
    "resolve_device",
]

log = logging.getLogger(__name__)

STATE_PREFIX = "model."  # the LightningModule holds the model as `self.model`
_MAX_FINE_TUNES = 8  # links followed from a fine-tuned model back to its pretraining run


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


@dataclass
class Finetuned:
    """A fine-tuned task model (eval mode, CPU) with its tokenizer and head settings.

    Attributes:
        model: the task model (`models.heads.SequenceClassifier`, or `DocumentClassifier` for
            sliding-window documents), as `pipeline.checkpoint.head.build_head` builds it.
        head: what the head predicts (the checkpoint's `finetune` entry).
        config: the fine-tuning run's resolved config.
    """

    model: SequenceClassifier | DocumentClassifier
    head: HeadSpec
    tokenizer: Tokenizer
    family: str
    source: Path
    config: dict[str, Any]
    trained_seq_len: int | None = None


def load_pretrained(
    given: str | os.PathLike | CheckpointSource, *, instead: str = "give it instead: ckpt={ckpt}"
) -> Pretrained:
    """Load a model and its tokenizer from a checkpoint file, a run folder or an HF folder.

    `instead`: what to do with the pretraining run when `given` is a fine-tuned model (its
    path replaces `{ckpt}`), e.g. "score it: make evaluate-lm ckpt={ckpt} suite=blimp".

    Raises:
        CheckpointLoadError: nothing loadable at `given`, a fine-tuned model, an unreadable or
            foreign checkpoint, or weights that do not fit the stored architecture.
    """
    source = resolve_checkpoint(given)
    if source.kind == "finetuned":
        raise CheckpointLoadError(not_pretrained(source, instead))
    if source.contents is None:
        pretrained = _load_hf_folder(source.path)
    else:
        pretrained = _load_lightning_checkpoint(source.path, source.contents)
    pretrained.model.eval()
    log.info("loaded a %s model from %s", pretrained.family, pretrained.source)
    return pretrained


def load_finetuned(given: str | os.PathLike | CheckpointSource) -> Finetuned:
    """Load a fine-tuned model from its checkpoint file or run folder.

    Raises:
        CheckpointLoadError: the path is missing, unreadable, or not a fine-tuned checkpoint
            (the message says what it is instead and what to give).
    """
    source = resolve_checkpoint(given, fine_tuned=True)
    if source.kind != "finetuned":
        raise CheckpointLoadError(
            f"{source.path} is not a fine-tuned model (no 'finetune' entry): it looks like "
            "a pretrained one; fine-tune it first with `make finetune task=... ckpt=...`"
        )
    file, record = source.path, source.record
    family, config = record.model(file)
    tokenizer = record.stored_tokenizer(file)
    try:
        head = HeadSpec.from_record(record.finetune)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointLoadError(f"{file}: damaged 'finetune' entry ({err!r})") from err
    with torch.device("meta"):  # the head's few weights and unsaved buffers are made as usual
        backbone = family_named(family).backbone_class(config)
    model = build_model(
        file,
        f"the {family} architecture in model_config with the task head in finetune",
        build_head(backbone, head),
        model_state(source.contents),
    ).eval()
    return Finetuned(
        model, head, tokenizer, family, file, dict(record.config), record.trained_seq_len
    )


def load_backbone(given: str | os.PathLike | CheckpointSource) -> Pretrained:
    """The backbone to fine-tune (as `model`) with its tokenizer and trained length.

    Takes a pretraining checkpoint or run folder, an HF folder (ours or any BERT/Llama one the
    models package imports), or a fine-tuned model (its backbone, e.g. MNLI -> RTE)."""
    source = resolve_checkpoint(given)
    if source.kind != "finetuned":
        return load_pretrained(source)
    tuned = load_finetuned(source)
    return Pretrained(
        tuned.family,
        task_backbone(tuned.model),
        tuned.tokenizer,
        tuned.source,
        tuned.trained_seq_len,
    )


def not_pretrained(source: CheckpointSource, instead: str) -> str:
    """The message for a fine-tuned model given where a pretrained one is needed: what it is
    (a task classifier: its weights hold no language-model head), the pretraining run it
    started from (`fine_tuned_from`), and `instead`, with that run in place of `{ckpt}`."""
    record = source.record
    text = (
        f"{source.argument} is a fine-tuned {(record.finetune or {}).get('task', 'task')} "
        f"classifier ({source.path.name}: a task head on the pretrained backbone, without the "
        "language-model head of pretraining)"
    )
    if record.config.get("from_scratch") is True:
        text += ", trained from random weights (from_scratch=true)"
    chain = fine_tuned_from(source)
    named, last = chain[-1] if chain else ("", None)
    if last is not None and last.kind != "finetuned":
        via = "".join(f" by way of the fine-tuned model {n}" for n, _ in chain[:-1])
        run = "the HF folder" if last.kind == "hf" else "the pretraining run"
        return f"{text}; it was fine-tuned from {run} {named}{via}: " + instead.format(
            ckpt=shlex.quote(named)
        )
    if chain and last is None:
        return (
            f"{text}; its fine-tuning was given ckpt={named}, which is not found from here; "
            "for that pretraining run: " + instead.format(ckpt=shlex.quote(named))
        )
    return f"{text}; its record does not name the pretraining run it started from: " + (
        instead.format(ckpt="outputs/<model>/<run>")
    )


def fine_tuned_from(source: CheckpointSource) -> list[tuple[str, CheckpointSource | None]]:
    """The models a fine-tuned `source` descends from, nearest first, each as the `ckpt=` its
    fine-tuning recorded (`_recorded_path`) and read (None: not found from here), up to the
    first that is not a fine-tuned model: its pretraining run (MNLI -> RTE is two links)."""
    chain: list[tuple[str, CheckpointSource | None]] = []
    origin: CheckpointSource | None = source
    while origin is not None and origin.kind == "finetuned" and len(chain) < _MAX_FINE_TUNES:
        named = origin.record.config.get("ckpt")
        if not isinstance(named, str):
            break
        named = _recorded_path(origin.path, named)
        try:
            origin = resolve_checkpoint(named)
        except CheckpointLoadError:
            origin = None
        chain.append((named, origin))
    return chain


def _recorded_path(checkpoint: Path, named: str) -> str:
    """A path recorded in a fine-tuned checkpoint's config (`ckpt=` as its command gave it):
    as recorded when it is absolute or exists from here, else joined to the working folder
    that Hydra recorded for the fine-tuning run (`.hydra/hydra.yaml` of the checkpoint's run
    folder), when that exists."""
    path = Path(named).expanduser()
    if path.is_absolute() or path.exists():
        return named
    try:
        hydra = OmegaConf.load(run_folder_of(checkpoint) / RECORD_DIR / "hydra.yaml")
        there = Path(str(hydra.hydra.runtime.cwd)) / path
    except (OSError, YAMLError, OmegaConfBaseException):  # no such record: keep the path
        return named
    return str(there) if there.exists() else named


def expect_inference(pretrained: Pretrained, inference: str) -> None:
    """Raise `WrongFamilyError` unless the family of `pretrained` does `inference` ("fill-mask",
    "generate", "score": `Family.inference`), naming the families that do and what to use
    instead (the model's family's `try_command`, e.g. "make fill-mask")."""
    family = family_named(pretrained.family)
    if family.supports(inference):
        return
    able = " or ".join(f.name.upper() for f in families() if f.supports(inference)) or "model"
    raise WrongFamilyError(
        f"{pretrained.source} holds a {family.name.upper()} model, but make "
        f"{INFERENCE_COMMAND[inference]} needs a "
        f"{able} ({INFERENCE[inference]}); for a {family.name.upper()} use "
        f"make {family.try_command[0]}"
    )


# ----------------------------------------------------------------------------------------------
# Building models from weights


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
    with torch.device("meta"):
        model = family_named(family).model_class(config)
    model = build_model(path, f"the {family} architecture in model_config", model, state)
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


def build_model(
    path: Path, described: str, model: nn.Module, state: dict[str, torch.Tensor]
) -> nn.Module:
    """`model`, built with its weights on the meta device (no random init is run), holding a
    copy of the weights of `state`, assigned to it; every name missing from `state`, every one
    `state` has besides, and every weight of another shape is listed in the error.

    Args:
        path: the checkpoint, for the error message.
        described: what the architecture is, for the error message ("the bert architecture
            in model_config").
        model: the model to fill; parts built off the meta device (a task head's buffers that
            are not saved) keep their values unless `state` holds them.
        state: the weights, named as `model.state_dict()` names them.

    A copy, not the checkpoint's tensors themselves: a `CheckpointSource` is read once and
    shared by every model built from it (`make glue` builds one per fine-tune), and training on
    a CPU changes a model's weights in place, so a model holding the source's tensors would hand
    its training on to the next model built from that source (a move to a GPU copies them
    anyway). The cost: the weights are read into memory at load, once per model."""
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
            f"{path}: the weights do not match {described} "
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
    # any registered family's model or backbone whose class names an HF mapping
    classes = [c for family in families() for c in (family.model_class, family.backbone_class)]
    try:
        model = load_hf(folder, classes)
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

"""The entries the pipeline adds to a Lightning checkpoint, defined once.

Beside Lightning's own entries (`state_dict`, `optimizer_states`, `loops`, `callbacks`, ...), a
checkpoint holds one `CheckpointRecord`: the architecture, the tokenizer, the resolved run
config, the longest sequence trained, the wandb run, every rank's RNG states and, for a
fine-tuned model, its head. The callbacks that save checkpoints write it with `write_into`
(`pipeline.checkpoint.saving.CheckpointExtras`, and `pipeline.finetune.task_module.TaskModule` for the head);
everything that reads a checkpoint reads it with `CheckpointRecord.of`. Every entry is plain
data, so a checkpoint loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from models.config import ModelConfig
from pipeline.run.errors import CheckpointLoadError, UnknownFamilyError
from pipeline.run.families import families, family_named, family_of_config
from tokenizer import UnsupportedTokenizerError, tokenizer_kind


@dataclass
class CheckpointRecord:
    """What the pipeline keeps in a checkpoint beside Lightning's state.

    Attributes:
        model_config: `{"family": name, **fields of the family's config}` (`describe_model`).
        tokenizer: `{"kind": "wordpiece" | "bpe", "json": Tokenizer.to_str()}` (the kind is
            for a reader of the file; the pipeline reads it from the tokenizer itself).
        config: the run's resolved Hydra config ({} when none was stored).
        trained_seq_len: the longest sequence (tokens, special ones included) trained so far;
            read from checkpoints that predate the entry as their config's `objective.seq_len`.
        wandb: the wandb run to continue (`pipeline.training.loggers.wandb_run_record`), {} for none.
        rng: the global RNG states of each rank, indexed by rank ([] for none).
        finetune: a fine-tuned model's head (`HeadSpec.record()`); None for a pretrained one.
    """

    model_config: dict[str, Any] | None = None
    tokenizer: dict[str, str] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    trained_seq_len: int | None = None
    wandb: dict[str, str] = field(default_factory=dict)
    rng: list[Any] = field(default_factory=list)
    finetune: dict[str, Any] | None = None

    @classmethod
    def of(cls, checkpoint: dict[str, Any] | None) -> CheckpointRecord:
        """The record in a checkpoint's contents, entries of the wrong type read as absent
        (the accessors below say what is missing when it is needed)."""
        checkpoint = checkpoint or {}

        def entry(name: str, kind: type) -> Any:
            value = checkpoint.get(name)
            return value if isinstance(value, kind) else None

        config = entry("config", dict) or {}
        length = checkpoint.get("trained_seq_len")
        if not isinstance(length, int):
            objective = config.get("objective")
            length = objective.get("seq_len") if isinstance(objective, dict) else None
        return cls(
            model_config=entry("model_config", dict),
            tokenizer=entry("tokenizer", dict),
            config=config,
            trained_seq_len=length if isinstance(length, int) else None,
            wandb=dict(entry("wandb", dict) or {}),
            rng=entry("rng", list) or [],
            finetune=entry("finetune", dict),
        )

    def write_into(self, checkpoint: dict[str, Any]) -> None:
        """Add the entries that are set to `checkpoint` (those left empty are not written)."""
        for name, value in dataclasses.asdict(self).items():
            if value is not None and value != {} and value != []:
                checkpoint[name] = value

    @staticmethod
    def describe_model(config: Any) -> dict[str, Any]:
        """The `model_config` entry of a model config: its family's name and its fields."""
        return {"family": family_of_config(config).name, **dataclasses.asdict(config)}

    @staticmethod
    def describe_tokenizer(tokenizer: Tokenizer) -> dict[str, str]:
        """The `tokenizer` entry: its kind and its full JSON."""
        return {"kind": tokenizer_kind(tokenizer), "json": tokenizer.to_str()}

    def model(self, path: Path) -> tuple[str, ModelConfig]:
        """(family name, model config) of the `model_config` entry.

        Raises:
            CheckpointLoadError: an unknown family, or fields that make no valid config.
        """
        fields = dict(self.model_config or {})
        try:
            family = family_named(fields.pop("family", None))
        except UnknownFamilyError as err:
            known = ", ".join(repr(f.name) for f in families())
            raise CheckpointLoadError(
                f"{path}: model_config['family'] is {err.args[1]!r}, expected one of {known}; "
                "the checkpoint was not written by `make pretrain`"
            ) from err
        config_class = family.config_class
        try:
            return family.name, config_class(**fields)
        except (TypeError, ValueError) as err:
            raise CheckpointLoadError(
                f"{path}: model_config does not make a valid {config_class.__name__} ({err}); "
                "the checkpoint may come from a different version of the pipeline"
            ) from err

    def stored_tokenizer(self, path: Path) -> Tokenizer:
        """The stored tokenizer, a WordPiece or BPE one.

        Raises:
            CheckpointLoadError: no tokenizer JSON, JSON that `tokenizers` cannot read, or a
                tokenizer of another model type.
        """
        text = (self.tokenizer or {}).get("json")
        if not isinstance(text, str):
            raise CheckpointLoadError(
                f"{path}: tokenizer['json'] is missing; the checkpoint was not written by "
                "`make pretrain`"
            )
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as err:  # tokenizers raises plain Exceptions for malformed JSON
            raise CheckpointLoadError(
                f"{path}: the stored tokenizer cannot be read ({err}); load the run's "
                "tokenizer.json through its HF export folder instead"
            ) from err
        try:
            tokenizer_kind(tokenizer)
        except UnsupportedTokenizerError as err:
            raise CheckpointLoadError(f"{path}: {err}") from err
        return tokenizer

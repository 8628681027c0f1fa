"""The model-family registry: what a `Family` record holds, and the lookups every module asks.

Everything the pipeline knows about a family is in its `Family` record, and every other module
asks the registry instead of branching on a family's name or class: the config check (which
tokenizer and objective fit the model), pretraining (the LightningModule, the vocabulary
padding, the "try it next" command), checkpoints (the `model_config` entry names the family;
loading builds its config and model classes), fine-tuning (the backbone class a task head sits
on) and HF folders (which family a loaded model or tokenizer belongs to).

The records hold classes, the LightningModule's among them, so they are written where all
their classes can be imported: BERT's and GPT's in `pipeline/pretrain/families.py`, beside the
LightningModules, above this module. The registry is filled when that module is imported:
every command that asks the registry imports it (tests/pipeline/test_families.py checks), as
do `tests/conftest.py` and the bench scripts that load models. A new family is one
`register(Family(...))` call: with its config dataclass, model classes, objective and
LightningModule, the generic paths (config check, checkpoint save and load, the checkpoint
resolver) work for it without touching any other pipeline module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from models.config import round_up
from pipeline.run.errors import UnknownFamilyError
from tokenizer import TEMPLATE_BY_KIND, InputTemplate

# What a trained model can do without training, by the command that does it.
INFERENCE = {
    "fill-mask": "an MLM head to guess masked words",
    "generate": "a causal model to continue a text",
    "score": "a causal model to score a text",
}
# The make target that does each kind of inference.
INFERENCE_COMMAND = {"fill-mask": "fill-mask", "generate": "generate", "score": "evaluate-lm"}


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: how checkpoints and messages name it ("bert").
        config_class: its architecture dataclass (`BertConfig`), built from `conf/model/`.
        model_class: the pretrained model a checkpoint holds (`BertForPreTraining`).
        backbone_class: the model without its pretraining heads, which a task head sits on
            (`BertModel`); the same as `model_class` when it has none.
        block_class: its repeated transformer block (`BertLayer`), the unit FSDP shards and
            activation checkpointing recomputes.
        tokenizer_kind: the tokenizer it trains with ("wordpiece" or "bpe"; a tokenizer's own
            kind is `tokenizer.tokenizer_kind`).
        objective_class: the pretraining objective it trains with (`MaskedLMObjective`).
        module_class: the LightningModule that pretrains it (`BertPretraining`).
        vocab_multiple: embedding rows are padded to a multiple of this (fast matmuls; BERT
            keeps 1 so its exports match the tokenizer).
        try_command: the make target and free-text argument that try a trained model.
        hf_auto_class: the `transformers` auto class that loads its HF export; None: the family
            has no HF mapping (`models.hf`), and a run exports no hf/ folder.
        output_bias: its pretrained model has a bias on the output layer over the vocabulary
            (`model.output_bias`, which `output_bias=unigram` sets); GPT's has none.
        inference: what a trained model of the family does without training (`INFERENCE`):
            "fill-mask" (an MLM head), "generate" and "score" (a causal LM).
        input_template: the special tokens around one or two texts when it is fine-tuned;
            None: the template of its tokenizer kind (`tokenizer.TEMPLATE_BY_KIND`).

    The model and backbone classes answer `models.heads.Backbone` (`backbone()`,
    `word_embeddings`, `token_states`, `sequence_features`), which task heads, probes and word
    vectors use for any family.
    """

    name: str
    config_class: type
    model_class: type[nn.Module]
    backbone_class: type[nn.Module]
    block_class: type[nn.Module]
    tokenizer_kind: str
    objective_class: type
    module_class: type[Any]
    vocab_multiple: int
    try_command: tuple[str, str]
    hf_auto_class: str | None
    output_bias: bool = False
    inference: frozenset[str] = frozenset()
    input_template: InputTemplate | None = None

    def __post_init__(self) -> None:
        unknown = self.inference - INFERENCE.keys()
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown inference {sorted(unknown)}")
        if self.input_template is None:
            object.__setattr__(self, "input_template", TEMPLATE_BY_KIND[self.tokenizer_kind])

    def supports(self, inference: str) -> bool:
        return inference in self.inference

    def model_vocab_size(self, tokenizer_vocab: int) -> int:
        """Embedding rows for a tokenizer of `tokenizer_vocab` tokens."""
        return round_up(tokenizer_vocab, self.vocab_multiple)


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (a new name, or a new record under an existing one) and return it."""
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (tests that register a toy one clean up with this)."""
    _REGISTRY.pop(name, None)


def families() -> list[Family]:
    return list(_REGISTRY.values())


def family_named(name: object) -> Family:
    if name not in _REGISTRY:
        raise UnknownFamilyError(f"model family {name!r} is not one of {_known()}", name)
    return _REGISTRY[name]


def family_of_config(config: object) -> Family:
    """The family whose architecture dataclass `config` is."""
    for family in _REGISTRY.values():
        if isinstance(config, family.config_class):
            return family
    raise UnknownFamilyError(
        f"no model family has the config type {type(config).__name__} (known: {_known()})"
    )


def family_of_target(target: str) -> Family | None:
    """The family whose architecture dataclass a config's `_target_` names (the dotted path), or
    None: a model node is checked by this before it is built."""
    return next(
        (
            family
            for family in _REGISTRY.values()
            if target == f"{family.config_class.__module__}.{family.config_class.__qualname__}"
        ),
        None,
    )


def family_of_model(model: nn.Module) -> Family:
    """The family of a model or a backbone."""
    for family in _REGISTRY.values():
        if isinstance(model, (family.model_class, family.backbone_class)):
            return family
    raise UnknownFamilyError(
        f"no model family has the model type {type(model).__name__} (known: {_known()})"
    )


def _known() -> str:
    """The registered families, or how to register BERT's and GPT's when none is."""
    if not _REGISTRY:
        return (
            "none: no family is registered in this process; import pipeline.pretrain.families "
            "(which registers BERT and GPT) before asking the registry, as the commands do"
        )
    return ", ".join(sorted(_REGISTRY))

"""What one of our model classes says about its Hugging Face twin: the contract `models.hf`
imports and exports through, with no branch on the family.

A model class with an HF twin names its mapping in a class attribute, `hf_mapping` (an
`HFMapping`: `BertForPreTraining.hf_mapping` reads and writes `BertForPreTraining`,
`GPT.hf_mapping` `LlamaForCausalLM`). The mapping holds what differs between families: the
architecture and `config.json` fields, the weight table, how an imported state is tidied, how
a fused parameter splits, and the tokenizer's special tokens. The per-family mappings are in
`models/hf_bert.py` and `models/hf_llama.py`; reading folders, copying weights and writing an
export, the same for every family, are in `models/hf.py`.

The weight table (`Spec`) lists (our parameter name, HF parameter names); fused parameters
list several HF names, concatenated along dim 0 on import and split back on export, so both
directions share the same table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["HFMapping", "Spec", "UnsupportedCheckpointError", "check_tied", "pairs", "require"]

# (our parameter name, HF parameter names concatenated along dim 0 to form it)
Spec = list[tuple[str, list[str]]]


class UnsupportedCheckpointError(ValueError):
    """The checkpoint's architecture, options or weights do not match what we can represent."""


class HFMapping(ABC):
    """How one of our model classes maps to one HF architecture, both ways.

    Attributes:
        architecture: the HF class (`config.json`'s `architectures` entry) it reads and writes.
        model_type: `config.json`'s `model_type`.
        special_tokens: the tokenizer's default special tokens of an export: HF role
            ("cls_token") -> candidate tokens, the first found in the vocabulary taken.
        model_input_names: what the HF tokenizer returns (`tokenizer_config.json`), or None
            for the default.
        writes_special_token_ids: an export's `config.json` gets the ids of the bos, eos and
            pad tokens (so that `generate` in transformers finds them).
    """

    architecture: str
    model_type: str
    special_tokens: Mapping[str, tuple[str, ...]]
    model_input_names: tuple[str, ...] | None = None
    writes_special_token_ids: bool = False

    @abstractmethod
    def config_from_hf(self, hf_config: Mapping[str, Any]) -> Any:
        """Our config dataclass from an HF `config.json` dict; raises
        `UnsupportedCheckpointError` for options our model does not have."""

    @abstractmethod
    def hf_config(self, config: Any) -> dict[str, Any]:
        """The HF `config.json` fields of our config."""

    @abstractmethod
    def spec(self, config: Any) -> Spec:
        """The weight table of a model of `config`."""

    def refusal(self, config: Any) -> str | None:
        """Why a model of `config` has no HF twin to export to (an option of ours that the HF
        architecture lacks), or None when it has one."""
        return None

    def imported_state(
        self, state: dict[str, torch.Tensor], config: Any
    ) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        """An HF state dict tidied for `spec` (old names renamed, tied copies checked), and
        the suffixes of HF keys that may be left over (buffers, tied copies)."""
        return state, ()

    def split_sizes(self, ours: str, parts: int, rows: int, config: Any) -> list[int]:
        """Rows of each of the `parts` HF tensors inside our fused parameter `ours` of `rows`
        rows: equal parts unless a mapping says otherwise."""
        return [rows // parts] * parts


def pairs(ours: str, hf: str) -> Spec:
    """The weight and bias of one layer."""
    return [(f"{ours}.{p}", [f"{hf}.{p}"]) for p in ("weight", "bias")]


def require(config: Mapping[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    """`config[key]` (or `default`) is one of `allowed`, or the checkpoint is refused."""
    value = config.get(key, default)
    if value not in allowed:
        raise UnsupportedCheckpointError(
            f"config.json has {key}={value!r}; only {' or '.join(map(repr, allowed))} is supported"
        )


def check_tied(hf_state: Mapping[str, torch.Tensor], copy: str, original: str) -> None:
    """A saved copy of a tied weight must equal the weight it is tied to."""
    if (
        copy in hf_state
        and original in hf_state
        and not torch.equal(hf_state[copy], hf_state[original])
    ):
        raise UnsupportedCheckpointError(
            f"{copy} differs from {original}; untied weights are not supported here"
        )

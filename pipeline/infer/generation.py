"""`make generate`: continue a prompt with a trained GPT.

    python -m pipeline.commands.generate ckpt=outputs/gpt/<stamp> prompt="The meaning of life" num_samples=3

Loads the model and tokenizer (`pipeline.checkpoint.load`), encodes the prompt with the run's byte-level BPE
(no special tokens added; an empty prompt starts from the end-of-text token, like a new
document), samples with `GPT.generate` and prints each sample: the prompt and its continuation,
which stops early at the end-of-text token.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from pipeline.checkpoint.load import Pretrained, inference_autocast
from pipeline.run.errors import ConfigError
from tokenizer.special import EOT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How to sample (the keys of `conf/generate.yaml` of the same names).

    Attributes:
        max_new_tokens: tokens to add to the prompt, at most.
        temperature: softmax temperature; 0 is greedy decoding.
        top_k: sample among the k most likely tokens only (None: all).
        top_p: nucleus sampling threshold in (0, 1] (None: off).
        num_samples: continuations of the same prompt.
        seed: seeds the sampling, so that a run can be repeated (None: a fresh draw each time).
    """

    max_new_tokens: int = 50
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = None
    num_samples: int = 1
    seed: int | None = 1234

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be >= 1, or null for no top-k cut")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1], or null for no nucleus cut")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Sampling:
        return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls)})


def prompt_ids(pretrained: Pretrained, prompt: str) -> list[int]:
    """The prompt's token ids; the end-of-text token alone for an empty prompt."""
    ids = pretrained.tokenizer.encode(prompt, add_special_tokens=False).ids
    if ids:
        return ids
    eot = pretrained.tokenizer.token_to_id(EOT)
    if eot is None:
        raise ConfigError(
            f"prompt is empty and the tokenizer has no {EOT} token to start from; give a prompt"
        )
    return [eot]


def continue_ids(
    pretrained: Pretrained, ids: list[int], sampling: Sampling, device: torch.device
) -> list[list[int]]:
    """`sampling.num_samples` continuations of `ids`, each cut before its end-of-text token.

    The model must already be on `device`.
    """
    model = pretrained.model
    if len(ids) + sampling.max_new_tokens > model.config.max_seq_len:
        log.warning(
            "prompt (%d tokens) + max_new_tokens (%d) exceed the %d tokens the model was trained "
            "on; text past that is extrapolation and usually degrades",
            len(ids),
            sampling.max_new_tokens,
            model.config.max_seq_len,
        )
    eos_id = pretrained.tokenizer.token_to_id(EOT)
    with inference_autocast(device):
        new_BN = model.generate(
            torch.tensor([ids] * sampling.num_samples, device=device),
            sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            eos_id=eos_id,
            seed=sampling.seed,
        )
    rows = new_BN.tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


def generate(
    pretrained: Pretrained, prompt: str, sampling: Sampling, device: torch.device
) -> list[str]:
    """Texts of `sampling.num_samples` samples, each the prompt followed by its continuation.

    Prompt and continuation are decoded together: a character whose UTF-8 bytes straddle the
    two comes out whole.
    """
    ids = prompt_ids(pretrained, prompt)
    continuations = continue_ids(pretrained, ids, sampling, device)
    return [pretrained.tokenizer.decode(ids + new) for new in continuations]


def print_samples(texts: list[str]) -> None:
    for i, text in enumerate(texts, 1):
        if len(texts) > 1:
            print(f"--- sample {i} of {len(texts)} ---")
        print(text)

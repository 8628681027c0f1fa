"""Parameter counts and training FLOPs per token, from the config alone (used for MFU).

FLOPs per token for training follow PaLM (appendix B) and nanoGPT's `estimate_mfu`:

    6 * N_matmul + 12 * L * H * E * T

- 6 = 2 FLOPs per multiply-add x 3 (forward, and backward for inputs and for weights);
- N_matmul counts the parameters each token multiplies: every non-embedding parameter, plus
  the output layer V x D even when it is tied to the embedding (the lookup is free, the output
  matmul is not; for small models it is most of the work);
- 12 L H E T is the attention score and value matmuls (QK^T and AV, 2 x 2 FLOPs each per
  key, x 3 for training) at context T.

What differs between families is where their parameters sit, which each config class says
in `param_counts()` (a `ParamCounts`); the arithmetic here is shared. A model whose output
head runs on some positions only (BERT trained with the gathered MLM head) passes
`predicted_fraction` (0.15 for the standard recipe); parameters that run once per sequence
(BERT's pooler and NSP head) are counted per token as 1/T of their size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["CountsParameters", "ParamCounts", "flops_per_token", "param_count"]


@dataclass(frozen=True)
class ParamCounts:
    """A model's trainable parameters, in the groups its FLOPs per token are counted by.

    Attributes:
        embedding: lookup tables (token, and for BERT position and token type): no matmul.
        body: multiplied by every token (blocks, norms).
        head: multiplied at the predicted positions only (the output layer when it is not
            tied, and any transform and bias before or on it).
        per_sequence: multiplied once per sequence (BERT's pooler and NSP head).
        tied_output: an output layer that shares the embedding's weight: counted once among
            the parameters (in `embedding`), but multiplied at the predicted positions.
    """

    embedding: int
    body: int
    head: int = 0
    per_sequence: int = 0
    tied_output: int = 0

    def total(self, *, embeddings: bool = True) -> int:
        """Trainable parameters, tied weights once; without the lookup tables if not
        `embeddings` (an untied output layer stays in)."""
        return (self.embedding if embeddings else 0) + self.body + self.head + self.per_sequence

    def matmul_per_token(self, seq_len: int, predicted_fraction: float) -> float:
        """N_matmul: the parameters one token multiplies, at context `seq_len`."""
        predicted = predicted_fraction * (self.head + self.tied_output)
        return self.body + self.per_sequence / seq_len + predicted


class CountsParameters(Protocol):
    """A family's config that FLOPs can be counted for (`BertConfig`, `GPTConfig`)."""

    n_layers: int
    n_heads: int
    max_seq_len: int

    @property
    def head_dim(self) -> int: ...

    def param_counts(self) -> ParamCounts: ...


def param_count(config: CountsParameters, *, embeddings: bool = True) -> int:
    """Trainable parameters of the pre-training model (`BertForPreTraining` / `GPT`).

    Tied weights count once. With `embeddings=False`, the lookup tables (token, and for BERT
    position and token type) are left out; an untied GPT output layer stays in.
    """
    return config.param_counts().total(embeddings=embeddings)


def flops_per_token(
    config: CountsParameters, seq_len: int | None = None, *, predicted_fraction: float = 1.0
) -> float:
    """Training FLOPs (forward + backward) per input token.

    Args:
        config: model config.
        seq_len: context T (defaults to `config.max_seq_len`).
        predicted_fraction: share of tokens the output head runs on (1.0 when every position
            is predicted, as in GPT or BERT's full-sequence path; ~0.15 for BERT's gathered
            training path).

    Returns:
        FLOPs per token; multiply by tokens/s and divide by the device peak for MFU.
    """
    T = seq_len or config.max_seq_len
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * T
    return 6 * config.param_counts().matmul_per_token(T, predicted_fraction) + attention

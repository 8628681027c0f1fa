"""Pre-training objectives: what training examples are built from the token stream and how.

`conf/objective/*.yaml` instantiates one of these; values are checked here so that a bad setting
fails before any work starts, with the config key in the message.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_fraction(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    if not (low_ok and value <= 1):
        bound = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"objective.{name} must be in {bound}, got {value!r}")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"objective.{name} must be a positive integer, got {value!r}")


@dataclass
class MaskedLMObjective:
    """BERT: masked language modelling plus next-sentence prediction.

    Attributes:
        seq_len: length of an instance, special tokens included (128 in the BERT recipe).
        batch_size: instances per batch (per device).
        mlm_probability: share of eligible tokens chosen for prediction.
        mask_replace_prob: of the chosen tokens, the share replaced by [MASK].
        random_replace_prob: of the chosen tokens, the share replaced by a random token; the rest
            stay unchanged.
        max_predictions_per_seq: cap on chosen tokens per instance (20 at seq 128).
        next_sentence_prediction: build A/B pairs with 50% random B and train the NSP head.
        short_seq_prob: share of instances with a shorter random target length.
        whole_word_masking: choose whole words (all their word pieces) instead of pieces.
    """

    seq_len: int = 128
    batch_size: int = 32
    mlm_probability: float = 0.15
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    max_predictions_per_seq: int = 20
    next_sentence_prediction: bool = True
    short_seq_prob: float = 0.1
    whole_word_masking: bool = False

    def __post_init__(self) -> None:
        _check_positive("seq_len", self.seq_len)
        _check_positive("batch_size", self.batch_size)
        _check_positive("max_predictions_per_seq", self.max_predictions_per_seq)
        if self.seq_len < 8:
            raise ValueError(f"objective.seq_len={self.seq_len} is too short for A/B pairs (>= 8)")
        _check_fraction("mlm_probability", self.mlm_probability, open_low=True)
        _check_fraction("mask_replace_prob", self.mask_replace_prob)
        _check_fraction("random_replace_prob", self.random_replace_prob)
        _check_fraction("short_seq_prob", self.short_seq_prob)
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError(
                "objective.mask_replace_prob + objective.random_replace_prob must be <= 1, got "
                f"{self.mask_replace_prob} + {self.random_replace_prob}"
            )


@dataclass
class CausalLMObjective:
    """GPT: next-token prediction on packed windows.

    Attributes:
        seq_len: tokens per window (inputs; targets are shifted by one).
        batch_size: windows per batch (per device).
        document_masking: restrict attention to the current document within a window.
    """

    seq_len: int = 256
    batch_size: int = 16
    document_masking: bool = False

    def __post_init__(self) -> None:
        _check_positive("seq_len", self.seq_len)
        _check_positive("batch_size", self.batch_size)

"""`make fill-mask`: a trained BERT's most likely tokens for each [MASK] in a text.

    python -m pipeline.commands.fill_mask ckpt=outputs/bert/<stamp> text="The capital of France is [MASK]."

Encodes the text with the run's WordPiece tokenizer (which adds [CLS] and [SEP]), runs the MLM
head at the masked positions only, and prints for every [MASK] the `top_k` tokens with their
probabilities (softmax over the whole vocabulary), then the text with each [MASK] replaced by its
most likely token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.checkpoint.load import Pretrained, inference_autocast
from pipeline.run.errors import CheckpointLoadError, ConfigError
from pipeline.run.families import family_named
from tokenizer.special import MASK


@dataclass
class MaskGuesses:
    """The most likely tokens for one [MASK], best first.

    Attributes:
        position: index of the [MASK] in the encoded text ([CLS] is 0).
        token_ids, tokens, probs: the top-k tokens and their probabilities.
    """

    position: int
    token_ids: list[int]
    tokens: list[str]
    probs: list[float]


def mask_probabilities(
    pretrained: Pretrained, text: str, device: torch.device
) -> tuple[list[int], list[int], torch.Tensor]:
    """Probabilities over the vocabulary at every [MASK] of `text`.

    The model must already be on `device`.

    Returns:
        The encoded ids (T,), the positions of the N masks among them, and (N, V) float32
        probabilities (each row sums to 1).

    Raises:
        ConfigError: the text has no [MASK], or is longer than the model's positions.
        CheckpointLoadError: the model has no MLM head, or the tokenizer no [MASK].
    """
    model = pretrained.model
    family = family_named(pretrained.family)
    if not isinstance(model, family.model_class):  # a backbone alone (a head-less HF export)
        raise CheckpointLoadError(
            f"{pretrained.source} holds a {type(model).__name__}, not a {family.name.upper()} "
            f"with its MLM head; fill-mask needs a {family.model_class.__name__} checkpoint (a "
            "run's checkpoint or hf/ export)"
        )
    mask_id = pretrained.tokenizer.token_to_id(MASK)
    if mask_id is None:
        raise CheckpointLoadError(
            f"the tokenizer of {pretrained.source} has no {MASK} token; fill-mask needs a "
            "WordPiece tokenizer trained by this pipeline"
        )
    encoding = pretrained.tokenizer.encode(text)
    positions = [i for i, token_id in enumerate(encoding.ids) if token_id == mask_id]
    if not positions:
        raise ConfigError(
            f"text={text!r} has no {MASK}; write {MASK} where the model should guess a word, "
            f'e.g. text="The capital of France is {MASK}."'
        )
    if len(encoding.ids) > model.config.max_seq_len:
        raise ConfigError(
            f"text is {len(encoding.ids)} tokens long, the model takes at most "
            f"{model.config.max_seq_len}; shorten it"
        )
    ids_BT = torch.tensor([encoding.ids], device=device)
    with torch.no_grad(), inference_autocast(device):
        out = model(
            ids_BT,
            attention_mask=torch.ones_like(ids_BT),
            token_type_ids=torch.tensor([encoding.type_ids], device=device),
            masked_positions=torch.tensor(positions, device=device),  # row 0: flat == column
        )
    return encoding.ids, positions, out.mlm_logits.float().softmax(dim=-1)


def fill_mask(
    pretrained: Pretrained, text: str, top_k: int, device: torch.device
) -> list[MaskGuesses]:
    """The `top_k` most likely tokens for each [MASK] of `text`, in text order."""
    if top_k < 1:
        raise ConfigError(f"top_k={top_k} must be >= 1")
    _, positions, probs_NV = mask_probabilities(pretrained, text, device)
    best = probs_NV.topk(min(top_k, probs_NV.shape[-1]), dim=-1)
    guesses = []
    for position, probs, token_ids in zip(
        positions, best.values.tolist(), best.indices.tolist(), strict=True
    ):
        tokens = [pretrained.tokenizer.id_to_token(i) or f"<id {i}>" for i in token_ids]
        guesses.append(MaskGuesses(position, token_ids, tokens, probs))
    return guesses


def best_filling(pretrained: Pretrained, text: str, guesses: list[MaskGuesses]) -> str:
    """`text` (as the tokenizer normalizes it) with every [MASK] replaced by its best guess."""
    ids = pretrained.tokenizer.encode(text).ids
    for guess in guesses:
        ids[guess.position] = guess.token_ids[0]
    return pretrained.tokenizer.decode(ids)


def format_guesses(guesses: list[MaskGuesses]) -> str:
    """A small table per [MASK]: rank, token, probability."""
    width = max(len("token"), *(len(t) for g in guesses for t in g.tokens))
    lines = []
    for n, guess in enumerate(guesses, 1):
        lines.append(f"{MASK} {n} of {len(guesses)} (token {guess.position})")
        lines.append(f"  rank  {'token':<{width}}  probability")
        for rank, (token, prob) in enumerate(zip(guess.tokens, guess.probs, strict=True), 1):
            lines.append(f"  {rank:>4}  {token:<{width}}  {prob:11.4f}")
    return "\n".join(lines)

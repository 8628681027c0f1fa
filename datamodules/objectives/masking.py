"""Dynamic masked-language-model masking, applied to every batch as it is built.

As in google-research/bert `create_masked_lm_predictions`, but fresh for every batch (the
RoBERTa "dynamic masking" that supersedes the original's dupe factor):

- Eligible tokens: every token that is not a special token ([CLS], [SEP], [PAD], [MASK],
  [UNK]); padding is never chosen.
- Per sequence, k = clamp(floor(n * p + u), 1, max_predictions_per_seq) of the n eligible tokens
  are chosen uniformly at random (u ~ U[0, 1): stochastic rounding keeps the expected share at
  exactly p for any length; the original's `round` shifts short sequences).
- Of the chosen tokens, `mask_replace_prob` (80%) become [MASK], `random_replace_prob` (10%) a
  random non-special token, and the rest stay unchanged; all are predicted.
- Whole-word masking chooses whole words (a piece plus its `##` continuations) in random order
  until k tokens are reached, skipping words that would overshoot, as the original does.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from tokenizer import SpecialIds


class MLMMasker:
    """Chooses and replaces the tokens to predict.

    Args:
        objective: masking settings (a `MaskedLMObjective`: probabilities, cap, whole-word
            masking).
        special: the tokenizer's special ids (mask id and the ids never chosen).
        vocab_size: tokenizer vocabulary size.
        continuation: (V,) True for word pieces that continue a word ("##..."); needed for
            whole-word masking. See `continuation_table`.
    """

    def __init__(
        self,
        objective,
        special: SpecialIds,
        vocab_size: int,
        continuation: np.ndarray | None = None,
    ) -> None:
        if special.mask is None:
            raise ValueError("MLM masking needs a tokenizer with a [MASK] token (wordpiece)")
        if objective.whole_word_masking and continuation is None:
            raise ValueError("whole-word masking needs the continuation table of the tokenizer")
        self.objective = objective
        self.mask_id = special.mask
        self.is_special = np.zeros(vocab_size, dtype=bool)
        self.is_special[sorted(special.all())] = True
        self.replacements = np.flatnonzero(~self.is_special)  # what a random replacement can be
        self.continuation = continuation

    def __call__(
        self, input_ids: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Mask a padded batch.

        Args:
            input_ids: (B, T) token ids, specials and padding included.
            rng: the batch's generator.

        Returns:
            masked (B, T) ids with the replacements applied; positions (N,) flat indices
            `row * T + col` of the chosen tokens in ascending order; labels (N,) their
            original ids.
        """
        eligible = ~self.is_special[input_ids]
        n = eligible.sum(axis=1)
        want = np.floor(n * self.objective.mlm_probability + rng.random(len(n))).astype(np.int64)
        k = np.minimum(np.clip(want, 1, self.objective.max_predictions_per_seq), n)
        if self.objective.whole_word_masking:
            chosen = self._choose_words(input_ids, eligible, k, rng)
        else:
            chosen = _choose_tokens(eligible, k, rng)
        positions = np.flatnonzero(chosen)
        labels = input_ids.reshape(-1)[positions]
        masked = input_ids.copy()
        flat = masked.reshape(-1)
        u = rng.random(len(positions))
        to_mask = u < self.objective.mask_replace_prob
        to_random = ~to_mask & (
            u < self.objective.mask_replace_prob + self.objective.random_replace_prob
        )
        flat[positions[to_mask]] = self.mask_id
        picks = rng.integers(len(self.replacements), size=int(to_random.sum()))
        flat[positions[to_random]] = self.replacements[picks]
        return masked, positions, labels

    def _choose_words(
        self, input_ids: np.ndarray, eligible: np.ndarray, k: np.ndarray, rng: np.random.Generator
    ) -> np.ndarray:
        # A word starts at an eligible token that is not a "##" piece, or whose predecessor is
        # not eligible (a stray piece after [CLS] starts its own word).
        prev_eligible = np.zeros_like(eligible)
        prev_eligible[:, 1:] = eligible[:, :-1]
        starts = eligible & (~self.continuation[input_ids] | ~prev_eligible)
        chosen = np.zeros_like(eligible)
        for row in range(len(input_ids)):
            columns = np.flatnonzero(eligible[row])
            word_of = np.cumsum(starts[row, columns]) - 1
            words = np.split(columns, np.flatnonzero(np.diff(word_of)) + 1)
            budget = int(k[row])
            for w in rng.permutation(len(words)):
                if budget == 0:
                    break
                if len(words[w]) <= budget:
                    chosen[row, words[w]] = True
                    budget -= len(words[w])
        return chosen


def _choose_tokens(eligible: np.ndarray, k: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(B, T) mask with exactly k[i] eligible tokens chosen uniformly in row i."""
    keys = np.where(eligible, rng.random(eligible.shape), 2.0)  # ineligible sort last
    rank = np.argsort(np.argsort(keys, axis=1), axis=1)
    return rank < k[:, None]


def continuation_table(tokenizer: Tokenizer, prefix: str = "##") -> np.ndarray:
    """(V,) True for vocabulary entries that continue a word (WordPiece "##" pieces)."""
    table = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=bool)
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        table[index] = token.startswith(prefix)
    return table

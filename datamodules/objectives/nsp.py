"""BERT pre-training instances: sentence pairs for next-sentence prediction (NSP).

This follows `create_instances_from_document` of google-research/bert `create_pretraining_data.py`:

- Walk a document's sentences, filling a chunk until it reaches the target length: max_seq_len
  minus 3 special tokens, or, with probability `short_seq_prob`, a random length in
  [2, max_seq_len - 3] (so the model also sees short inputs).
- Segment A is a random number of leading sentences of the chunk.
- With probability 0.5, segment B is the rest of the chunk (the actual continuation, label 0);
  otherwise B is a run of sentences from a random start in a *different* document, as long as
  the target length needs (label 1), and the chunk's unused sentences are put back to start the
  next chunk.
- The longer segment loses one token at a time, from its front or back at random, until the pair
  fits in max_seq_len - 3 tokens.

Differences from the original, each to keep the pair statistics exact:
- The target length is drawn for every instance; the original draws it once per document, so
  a short document-wide target made all of that document's instances short.
- A one-sentence chunk whose coin says "actual next" takes the document's next sentence as B;
  the original forced a random B there, which pushed the random share above 50%. A lone last
  sentence of a document has no next sentence: that chunk makes no instance, whatever the coin
  says (dropping only the "actual next" ones would bias the labels the same way).
- The random document is drawn among the *other* documents of the split, so a random B never
  comes from A's document (the original retried 10 times and could still pick it).

Without NSP (RoBERTa-style), an instance is one chunk of whole sentences, `[CLS] A [SEP]`.

An instance is stored as six integers (token offsets into the store, so a contiguous span):
    a_start, a_end   segment A after truncation
    cut              where A ended before truncation (a sentence boundary; for label 0 the
                     continuation B starts here before its own truncation)
    b_start, b_end   segment B after truncation (empty without NSP)
    label            0 = B follows A, 1 = B is random (as HF BERT), -1 without NSP
"""

from __future__ import annotations

import random
from array import array

import numpy as np

FIELDS = ("a_start", "a_end", "cut", "b_start", "b_end", "label")
LABEL = FIELDS.index("label")
IS_NEXT, IS_RANDOM, NO_PAIR = 0, 1, -1


class InstanceBuilder:
    """Creates the instances of one split of documents for one epoch.

    Args:
        sentence_offsets: (S + 1,) token offsets of the store's sentences.
        doc_sentences: (D + 1,) first sentence of every store document.
        documents: (M,) indices of the split's documents (M >= 2 with NSP).
        seq_len: instance length, special tokens included.
        short_seq_prob: share of instances with a random shorter target length.
        next_sentence_prediction: build A/B pairs; otherwise single segments.
    """

    def __init__(
        self,
        sentence_offsets: np.ndarray,
        doc_sentences: np.ndarray,
        documents: np.ndarray,
        seq_len: int,
        short_seq_prob: float,
        next_sentence_prediction: bool = True,
    ) -> None:
        if next_sentence_prediction and len(documents) < 2:
            raise ValueError(
                f"next-sentence prediction needs at least 2 documents in a split, got "
                f"{len(documents)}; use a larger corpus or val_fraction, or set "
                "objective.next_sentence_prediction=false"
            )
        self._sentence_offsets = np.asarray(sentence_offsets)
        starts = np.asarray(doc_sentences)
        self._first = starts[documents]
        self._count = starts[np.asarray(documents) + 1] - self._first
        self.nsp = next_sentence_prediction
        self.max_tokens = seq_len - (3 if next_sentence_prediction else 2)
        self.short_seq_prob = short_seq_prob
        self._lists: tuple[list[int], list[int], list[int]] | None = None

    def __getstate__(self) -> dict:
        # The lists are rebuilt on demand: cheaper than pickling them to DataLoader workers.
        skip = ("_lists", "offsets", "first", "count")
        return {k: v for k, v in self.__dict__.items() if k not in skip} | {"_lists": None}

    def _as_lists(self) -> tuple[list[int], list[int], list[int]]:
        # The walk does scalar lookups, which are ~10x faster on lists than on numpy arrays.
        if self._lists is None:
            self._lists = (
                self._sentence_offsets.tolist(),
                self._first.tolist(),
                self._count.tolist(),
            )
        return self._lists

    def build(self, seed: int) -> np.ndarray:
        """All instances of the split for one seed (one epoch), in document order.

        Returns:
            (N, 6) int64 table with the columns of `FIELDS`.
        """
        rng = random.Random(seed)
        out = array("q")
        # The walk below reads these as attributes (transient: not pickled, see __getstate__).
        self.offsets, self.first, self.count = self._as_lists()
        for index in range(len(self.first)):
            self._document(index, rng, out)
        return np.frombuffer(out, dtype=np.int64).reshape(-1, len(FIELDS)).copy()

    def _target(self, rng: random.Random) -> int:
        if rng.random() < self.short_seq_prob:
            return rng.randint(2, self.max_tokens)
        return self.max_tokens

    def _document(self, index: int, rng: random.Random, out: array) -> None:
        first, n = self.first[index], self.count[index]
        bounds = self.offsets[first : first + n + 1]  # token offset of every sentence boundary
        target = self._target(rng)
        start = 0  # first sentence of the current chunk
        i = 0
        while i < n:
            if i == n - 1 or bounds[i + 1] - bounds[start] >= target:
                end = i + 1  # the chunk is sentences [start, end)
                if not self.nsp:
                    self._emit(
                        bounds[start], bounds[end], bounds[end], bounds[end], NO_PAIR, rng, out
                    )
                else:
                    i = self._pair(index, bounds, start, end, target, rng, out)
                start = i + 1
                target = self._target(rng)
            i += 1

    def _pair(
        self,
        index: int,
        bounds: list[int],
        start: int,
        end: int,
        target: int,
        rng: random.Random,
        out: array,
    ) -> int:
        """Emit one A/B instance from the chunk [start, end); returns the last sentence used."""
        a_end = start + 1 if end - start < 2 else rng.randint(start + 1, end - 1)
        is_random = rng.random() < 0.5
        if end - start == 1:
            if end == len(bounds) - 1:
                return end - 1  # a lone last sentence: no instance (see module doc)
            if not is_random:
                end += 1  # take the next sentence as B
        if not is_random:
            self._emit(bounds[start], bounds[a_end], bounds[a_end], bounds[end], IS_NEXT, rng, out)
            return end - 1
        b_start, b_end = self._random_segment(index, target - (bounds[a_end] - bounds[start]), rng)
        self._emit(bounds[start], bounds[a_end], b_start, b_end, IS_RANDOM, rng, out)
        return a_end - 1  # the chunk's unused sentences start the next chunk

    def _random_segment(self, index: int, target: int, rng: random.Random) -> tuple[int, int]:
        """Token span of sentences from a random start in another document, >= target tokens
        unless that document ends first."""
        other = rng.randint(0, len(self.first) - 2)
        other += other >= index  # any document but `index`
        first, n = self.first[other], self.count[other]
        j = first + rng.randint(0, n - 1)
        b_start = self.offsets[j]
        while j < first + n - 1 and self.offsets[j + 1] - b_start < target:
            j += 1
        return b_start, self.offsets[j + 1]

    def _emit(
        self,
        a_start: int,
        a_end: int,
        b_start: int,
        b_end: int,
        label: int,
        rng: random.Random,
        out: array,
    ) -> None:
        cut = a_end
        # Truncate the longer segment one token at a time from a random end (original recipe).
        while (a_end - a_start) + (b_end - b_start) > self.max_tokens:
            if a_end - a_start > b_end - b_start:
                if rng.random() < 0.5:
                    a_start += 1
                else:
                    a_end -= 1
            elif rng.random() < 0.5:
                b_start += 1
            else:
                b_end -= 1
        out.extend((a_start, a_end, cut, b_start, b_end, label))

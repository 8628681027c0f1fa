"""A count-based language model of a corpus: interpolated Kneser-Ney with modified discounts
(Chen & Goodman 1999), the n-gram baseline beside which `make evaluate-lm suite=blimp` puts a
pretrained model (what counting the same tokens of the same corpus already gives).

    lm = KneserNey.fit(documents, vocab_size=8192, order=3)   # token-id arrays, one per document
    lm.logprob(ids)                                           # log p(ids | start of a document)

Every document starts after `order - 1` start symbols (an id beyond the vocabulary that is
only ever context, never predicted), so a sentence scored alone is scored as the start of a
document, as the neural models score it after their separator token. Probabilities, at the
highest order and below:

    p_k(w | h) = max(c(h w) - D_k(c), 0) / c(h .) + gamma(h) p_{k-1}(w | h'),
    gamma(h)   = (D_k1 N1(h .) + D_k2 N2(h .) + D_k3 N3+(h .)) / c(h .)

with raw counts at the highest order and continuation counts (how many distinct tokens precede
the n-gram) below it, p_0 uniform over the vocabulary, and a context never seen (c(h .) = 0)
handing its whole mass to the order below. The discounts D_k1, D_k2, D_k3+ come from each
order's counts of counts (n1 .. n4), as Chen & Goodman estimate them, kept within [0, c] so
that every distribution sums to 1 over the vocabulary.

The n-grams are kept as int64 keys (the ids in base vocab_size + 1) in sorted numpy arrays, so
fitting is a sort per order and scoring a binary search: WikiText-2 (2.4 M tokens) fits in
seconds and a few hundred MB. The highest order is counted `chunk_tokens` tokens at a time, each
chunk's counts merged into the running table, so memory grows with the distinct n-grams of the
corpus (16 bytes each, plus the same again while a chunk is merged), not with its length: a
corpus of books (tens of millions of tokens) is counted without holding its tokens at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from pipeline.run.errors import ConfigError

MAX_KEY_BITS = 63
CHUNK_TOKENS = 8_000_000  # n-grams counted at a time before they are merged into the table


@dataclass(frozen=True)
class _Order:
    """The n-grams of one order k: their keys (sorted) and counts, the statistics of their
    contexts (the keys of the first k - 1 symbols, sorted), and the three discounts."""

    grams: np.ndarray
    counts: np.ndarray
    contexts: np.ndarray
    context_totals: np.ndarray
    context_gamma: np.ndarray  # gamma(h) * c(h .): the discounted mass, before the division
    discounts: np.ndarray  # D1, D2, D3+


class KneserNey:
    """Interpolated modified Kneser-Ney of `order` over ids 0 .. vocab_size - 1 (see the module
    docstring). Build it with `fit`."""

    def __init__(self, vocab_size: int, order: int, orders: list[_Order]) -> None:
        self.vocab_size = vocab_size
        self.order = order
        self.start = vocab_size  # the start symbol, context only
        self.base = vocab_size + 1
        self._orders = orders  # orders[k - 1]: the k-grams

    @classmethod
    def fit(
        cls,
        documents: Iterable[np.ndarray],
        vocab_size: int,
        order: int = 3,
        chunk_tokens: int = CHUNK_TOKENS,
    ) -> KneserNey:
        """Count the n-grams of `documents` (token-id arrays, ids below `vocab_size`), about
        `chunk_tokens` tokens at a time (the counts do not depend on it).

        Raises:
            ConfigError: an order below 1 or too high for the vocabulary (its n-gram keys would
                not fit 63 bits), or no tokens at all.
        """
        base = vocab_size + 1
        longest = cls.longest_order(vocab_size)
        if not 1 <= order <= longest:
            raise ConfigError(
                f"an n-gram order of {order} is not possible with a {vocab_size:,}-token "
                f"vocabulary; choose 1 to {longest}"
            )
        grams, counts = _count(
            (
                _keys(_padded(np.asarray(d, dtype=np.int64), order, vocab_size), order, base)
                for d in documents
                if len(d)
            ),
            chunk_tokens,
        )
        if not len(grams):
            raise ConfigError("the n-gram model's corpus has no tokens; check the run's data")
        orders = [_statistics(grams, counts, base)]
        for k in range(order - 1, 0, -1):
            # Continuation counts: how many distinct (k+1)-grams end in each k-gram.
            grams, counts = np.unique(grams % base**k, return_counts=True)
            orders.append(_statistics(grams, counts, base))
        return cls(vocab_size, order, orders[::-1])

    @staticmethod
    def longest_order(vocab_size: int) -> int:
        """The highest order whose n-gram keys fit 63 bits with this vocabulary."""
        return int(MAX_KEY_BITS // np.log2(vocab_size + 1))

    def probabilities(self, contexts: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """p(tokens[i] | contexts[i]) for every i: contexts (N, order - 1) of ids (the start
        symbol `self.start` allowed), tokens (N,) ids below the vocabulary size."""
        contexts = np.asarray(contexts, dtype=np.int64).reshape(len(tokens), self.order - 1)
        tokens = np.asarray(tokens, dtype=np.int64)
        p = np.full(len(tokens), 1.0 / self.vocab_size)
        for k, level in enumerate(self._orders, start=1):
            history = contexts[:, self.order - k :]  # the last k - 1 symbols
            context_key = _key_of(history, self.base)
            at, seen = _find(level.contexts, context_key)
            total = np.where(seen, level.context_totals[at], 0)
            count = np.zeros(len(tokens), dtype=np.int64)
            where, found = _find(level.grams, context_key * self.base + tokens)
            count[found] = level.counts[where[found]]
            discount = level.discounts[np.clip(count, 1, 3) - 1] * (count > 0)
            mixed = (np.maximum(count - discount, 0.0) + level.context_gamma[at] * p) / np.maximum(
                total, 1
            )
            p = np.where(total > 0, mixed, p)
        return p

    def logprob(self, ids: np.ndarray | list[int]) -> float:
        """log p(ids) in nats, the ids read as the start of a document."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return 0.0
        padded = _padded(ids, self.order, self.vocab_size)
        windows = np.lib.stride_tricks.sliding_window_view(padded, self.order)
        return float(np.log(self.probabilities(windows[:, :-1], windows[:, -1])).sum())

    def sentence_logprobs(self, sentences: Sequence[str], tokenizer: Tokenizer) -> list[float]:
        """log p of each sentence in nats, tokenized by `tokenizer` without special tokens and
        read as the start of a document."""
        encoded = tokenizer.encode_batch(list(sentences), add_special_tokens=False)
        return [self.logprob(e.ids) for e in encoded]

    def distribution(self, context: list[int]) -> np.ndarray:
        """p(w | context) for every w of the vocabulary (context: the last order - 1 ids)."""
        contexts = np.tile(np.asarray(context, dtype=np.int64), (self.vocab_size, 1))
        return self.probabilities(contexts, np.arange(self.vocab_size))


def _padded(ids: np.ndarray, order: int, vocab_size: int) -> np.ndarray:
    """`ids` after order - 1 start symbols."""
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(
            f"token id {int(ids.max()) if ids.max() >= vocab_size else int(ids.min())} is "
            f"outside the vocabulary of {vocab_size:,}: the corpus was tokenized with another "
            "tokenizer than the model's"
        )
    return np.concatenate([np.full(order - 1, vocab_size, dtype=np.int64), ids])


def _keys(padded: np.ndarray, order: int, base: int) -> np.ndarray:
    """The key of every n-gram of `padded` that ends on a real token."""
    return _key_of(np.lib.stride_tricks.sliding_window_view(padded, order), base)


def _count(keys: Iterable[np.ndarray], chunk_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys sorted, their counts) of all the key arrays `keys`, counted about
    `chunk_tokens` keys at a time and merged into one table."""
    grams, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    chunk: list[np.ndarray] = []
    held = 0

    def merged() -> tuple[np.ndarray, np.ndarray]:
        # both sorted and distinct: add the counts of the keys already held, insert the others
        new, new_counts = np.unique(np.concatenate(chunk), return_counts=True)
        at = np.searchsorted(grams, new)
        known = at < len(grams)
        known[known] = grams[at[known]] == new[known]
        counts[at[known]] += new_counts[known]
        fresh = ~known
        return np.insert(grams, at[fresh], new[fresh]), np.insert(
            counts, at[fresh], new_counts[fresh]
        )

    for array in keys:
        chunk.append(array)
        held += len(array)
        if held >= chunk_tokens:
            grams, counts = merged()
            chunk, held = [], 0
    if chunk:
        grams, counts = merged()
    return grams, counts


def _key_of(symbols: np.ndarray, base: int) -> np.ndarray:
    """Rows of symbols (N, k) as integers in base `base` (k = 0: all zero)."""
    key = np.zeros(len(symbols), dtype=np.int64)
    for column in range(symbols.shape[1]):
        key = key * base + symbols[:, column]
    return key


def _find(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, found) of each key in `sorted_keys`; the index is valid (0) where not found."""
    at = np.searchsorted(sorted_keys, keys)
    at = np.minimum(at, len(sorted_keys) - 1)
    found = sorted_keys[at] == keys
    return np.where(found, at, 0), found


def _discounts(counts: np.ndarray) -> np.ndarray:
    """D1, D2, D3+ from the counts of counts n1 .. n4 (Chen & Goodman 1999), each within
    [0, its count]; 0.5, 1, 1.5 where the counts give no estimate (a tiny corpus)."""
    n1, n2, n3, n4 = (int(np.count_nonzero(counts == c)) for c in (1, 2, 3, 4))
    fallback = np.array([0.5, 1.0, 1.5])
    if not (n1 and n2 and n3 and n4):
        return fallback
    y = n1 / (n1 + 2 * n2)
    estimated = np.array([1 - 2 * y * n2 / n1, 2 - 3 * y * n3 / n2, 3 - 4 * y * n4 / n3])
    return np.clip(estimated, 0.0, [1.0, 2.0, 3.0])


def _statistics(grams: np.ndarray, counts: np.ndarray, base: int) -> _Order:
    discounts = _discounts(counts)
    contexts, inverse = np.unique(grams // base, return_inverse=True)
    totals = np.bincount(inverse, weights=counts).astype(np.int64)
    kept = discounts[np.clip(counts, 1, 3) - 1]
    gamma = np.bincount(inverse, weights=kept, minlength=len(contexts))
    return _Order(grams, counts, contexts, totals, gamma, discounts)

"""Long documents for classification: sliding-window chunks and truncation baselines. (Chunk
predictions go back to one per document with `models.pooling.aggregate_chunk_logits` or
`ChunkAttentionPooling`.)

Shapes: N chunks (over all documents of a batch or split), C classes, M documents.

Token ids here are content tokens, without [CLS]/[SEP] (encode with `add_special_tokens=False`);
`chunk_document` adds them around every chunk, so a model with a window of T positions takes
`window = T - 2`.

Sliding windows (`chunk_spans`): a chunk starts every `stride` tokens, each chunk holds `window`
tokens, so consecutive chunks share `window - stride` tokens. Rather than ending on a short chunk,
the last chunk is moved left to end exactly at the document's end: every chunk is full, and only
that last one may overlap its predecessor by more than `window - stride`.

Truncation baselines (`truncate`): keep the head, or head+tail as in Sun et al. 2019 ("How to
fine-tune BERT for text classification?": the first 128 and last 382 tokens beat head-only on
IMDB).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "LongTextError",
    "LongTextSpec",
    "chunk_document",
    "chunk_spans",
    "sample_chunks",
    "truncate",
]


class LongTextError(ValueError):
    """Bad `task.long_text` settings: the message names the setting and the fix."""


MODES = ("window", "truncate")
AGGREGATIONS = ("mean", "max", "attention")
TRUNCATIONS = ("head", "head_tail")


@dataclass
class LongTextSpec:
    """How a task's documents longer than the model's window are classified (`task.long_text`).

    Attributes:
        mode: "window" classifies every chunk of a sliding window and aggregates per document;
            "truncate" keeps one piece of each document (the baselines).
        window: content tokens per chunk; null fills the model's sequence length
            (`max_seq_len` minus the special tokens around a chunk).
        stride: tokens from one chunk's start to the next; null is 3/4 of the window (chunks
            share a quarter of their tokens).
        train_chunks: null trains on every chunk of every document, each with the document's
            label; k trains on k chunks per document per epoch, sampled anew each epoch.
        aggregate: how chunk predictions become one per document: "mean" or "max" of the chunk
            logits, or "attention", a learned pooling of the chunk states (trained per
            document).
        truncate: "head" keeps the first tokens; "head_tail" the first `head` and the last
            ones (Sun et al. 2019).
        head: tokens kept from the start in "head_tail" mode; null keeps a quarter of the
            room (Sun et al.'s 128 of 510).
    """

    mode: str = "window"
    window: int | None = None
    stride: int | None = None
    train_chunks: int | None = None
    aggregate: str = "mean"
    truncate: str = "head"
    head: int | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("mode", self.mode, MODES),
            ("aggregate", self.aggregate, AGGREGATIONS),
            ("truncate", self.truncate, TRUNCATIONS),
        ):
            if value not in allowed:
                raise LongTextError(
                    f"task.long_text.{name}={value!r} is not one of {list(allowed)}"
                )
        for name in ("window", "stride", "train_chunks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LongTextError(f"task.long_text.{name}={value} must be >= 1, or null")
        if self.head is not None and self.head < 0:
            raise LongTextError(f"task.long_text.head={self.head} must be >= 0, or null")

    def head_tokens(self, content_len: int) -> int:
        """Tokens kept from the start in "head_tail" mode, for `content_len` content tokens.

        Raises:
            LongTextError: `head` exceeds the room.
        """
        if self.head is None:
            return content_len // 4
        if self.head > content_len:
            raise LongTextError(
                f"task.long_text.head={self.head} exceeds the {content_len} content tokens a "
                "sequence has room for; lower it (null keeps a quarter) or raise max_seq_len"
            )
        return self.head

    def resolve(self, content_len: int) -> tuple[int, int]:
        """(window, stride) for a model with room for `content_len` content tokens per chunk.

        Raises:
            ValueError: the window does not fit, or the stride exceeds the window.
        """
        window = content_len if self.window is None else self.window
        if window > content_len:
            raise LongTextError(
                f"task.long_text.window={window} does not fit max_seq_len: a chunk has room for "
                f"{content_len} content tokens; lower the window or raise max_seq_len"
            )
        stride = max(1, window * 3 // 4) if self.stride is None else self.stride
        if stride > window:
            raise LongTextError(
                f"task.long_text.stride={stride} exceeds the window ({window}): tokens between "
                "chunks would be skipped; use a stride <= window"
            )
        return window, stride


def chunk_spans(num_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """Half-open `[start, end)` spans of content tokens that cover a document of `num_tokens`.

    Chunk i (all but the last) spans `[i * stride, i * stride + window)`; they are emitted while
    they end before the document does (`i * stride + window < num_tokens`). The final chunk is
    then `[num_tokens - window, num_tokens)`: full length and ending exactly at the end. Its
    overlap with the previous chunk is `window - stride` when `num_tokens - window` is a
    multiple of `stride` (it is then the regular next chunk), and otherwise between
    `window - stride + 1` and `window - 1` tokens.

    A document of at most `window` tokens (including an empty one) gives the single span
    `(0, num_tokens)`.

    Args:
        num_tokens: length of the document in content tokens.
        window: tokens per chunk, excluding [CLS]/[SEP].
        stride: step between chunk starts, 1 <= stride <= window (stride == window: no overlap).

    Raises:
        ValueError: a negative `num_tokens`, `window < 1`, or a stride outside [1, window]
            (a stride above the window would skip tokens).
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if not 1 <= stride <= window:
        raise ValueError(
            f"stride must be in [1, window={window}] so that chunks overlap or touch, got "
            f"stride={stride}; overlap = window - stride"
        )
    if num_tokens <= window:
        return [(0, num_tokens)]
    last_start = num_tokens - window
    return [(s, s + window) for s in range(0, last_start, stride)] + [(last_start, num_tokens)]


def _as_list(token_ids: Sequence[int] | np.ndarray) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]


def chunk_document(
    token_ids: Sequence[int] | np.ndarray,
    prefix: Sequence[int],
    suffix: Sequence[int],
    window: int,
    stride: int,
) -> list[list[int]]:
    """The chunks of one document, each `prefix chunk suffix`: `[CLS] chunk [SEP]` for BERT,
    `chunk <eot>` for GPT (at most `window + len(prefix) + len(suffix)` ids).

    Args:
        token_ids: the document's content tokens, without special tokens.
        prefix, suffix: special-token ids put around every chunk (`special_ids`).
        window, stride: as in `chunk_spans`.

    Raises:
        ValueError: the ids already contain one of the special tokens (encode without special
            tokens), or bad `window`/`stride` (see `chunk_spans`).
    """
    ids = _as_list(token_ids)
    specials = {*prefix, *suffix}
    if specials.intersection(ids):
        raise ValueError(
            f"token_ids already contain the special token ids {sorted(specials)}; encode "
            "documents with add_special_tokens=False, chunk_document adds them to every chunk"
        )
    head, tail = list(prefix), list(suffix)
    return [head + ids[start:end] + tail for start, end in chunk_spans(len(ids), window, stride)]


def truncate(
    token_ids: Sequence[int] | np.ndarray,
    max_content: int,
    mode: Literal["head", "head_tail"] = "head",
    head: int = 128,
) -> list[int]:
    """Cut a document to at most `max_content` tokens (the single-chunk baselines).

    Args:
        token_ids: content tokens, without special tokens.
        max_content: tokens kept (510 for a 512-position model with [CLS]/[SEP]).
        mode: "head" keeps the first `max_content` tokens; "head_tail" keeps the first `head`
            and the last `max_content - head` (Sun et al. 2019: 128 + 382).
        head: tokens kept from the start in "head_tail" mode, 0 <= head <= max_content.

    Returns:
        The kept tokens in document order; documents within the budget come back whole.
    """
    if max_content < 1:
        raise ValueError(f"max_content must be >= 1, got {max_content}")
    if mode not in ("head", "head_tail"):
        raise ValueError(f"truncation mode must be 'head' or 'head_tail', got {mode!r}")
    if mode == "head_tail" and not 0 <= head <= max_content:
        raise ValueError(f"head must be in [0, max_content={max_content}], got head={head}")
    ids = _as_list(token_ids)
    if len(ids) <= max_content:
        return ids
    if mode == "head":
        return ids[:max_content]
    tail = max_content - head
    return ids[:head] + ids[len(ids) - tail :]  # not ids[-tail:], which is everything at tail=0


def sample_chunks(n_chunks: int, k: int, rng: np.random.Generator) -> list[int]:
    """Indices of `k` distinct chunks of a document, in document order, to train on this epoch.

    A document with at most `k` chunks uses them all. Seed `rng` with the epoch (and document)
    so that each epoch sees another subset and a resumed run the same one.

    Raises:
        ValueError: `n_chunks < 1` or `k < 1`.
    """
    if n_chunks < 1:
        raise ValueError(f"a document has at least one chunk, got n_chunks={n_chunks}")
    if k < 1:
        raise ValueError(f"k (chunks per document) must be >= 1, got {k}")
    if n_chunks <= k:
        return list(range(n_chunks))
    return sorted(rng.choice(n_chunks, size=k, replace=False).tolist())

"""What tokenizer a run uses (`conf/tokenizer/*.yaml`), and getting it: load, reuse from cache,
or train."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tokenizer.build import batched, train_tokenizer
from tokenizer.cache import cache_key, cached_tokenizer_path, read_cached, write_cached
from tokenizer.load import load_tokenizer
from tokenizer.special import (
    SPECIALS_BY_KIND,
    UnsupportedTokenizerError,
    special_ids,
    tokenizer_kind,
)

log = logging.getLogger(__name__)


@dataclass
class TokenizerSpec:
    """Settings of the run's tokenizer.

    Attributes:
        kind: "wordpiece" (BERT) or "bpe" (byte-level BPE, GPT).
        vocab_size: target vocabulary size when training, special tokens included.
        min_frequency: a merge needs at least this many occurrences.
        lowercase: WordPiece only: lower-case and strip accents (uncased BERT).
        path: an existing tokenizer to load instead of training (tokenizer.json, vocab.txt, a
            directory holding one, or a hub name when online).
        sample_mb: train on the corpus's first `sample_mb` MB of text (in reading order)
            instead of all of it: a streamed run on a large corpus then starts in seconds.
            None: the whole corpus.
    """

    kind: str = "wordpiece"
    vocab_size: int = 8192
    min_frequency: int = 2
    lowercase: bool = True
    path: str | None = None
    sample_mb: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPECIALS_BY_KIND:
            raise ValueError(
                f"tokenizer.kind={self.kind!r} is not one of {sorted(SPECIALS_BY_KIND)}"
            )
        floor = len(SPECIALS_BY_KIND[self.kind]) + (256 if self.kind == "bpe" else 0)
        if not isinstance(self.vocab_size, int) or self.vocab_size <= floor:
            raise ValueError(
                f"tokenizer.vocab_size={self.vocab_size!r} is too small for {self.kind}; "
                f"it must exceed {floor} (special tokens"
                f"{' + 256 byte symbols' if self.kind == 'bpe' else ''})"
            )
        if self.min_frequency < 1:
            raise ValueError(f"tokenizer.min_frequency must be >= 1, got {self.min_frequency}")
        if self.sample_mb is not None and not self.sample_mb > 0:
            raise ValueError(
                f"tokenizer.sample_mb must be a positive size in MB, or null for the whole "
                f"corpus; got {self.sample_mb!r}"
            )

    def training_settings(self) -> dict:
        settings = asdict(self)
        settings.pop("path")
        if self.sample_mb is None:
            settings.pop("sample_mb")  # the keys of tokenizers trained on everything stay
        if self.kind == "bpe":
            settings.pop("lowercase")  # byte-level BPE never normalizes
        return settings


def get_tokenizer(
    spec: TokenizerSpec,
    corpus,
    cache_dir: str | os.PathLike,
    *,
    may_train: bool = True,
    wait_timeout_s: float = 6 * 3600,
) -> Tokenizer:
    """The run's tokenizer: loaded from `spec.path`, else from the cache, else trained and cached.

    Args:
        spec: tokenizer settings.
        corpus: a corpus from `datamodules.corpora.corpus` (only read when training).
        cache_dir: root of the project's caches.
        may_train: False in every process of a multi-process run but rank 0: WordPiece
            training is not reproducible across processes, so the others wait for rank 0's
            cached tokenizer instead of training their own.
        wait_timeout_s: how long a process that may not train waits.
    """
    if spec.path:
        tokenizer = load_tokenizer(spec.path, lowercase=spec.lowercase)
        try:
            kind = tokenizer_kind(tokenizer)
        except UnsupportedTokenizerError as err:
            raise UnsupportedTokenizerError(
                f"tokenizer.path={spec.path!r}: {err}; point it at a {spec.kind} tokenizer, or "
                "set tokenizer.path=null to train one"
            ) from err
        if kind != spec.kind:
            raise UnsupportedTokenizerError(
                f"tokenizer.path={spec.path!r} is a {kind} tokenizer, but this run needs "
                f"tokenizer.kind={spec.kind}; point tokenizer.path at a {spec.kind} tokenizer, or "
                "set tokenizer.path=null to train one"
            )
        special_ids(tokenizer)  # fail now if it lacks our special tokens
        return tokenizer
    path = tokenizer_cache_path(spec, corpus, cache_dir)
    tokenizer = read_cached(path)
    if tokenizer is None and not may_train:
        tokenizer = _wait_for_cached(path, wait_timeout_s)
    if tokenizer is not None:
        log.info("reusing cached tokenizer %s", path)
    else:
        log.info(
            "training a %s tokenizer (vocab %d) on %s%s",
            spec.kind,
            spec.vocab_size,
            corpus.describe(),
            "" if spec.sample_mb is None else f" (its first {spec.sample_mb:g} MB)",
        )
        documents = corpus.documents()
        if spec.sample_mb is not None:
            documents = first_text(documents, int(spec.sample_mb * 1e6))
        tokenizer = train_tokenizer(
            spec.kind,
            batched(documents),
            spec.vocab_size,
            spec.min_frequency,
            spec.lowercase,
        )
        write_cached(tokenizer, path)
        log.info("saved tokenizer to %s", path)
    if may_train:  # once per run: the processes that wait for rank 0 read the same tokenizer
        warn_if_short_vocabulary(spec, tokenizer)
    return tokenizer


def first_text(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """The documents up to the one that brings their UTF-8 size to `max_bytes`."""
    size = 0
    for document in documents:
        yield document
        size += len(document.encode())
        if size >= max_bytes:
            return


def warn_if_short_vocabulary(spec: TokenizerSpec, tokenizer: Tokenizer) -> None:
    """Log a warning when a tokenizer trained for `spec` has fewer tokens than
    `spec.vocab_size` asked: training stops when no pair of pieces occurs `min_frequency`
    times, and the model's vocabulary is then sized from the tokens there are."""
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got < spec.vocab_size:
        log.warning(
            "tokenizer.vocab_size=%d asked, but the trained %s tokenizer has %d tokens: the "
            "corpus has no more distinct pieces seen at least tokenizer.min_frequency=%d times. "
            "The model's vocabulary is sized from these %d tokens; more text gives more",
            spec.vocab_size,
            spec.kind,
            got,
            spec.min_frequency,
            got,
        )


def tokenizer_cache_path(spec: TokenizerSpec, corpus, cache_dir: str | os.PathLike) -> Path:
    """Where `get_tokenizer` caches the tokenizer trained for (spec, corpus)."""
    return cached_tokenizer_path(
        cache_dir, spec.kind, cache_key(corpus.fingerprint(), spec.training_settings())
    )


def _wait_for_cached(path: Path, timeout_s: float, poll_s: float = 1.0) -> Tokenizer:
    log.info("waiting for rank 0 to train the tokenizer (%s)", path)
    deadline = time.monotonic() + timeout_s
    while (tokenizer := read_cached(path)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for rank 0 to write the tokenizer {path}; the "
                "processes need a shared paths.cache_dir, or give a trained tokenizer with "
                "tokenizer.path=... (make tokenizer trains one)"
            )
        time.sleep(poll_s)
    return tokenizer

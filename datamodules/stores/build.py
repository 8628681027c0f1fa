"""Build token stores: stream a corpus through the tokenizer into a store, in bounded memory.

Documents are read one at a time and grouped into chunks of about `chunk_mb` MB of text. Each
chunk is encoded with `Tokenizer.encode_batch_fast`, which runs on all cores (Rust threads, GIL
released) while this thread reads and sentence-splits the next chunk; its ids are appended to the
store files as they come. At most two chunks are alive at once, so memory is bounded by the chunk
size (and the longest document), never by the corpus size. How a chunk becomes ids (sentence
stores, special-token text, empty documents) is `datamodules.stores.encoding`; a document left
with no token is skipped and counted in the manifest (`skipped_documents`).

`open_or_build_store` is the entry point: reuse a valid store, rebuild a missing or damaged one
(only in the process allowed to build: rank 0), or wait for the builder and then read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import Tokenizer

from datamodules.corpora.corpus import CorpusError
from datamodules.stores.encoding import BlockEncoder, Encoded, _Chunk
from datamodules.stores.store import (
    DOC_SENTENCES,
    DOCUMENTS,
    MANIFEST,
    OFFSET_DTYPE,
    SENTENCES,
    STORE_FORMAT,
    TOKENS,
    StoreInvalidError,
    StoreSettings,
    StoreStats,
    TokenStore,
    store_dir,
    store_key,
    token_dtype,
    tokenizer_hash,
)
from tokenizer import atomic_path

log = logging.getLogger(__name__)
_PROGRESS_EVERY = 100_000_000  # bytes of text between progress lines


def open_or_build_store(
    corpus,
    tokenizer: Tokenizer,
    settings: StoreSettings,
    cache_dir: str | os.PathLike,
    *,
    may_build: bool = True,
    chunk_mb: float = 4.0,
    wait_timeout_s: float = 6 * 3600,
    poll_s: float = 2.0,
    fingerprint: str | None = None,
) -> tuple[TokenStore, StoreStats]:
    """The store of (corpus, tokenizer, settings) under `cache_dir`, built if needed.

    Args:
        corpus: a corpus from `datamodules.corpora.corpus` (anything with `documents()`,
            `fingerprint()` and `describe()`).
        tokenizer: the run's tokenizer.
        settings: see `StoreSettings`.
        cache_dir: root of the project's caches.
        may_build: whether this process builds a missing or damaged store (rank 0). Other
            processes wait until the store is valid, then read it.
        chunk_mb: text per encoding chunk; bounds the builder's memory.
        wait_timeout_s: how long a non-building process waits for the store.
        poll_s: how often it looks.
        fingerprint: `corpus.fingerprint()` when the caller already has it.

    Returns:
        The opened store and its stats.

    Raises:
        CorpusError: the corpus has no text.
        StoreInvalidError: a waiting process timed out.
    """
    fingerprint = fingerprint or corpus.fingerprint()
    path = store_path(fingerprint, tokenizer, settings, cache_dir)
    if not may_build:
        store = wait_for_store(path, wait_timeout_s, poll_s)
        return store, StoreStats.from_manifest(path, store.manifest, built=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The lock keeps two independent runs from building the same store at once (each would be
    # correct, as every file is written atomically, but the work would be done twice).
    with exclusive_lock(path.parent / f"{path.name}.lock"):
        try:
            store = TokenStore.open(path)
            log.info("reusing token store %s", path)
            return store, StoreStats.from_manifest(path, store.manifest, built=False)
        except StoreInvalidError as err:
            if path.exists():
                log.warning("rebuilding token store: %s", err)
        stats = build_store(corpus, tokenizer, settings, path, fingerprint, chunk_mb=chunk_mb)
        return TokenStore.open(path, verify=False), stats


def store_path(
    fingerprint: str, tokenizer: Tokenizer, settings: StoreSettings, cache_dir: str | os.PathLike
) -> Path:
    """Where the store of (corpus fingerprint, tokenizer, settings) lives under `cache_dir`."""
    return store_dir(cache_dir, store_key(fingerprint, tokenizer_hash(tokenizer), settings))


def build_store(
    corpus,
    tokenizer: Tokenizer,
    settings: StoreSettings,
    path: Path,
    corpus_fingerprint: str,
    *,
    chunk_mb: float = 4.0,
    allow_empty: bool = False,
) -> StoreStats:
    """Tokenize `corpus` into a new store at `path` (replacing whatever is there).

    Raises:
        CorpusError: the corpus yields no document with any token (unless `allow_empty`: a
            part of a store built in parallel may hold only empty documents).
    """
    start = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)  # the store is invalid from here until complete
    encoding = BlockEncoder(tokenizer, settings)
    names = [TOKENS, DOCUMENTS] + ([SENTENCES, DOC_SENTENCES] if settings.sentences else [])
    totals = {"documents": 0, "sentences": 0, "tokens": 0, "skipped_documents": 0, "text_bytes": 0}
    with ExitStack() as stack:
        writer = StoreWriter(path, names, stack)
        for name in names[1:]:
            writer.write(name, np.zeros(1, OFFSET_DTYPE))
        chunks = encoding.chunks(corpus.documents(), int(chunk_mb * 1e6))
        next_report = _PROGRESS_EVERY
        for encoded in _encode_pipelined(encoding, chunks):
            _append(writer, encoded, totals)
            if totals["text_bytes"] >= next_report:
                next_report += _PROGRESS_EVERY
                rate = totals["text_bytes"] / 1e6 / (time.perf_counter() - start)
                log.info("tokenized %.0f MB (%.1f MB/s)", totals["text_bytes"] / 1e6, rate)
        if totals["documents"] == 0 and not allow_empty:
            raise no_text(corpus, totals["skipped_documents"])
    if totals["skipped_documents"]:
        log.warning("%d documents produced no token and were skipped", totals["skipped_documents"])
    seconds = time.perf_counter() - start
    return write_manifest(
        path, corpus, corpus_fingerprint, tokenizer, settings, totals, seconds, writer.summary()
    )


def write_manifest(
    path: Path,
    corpus,
    corpus_fingerprint: str,
    tokenizer: Tokenizer,
    settings: StoreSettings,
    totals: dict[str, int],
    seconds: float,
    files: dict[str, dict[str, Any]],
) -> StoreStats:
    """Write the manifest of the store at `path` (last, atomically: the store is valid from
    here) and return its stats."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    manifest = {
        "format": STORE_FORMAT,
        "corpus": corpus.describe(),
        "corpus_fingerprint": corpus_fingerprint,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "vocab_size": vocab_size,
        "settings": asdict(settings),
        "dtype": token_dtype(vocab_size).name,
        "counts": totals,
        "build": {
            "seconds": seconds,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "files": files,
    }
    with atomic_path(path / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    stats = StoreStats.from_manifest(path, manifest, built=True)
    log.info("%s", stats.summary())
    return stats


def _encode_pipelined(encoding: BlockEncoder, chunks: Iterator[_Chunk]) -> Iterator[Encoded]:
    """Encode chunk k on a helper thread while the caller's thread prepares chunk k + 1."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(encoding.encode, chunk))
            if len(pending) > 1:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _append(writer: StoreWriter, encoded: Encoded, totals: dict[str, int]) -> None:
    writer.write(TOKENS, encoded.ids)
    writer.write(DOCUMENTS, totals["tokens"] + np.cumsum(encoded.doc_lengths))
    if encoded.sentence_lengths is not None:
        writer.write(SENTENCES, totals["tokens"] + np.cumsum(encoded.sentence_lengths))
        writer.write(DOC_SENTENCES, totals["sentences"] + np.cumsum(encoded.doc_sentence_counts))
        totals["sentences"] += len(encoded.sentence_lengths)
    totals["tokens"] += len(encoded.ids)
    totals["documents"] += len(encoded.doc_lengths)
    totals["skipped_documents"] += encoded.skipped
    totals["text_bytes"] += encoded.text_bytes


class StoreWriter:
    """Streams arrays into the store's files through `atomic_path`, hashing as it goes.

    The files appear under their final names only when the enclosing `ExitStack` closes
    without an exception.
    """

    def __init__(self, path: Path, names: list[str], stack: ExitStack) -> None:
        self._handles: dict[str, BinaryIO] = {}
        self._digests = {name: hashlib.sha256() for name in names}
        self._sizes = dict.fromkeys(names, 0)
        for name in names:
            tmp = stack.enter_context(atomic_path(path / name))
            self._handles[name] = stack.enter_context(open(tmp, "wb"))  # noqa: SIM115

    def write(self, name: str, array: np.ndarray) -> None:
        if name != TOKENS:
            array = array.astype(OFFSET_DTYPE, copy=False)
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self._handles[name].write(data)
        self._digests[name].update(data)
        self._sizes[name] += data.nbytes

    def summary(self) -> dict[str, dict[str, Any]]:
        return {
            name: {"bytes": self._sizes[name], "sha256": digest.hexdigest()}
            for name, digest in self._digests.items()
        }


def no_text(corpus, skipped: int) -> CorpusError:
    """The error of a corpus that yielded no document with any token (`skipped`: empty ones)."""
    return CorpusError(
        f"{corpus.describe()} yielded no text to tokenize ({skipped} empty documents); check "
        "data.paths and that the files hold text"
    )


def wait_for_store(
    path: Path,
    timeout_s: float,
    poll_s: float,
    *,
    verify: bool = True,
    builder: str = "rank 0 to build the token store",
    hint: str = "Check rank 0's log, or build it first with `make prepare`",
    failed: Callable[[], str | None] | None = None,
) -> TokenStore:
    """The store at `path` once it is valid. `builder` and `hint` word the timeout's error;
    `failed()`, asked while waiting, returns the message of a build that failed elsewhere
    (raised as a CorpusError) or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return TokenStore.open(path, verify=verify)
        except StoreInvalidError as err:
            if failed is not None and (message := failed()) is not None:
                raise CorpusError(message) from None
            if time.monotonic() > deadline:
                raise StoreInvalidError(
                    f"waited {timeout_s:.0f} s for {builder}, still invalid: {err}. {hint}"
                ) from None
        time.sleep(poll_s)


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

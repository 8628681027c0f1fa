"""Build token stores: stream a corpus through the tokenizer into a store, in bounded memory.

Documents are read one at a time and grouped into chunks of about `chunk_mb` MB of text. Each
chunk is encoded with `Tokenizer.encode_batch_fast`, which runs on all cores (Rust threads, GIL
released) while this thread reads and sentence-splits the next chunk; its ids are appended to the
store files as they come. At most two chunks are alive at once, so memory is bounded by the chunk
size (and the longest document), never by the corpus size.

Sentence stores (BERT) encode whole documents, not sentences one by one: the sentences of a
document are joined by `SENTENCE_MARK`, a private-use character the encoder copy knows as an added
token, and the marker ids in the output give the sentence boundaries. Added tokens split the text
before normalization and pre-tokenization, so the ids are exactly those of encoding each sentence
alone, at the cost of one long text per document instead of tens of short ones (1.4x faster on
WikiText-2). A long document is cut into several joined texts (at sentence boundaries, every
~32k characters), so its encoding still spreads over the tokenizer's threads. A document that
itself contains the marker character has its sentences encoded one by one with the plain
encoder, so the character stays what the tokenizer makes of it; so do all documents of a
tokenizer whose pre-tokenizer treats the start of the text apart from later splits (Metaspace
with `prepend_scheme="first"`) or is of a kind not known here.

The text is encoded with `encode_special_tokens=True`: a literal "[SEP]" or "<|endoftext|>" in the
corpus becomes ordinary word pieces, so special ids in a store only ever come from this code (the
GPT end-of-text separators). Sentences or documents that encode to no token are dropped; a
document left with no token is skipped and counted in the manifest (`skipped_documents`).

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
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tokenizers import AddedToken, Tokenizer

from datamodules.corpora.corpus import CorpusError
from datamodules.corpora.sentences import split_sentences
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
# Joins a document's sentences for encoding; a Unicode private-use character, so text almost never
# holds it (a document that does is encoded sentence by sentence).
SENTENCE_MARK = "\ue000"
_JOINED_CHARS = 32_000  # a joined text ends at the first sentence boundary past this length
# Pre-tokenizers that treat every split of the text alike, so that splitting at an added token
# gives the ids of encoding each piece alone (Metaspace only with prepend_scheme always/never).
_SPLIT_ALIKE_PRE_TOKENIZERS = frozenset(
    [
        "BertPreTokenizer",
        "ByteLevel",
        "Whitespace",
        "WhitespaceSplit",
        "Punctuation",
        "Digits",
        "Split",
        "CharDelimiterSplit",
        "UnicodeScripts",
        "Metaspace",
        "Sequence",
    ]
)
_PROGRESS_EVERY = 100_000_000  # bytes of text between progress lines


@dataclass
class _Chunk:
    """Texts to encode and the UTF-8 size of the documents they came from. GPT stores: one text
    per document. Sentence stores: one text per document with `SENTENCE_MARK` between its
    sentences (or one per sentence, for a document holding the marker: `apart` lists those texts),
    and `per_document` the number of sentences of each document."""

    texts: list[str]
    per_document: list[int] | None
    text_bytes: int
    apart: list[int]


@dataclass
class Encoded:
    """A chunk after encoding, empty pieces dropped. Lengths are per kept document/sentence."""

    ids: np.ndarray
    doc_lengths: np.ndarray
    sentence_lengths: np.ndarray | None
    doc_sentence_counts: np.ndarray | None
    skipped: int
    text_bytes: int


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


class BlockEncoder:
    """Encodes documents as a store build does (the same ids, module notes): `chunks` groups
    them, `encode` encodes a chunk. Streaming (`datamodules.streaming.read`) encodes its blocks
    with it, so a streamed run reads the tokens a store would hold.

    Args:
        tokenizer: the run's tokenizer (copied, not changed).
        settings: the store layout (sentences for BERT, an EOS id for GPT).
    """

    def __init__(self, tokenizer: Tokenizer, settings: StoreSettings) -> None:
        self.settings = settings
        self.dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        self.encoder = _encoder(tokenizer)
        self.join = settings.sentences and _splits_alike(self.encoder)
        self.marked = _with_sentence_mark(self.encoder) if self.join else None

    def chunks(self, documents: Iterable[str], chunk_bytes: int) -> Iterator[_Chunk]:
        """`documents` in chunks of about `chunk_bytes` bytes of text."""
        return _chunks(documents, self.settings.sentences, self.join, chunk_bytes)

    def encode(self, chunk: _Chunk) -> Encoded:
        """The ids of a chunk, its documents' and sentences' lengths (empty ones dropped)."""
        return _encode(self.encoder, self.marked, chunk, self.settings, self.dtype)

    def encode_documents(self, documents: list[str]) -> Encoded:
        """The ids of `documents`, as one chunk (none: empty)."""
        empty = _Chunk([], [] if self.settings.sentences else None, 0, [])
        return self.encode(next(self.chunks(documents, 1 << 62), empty))


def _encoder(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that encodes special-token text literally, without truncation or
    padding (the run's tokenizer object is left as it was)."""
    encoder = Tokenizer.from_str(tokenizer.to_str())
    encoder.encode_special_tokens = True
    encoder.no_truncation()
    encoder.no_padding()
    return encoder


def _splits_alike(tokenizer: Tokenizer) -> bool:
    """Whether the pre-tokenizer treats every split of a text alike (see the module notes)."""

    def alike(spec: dict | None) -> bool:
        if spec is None:
            return True
        kind = spec.get("type")
        if kind == "Sequence":
            return all(alike(p) for p in spec.get("pretokenizers", []))
        if kind == "Metaspace":
            return spec.get("prepend_scheme", "always") != "first"
        return kind in _SPLIT_ALIKE_PRE_TOKENIZERS

    return alike(json.loads(tokenizer.to_str()).get("pre_tokenizer"))


def _with_sentence_mark(encoder: Tokenizer) -> Tokenizer:
    """A copy of `encoder` that knows `SENTENCE_MARK` as one (non-special) added token."""
    marked = _encoder(encoder)
    marked.add_tokens([AddedToken(SENTENCE_MARK, normalized=False, special=False)])
    return marked


def _chunks(
    documents: Iterable[str], sentences: bool, join: bool, chunk_bytes: int
) -> Iterator[_Chunk]:
    """Chunks of about `chunk_bytes` of text. Sentence stores: with `join`, each document's
    sentences joined by the marker (see `_joined`); without, one text per sentence."""
    texts: list[str] = []
    per_document: list[int] = []
    apart: list[int] = []
    size = 0
    for document in documents:
        if sentences:
            pieces = split_sentences(document)
            if join and SENTENCE_MARK not in document:
                texts.extend(_joined(pieces))
            else:
                if join:  # the marker is text here: these sentences are encoded apart
                    apart.extend(range(len(texts), len(texts) + len(pieces)))
                texts.extend(pieces)
            per_document.append(len(pieces))
        else:
            texts.append(document)
        size += len(document.encode())
        if size >= chunk_bytes:
            yield _Chunk(texts, per_document if sentences else None, size, apart)
            texts, per_document, apart, size = [], [], [], 0
    if texts or per_document:
        yield _Chunk(texts, per_document if sentences else None, size, apart)


def _joined(sentences: list[str]) -> list[str]:
    """The sentences joined by `SENTENCE_MARK` into texts that end at the first sentence
    boundary past `_JOINED_CHARS` characters."""
    texts, group, length = [], [], 0
    for sentence in sentences:
        group.append(sentence)
        length += len(sentence) + 1
        if length >= _JOINED_CHARS:
            texts.append(SENTENCE_MARK.join(group))
            group, length = [], 0
    if group:
        texts.append(SENTENCE_MARK.join(group))
    return texts


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


def _encode(
    encoder: Tokenizer,
    marked: Tokenizer | None,
    chunk: _Chunk,
    settings: StoreSettings,
    dtype: np.dtype,
) -> Encoded:
    """Encode a chunk: joined sentence texts with `marked`, the texts `apart` (and everything
    when `marked` is None) with the plain `encoder`."""
    texts = chunk.texts
    if marked is not None and chunk.apart:
        texts = list(texts)
        for index in chunk.apart:
            texts[index] = ""  # encoded below, with the plain encoder
    encodings = (marked or encoder).encode_batch_fast(texts, add_special_tokens=False)
    for index in chunk.apart:
        encodings[index] = encoder.encode(chunk.texts[index], add_special_tokens=False)
    lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
    # The marker's id may not fit the store's dtype: sentence ids are read as int64 first.
    read_as = np.int64 if settings.sentences else dtype
    ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), read_as, int(lengths.sum()))
    del encodings  # the Encoding objects are ~10x larger than the ids
    if settings.sentences:
        if marked is not None:
            mark_id = marked.token_to_id(SENTENCE_MARK)
            ids, lengths = _split_at_marks(ids, lengths, mark_id, chunk.apart)
        return _group_sentences(
            ids.astype(dtype),
            lengths,
            np.asarray(chunk.per_document, dtype=np.int64),
            chunk.text_bytes,
        )
    kept = lengths > 0
    if settings.eos_id is not None:
        ids = np.insert(ids, np.cumsum(lengths)[kept], np.array(settings.eos_id, dtype))
        lengths = lengths + 1
    return Encoded(ids, lengths[kept], None, None, int((~kept).sum()), chunk.text_bytes)


def _split_at_marks(
    ids: np.ndarray, text_lengths: np.ndarray, mark_id: int, apart: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The ids without the sentence markers, and the length of each sentence.

    Every text ends a sentence and every marker ends one, so the token after m markers in text t
    belongs to sentence t + m (sentences that encode to nothing get length 0). Texts `apart`
    hold no marker (their ids come from the plain encoder, even if one equals `mark_id`)."""
    text_of = np.repeat(np.arange(len(text_lengths)), text_lengths)
    is_mark = ids == mark_id
    if apart:
        is_mark &= ~np.isin(text_of, apart)
    sentence_of = text_of + np.cumsum(is_mark) - is_mark
    kept = ~is_mark
    n_sentences = len(text_lengths) + int(is_mark.sum())
    lengths = np.bincount(sentence_of[kept], minlength=n_sentences).astype(np.int64)
    return ids[kept], lengths


def _group_sentences(
    ids: np.ndarray, sentence_lengths: np.ndarray, per_document: np.ndarray, text_bytes: int
) -> Encoded:
    """Drop empty sentences, then documents left without a sentence."""
    document_of = np.repeat(np.arange(len(per_document)), per_document)
    kept = sentence_lengths > 0
    counts = np.bincount(document_of[kept], minlength=len(per_document))
    tokens = np.bincount(document_of, weights=sentence_lengths, minlength=len(per_document))
    has_text = counts > 0
    return Encoded(
        ids=ids,
        doc_lengths=tokens[has_text].astype(np.int64),
        sentence_lengths=sentence_lengths[kept],
        doc_sentence_counts=counts[has_text],
        skipped=int((~has_text).sum()),
        text_bytes=text_bytes,
    )


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

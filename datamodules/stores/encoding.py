"""How documents become the token ids that a store holds: `BlockEncoder` groups documents into
chunks of text and encodes a chunk, for store builds (`datamodules.stores.build`) and streaming
(`datamodules.streaming.read`) alike, so that a streamed run reads the tokens a store would hold.

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
GPT end-of-text separators). Sentences or documents that encode to no token are dropped and the
documents counted (`Encoded.skipped`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain

import numpy as np
from tokenizers import AddedToken, Tokenizer

from datamodules.corpora.sentences import split_sentences
from datamodules.stores.store import StoreSettings, token_dtype

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

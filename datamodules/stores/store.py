"""The token store: a corpus tokenized once into flat arrays on disk, memory-mapped for reading.

A store lives in `<cache_dir>/token_stores/<key>/`, where the key hashes everything its content
depends on: the corpus fingerprint (every reading setting, `datamodules.corpora.fingerprint`), the
tokenizer (its full JSON, and the `tokenizers` version that encodes with it), the store settings
and `STORE_FORMAT`, which is bumped whenever the code that reads, splits or encodes changes what a
store holds. Objective settings that only shape batches (seq_len, batch size, masking) are not in
it: stores are shared by every run over the same tokens. Files:

    tokens.bin          all token ids, documents one after another: uint16 when the vocabulary
                        fits in 16 bits, else uint32. GPT stores end every document with the
                        end-of-text id.
    documents.bin       int64 (D + 1,): token offset of each document's start, then the total.
    sentences.bin       int64 (S + 1,): token offset of each sentence's start, then the total
                        (BERT stores only: NSP pairs are built from sentences).
    doc_sentences.bin   int64 (D + 1,): index of each document's first sentence, then S.
    manifest.json       written last: counts, dtype, build figures, and the byte size and sha256
                        of every file above.

Every file is written atomically (`tokenizer.atomic_path`) and the manifest only after all the
others, so a store without a manifest is incomplete. `TokenStore.open` checks sizes and
checksums and raises `StoreInvalidError` for a partial or corrupt store, which the builder then
rebuilds: a damaged cache is never read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from tokenizer import tokenizers_version

STORE_FORMAT = 1
TOKENS, DOCUMENTS, SENTENCES, DOC_SENTENCES = (
    "tokens.bin",
    "documents.bin",
    "sentences.bin",
    "doc_sentences.bin",
)
MANIFEST = "manifest.json"
OFFSET_DTYPE = np.dtype(np.int64)


class StoreInvalidError(RuntimeError):
    """A token store directory is missing, incomplete or corrupt (the message says which)."""


@dataclass(frozen=True)
class StoreSettings:
    """How a corpus is turned into tokens; part of the cache key (every field).

    Attributes:
        sentences: split documents into sentences and record their offsets (BERT, for NSP).
        eos_id: token appended after every document (GPT packing), or None.
    """

    sentences: bool
    eos_id: int | None = None


@dataclass
class StoreStats:
    """What a store holds and how fast it was built (what `make prepare` prints).

    Attributes:
        path: the store directory.
        documents: documents kept.
        sentences: sentences kept (0 for GPT stores).
        tokens: tokens stored (GPT stores include one end-of-text per document).
        skipped_documents: documents that produced no token.
        text_bytes: UTF-8 bytes of text read.
        seconds: build time (of the original build when the store was reused).
        built: True if built by this call, False if an existing store was reused.
    """

    path: Path
    documents: int
    sentences: int
    tokens: int
    skipped_documents: int
    text_bytes: int
    seconds: float
    built: bool

    @property
    def mb_per_s(self) -> float:
        """Raw text throughput of the build, in MB (10^6 bytes) per second."""
        return self.text_bytes / 1e6 / max(self.seconds, 1e-9)

    def summary(self) -> str:
        how = "built" if self.built else "reused"
        return (
            f"{how} token store {self.path}: {self.documents:,} documents, "
            f"{self.tokens:,} tokens, {self.text_bytes / 1e6:.1f} MB of text at "
            f"{self.mb_per_s:.2f} MB/s"
            + (
                f", {self.skipped_documents} empty documents skipped"
                if self.skipped_documents
                else ""
            )
        )

    @classmethod
    def from_manifest(cls, path: Path, manifest: dict[str, Any], built: bool) -> StoreStats:
        counts = manifest["counts"]
        return cls(
            path=path,
            documents=counts["documents"],
            sentences=counts["sentences"],
            tokens=counts["tokens"],
            skipped_documents=counts["skipped_documents"],
            text_bytes=counts["text_bytes"],
            seconds=manifest["build"]["seconds"],
            built=built,
        )


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """A short hash of the tokenizer's full definition (vocabulary, merges, normalizer, ...)."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]


def store_key(corpus_fingerprint: str, tokenizer_digest: str, settings: StoreSettings) -> str:
    """Cache key of a store: changes whenever the corpus, tokenizer or settings change."""
    payload = json.dumps(
        {
            "format": STORE_FORMAT,
            "corpus": corpus_fingerprint,
            "tokenizer": tokenizer_digest,
            "tokenizers": tokenizers_version(),
            "settings": asdict(settings),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def store_dir(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir).expanduser() / "token_stores" / key


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits (halves the store and the page cache), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(block):
            digest.update(chunk)
    return digest.hexdigest()


class TokenStore:
    """Read access to a validated store; arrays are memory-mapped, never loaded whole.

    Attributes:
        path: the store directory.
        manifest: the parsed manifest.json.
        tokens: (N,) token ids (memory-mapped).
        doc_offsets: (D + 1,) token offsets of documents.
        sentence_offsets: (S + 1,) token offsets of sentences, or None (GPT stores).
        doc_sentences: (D + 1,) first sentence of each document, or None.

    A store pickles as its path (DataLoader workers re-map the files instead of copying them).
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self._map()

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = True) -> TokenStore:
        """Open the store at `path` after checking it is complete.

        Args:
            path: store directory.
            verify: also compare every file's sha256 with the manifest (one read of the
                store); without it only sizes are checked.

        Raises:
            StoreInvalidError: no manifest, a wrong format, a missing file, or a size or
                checksum that differs from the manifest.
        """
        path = Path(path)
        return cls(path, validate(path, verify=verify))

    def _map(self) -> None:
        counts = self.manifest["counts"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.tokens = self._memmap(TOKENS, self.dtype, counts["tokens"])
        self.doc_offsets = self._memmap(DOCUMENTS, OFFSET_DTYPE, counts["documents"] + 1)
        self.sentence_offsets = self.doc_sentences = None
        if self.manifest["settings"]["sentences"]:
            self.sentence_offsets = self._memmap(SENTENCES, OFFSET_DTYPE, counts["sentences"] + 1)
            self.doc_sentences = self._memmap(DOC_SENTENCES, OFFSET_DTYPE, counts["documents"] + 1)

    def _memmap(self, name: str, dtype: np.dtype, count: int) -> np.ndarray:
        if count == 0:  # an empty file cannot be mapped (a part of a parallel build may be empty)
            return np.empty(0, dtype)
        return np.memmap(self.path / name, dtype=dtype, mode="r", shape=(count,))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.manifest = state["path"], state["manifest"]
        self._map()

    @property
    def num_documents(self) -> int:
        return int(self.manifest["counts"]["documents"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["counts"]["tokens"])

    @property
    def eos_id(self) -> int | None:
        return self.manifest["settings"]["eos_id"]

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index` (a view into the memory map)."""
        return self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]]

    def sentences(self, index: int) -> list[np.ndarray]:
        """Token ids of each sentence of document `index` (BERT stores only)."""
        if self.sentence_offsets is None:
            raise ValueError(f"store {self.path} was built without sentences (a GPT store)")
        first, last = self.doc_sentences[index], self.doc_sentences[index + 1]
        bounds = self.sentence_offsets[first : last + 1]
        return [self.tokens[a:b] for a, b in itertools.pairwise(bounds)]


def validate(path: Path, verify: bool = True) -> dict[str, Any]:
    """The manifest of the store at `path`, after checking every file against it.

    Raises:
        StoreInvalidError: see `TokenStore.open`.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise StoreInvalidError(f"{path}: no {MANIFEST} (never built, or interrupted)") from None
    except (OSError, ValueError) as err:
        raise StoreInvalidError(f"{path / MANIFEST}: unreadable ({err})") from None
    if manifest.get("format") != STORE_FORMAT:
        raise StoreInvalidError(
            f"{path}: store format {manifest.get('format')!r}, this code reads {STORE_FORMAT}"
        )
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise StoreInvalidError(f"{file}: missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise StoreInvalidError(
                f"{file}: {size} bytes, the manifest says {expected['bytes']} (truncated?)"
            )
        if verify and file_sha256(file) != expected["sha256"]:
            raise StoreInvalidError(f"{file}: checksum differs from the manifest (corrupt)")
    return manifest

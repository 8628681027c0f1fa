"""Text corpora: where raw documents come from.

Every corpus yields documents as strings (paragraphs separated by "\\n") one at a time, so nothing
ever holds the whole corpus in memory, and has a `fingerprint()` that changes whenever its content or
reading settings change (it keys the tokenizer and token-store caches): every field of a corpus is
in it unless declared `_NOT_IN_KEY` with the reason (`datamodules.corpora.fingerprint`).

Sources:
- `EmbeddedCorpus`: the English documentation prose that CPython ships (`pydoc_data.topics`), on
  every machine with Python; the default when no data is configured.
- `TextFilesCorpus`: local text files by glob (plain or .gz), one document per file, documents
  separated by blank lines, or WikiText articles (` = Title = ` headings).
- `JsonlCorpus`, `ParquetCorpus`: one document per record, text in a configurable field.
- `HFDatasetCorpus`: a named Hugging Face dataset (from the local `datasets` cache when offline).
"""

from __future__ import annotations

import functools
import glob as globlib
import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from datamodules.corpora.fingerprint import (
    _KEY_WHEN_SET,
    _NOT_IN_KEY,
    ChangeDetection,
    _files_key,
    _fingerprint,
)

log = logging.getLogger(__name__)

DocSplit = Literal["file", "blank_line", "wikitext"]
HFDocSplit = Literal["record", "wikitext"]
Errors = Literal["strict", "replace", "skip"]
_WIKITEXT_ARTICLE = re.compile(r"^ = [^=].* = $")
_PATHS_REASON = "resolved to files, whose path, size and content (or mtime) are in it"
_CHANGE_REASON = (
    "it decides how a file is identified, not what is read; the identity it picks (a digest or "
    "an mtime) is in the fingerprint, and leaving the setting out keeps a `stat` key what it was "
    "before the setting existed, so the caches of corpora identified by stat are not rebuilt"
)


class DataSetupError(ValueError):
    """The data does not fit the run's settings: too little text for a batch or an optimizer
    step, or a resume position saved under other settings."""


class CorpusError(ValueError):
    """Bad corpus input: the message names the file or setting and the fix."""


def _check_choice(key: str, value: object, choices: Any) -> None:
    """Raise a CorpusError naming `key` unless `value` is one of the `Literal` type `choices`."""
    allowed = get_args(choices)
    if value not in allowed:
        raise CorpusError(
            f"{key}={value!r} is not one of {', '.join(allowed)}; e.g. {key}={allowed[0]}"
        )


def _resolve_paths(patterns: str | Iterable[str], what: str) -> list[str]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise CorpusError(f"data.paths is empty; give {what} paths or glob patterns")
    paths: list[str] = []
    for pattern in patterns:
        expanded = os.path.expanduser(str(pattern))
        matches = sorted(p for p in globlib.glob(expanded, recursive=True) if os.path.isfile(p))
        if not matches:
            raise CorpusError(
                f"data.paths pattern {pattern!r} matches no file (resolved against "
                f"{os.getcwd()}); check the path, or quote the glob so the shell does not expand it"
            )
        paths.extend(matches)
    return paths


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decode_lines(path: str, errors: Errors) -> Iterator[str]:
    """Yield the lines of a (possibly gzipped) file as text, reporting bad UTF-8 precisely."""
    offset = 0
    with _open_binary(path) as handle:
        for raw in _gzip_checked(handle, path):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                if errors == "strict":
                    raise CorpusError(
                        f"{path}: invalid UTF-8 at byte offset {offset + err.start} "
                        f"({err.reason}); fix the file, or set data.errors=replace (substitute "
                        f"U+FFFD) or data.errors=skip (drop the line)"
                    ) from None
                if errors == "replace":
                    yield raw.decode("utf-8", errors="replace")
                else:
                    log.warning("%s: skipped a line with invalid UTF-8 at byte %d", path, offset)
            offset += len(raw)


def _gzip_checked(handle, path: str) -> Iterator[bytes]:
    """The lines of `handle`, with a damaged or mislabelled .gz file reported as a CorpusError."""
    try:
        yield from handle
    except GeneratorExit:
        # closed unfinished, perhaps at interpreter shutdown, when the module globals the next
        # clause names may be gone already: nothing to report
        raise
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise CorpusError(
            f"{path}: not a readable gzip file ({err}); a .gz name is read as gzip: "
            "re-download or re-compress it, or drop the .gz suffix if it holds plain text"
        ) from None


def _join(lines: list[str]) -> str:
    return "\n".join(line.strip() for line in lines if line.strip())


@dataclass
class EmbeddedCorpus:
    """CPython's documentation topics (~80 documents, ~460 KB of English prose).

    Attributes:
        min_chars: paragraphs shorter than this (headings, code fragments) are dropped.
    """

    min_chars: int = 40

    def documents(self) -> Iterator[str]:
        from pydoc_data.topics import topics

        for name in sorted(topics):
            paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name])]
            doc = "\n".join(p for p in paragraphs if len(p) >= self.min_chars)
            if doc:
                yield doc

    def fingerprint(self) -> str:
        from pydoc_data.topics import topics

        return _fingerprint(self, sorted(topics.items()))

    def describe(self) -> str:
        return "embedded CPython documentation (pydoc_data.topics)"


@dataclass
class TextFilesCorpus:
    """Local text files matched by glob patterns (plain or gzip).

    Attributes:
        paths: glob patterns or file paths.
        doc_split: "file" (one document per file), "blank_line" (documents separated by one or
            more blank lines), or "wikitext" (an article starts at each ` = Title = ` line).
        errors: what to do with invalid UTF-8: "strict" (error naming file and byte offset),
            "replace" (U+FFFD), "skip" (drop the line, logged).
        change_detection: how the caches tell that a file changed: "content" (a digest of its
            bytes), "stat" (its size and modification time: fooled by an edit that keeps the
            size and restores the mtime, as `cp -p` or `rsync -t` of a changed file does), or
            "auto" (content while the files total at most 1 GiB, else stat).
    """

    paths: list[str] | str = field(default_factory=list, metadata={_NOT_IN_KEY: _PATHS_REASON})
    doc_split: DocSplit = "blank_line"
    errors: Errors = "strict"
    change_detection: ChangeDetection = field(
        default="auto", metadata={_NOT_IN_KEY: _CHANGE_REASON}
    )

    def __post_init__(self) -> None:
        _check_choice("data.doc_split", self.doc_split, DocSplit)
        _check_choice("data.errors", self.errors, Errors)
        _check_choice("data.change_detection", self.change_detection, ChangeDetection)
        self.files = _resolve_paths(self.paths, "text file")
        self._digests: dict = {}

    def documents(self) -> Iterator[str]:
        for path in self.files:
            lines: list[str] = []
            for line in _decode_lines(path, self.errors):
                if self._starts_document(line):
                    if doc := _join(lines):
                        yield doc
                    lines = []
                lines.append(line)
            if doc := _join(lines):
                yield doc

    def _starts_document(self, line: str) -> bool:
        if self.doc_split == "blank_line":
            return not line.strip()
        if self.doc_split == "wikitext":
            return bool(_WIKITEXT_ARTICLE.match(line.rstrip("\n")))
        return False

    def fingerprint(self) -> str:
        return _fingerprint(self, _files_key(self.files, self.change_detection, self._digests))

    def describe(self) -> str:
        documents = {
            "file": "one document per file",
            "blank_line": "documents separated by blank lines",
            "wikitext": "one document per ` = Title = ` article",
        }
        return f"{len(self.files)} text file(s), {documents[self.doc_split]}"


@dataclass
class JsonlCorpus:
    """JSON Lines files, one document per record.

    Attributes:
        paths: glob patterns or file paths (.jsonl, optionally .gz).
        text_field: the record field holding the text.
        errors: what to do with invalid UTF-8, as in `TextFilesCorpus` ("skip" drops the line,
            and so the record).
        change_detection: as in `TextFilesCorpus`.
    """

    paths: list[str] | str = field(default_factory=list, metadata={_NOT_IN_KEY: _PATHS_REASON})
    text_field: str = "text"
    errors: Errors = "strict"
    change_detection: ChangeDetection = field(
        default="auto", metadata={_NOT_IN_KEY: _CHANGE_REASON}
    )

    def __post_init__(self) -> None:
        _check_choice("data.errors", self.errors, Errors)
        _check_choice("data.change_detection", self.change_detection, ChangeDetection)
        self.files = _resolve_paths(self.paths, "JSONL")
        self._digests: dict = {}

    def documents(self) -> Iterator[str]:
        for path in self.files:
            for number, line in enumerate(_decode_lines(path, self.errors), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorpusError(f"{path}:{number}: not valid JSON ({err.msg})") from None
                yield _field(record, self.text_field, f"{path}:{number}")

    def fingerprint(self) -> str:
        return _fingerprint(self, _files_key(self.files, self.change_detection, self._digests))

    def describe(self) -> str:
        return f"{len(self.files)} JSONL file(s), field {self.text_field!r}"


def _field(record: dict, name: str, where: str) -> str:
    if name not in record:
        raise CorpusError(
            f"{where}: record has no field {name!r} (fields: {sorted(record)}); "
            f"set data.text_field to the field that holds the text"
        )
    value = record[name]
    if not isinstance(value, str):
        raise CorpusError(f"{where}: field {name!r} is {type(value).__name__}, not text")
    return value


@dataclass
class ParquetCorpus:
    """Parquet files, one document per row, read in record batches (bounded memory).

    Attributes:
        paths: glob patterns or file paths.
        text_field: the column holding the text.
        batch_rows: rows read at a time.
        change_detection: as in `TextFilesCorpus`.
        row_groups: read only these row groups of each file (None: all). `file_pieces`
            (`datamodules.corpora.pieces`) cuts a file of several row groups into one piece per
            group this way, so that parallel builds and streaming readers share out a large file.
    """

    paths: list[str] | str = field(default_factory=list, metadata={_NOT_IN_KEY: _PATHS_REASON})
    text_field: str = "text"
    batch_rows: int = field(default=4096, metadata={_NOT_IN_KEY: "how many rows a read takes"})
    change_detection: ChangeDetection = field(
        default="auto", metadata={_NOT_IN_KEY: _CHANGE_REASON}
    )
    row_groups: list[int] | None = field(default=None, metadata={_KEY_WHEN_SET: True})

    def __post_init__(self) -> None:
        _check_choice("data.change_detection", self.change_detection, ChangeDetection)
        if self.row_groups is not None:  # a list from a config (ListConfig) or a tuple
            self.row_groups = [int(group) for group in self.row_groups]
        self.files = _resolve_paths(self.paths, "Parquet")
        self._digests: dict = {}

    def documents(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for path in self.files:
            try:
                parquet = pq.ParquetFile(path)
            except pa.ArrowException as err:  # not Parquet, or damaged
                raise CorpusError(f"{path}: not a readable Parquet file ({err})") from None
            schema = parquet.schema_arrow
            if self.text_field not in schema.names:
                raise CorpusError(
                    f"{path}: no column {self.text_field!r} (columns: {schema.names}); set "
                    "data.text_field"
                )
            kind = schema.field(self.text_field).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise CorpusError(
                    f"{path}: column {self.text_field!r} holds {kind}, not text; set "
                    f"data.text_field to a text column (columns: {schema.names})"
                )
            batches = parquet.iter_batches(
                self.batch_rows, row_groups=self.row_groups, columns=[self.text_field]
            )
            for batch in batches:
                for text in batch.column(0).to_pylist():
                    if text:
                        yield text

    def fingerprint(self) -> str:
        return _fingerprint(self, _files_key(self.files, self.change_detection, self._digests))

    def describe(self) -> str:
        groups = "" if self.row_groups is None else f", row group(s) {self.row_groups}"
        return f"{len(self.files)} Parquet file(s), column {self.text_field!r}{groups}"


@dataclass
class HFDatasetCorpus:
    """A named Hugging Face dataset, streamed from the local `datasets` cache or the hub.

    Line-per-record datasets such as WikiText are regrouped into articles with
    `doc_split="wikitext"`; otherwise each record is one document.

    Attributes:
        name: dataset name on the hub (e.g. "wikitext").
        config: dataset configuration (e.g. "wikitext-103-raw-v1").
        split: split to read.
        text_field: column holding the text.
        doc_split: "record" or "wikitext".
    """

    name: str = "wikitext"
    config: str | None = "wikitext-103-raw-v1"
    split: str = "train"
    text_field: str = "text"
    doc_split: HFDocSplit = "wikitext"

    def __post_init__(self) -> None:
        _check_choice("data.doc_split", self.doc_split, HFDocSplit)

    @functools.cached_property
    def _dataset(self):
        """The dataset, loaded once: the fingerprint, the tokenizer cache key, the token-store key
        and the text all need it, and each load re-reads the cache's metadata."""
        import datasets

        try:
            return datasets.load_dataset(self.name, self.config, split=self.split)
        except Exception as err:  # datasets raises many types for offline / missing data
            raise CorpusError(
                f"could not load Hugging Face dataset {self.name!r} ({self.config}, split "
                f"{self.split!r}): {err}. Offline, it must already be in the datasets cache "
                f"(HF_DATASETS_OFFLINE=1); or download the files and use data=text_files "
                f"data.paths=..."
            ) from err

    def documents(self) -> Iterator[str]:
        dataset = self._dataset
        if self.text_field not in dataset.column_names:
            raise CorpusError(
                f"dataset {self.name!r} has no column {self.text_field!r} "
                f"(columns: {dataset.column_names}); set data.text_field"
            )
        texts = (row[self.text_field] for row in dataset)
        if self.doc_split == "record":
            yield from (t for t in texts if t.strip())
            return
        lines: list[str] = []
        for text in texts:
            if _WIKITEXT_ARTICLE.match(text.rstrip("\n")) and lines:
                if doc := _join(lines):
                    yield doc
                lines = []
            lines.append(text)
        if doc := _join(lines):
            yield doc

    def fingerprint(self) -> str:
        return _fingerprint(self, self._dataset._fingerprint)

    def describe(self) -> str:
        return f"Hugging Face dataset {self.name}/{self.config} [{self.split}]"


@dataclass
class ConcatCorpus:
    """Several corpora read one after another, as one (e.g. WikiText-2 and task texts).

    Attributes:
        parts: the corpora, in reading order: a list, or a mapping of names to corpora (in a
            config: `defaults` entries `/data@parts.<name>: <data config>`, as
            `conf/data/wikitext2_glue_texts.yaml` does).
    """

    parts: list[Any] | dict[str, Any] = field(
        default_factory=list, metadata={_NOT_IN_KEY: "each part's own fingerprint is in it"}
    )

    def __post_init__(self) -> None:
        self.parts = list(self.parts.values() if isinstance(self.parts, dict) else self.parts)
        if not self.parts:
            raise CorpusError("data.parts is empty; give at least one corpus")

    def documents(self) -> Iterator[str]:
        for part in self.parts:
            yield from part.documents()

    def fingerprint(self) -> str:
        return _fingerprint(self, [part.fingerprint() for part in self.parts])

    def describe(self) -> str:
        return " + ".join(part.describe() for part in self.parts)

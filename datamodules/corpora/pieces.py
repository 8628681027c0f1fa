"""A corpus cut into pieces that are corpora themselves: one per file (per row group, for
Parquet), with its size, whose documents one after another are the corpus's. Parallel store
builds (`datamodules.stores.parallel`) share the pieces out among processes, and streaming
(`datamodules.streaming`) among ranks and loader workers."""

from __future__ import annotations

import dataclasses
import glob as globlib
import os
from typing import Any

from datamodules.corpora.corpus import ConcatCorpus, CorpusError, ParquetCorpus


def file_pieces(corpus) -> list[tuple[Any, int]]:
    """(corpus of one file, its size in bytes) for each file of `corpus` in reading order (for
    Parquet, each row group of each file): their documents one after another are the corpus's.
    A corpus not read from files (embedded, a Hugging Face dataset, GLUE texts) is one piece of
    unknown size (counted as 1 MB)."""
    if isinstance(corpus, ConcatCorpus):
        return [piece for part in corpus.parts for piece in file_pieces(part)]
    if isinstance(corpus, ParquetCorpus):
        return row_group_pieces(corpus)
    files = getattr(corpus, "files", None)
    if not files or len(files) == 1:
        return [(corpus, sum(os.path.getsize(f) for f in files) if files else 1 << 20)]
    # the path as a glob that matches just that file, whatever characters its name holds
    return [
        (dataclasses.replace(corpus, paths=[globlib.escape(f)]), os.path.getsize(f)) for f in files
    ]


def row_group_pieces(corpus: ParquetCorpus) -> list[tuple[ParquetCorpus, int]]:
    """(`corpus` reading one row group of one file, the group's bytes) for every row group, in
    reading order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pieces = []
    for path in corpus.files:
        try:
            metadata = pq.ParquetFile(path).metadata
        except pa.ArrowException as err:
            raise CorpusError(f"{path}: not a readable Parquet file ({err})") from None
        for group in corpus.row_groups or range(metadata.num_row_groups):
            size = metadata.row_group(group).total_byte_size
            one = dataclasses.replace(corpus, paths=[globlib.escape(path)], row_groups=[group])
            pieces.append((one, size))
    return pieces

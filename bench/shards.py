"""The rows of `make bench-data` for a corpus of real size in JSON Lines shards (by default the
Gutenberg books of ../shared/data/gutenberg, 16 shards): the token store built by
`make prepare` with 1 and then 2 processes, MB/s of text and the peak memory of its largest
process; the streamed loader's rows are `bench_data.bench_streaming`'s, on the same shards.

Each build is the command a user runs, in a process of its own so that its memory is its own:

    python -m pipeline.commands.prepare model=<family> data=jsonl 'data.paths=[<shards>]'
        tokenizer.path=<tokenizer> paths.cache_dir=<an empty folder> prepare.workers=N

Its seconds are the whole command's (start-up and reading the files included), as a user waits
them. The tokenizer is trained here beforehand on the first shard's first `TOKENIZER_MB` of
text, so that the build times no tokenizer training. Peak memory is the largest resident set of
the command's processes, measured from a fresh interpreter (`bench/rss.py`), so that this
process's own memory does not count: with 2 processes, that of the largest.
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from bench.common import SHARED, BenchError, child_env, run_measured
from datamodules.corpora.corpus import CorpusError, JsonlCorpus
from pipeline.run.config_keys import hydra_value
from tokenizer import batched, train_tokenizer
from tokenizer.spec import first_text

GUTENBERG_SHARDS = SHARED / "gutenberg" / "train-*.jsonl.gz"
TOKENIZER_MB = 10.0  # text the bench's tokenizers are trained on (from the first shard)
# how a parallel build says how many processes it ran (datamodules/stores/parallel.py)
PARALLEL_LOG = re.compile(r"in \d+ parts? \(.*?(?P<processes>\d+) process")


@dataclass(frozen=True)
class Shards:
    """JSON Lines shards read as one corpus, and the size of their text."""

    pattern: str
    corpus: JsonlCorpus
    text_mb: float
    documents: int

    @classmethod
    def read(cls, pattern: str) -> Shards:
        """The shards matching `pattern` (read once through, to count their text), or a
        BenchError naming the pattern."""
        try:
            corpus = JsonlCorpus(paths=[pattern])
        except CorpusError as err:  # its message names what is missing
            raise BenchError(
                f"--shards {pattern}: {err}; give a glob of JSON Lines files with a 'text' "
                "field, or --shards none"
            ) from err
        size = count = 0
        for document in corpus.documents():
            size, count = size + len(document.encode()), count + 1
        return cls(pattern, corpus, size / 1e6, count)

    def tokenizer(self, kind: str, vocab_size: int) -> Tokenizer:
        """A `kind` tokenizer trained on the first `TOKENIZER_MB` of the shards (as
        `tokenizer.sample_mb` would train it: the first shard's first books)."""
        texts = first_text(self.corpus.documents(), int(TOKENIZER_MB * 1e6))
        return train_tokenizer(kind, batched(texts), vocab_size)

    def builds(self, family: str, tokenizer: Tokenizer) -> dict:
        """`family`'s store of the shards built by `make prepare` with 1 and then 2 processes,
        each into an empty cache of its own."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "tokenizer.json"
            tokenizer.save(str(path))
            builds = [
                timed_build(
                    family,
                    self.pattern,
                    path,
                    workers,
                    Path(tmp) / f"cache{workers}",
                    Path(tmp) / f"prepare{workers}.log",
                )
                for workers in (1, 2)
            ]
        for build in builds:
            build["mb_per_s"] = self.text_mb / build["seconds"]
        return {
            "files": len(self.corpus.files),
            "text_mb": self.text_mb,
            "documents": self.documents,
            "builds": builds,
            "two_processes_vs_one": builds[1]["mb_per_s"] / builds[0]["mb_per_s"],
        }


def timed_build(
    family: str, pattern: str, tokenizer: Path, workers: int, cache: Path, log: Path
) -> dict:
    """Wall seconds and peak RSS (MB, of its largest process) of `make prepare` building
    `family`'s store of the shards into the empty folder `cache` with `workers` processes,
    and the processes its log says it tokenized with (1 when it logs no parallel build)."""
    command = [
        sys.executable,
        "-m",
        "pipeline.commands.prepare",
        f"model={family}",
        "data=jsonl",
        f"data.paths={hydra_value([pattern])}",
        f"tokenizer.path={hydra_value(str(tokenizer))}",
        f"paths.cache_dir={hydra_value(str(cache))}",
        f"prepare.workers={workers}",
    ]
    measured = run_measured(command, log, env=child_env())
    parallel = PARALLEL_LOG.search(log.read_text())
    return {
        "workers": workers,
        "processes": int(parallel["processes"]) if parallel else 1,
        "seconds": measured.wall_s,
        "peak_rss_mb": measured.peak_rss_mb,
    }

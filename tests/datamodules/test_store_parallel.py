"""Token stores built by several processes and ranks (datamodules/store_parallel.py): the same
bytes as the one-process build, parts reused after a failure, bad input named."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pytest

from datamodules.corpus import (
    ConcatCorpus,
    CorpusError,
    EmbeddedCorpus,
    ParquetCorpus,
    TextFilesCorpus,
    file_pieces,
)
from datamodules.objective import CausalLMObjective, MaskedLMObjective
from datamodules.run_stores import prepare_stores, store_settings
from datamodules.store import MANIFEST, StoreInvalidError, TokenStore
from datamodules.store_parallel import _partition_key, build_in_parallel, corpus_parts
from tests.conftest import CLI_ENV, REPO


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """The embedded corpus's documents in 7 files of unequal size (one with a glob character
    in its name), one empty file among them."""
    folder = tmp_path_factory.mktemp("texts")
    docs = list(EmbeddedCorpus().documents())
    cuts = [0, 3, 15, 16, 30, 50, 60, len(docs)]
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        name = f"part{i}[x].txt" if i == 2 else f"part{i}.txt"
        (folder / name).write_text("\n\n".join(docs[a:b]) + "\n")
    (folder / "part3.txt").write_text("")  # an empty file: its part has no document
    return folder


def manifest_files(store_stats) -> dict:
    return json.loads((store_stats.path / MANIFEST).read_text())["files"]


@pytest.mark.parametrize("kind", ["bert", "gpt"])
def test_two_processes_build_the_bytes_one_process_builds(
    kind, text_folder, wordpiece, bpe, tmp_path
):
    corpus = TextFilesCorpus(paths=str(text_folder / "*.txt"))
    tokenizer, objective = (
        (wordpiece, MaskedLMObjective()) if kind == "bert" else (bpe, CausalLMObjective())
    )
    [one] = prepare_stores(corpus, tokenizer, objective, tmp_path / "one")
    [two] = prepare_stores(corpus, tokenizer, objective, tmp_path / "two", workers=2)
    assert two.built and one.path.name == two.path.name  # the same cache key
    assert manifest_files(one) == manifest_files(two)  # every file: size and sha256
    assert (one.documents, one.tokens, one.sentences, one.text_bytes) == (
        two.documents,
        two.tokens,
        two.sentences,
        two.text_bytes,
    )
    assert not (tmp_path / "two/token_stores" / f"{two.path.name}.parts").exists()  # cleaned up
    # and it reads as a store: a document from the middle, the same ids
    a, b = TokenStore.open(one.path), TokenStore.open(two.path)
    middle = a.num_documents // 2
    assert (a.document(middle) == b.document(middle)).all()
    [again] = prepare_stores(corpus, tokenizer, objective, tmp_path / "two", workers=2)
    assert not again.built


def test_parts_are_contiguous_runs_of_files_balanced_by_size(text_folder):
    corpus = TextFilesCorpus(paths=str(text_folder / "*.txt"))
    parts = corpus_parts(corpus, 3)
    assert len(parts) == 3
    files = [
        f
        for p in parts
        for f in (p.files if hasattr(p, "files") else [x for q in p.parts for x in q.files])
    ]
    assert files == corpus.files  # every file once, in reading order
    assert [d for p in parts for d in p.documents()] == list(corpus.documents())
    # a concatenation is cut across its parts; a corpus not read from files is one part
    both = ConcatCorpus([corpus, EmbeddedCorpus()])
    assert [d for p in corpus_parts(both, 4) for d in p.documents()] == list(both.documents())
    assert corpus_parts(EmbeddedCorpus(), 4) == [corpus_parts(EmbeddedCorpus(), 1)[0]]


def test_bad_input_in_a_part_names_its_file(text_folder, wordpiece, tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for f in sorted(text_folder.iterdir()):
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "part6.txt").write_bytes(b"Good text.\n\nThen \xff broken.\n")
    corpus = TextFilesCorpus(paths=str(folder / "*.txt"))
    settings = store_settings(MaskedLMObjective(), wordpiece)
    with pytest.raises(CorpusError, match=r"part6\.txt: invalid UTF-8 at byte offset"):
        build_in_parallel(corpus, wordpiece, settings, tmp_path / "cache", workers=2)
    assert not list((tmp_path / "cache/token_stores").glob("*/manifest.json"))


def test_the_parts_of_a_rank_that_stopped_are_reused(text_folder, wordpiece, tmp_path, caplog):
    """Rank 0 of 2 builds its part, then gives up waiting for rank 1's; the rerun on one machine
    with 2 processes (the same 2 parts) reuses it and builds only the other."""
    corpus = TextFilesCorpus(paths=str(text_folder / "*.txt"))
    settings = store_settings(MaskedLMObjective(), wordpiece)
    cache = tmp_path / "cache"
    with pytest.raises(StoreInvalidError, match="the rank that builds part-0001"):
        build_in_parallel(
            corpus, wordpiece, settings, cache, rank=0, ranks=2, wait_timeout_s=0.1, poll_s=0.05
        )
    with caplog.at_level("INFO", logger="datamodules.store_parallel"):
        _, stats = build_in_parallel(corpus, wordpiece, settings, cache, workers=2)
    assert "1 of the 2 parts here were built before: reused" in caplog.text
    [one] = prepare_stores(corpus, wordpiece, MaskedLMObjective(), tmp_path / "one")
    assert manifest_files(one) == manifest_files(stats)


def test_a_rank_without_parts_waits_and_a_failed_part_stops_every_rank(
    text_folder, wordpiece, tmp_path
):
    """A corpus of one file is one part: rank 1 of 2 has none to build and waits for rank 0's
    store (no crash). Bad input in rank 1's part stops rank 0 with its error at once, instead of
    waiting for a part that will never come."""
    settings = store_settings(MaskedLMObjective(), wordpiece)
    one_file = TextFilesCorpus(paths=str(text_folder / "part1.txt"))
    with pytest.raises(StoreInvalidError, match="waited 0 s for rank 0 to join the parts"):
        build_in_parallel(
            one_file,
            wordpiece,
            settings,
            tmp_path / "a",
            rank=1,
            ranks=2,
            wait_timeout_s=0.1,
            poll_s=0.05,
        )
    _, built = build_in_parallel(one_file, wordpiece, settings, tmp_path / "a", rank=0, ranks=2)
    _, seen = build_in_parallel(one_file, wordpiece, settings, tmp_path / "a", rank=1, ranks=2)
    assert built.built and not seen.built and seen.path == built.path

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("First document here.\n\nSecond one, longer than the first.\n")
    (folder / "b.txt").write_bytes(b"Good text.\n\nThen \xff broken.\n")
    corpus = TextFilesCorpus(paths=str(folder / "*.txt"))
    with pytest.raises(CorpusError, match=r"b\.txt: invalid UTF-8"):
        build_in_parallel(corpus, wordpiece, settings, tmp_path / "b", rank=1, ranks=2)
    started = time.monotonic()
    with pytest.raises(CorpusError, match=r"b\.txt: invalid UTF-8"):
        build_in_parallel(corpus, wordpiece, settings, tmp_path / "b", rank=0, ranks=2, poll_s=0.05)
    assert time.monotonic() - started < 60


def test_parts_cut_another_way_are_never_reused(tmp_path):
    """5 files of 4:1:1:1:1 units cut for 5 and for 6 processes make 4 parts both times, of
    other files: their folders differ, so one build never joins the other's parts."""
    for i, size in enumerate([4, 1, 1, 1, 1]):
        (tmp_path / f"f{i}.txt").write_text(("Some words here. " * 60 + "\n\n") * size)
    corpus = TextFilesCorpus(paths=str(tmp_path / "*.txt"))
    five, six = corpus_parts(corpus, 5), corpus_parts(corpus, 6)
    assert len(five) == len(six) == 4
    assert _partition_key(five) != _partition_key(six)
    assert _partition_key(five) == _partition_key(corpus_parts(corpus, 5))


def test_two_launcher_ranks_build_one_store(text_folder, tmp_path):
    """`make prepare` under a launcher: two processes with RANK 0 and 1 of WORLD_SIZE 2 each
    build their part, rank 0 joins; the store equals the one-process build's."""
    data = ["model=gpt-tiny", "data=text_files", f"data.paths={text_folder}/*.txt"]

    def prepare(cache, rank=None, ranks=None):
        env = dict(CLI_ENV)
        if rank is not None:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0"}
        command = [
            sys.executable,
            "-m",
            "pipeline.commands.prepare",
            f"paths.cache_dir={cache}",
            *data,
        ]
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    single = prepare(tmp_path / "one")
    _, err = single.communicate(timeout=300)
    assert single.returncode == 0, err[-2000:]
    ranks = [prepare(tmp_path / "two", rank, 2) for rank in (0, 1)]
    results = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    one = next((tmp_path / "one/token_stores").glob("*/manifest.json"))
    two = next((tmp_path / "two/token_stores").glob("*/manifest.json"))
    assert one.parent.name == two.parent.name
    assert json.loads(one.read_text())["files"] == json.loads(two.read_text())["files"]
    assert "(built)" in results[0][0] and "reused" in results[1][0]


def test_prepare_workers_must_be_a_whole_number(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.commands.prepare",
            f"paths.cache_dir={tmp_path}",
            "prepare.workers=0",
        ],
        cwd=REPO,
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "prepare.workers=0 is not a whole number >= 1" in done.stderr
    assert "Traceback" not in done.stderr
    assert not any(os.scandir(tmp_path))


def test_one_parquet_file_of_row_groups_is_built_by_two_processes_in_the_same_bytes(bpe, tmp_path):
    """A single Parquet file of 4 row groups is cut into 4 pieces (one per group, read in
    order), so two processes share it and build the one-process bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = list(EmbeddedCorpus().documents())
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": docs}), path, row_group_size=-(-len(docs) // 4))
    corpus = ParquetCorpus(str(path))
    pieces = [piece for piece, _ in file_pieces(corpus)]
    assert [p.row_groups for p in pieces] == [[0], [1], [2], [3]]
    assert [d for p in pieces for d in p.documents()] == docs
    assert len({p.fingerprint() for p in pieces} | {corpus.fingerprint()}) == 5
    assert len(corpus_parts(corpus, 2)) == 2
    [one] = prepare_stores(corpus, bpe, CausalLMObjective(), tmp_path / "one")
    [two] = prepare_stores(corpus, bpe, CausalLMObjective(), tmp_path / "two", workers=2)
    assert two.built and one.path.name == two.path.name
    assert manifest_files(one) == manifest_files(two)

"""Token stores built by several processes and ranks (datamodules/stores/parallel.py): the same
bytes as the one-process build, parts reused after a failure, bad input named."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datamodules.corpora.corpus import (
    ConcatCorpus,
    CorpusError,
    EmbeddedCorpus,
    ParquetCorpus,
    TextFilesCorpus,
)
from datamodules.corpora.pieces import file_pieces
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.run_stores import prepare_stores, store_settings
from datamodules.stores.parallel import _partition_key, build_in_parallel, corpus_parts
from datamodules.stores.store import MANIFEST, StoreInvalidError, TokenStore
from tests.conftest import CLI_ENV, REPO, run_command


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
    with caplog.at_level("INFO", logger="datamodules.stores.parallel"):
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

    def prepare(cache, rank, ranks):
        env = CLI_ENV | {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0"}
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

    # the one-process build to compare with: in this process (the ranks are the processes)
    single = run_command("pipeline.commands.prepare", f"paths.cache_dir={tmp_path / 'one'}", *data)
    assert single.returncode == 0, single.stderr[-2000:]
    ranks = [prepare(tmp_path / "two", rank, 2) for rank in (0, 1)]
    results = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    one = next((tmp_path / "one/token_stores").glob("*/manifest.json"))
    two = next((tmp_path / "two/token_stores").glob("*/manifest.json"))
    assert one.parent.name == two.parent.name
    assert json.loads(one.read_text())["files"] == json.loads(two.read_text())["files"]
    assert "(built)" in results[0][0] and "reused" in results[1][0]


def test_prepare_workers_must_be_a_whole_number(tmp_path):
    done = run_command(
        "pipeline.commands.prepare", f"paths.cache_dir={tmp_path}", "prepare.workers=0"
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


# Loaded by every Python process of a test's `make prepare` (PYTHONPATH): in the process that
# builds part-0001, the first chunk of text either kills the process as the OOM killer does
# (SIGKILL; its temporary files are open) or marks the file HOOK_MARK and waits, to be stopped.
PART_HOOK = """
import os, signal, sys, time
argv = getattr(sys, "orig_argv", [])
if any("stores.parallel" in a for a in argv) and any(a.endswith("part-0001") for a in argv):
    import datamodules.stores.encoding as encoding
    original = encoding._chunks

    def _chunks(*args, **kwargs):
        if os.environ["HOOK_ACTION"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.environ["HOOK_MARK"] + ".tmp", "w") as mark:  # this process's pid
            mark.write(str(os.getpid()))
        os.replace(os.environ["HOOK_MARK"] + ".tmp", os.environ["HOOK_MARK"])
        time.sleep(300)
        yield from original(*args, **kwargs)

    encoding._chunks = _chunks
"""


def prepare_in_two_parts(text_folder, tmp_path, action: str) -> tuple[subprocess.Popen, list]:
    """`python -m pipeline.commands.prepare ... prepare.workers=2` (in a session of its own)
    with PART_HOOK doing `action` in part-0001's process; returns the process and its
    command line."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PART_HOOK)
    env = CLI_ENV | {"PYTHONPATH": str(hook), "HOOK_ACTION": action}
    env["HOOK_MARK"] = str(tmp_path / "mark")
    overrides = [
        "model=gpt-tiny",
        "data=text_files",
        f"data.paths={text_folder}/*.txt",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "prepare.workers=2",
    ]
    command = [sys.executable, "-m", "pipeline.commands.prepare", *overrides]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    return process, overrides


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's default action in the command, as a terminal's foreground job has it: tests run
    as a background job of a script inherit SIGINT ignored, and a Python started with it
    ignored never raises KeyboardInterrupt (Ctrl-C would go unheard)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def paste(command_line: str) -> subprocess.CompletedProcess:
    """A printed `make prepare ...` command run as a user pastes it, in the repository."""
    assert command_line.startswith("make prepare ")
    inherited = ("ALLOCATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in inherited} | CLI_ENV
    return subprocess.run(
        ["bash", "-c", command_line],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_part_process_killed_by_the_oom_killer_is_named_with_the_fix(text_folder, tmp_path):
    """The process of part-0001 gets SIGKILL mid-build: one error line names the part, its
    files, the signal, the likely cause and fewer prepare.workers; the command printed runs."""
    process, _ = prepare_in_two_parts(text_folder, tmp_path, "kill")
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "messages are above" not in err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]
    assert "building part part-0001 of the token store" in error
    assert f"token store ({text_folder}/part6.txt) was killed by SIGKILL" in error
    assert "killed by SIGKILL" in error and "ran out of memory" in error
    assert "prepare.workers=1 (it was 2)" in error
    [again] = [line for line in err.splitlines() if line.startswith("run again with: ")]
    command = again.removeprefix("run again with: ")
    assert command.endswith(" prepare.workers=1") and "prepare.workers=2" not in command
    done = paste(command)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(built)" in done.stdout


def test_ctrl_c_in_prepare_leaves_a_consistent_cache_that_the_same_command_continues(
    text_folder, tmp_path
):
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it) while part-0001
    is being written and part-0000 is done: one line, exit status 130, no temporary file left;
    the printed command reuses part-0000 and finishes the store."""
    process, overrides = prepare_in_two_parts(text_folder, tmp_path, "wait")
    parts = tmp_path / "cache" / "token_stores"
    deadline = time.monotonic() + 300
    while not ((tmp_path / "mark").exists() and list(parts.glob("*.parts/*/part-0000/manifest*"))):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    [line] = [line for line in err.splitlines() if line.startswith("interrupted:")]
    assert "the cache is consistent" in line
    command = line.partition("the same command goes on from there: ")[2]
    assert shlex.split(command)[2:] == overrides  # make prepare <the same overrides>
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]  # nothing half-written
    assert not list(parts.glob("*/manifest.json"))  # no store yet, and part-0001 not claimed
    assert not list(parts.glob("*.parts/*/part-0001/manifest.json"))
    done = paste(command)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 of the 2 parts here were built before: reused" in done.stdout + done.stderr
    [store] = parts.glob("*/manifest.json")
    TokenStore.open(store.parent, verify=True)  # every file's size and sha256 as recorded


def running(pid: int) -> bool:
    """Whether process `pid` runs (not ended, nor a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_part_process_ends_when_prepare_is_killed_outright(text_folder, tmp_path):
    """SIGKILL to `prepare` itself (no cleanup of its own) while part-0001 is written: the
    part's process, in a session of its own, is sent SIGINT by the kernel and ends, leaving no
    temporary file, instead of writing on beside the user's next run."""
    process, _ = prepare_in_two_parts(text_folder, tmp_path, "wait")
    mark = tmp_path / "mark"
    deadline = time.monotonic() + 300
    while not mark.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    part = int(mark.read_text())
    process.kill()
    process.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while running(part):
        assert time.monotonic() < deadline, "the part's process outlived prepare by 60 s"
        time.sleep(0.1)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.name.endswith(".tmp")]

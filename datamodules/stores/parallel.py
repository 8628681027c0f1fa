"""Token stores built by many processes, on one machine and across nodes.

    make prepare prepare.workers=8                                  # 8 processes on this machine
    torchrun --nnodes 4 --nproc-per-node 1 ... -m pipeline.commands.prepare prepare.workers=16
    srun --ntasks 4 python -m pipeline.commands.prepare prepare.workers=16

The corpus is cut into `ranks x workers` parts (`corpus_parts`): contiguous runs of its files
(of a Parquet file's row groups), balanced by size, so that the parts' documents one after another are the corpus's documents in
order. Rank r builds parts r, r + R, r + 2R, ... (R ranks), each into a part store of its own
(the ordinary builder, `datamodules.stores.build.build_store`) under `<store>.parts/<N>-<how the files were
cut>/`, one process per part, at most `workers` at once (a fresh interpreter each, with its
share of the cores for the tokenizer's threads). Rank 0 then waits for every part and joins them (`join_parts`) into the store one process would have built: the token
files are the parts' files one after another, the offsets shifted; so the same bytes, and the same
cache key, which training finds on any number of nodes. The parts are removed after the join. A
part already built (a rank or node that died, then a rerun that cuts the files the same way) is
reused; bad input in any part stops every rank with that part's error.

A part's process that dies without such an error (the kernel's OOM killer sends SIGKILL) ends
the build with a `PartBuildError` naming the part, its files, the signal, the likely cause and
how many processes to try instead. The part processes run in a session of their own: on
Ctrl-C (or an error in another part) this process sends each one SIGINT, once, and waits for it
to remove its temporary files, so that an interrupted build leaves only finished parts, which
the same command reuses.

Several nodes need the cache on a file system they all see (`paths.cache_dir`); the ranks
coordinate through it (each part's manifest, then the store's), with no process group. A corpus
that is not read from files (the embedded corpus, a Hugging Face dataset, GLUE texts) is one
part: it is built by one process, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from datamodules.corpora.corpus import ConcatCorpus, CorpusError
from datamodules.corpora.pieces import file_pieces
from datamodules.stores.build import (
    StoreWriter,
    build_store,
    exclusive_lock,
    no_text,
    store_path,
    wait_for_store,
    write_manifest,
)
from datamodules.stores.store import (
    DOC_SENTENCES,
    DOCUMENTS,
    OFFSET_DTYPE,
    SENTENCES,
    TOKENS,
    StoreInvalidError,
    StoreSettings,
    StoreStats,
    TokenStore,
)
from tokenizer import atomic_path

log = logging.getLogger(__name__)
_ROOT = Path(__file__).resolve().parents[1]  # the folder that holds `datamodules`
_JOINER = "rank 0 to join the parts into the store"
_COPY_ELEMENTS = 1 << 24  # array elements copied at a time while joining (bounded memory)
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for when the parent ends
_STOP_WAIT_S = 30.0  # how long a part's process may take to clean up after SIGINT
INTERRUPTED = 130  # a part process's exit status after SIGINT (as a shell reports Ctrl-C)
# A part's process: SIGINT while it starts ends it at once and quietly (it has written nothing
# yet); `_worker` then turns SIGINT into KeyboardInterrupt, which removes its temporary files.
_WORKER_MAIN = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "from datamodules.stores.parallel import _worker; sys.exit(_worker(*sys.argv[1:]))"
)
# Why a part's process ended by a signal, as far as it can be told from outside.
_SIGNAL_CAUSES = {
    signal.SIGKILL: "most likely the system ran out of memory and its OOM killer ended the "
    "process (`dmesg` or `journalctl -k` says so)",
    signal.SIGTERM: "something stopped it (`kill`, a job scheduler's time limit or preemption)",
}


class PartBuildError(RuntimeError):
    """A part's process died without the message of bad input (a signal, an uncaught exception).

    Attributes:
        fewer_workers: the `prepare.workers` to try again with (half as many, at least 1;
            as many after SIGTERM, which something sent on purpose).
    """

    def __init__(self, message: str, fewer_workers: int) -> None:
        super().__init__(message)
        self.fewer_workers = fewer_workers


def corpus_parts(corpus, count: int) -> list:
    """`corpus` cut into at most `count` corpora whose documents, one after another, are its
    documents: contiguous runs of its files (a concatenation's parts' files in turn), balanced
    by size. A corpus not read from files is a single piece."""
    pieces = file_pieces(corpus)
    if count <= 1 or len(pieces) <= 1:
        return [corpus]
    sizes = np.array([size for _, size in pieces], dtype=np.float64)
    # piece i goes to the part its middle falls in: contiguous, and about equal in bytes
    middles = (np.cumsum(sizes) - sizes / 2) / max(sizes.sum(), 1.0)
    owner = np.minimum((middles * count).astype(int), count - 1)
    parts = []
    for index in np.unique(owner):
        group = [piece for (piece, _), o in zip(pieces, owner, strict=True) if o == index]
        parts.append(group[0] if len(group) == 1 else ConcatCorpus(group))
    return parts


def build_in_parallel(
    corpus,
    tokenizer: Tokenizer,
    settings: StoreSettings,
    cache_dir: str | os.PathLike,
    *,
    workers: int = 1,
    rank: int = 0,
    ranks: int = 1,
    chunk_mb: float = 4.0,
    wait_timeout_s: float = 24 * 3600,
    poll_s: float = 2.0,
) -> tuple[TokenStore, StoreStats]:
    """The store of (corpus, tokenizer, settings) under `cache_dir`, built by `workers`
    processes on each of `ranks` launcher ranks (this one is `rank`) if it is not there yet.

    Returns:
        The opened store and its stats (on every rank, once the store is complete).

    Raises:
        CorpusError: bad input in a part (its message names the file), or no text at all.
        StoreInvalidError: a waiting rank timed out.
    """
    if workers < 1 or not 0 <= rank < ranks:
        raise ValueError(f"workers={workers}, rank={rank} of {ranks}: need workers >= 1")
    start = time.perf_counter()
    fingerprint = corpus.fingerprint()
    path = store_path(fingerprint, tokenizer, settings, cache_dir)
    try:
        store = TokenStore.open(path)
        return store, StoreStats.from_manifest(path, store.manifest, built=False)
    except StoreInvalidError:
        pass
    parts = corpus_parts(corpus, workers * ranks)
    # the folder names how the files were cut: parts are reused only by a build cut the same way
    folder = path.parent / f"{path.name}.parts" / f"{len(parts):04d}-{_partition_key(parts)}"
    part_paths = [folder / f"part-{i:04d}" for i in range(len(parts))]
    mine = [i for i in range(len(parts)) if i % ranks == rank]
    folder.mkdir(parents=True, exist_ok=True)
    for i in mine:  # an earlier attempt's error, which this one retries
        part_paths[i].with_suffix(".error").unlink(missing_ok=True)
    log.info(
        "building token store %s in %d parts (%d here, %d processes)",
        path,
        len(parts),
        len(mine),
        min(workers, len(mine)),
    )
    _build_parts(
        [parts[i] for i in mine],
        [part_paths[i] for i in mine],
        tokenizer,
        settings,
        workers,
        chunk_mb,
    )
    # a part that failed anywhere (its `.error` file, written where bad input was met) ends
    # every wait with its error
    waiting = {
        "hint": "Check that every rank of the job runs `make prepare` with the same settings, "
        f"and its log (parts in {folder})",
        "failed": lambda: next((e.read_text() for e in sorted(folder.glob("*.error"))), None),
    }
    if rank != 0:
        store = wait_for_store(path, wait_timeout_s, poll_s, builder=_JOINER, **waiting)
        return store, StoreStats.from_manifest(path, store.manifest, built=False)
    stores = [
        wait_for_store(
            p,
            wait_timeout_s,
            poll_s,
            verify=False,
            builder=f"the rank that builds {p.name}",
            **waiting,
        )
        for p in part_paths
    ]
    with exclusive_lock(path.parent / f"{path.name}.lock"):
        if (store := _opened(path, verify=True)) is not None:  # another build joined first
            return store, StoreStats.from_manifest(path, store.manifest, built=False)
        stats = join_parts(stores, corpus, fingerprint, tokenizer, settings, path, start)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # other builds' parts may still be there
        folder.parent.rmdir()
    return TokenStore.open(path, verify=False), stats


def _partition_key(parts: list) -> str:
    """A short hash of which files (or which corpora) each part reads."""
    described = [[str(f) for f in _files_of(part)] for part in parts]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:12]


def _files_of(corpus) -> list:
    if isinstance(corpus, ConcatCorpus):
        return [f for part in corpus.parts for f in _files_of(part)]
    if getattr(corpus, "row_groups", None) is not None:  # a Parquet file's row groups
        return [f"{f}#{corpus.row_groups}" for f in corpus.files]
    return list(getattr(corpus, "files", None) or [corpus.describe()])


def _opened(path: Path, verify: bool = False) -> TokenStore | None:
    """The valid store at `path`, or None."""
    try:
        return TokenStore.open(path, verify=verify)
    except StoreInvalidError:
        return None


def _build_parts(
    parts: list,
    paths: list[Path],
    tokenizer: Tokenizer,
    settings: StoreSettings,
    workers: int,
    chunk_mb: float,
) -> None:
    """Build the part stores not built yet, each in a fresh Python process (`_worker`; at most
    `workers` at once, each with its share of the cores for the tokenizer's threads), or in
    this process when there is one part to build or one worker. Fresh processes
    start in a fraction of a second: they import only what tokenizing needs, where a spawned
    multiprocessing child would import this process's whole command (torch, Lightning)."""
    todo = [(part, p) for part, p in zip(parts, paths, strict=True) if _opened(p) is None]
    if len(todo) < len(parts):
        log.info(
            "%d of the %d parts here were built before: reused", len(parts) - len(todo), len(parts)
        )
    if not todo:
        return
    if len(todo) == 1 or workers == 1:
        for part, p in todo:
            _build_part(part, p, tokenizer, settings, chunk_mb)
        return
    processes = min(workers, len(todo))
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    env = os.environ | {
        "RAYON_NUM_THREADS": threads,
        "RAYON_RS_NUM_CPUS": threads,
        "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    tokenizer_file = paths[0].parent / "tokenizer.json"
    with atomic_path(tokenizer_file) as tmp:
        tmp.write_text(tokenizer.to_str())
    running: list[tuple[subprocess.Popen, Path, object]] = []
    try:
        for part, p in todo:
            while len(running) >= processes:
                running = _reap(running, workers)
            job = p.parent / f"{p.name}.job"
            with atomic_path(job) as tmp:
                tmp.write_bytes(pickle.dumps((part, str(tokenizer_file), settings, chunk_mb)))
            command = [sys.executable, "-c", _WORKER_MAIN, str(job), str(p), str(os.getpid())]
            # a group of its own: Ctrl-C reaches it once, from `_stop`, not also from the terminal
            running.append((subprocess.Popen(command, env=env, start_new_session=True), p, part))
        while running:
            running = _reap(running, workers)
    finally:
        _stop([process for process, _, _ in running])


def _stop(processes: list[subprocess.Popen]) -> None:
    """End the part processes still running (an error in one part, or Ctrl-C here): SIGINT,
    which each answers by removing its temporary files, then SIGKILL for any that hangs."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + _STOP_WAIT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _reap(
    running: list[tuple[subprocess.Popen, Path, object]], workers: int
) -> list[tuple[subprocess.Popen, Path, object]]:
    """The processes still running, after waiting a moment for one to end; a part that
    failed raises its error (a CorpusError naming the file, when it was bad input)."""
    time.sleep(0.05)
    still = []
    for process, path, part in running:
        status = process.poll()
        if status is None:
            still.append((process, path, part))
        elif status in (INTERRUPTED, -signal.SIGINT):  # someone interrupted the part
            raise KeyboardInterrupt
        elif status != 0:
            error = path.with_suffix(".error")
            if error.exists():
                raise CorpusError(error.read_text())
            raise _part_failure(path, part, status, workers)
    return still


def _part_failure(path: Path, part, status: int, workers: int) -> PartBuildError:
    """The error of a part's process that ended with `status` (negative: killed by a signal)
    and no message of bad input."""
    files = [str(f) for f in _files_of(part)]
    shown = files[0] if len(files) == 1 else f"{len(files)} files, {files[0]} ... {files[-1]}"
    if status < 0:
        name = signal.Signals(-status).name
        cause = _SIGNAL_CAUSES.get(-status, "it crashed or was stopped from outside")
        ended = f"was killed by {name}: {cause}"
    else:  # an exception the process printed (MemoryError, a bug): its traceback is above
        ended = f"failed (exit status {status}); its traceback is printed above"
    text = f"the process building part {path.name} of the token store ({shown}) {ended}. "
    if status == -signal.SIGTERM:  # stopped on purpose: nothing to change
        return PartBuildError(text + "Run the same command again", workers)
    fewer = max(1, workers // 2)
    return PartBuildError(
        text + f"Run the same command with fewer processes at once: prepare.workers={fewer} "
        f"(it was {workers})",
        fewer,
    )


def _build_part(
    part, path: Path, tokenizer: Tokenizer, settings: StoreSettings, chunk_mb: float
) -> None:
    """Build one part store (unless another process built it meanwhile); bad input is also
    written to `<part>.error`, where the other ranks waiting for this part find it."""
    with exclusive_lock(path.parent / f"{path.name}.lock"):
        if _opened(path) is None:  # the part's fingerprint is not needed: its folder keys it
            label = f"part {path.name}"
            try:
                build_store(
                    part, tokenizer, settings, path, label, chunk_mb=chunk_mb, allow_empty=True
                )
            except CorpusError as err:
                path.with_suffix(".error").write_text(str(err))
                raise


def _worker(job: str, part_path: str, parent: str) -> int:
    """A part's process (`_WORKER_MAIN`): build the part that the file `job` describes at
    `part_path` (bad input: exit status 3, the message in PART.error for the parent to raise;
    SIGINT: its temporary files removed, exit status 130, quietly); `parent`: the pid of the
    process that started it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not _interrupted_when_parent_dies(int(parent)):  # gone already: nobody to build for
        return INTERRUPTED
    path = Path(part_path)
    logging.basicConfig(level=logging.INFO, format=f"[{path.name}] %(message)s")
    part, tokenizer_file, settings, chunk_mb = pickle.loads(Path(job).read_bytes())
    try:
        _build_part(part, path, Tokenizer.from_file(tokenizer_file), settings, chunk_mb)
    except CorpusError:  # written to PART.error for the parent
        return 3
    except KeyboardInterrupt:  # from `_stop`: the temporary files are gone; the parent reports
        return INTERRUPTED
    return 0


def _interrupted_when_parent_dies(parent: int) -> bool:
    """Ask Linux to send this part's process SIGINT when its parent ends: it runs in a session
    of its own (out of reach of the terminal's Ctrl-C, which the parent forwards), so a parent
    killed outright (SIGKILL, a job scheduler) would otherwise leave it writing parts beside
    the user's next run (elsewhere nothing is asked). False when the parent (its pid) has
    ended already."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl: it outlives the parent
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGINT))
    return os.getppid() == parent


def join_parts(
    parts: list[TokenStore],
    corpus,
    fingerprint: str,
    tokenizer: Tokenizer,
    settings: StoreSettings,
    path: Path,
    started: float,
) -> StoreStats:
    """Write the store of all `parts` (in order) at `path`: tokens one after another, offsets
    shifted by the tokens and sentences before each part; the bytes one process would write.

    Raises:
        CorpusError: no part holds any document.
    """
    totals = {"documents": 0, "sentences": 0, "tokens": 0, "skipped_documents": 0, "text_bytes": 0}
    for part in parts:
        for key in totals:
            totals[key] += part.manifest["counts"][key]
    if totals["documents"] == 0:
        raise no_text(corpus, totals["skipped_documents"])
    names = [TOKENS, DOCUMENTS] + ([SENTENCES, DOC_SENTENCES] if settings.sentences else [])
    path.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        writer = StoreWriter(path, names, stack)
        for name in names[1:]:
            writer.write(name, np.zeros(1, OFFSET_DTYPE))
        tokens = sentences = 0
        for part in parts:
            _copy(writer, part, TOKENS, 0)
            _copy(writer, part, DOCUMENTS, tokens)
            if settings.sentences:
                _copy(writer, part, SENTENCES, tokens)
                _copy(writer, part, DOC_SENTENCES, sentences)
                sentences += part.manifest["counts"]["sentences"]
            tokens += part.num_tokens
    seconds = time.perf_counter() - started
    return write_manifest(
        path, corpus, fingerprint, tokenizer, settings, totals, seconds, writer.summary()
    )


def _copy(writer: StoreWriter, part: TokenStore, name: str, shift: int) -> None:
    """Append a part's file `name` to the store's: its token ids as they are, or its offsets
    plus `shift` without their leading 0 (the store's file already ends with that offset). Read
    in blocks from the file, not through its memory map, whose pages would count in this
    process's memory."""
    dtype, skip = (part.dtype, 0) if name == TOKENS else (OFFSET_DTYPE, 1)
    with open(part.path / name, "rb") as handle:
        handle.seek(skip * dtype.itemsize)
        while len(block := np.fromfile(handle, dtype=dtype, count=_COPY_ELEMENTS)):
            writer.write(name, block + shift if shift else block)

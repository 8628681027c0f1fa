"""How a suite runs its fine-tunes: one at a time in its own process (`InThisProcess`), or, with
`make glue jobs=N`, side by side, each in a process of its own (`SideBySide`).

For a machine where one fine-tune cannot keep every core busy (many cores, a small model;
on 2 cores `jobs=2` was no faster, docs/results/cpu-bench.md): with `jobs=N` a suite keeps N
fine-tunes running, each in a process of its own with 1/N of this process's threads
(`torch.get_num_threads()`, which OMP_NUM_THREADS sets; at least one).

Each fine-tune's process is started for it (`spawn`: a fork of a process whose thread pool has
run can hang) and is the fine-tune `jobs=1` runs in the suite's own process: the same config,
resolved here (the process has no Hydra), the same seed, the checkpoint as the suite read it.
A fine-tune that fails stops the suite as it would with `jobs=1`: the others are stopped, and
their folders, unfinished, are moved aside when the suite resumes. A fine-tune's process ends
with the suite's, if that is killed.

Both runners take a job's folder and config (`start`) and give back (folder, results) for each
fine-tune that has ended: `start` for one run in this process, `make_room` and `drain` for
those side by side.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from omegaconf import DictConfig, OmegaConf

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT in a fine-tune's process)
from pipeline.checkpoint.source import CheckpointSource
from pipeline.finetune.results import FinetuneResults
from pipeline.finetune.run import finetune
from pipeline.run.cli import USER_ERRORS
from pipeline.run.errors import ConfigError, FineTuneCrashError
from pipeline.run.launcher import launcher_world_size

STOP_WAIT = 30  # seconds a fine-tune asked to stop has before it is killed


def check_jobs(jobs: Any, cfg: DictConfig) -> int:
    """`jobs` as a count of fine-tunes at once.

    Raises:
        ConfigError: not a positive integer, or more than one with a fine-tune on several
            devices or nodes (each is then one DDP run of its own processes).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs={jobs!r}: give how many fine-tunes run at once, e.g. jobs=2")
    devices = OmegaConf.select(cfg, "trainer.devices")
    nodes = OmegaConf.select(cfg, "trainer.num_nodes") or 1
    several = devices not in (1, "1", None, "auto") or nodes != 1 or launcher_world_size() > 1
    if jobs > 1 and several:
        raise ConfigError(
            f"jobs={jobs} runs fine-tunes side by side, each on one device, but "
            f"trainer.devices={devices} trainer.num_nodes={nodes} (or a launcher's processes) "
            "makes each a run on several: "
            "use jobs=1 with several devices, or trainer.devices=1 with jobs>1"
        )
    return jobs


def worker_config(job_cfg: DictConfig) -> dict:
    """A job's config as its process gets it: resolved (no Hydra there), with no progress bar
    or model summary, which several processes would interleave."""
    resolved = OmegaConf.to_container(job_cfg, resolve=True)
    quiet = {"enable_progress_bar": False, "enable_model_summary": False}
    resolved["trainer"] |= quiet | {"devices": 1}  # `auto` would take every GPU for each job
    return resolved


def _fine_tune(
    config: dict,
    source: CheckpointSource,
    hydra: DictConfig | None,
    threads: int,
    results: Connection,
) -> None:
    """A fine-tune's process: its results, or the error that stopped it, go to `results`.
    `source`: the checkpoint as the suite read it (a run folder's best.ckpt may be replaced
    while the suite runs); `hydra`: the suite's Hydra config, which its results record (the
    command line's overrides)."""
    exit_with_the_suite()
    try:
        torch.set_num_threads(threads)
        if hydra is not None:  # and its log: the same lines, into the same file
            HydraConfig.instance().set_config(hydra)
            configure_log(HydraConfig.get().job_logging, HydraConfig.get().verbose)
        results.send(finetune(OmegaConf.create(config), source=source, announce=False))
    except BaseException as err:
        if isinstance(err, USER_ERRORS):  # said in one line, by the suite
            sent = err if round_trips(err) else ConfigError(str(err))
        elif isinstance(err, (KeyboardInterrupt, SystemExit)):  # asked to stop
            sent = err if round_trips(err) else SystemExit(1)
        else:  # its traceback, here where it happened; the suite says which fine-tune it was
            traceback.print_exc()
            first_line = next(iter(str(err).splitlines()), "")
            said = f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
            sent = FineTuneCrashError(said)
        results.send(sent)
        raise SystemExit(1) from None


def exit_with_the_suite() -> None:
    """End this process when the suite's process ends (killed, say): a fine-tune nobody waits
    for would go on writing into the suite's folder."""
    suite = multiprocessing.parent_process()
    if suite is not None:
        watch = threading.Thread(
            target=lambda: (wait([suite.sentinel]), os._exit(1)), daemon=True, name="suite"
        )
        watch.start()


def round_trips(err: BaseException) -> bool:
    """Whether `err` is read back as it was sent (some exceptions pickle, then fail to load)."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return False
    return True


def receive(results: Connection) -> Any:
    """What a fine-tune's process sent (waiting for all of it), or None if it sent nothing
    whole (it ended without a word, or mid-message)."""
    try:
        return results.recv()
    except (EOFError, OSError):
        return None


@dataclass
class Running:
    """A fine-tune's process, the end of its pipe, and what the suite calls its job."""

    process: multiprocessing.process.BaseProcess
    results: Connection
    job: Any


Ended = list[tuple[Any, FinetuneResults]]


class InThisProcess:
    """Fine-tunes one at a time, in this process, from the checkpoint read once (`source`)."""

    def __init__(self, source: CheckpointSource) -> None:
        self.source = source

    def make_room(self) -> Ended:
        return []

    def start(self, job: Any, job_cfg: DictConfig) -> Ended:
        return [(job, finetune(job_cfg, source=self.source, announce=False))]

    def drain(self) -> Ended:
        return []

    def stop(self) -> None:
        pass


class SideBySide:
    """Up to `jobs` fine-tunes at once, each in a process with 1/`jobs` of this process's torch
    threads (at least one).

    `make_room` waits until fewer than `jobs` run, `start` starts one, `drain` waits for all;
    each gives (job, results) for the fine-tunes that ended. `stop` ends those still running.
    """

    def __init__(self, source: CheckpointSource, jobs: int) -> None:
        self.source = source
        self.jobs = jobs
        self.threads = max(1, torch.get_num_threads() // jobs)
        self.context = multiprocessing.get_context("spawn")
        self.hydra = HydraConfig.instance().cfg  # None outside a Hydra job (tests)
        self.running: list[Running] = []

    def make_room(self) -> Ended:
        ended = []
        while len(self.running) >= self.jobs:
            ended += self.finished()
        return ended

    def drain(self) -> Ended:
        ended = []
        while self.running:
            ended += self.finished()
        return ended

    def start(self, job: Any, job_cfg: DictConfig) -> Ended:
        receive, send = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=_fine_tune,
            args=(worker_config(job_cfg), self.source, self.hydra, self.threads, send),
        )  # not a daemon: a fine-tune may start data-loading processes of its own
        process.start()
        send.close()
        self.running.append(Running(process, receive, job))
        return []

    def finished(self) -> Ended:
        """Wait until one or more fine-tunes end; their jobs and results.

        Raises:
            the user error a fine-tune ended with (the others are stopped first), or
            FineTuneCrashError for an unexpected one (its process printed the traceback) or
            for one that ended without a word (killed, out of memory).
        """
        # the pipes too: a process blocks on sending results larger than a pipe's buffer
        ready = wait([r.results for r in self.running] + [r.process.sentinel for r in self.running])
        done = [r for r in self.running if r.results in ready or r.process.sentinel in ready]
        self.running = [r for r in self.running if r not in done]
        out = []
        for run in done:
            result = receive(run.results)
            run.process.join()
            if isinstance(result, FinetuneResults):
                out.append((run.job, result))
                continue
            self.stop()
            if isinstance(result, FineTuneCrashError):
                raise FineTuneCrashError(
                    f"the fine-tune of {run.job} failed: {result} (its traceback is above)"
                )
            if isinstance(result, BaseException):
                raise result
            code = run.process.exitcode
            why = f"killed by signal {-code}: out of memory?" if code < 0 else f"exit code {code}"
            raise FineTuneCrashError(
                f"the fine-tune of {run.job} ended without results ({why}); its log is above"
            )
        return out

    def stop(self) -> None:
        """End every fine-tune still running (their folders stay, unfinished): asked to stop,
        then killed after STOP_WAIT seconds (a step in progress finishes first)."""
        if self.running:
            print(f"stopping {len(self.running)} fine-tune(s) still running", file=sys.stderr)
        for run in self.running:
            run.process.terminate()
        for run in self.running:
            run.process.join(STOP_WAIT)
            if run.process.is_alive():
                run.process.kill()
                run.process.join()
        self.running = []


__all__ = ["InThisProcess", "SideBySide", "check_jobs", "worker_config"]

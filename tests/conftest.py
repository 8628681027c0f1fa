"""Shared fixtures: composing the real Hydra configs, small corpora, the shared data folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT, which tests ask for)
from pipeline.run.launcher import register_resolvers
from tests.in_process import run_module

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHARED_DATA = Path(os.environ.get("LMPIPE_SHARED_DATA", REPO.parent / "shared" / "data"))


def compose_pretrain(*overrides: str, hydra_node: bool = False) -> DictConfig:
    """Compose conf/pretrain.yaml with overrides, as `make pretrain` would (no run started)."""
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("pretrain", overrides=list(overrides), return_hydra_config=hydra_node)
    if not hydra_node:
        OmegaConf.set_struct(cfg, False)
        cfg.paths.output_dir = "unused-output-dir"
    return cfg


def pretrain_command(
    tmp_path: Path, *overrides: str, entry: str = "pipeline.commands.pretrain"
) -> list[str]:
    """`python -m pipeline.commands.pretrain` (or another `entry` module) with caches and outputs
    under tmp_path, no progress bar (outputs land in `tmp_path/out/<model>/<run_name>`)."""
    return [
        sys.executable,
        "-m",
        entry,
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        "+trainer.enable_progress_bar=false",
        *overrides,
    ]


# Torch threads of a test's own runs and of the commands it starts: at most 2, and the cores
# shared among pytest-xdist's workers (`make test` runs one per core), so that two workers never
# run four threads on two cores. In-process runs and the processes a test starts use the same
# number: runs compared bit for bit add their sums in the same order.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
THREADS = max(1, min(2, CORES // WORKERS))
torch.set_num_threads(THREADS)

# Environment of CLI subprocesses: offline, no inherited run stamp or debug switches, and no
# wandb (the default logger list has it; tests/pipeline/test_loggers.py turns it on).
CLI_ENV = {
    "PATH": "/usr/bin:/bin",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": str(THREADS),
    "WANDB_MODE": "disabled",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under coverage (pytest-cov with `patch = subprocess`, which starts measuring before the
    session), the commands the tests start are measured too: they get its settings."""
    CLI_ENV.update({k: v for k, v in os.environ.items() if k.startswith("COVERAGE_")})


def run_command(
    module: str,
    *args: str,
    env: dict | None = None,
    cwd: Path = REPO,
    timeout: float = 600,
    stdin=None,
    process: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m module *args` to completion in `cwd`, with exactly the environment `env`
    (default `CLI_ENV`). A command of `pipeline.commands` runs in this process
    (`tests.in_process`, seconds faster) unless the test is about the process itself:
    `process=True`, a `stdin` (a file descriptor) to give it, a module of the tests (which
    patch the library for the run, e.g. a fake clock), or a run of several processes (their
    launcher starts the others from a Python whose torch would already be set up by the tests)
    start a Python of its own, stopped after `timeout` seconds."""
    env = CLI_ENV if env is None else env
    in_process = not process and stdin is None and not launches_processes(args)
    if in_process and module.startswith("pipeline.commands."):
        return run_module(module, args, env=env, cwd=cwd)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=stdin,
    )


def launches_processes(args: Sequence[str]) -> bool:
    """Whether the overrides `args` run on more than one device or node (Lightning then starts
    one process per device)."""
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key not in ("trainer.devices", "trainer.num_nodes"):
            continue
        if value.lstrip("-").isdigit() and (int(value) > 1 or int(value) == -1):  # -1: all
            return True
        if value.startswith("[") and "," in value:  # a list of devices
            return True
    return False


def run_pretrain(
    tmp_path: Path,
    *overrides: str,
    entry: str = "pipeline.commands.pretrain",
    **how,
) -> subprocess.CompletedProcess:
    """Run the pretraining CLI (`entry`) with caches and outputs under tmp_path (`run_command`
    says where it runs; `how`: its keyword arguments)."""
    command = pretrain_command(tmp_path, *overrides, entry=entry)
    return run_command(entry, *command[3:], **how)


class ListCorpus:
    """An in-memory corpus with the same interface as datamodules.corpora.corpus."""

    def __init__(self, docs: list[str]) -> None:
        self.docs = docs
        self.reads = 0

    def documents(self):
        self.reads += 1
        yield from self.docs

    def fingerprint(self) -> str:
        return hashlib.sha256("\0".join(self.docs).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{len(self.docs)} in-memory documents"


@pytest.fixture(scope="session")
def small_docs() -> list[str]:
    """~150 KB of real English prose from the embedded corpus (first 30 documents)."""
    from datamodules.corpora.corpus import EmbeddedCorpus

    docs = list(EmbeddedCorpus().documents())
    return docs[:30]


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set LMPIPE_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _no_wandb_unless_asked(monkeypatch):
    """Runs built in-process leave wandb out (the default logger list has it), so tests start
    no wandb service; a test that wants wandb sets WANDB_MODE itself."""
    monkeypatch.setenv("WANDB_MODE", "disabled")


def write_two_source_mixture(folder: Path, weights: str = "{alpha: 0.7, beta: 0.3}") -> list[str]:
    """A data config of two local text sources (the first 40 embedded documents, and the next
    20) mixed by `weights`, written under `folder`; the overrides that select it (a config
    folder on Hydra's search path, as a user's own mixture would be)."""
    from datamodules.corpora.corpus import EmbeddedCorpus

    docs = list(EmbeddedCorpus().documents())
    (folder / "alpha.txt").write_text("\n\n".join(docs[:40]) + "\n")
    (folder / "beta.txt").write_text("\n\n".join(docs[40:60]) + "\n")
    conf = folder / "mixture_conf" / "data"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "two_sources.yaml").write_text(
        "defaults:\n"
        "  - /data@sources.alpha: text_files\n"
        "  - /data@sources.beta: text_files\n"
        "  - _self_\n"
        "_target_: datamodules.corpora.mixture.MixtureCorpus\n"
        "_convert_: object\n"
        f"sources:\n  alpha: {{paths: {folder / 'alpha.txt'}}}\n"
        f"  beta: {{paths: {folder / 'beta.txt'}}}\n"
        f"weights: {weights}\n"
        "epochs: null\n"
    )
    return [f"hydra.searchpath=[file://{folder / 'mixture_conf'}]", "data=two_sources"]

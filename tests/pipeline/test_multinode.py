"""Two nodes, simulated on this machine (docs/scaling.md, "Several nodes").

Each "node" is a `torchrun --nnodes=2 --nproc-per-node=1` launch with the c10d rendezvous (gloo,
one process), started in its own working folder: node A hosts the rendezvous, as the head node
named in `--rdzv-endpoint` does. The two share nothing but the output folder, and either a cache
folder each (`LMPIPE_CACHE` pointing at a local disk, with the tokenizer given by
`tokenizer.path`, as docs/scaling.md says) or one shared cache folder, as on NFS. A run trains,
validates and checkpoints; one node is then lost (SIGKILL of every process of it, or frozen with
SIGSTOP, as a node that lost its network); the other must stop within
`trainer.strategy.timeout_s` with one line that names the lost rank and the command that
continues; that command, given to both nodes, resumes the run, which ends with the weights of
one node running two processes (`trainer.devices=2`) for the same steps.

An audit hook in every process (a `sitecustomize` on PYTHONPATH) records each file written in
the output folder and by which rank, so the tests see that checkpoints are written by global
rank 0 only, once per save.

The two-node tests are slow (about a minute each on 2 cores; CI runs them, .ci/run); the
pieces they rely on (the timeout setting, how a lost peer is told, the command to continue,
each rank's own log file) are also checked in-process, fast.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from omegaconf import OmegaConf, open_dict

from pipeline.pretrain.checks import check_config
from pipeline.run.errors import ConfigError, PeerLostError
from pipeline.run.folder import own_log_file
from pipeline.run.launcher import local_rank, relaunch_command
from pipeline.training.strategies import (
    Peer,
    PeerDirectory,
    lost_peer_seen,
    peers_lost_as_error,
)
from tests.conftest import CLI_ENV, REPO, compose_pretrain, run_pretrain

STEPS = 12
EVERY = 4  # checkpoint and validation interval
TIMEOUT_S = 20  # trainer.strategy.timeout_s: a frozen node is noticed after it
RUN = (
    "model=gpt-tiny",
    "trainer.accelerator=cpu",
    "trainer.precision=32",
    "objective.batch_size=4",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={EVERY}",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    f"checkpoint.every_n_steps={EVERY}",
    "logger=csv",
    "run_name=multi",
)
# What every node's torchrun is given after `-m pipeline.commands.pretrain`.
NODE_RUN = (
    *RUN,
    "+trainer.enable_progress_bar=false",
    "trainer=ddp",
    "trainer.devices=1",
    "trainer.num_nodes=2",
)

# Records, in $AUDIT_LOG, every file this process opens for writing or renames into place under
# $AUDIT_ROOT, with the global rank that torchrun gave it.
AUDIT_HOOK = """
import os, sys
_root = os.environ.get("AUDIT_ROOT")
if _root and "RANK" in os.environ:
    _fd = os.open(os.environ["AUDIT_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _rank = os.environ["RANK"]
    _written = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def _audit(event, args):
        if event == "open":
            path, mode, flags = args
            if mode is not None and not any(c in mode for c in "wax+"):
                return
            if mode is None and not (flags or 0) & _written:
                return
        elif event == "os.rename":
            path = args[1]
        else:
            return
        if isinstance(path, (str, os.PathLike)):
            path = os.path.abspath(os.fspath(path))
            if path.startswith(_root):
                os.write(_fd, f"{_rank} {event} {os.path.relpath(path, _root)}\\n".encode())

    sys.addaudithook(_audit)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (torchrun starts its workers in sessions of their own, so a
    process group would miss them)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # gone meanwhile
            continue
        for child in children:
            found += process_tree(int(child))
    return found


def is_worker(pid: int) -> bool:
    """Whether `pid` is a training process (not the torchrun that started it)."""
    words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return b"pipeline.commands.pretrain" in words and b"torch.distributed.run" not in words


@dataclass
class Node:
    """One simulated node: its torchrun and the file its output goes to."""

    name: str
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rank(self) -> int | None:
        found = re.search(r"GLOBAL_RANK: (\d+)", self.output())
        return int(found[1]) if found else None

    def signal_all(self, signum: int) -> list[int]:
        """Send `signum` to every process of the node at once; their pids."""
        pids = process_tree(self.process.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signum)
        return pids

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_all(signal.SIGKILL)
            self.process.wait()
            pytest.fail(f"node {self.name} still ran after {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return f"--- node {self.name} ---\n{self.output()[-4000:]}"


class Cluster:
    """Two nodes' folders and the output folder they share; `launch` starts a job on both."""

    def __init__(self, base: Path, shared_cache: Path | None = None) -> None:
        self.base = base
        self.out = base / "out"
        self.shared_cache = shared_cache
        hook = base / "hook"
        hook.mkdir(parents=True)
        (hook / "sitecustomize.py").write_text(AUDIT_HOOK)
        self.jobs = 0

    def cache(self, name: str) -> Path:
        return self.shared_cache or self.base / f"node{name}" / "local-disk-cache"

    def launch(self, overrides: list[str]) -> list[Node]:
        """Start torchrun on both nodes with the same command line (node A first: it hosts
        the rendezvous)."""
        self.jobs += 1
        port, nodes = free_port(), []
        for name in "AB":
            folder = self.base / f"node{name}"
            folder.mkdir(exist_ok=True)
            env = {
                **CLI_ENV,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",  # the test reads the ranks' output as it comes
                "PYTHONPATH": f"{self.base / 'hook'}:{REPO}",
                "LMPIPE_CACHE": str(self.cache(name)),
                "AUDIT_ROOT": str(self.out),
                "AUDIT_LOG": str(self.base / f"audit-job{self.jobs}-{name}.txt"),
            }
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=job{self.jobs}",
                f"--rdzv-conf=is_host={int(name == 'A')}",
                "-m",
                "pipeline.commands.pretrain",
                *overrides,
            ]
            log = folder / f"job{self.jobs}.log"
            with open(log, "w") as handle:
                process = subprocess.Popen(
                    command,
                    cwd=folder,
                    env=env,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            nodes.append(Node(name, process, log))
        return nodes

    def audit(self, job: int) -> list[tuple[int, str, str]]:
        """(rank, event, path under the output folder) of every write of job `job`."""
        events = []
        for path in self.base.glob(f"audit-job{job}-*.txt"):
            for line in path.read_text().splitlines():
                rank, event, written = line.split(" ", 2)
                events.append((int(rank), event, written))
        return events

    @property
    def run_dir(self) -> Path:
        return self.out / "gpt-tiny" / "multi"


def run_until_lost(cluster: Cluster, overrides: list[str], victim: str, signum: int):
    """Start a job, and once its first checkpoint is written, stop every process of the node
    that `victim` picks ("rank0": the node of global rank 0; "B") with `signum` (after a
    SIGSTOP, so that the other stops in the step it is in). Returns (victim node, surviving
    node, seconds the survivor took to exit after the loss, the pid of the victim's worker)."""
    nodes = cluster.launch(overrides)
    first = cluster.run_dir / "checkpoints" / f"step{EVERY:07d}.ckpt"
    deadline = time.monotonic() + 300
    while not first.exists():
        for node in nodes:
            assert node.process.poll() is None, f"node {node.name} ended early:\n{node.tail()}"
        assert time.monotonic() < deadline, "no checkpoint after 300 s:\n" + nodes[0].tail()
        time.sleep(0.02)
    ranks = {node.name: node.rank() for node in nodes}
    assert sorted(ranks.values()) == [0, 1], ranks
    lost = next(n for n in nodes if (ranks[n.name] == 0 if victim == "rank0" else n.name == victim))
    survivor = next(n for n in nodes if n is not lost)
    pids = lost.signal_all(signal.SIGSTOP)
    [worker] = [pid for pid in pids if is_worker(pid)]
    if signum != signal.SIGSTOP:
        lost.signal_all(signum)
    lost_at = time.monotonic()
    assert survivor.wait(TIMEOUT_S + 90) != 0, survivor.tail()
    took = time.monotonic() - lost_at
    assert survivor.output().count("error: rank ") == 1, survivor.tail()  # one line a node
    lost.signal_all(signal.SIGKILL)
    lost.process.wait(timeout=60)
    return lost, survivor, took, worker


def continued_overrides(output: str) -> list[str]:
    """The overrides of the command a stopped node printed to continue the run."""
    found = re.search(
        r"continue with: .*?-m pipeline\.commands\.pretrain (.*) \(on every node\)$",
        output,
        re.MULTILINE,
    )
    assert found, f"no command to continue the run in:\n{output[-3000:]}"
    return shlex.split(found[1])


def weights(checkpoint: Path) -> tuple[int, dict[str, torch.Tensor]]:
    contents = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return contents["global_step"], contents["state_dict"]


def validation_losses(run_dir: Path) -> dict[int, str]:
    """step -> val/loss, as the run's CSV log has it."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {
            int(row["step"]): row["val/loss"]
            for row in csv.DictReader(handle)
            if row.get("val/loss")
        }


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    """The run on one node with two processes (Lightning's own launcher), in its own cache:
    its run folder (its tokenizer.json is the one the two-node runs are given)."""
    base = tmp_path_factory.mktemp("one-node")
    done = run_pretrain(
        base,
        *RUN,
        "trainer=ddp",
        "trainer.devices=2",
        timeout=300,
        env={**CLI_ENV, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return base / "out" / "gpt-tiny" / "multi"


def resume_and_compare(cluster: Cluster, survivor: Node, one_node: Path) -> list[Node]:
    """Give both nodes the command the survivor printed; the run must end as the one-node
    run did: same steps, same weights, validated at each interval."""
    overrides = continued_overrides(survivor.output())
    assert overrides[-2:] == ["run_name=multi", "resume=auto"]
    nodes = cluster.launch(overrides)
    for node in nodes:
        assert node.wait(300) == 0, node.tail()
    said = "\n".join(node.output() for node in nodes)
    resumed = int(re.search(r"resuming from \S+ \(step (\d+)\)", said)[1])
    assert EVERY <= resumed < STEPS
    assert f"finished {STEPS} steps" in said
    step, ours = weights(cluster.run_dir / "checkpoints" / "last.ckpt")
    reference_step, reference = weights(one_node / "checkpoints" / "last.ckpt")
    assert step == reference_step == STEPS
    assert ours.keys() == reference.keys()
    differ = [name for name in ours if not torch.equal(ours[name], reference[name])]
    assert not differ, f"weights differ from the one-node run's: {differ}"
    # validated after the resume as the one-node run was (step EVERY's validation comes after
    # its checkpoint: the lost node may have taken it along)
    ours, reference = validation_losses(cluster.run_dir), validation_losses(one_node)
    after = [step for step in range(EVERY, STEPS + 1, EVERY) if step > resumed]
    assert [ours.get(step) for step in after] == [reference[step] for step in after]
    return nodes


def assert_only_rank0_writes_checkpoints(cluster: Cluster) -> None:
    """In every job, each checkpoint was put in place by global rank 0, each periodic one once;
    the other rank wrote nothing in the run folder but its own log (not rank 0's: over NFS,
    appends from two nodes to one file overwrite each other)."""
    for job in range(1, cluster.jobs + 1):
        events = cluster.audit(job)
        placed = [(rank, path) for rank, event, path in events if event == "os.rename"]
        checkpoints = [(rank, path) for rank, path in placed if path.endswith(".ckpt")]
        assert checkpoints, f"job {job} put no checkpoint in place"
        assert {rank for rank, _ in checkpoints} == {0}, checkpoints
        periodic = [path for _, path in checkpoints if re.search(r"/step\d+\.ckpt$", path)]
        assert len(periodic) == len(set(periodic)), f"a checkpoint written twice: {periodic}"
        others = {(rank, path) for rank, _, path in events if rank != 0}
        assert others == {(1, "gpt-tiny/multi/pretrain_rank1.log")}, others


@pytest.mark.slow
def test_two_nodes_with_local_caches_resume_after_the_head_node_is_killed(tmp_path, one_node):
    """Caches on each node's own disk: each node builds its token store there. The node of
    rank 0 (also the rendezvous host, which writes the checkpoints) is killed outright: the
    other node's process stops at once and names it."""
    cluster = Cluster(tmp_path)
    tokenizer = f"tokenizer.path={one_node / 'tokenizer.json'}"
    overrides = [*NODE_RUN, f"paths.output_root={cluster.out}", tokenizer]
    overrides.append(f"trainer.strategy.timeout_s={TIMEOUT_S}")
    _, survivor, took, worker = run_until_lost(cluster, overrides, "rank0", signal.SIGKILL)
    said = survivor.output()
    assert "error: rank 1 of 2 (pid " in said
    assert f"lost its connection to rank 0 (pid {worker} on {socket.gethostname()})" in said
    assert took < TIMEOUT_S, f"the survivor took {took:.0f} s to stop:\n{survivor.tail()}"
    for name in "AB":  # each node built the store on its own disk
        stores = (cluster.cache(name) / "token_stores").iterdir()
        assert len([path for path in stores if path.is_dir()]) == 1
    resume_and_compare(cluster, survivor, one_node)
    assert_only_rank0_writes_checkpoints(cluster)


@pytest.mark.slow
def test_two_nodes_with_a_shared_cache_resume_after_a_node_stops_answering(tmp_path, one_node):
    """One cache folder for both nodes (NFS): the store is built once, by one node, while
    the other waits. Node B then freezes (SIGSTOP: a node cut off from the network closes no
    connection): node A must give up after trainer.strategy.timeout_s, not hang."""
    shared = tmp_path / "nfs-cache"
    # The tokenizer the one-node run trained, as `make tokenizer` would leave it in the cache
    # (trained again, ties between equally frequent merges could break the other way).
    reference_cache = one_node.parents[2] / "cache"
    shutil.copytree(reference_cache / "tokenizers", shared / "tokenizers")
    cluster = Cluster(tmp_path / "cluster", shared_cache=shared)
    overrides = [*NODE_RUN, f"paths.output_root={cluster.out}"]
    overrides.append(f"trainer.strategy.timeout_s={TIMEOUT_S}")
    lost, survivor, took, worker = run_until_lost(cluster, overrides, "B", signal.SIGSTOP)
    said = survivor.output()
    assert (
        f"had no answer from the other processes within {TIMEOUT_S} s "
        "(trainer.strategy.timeout_s)" in said
    ), survivor.tail()
    assert f"pid {worker} on {socket.gethostname()}" in said
    assert took < TIMEOUT_S + 60, f"the survivor took {took:.0f} s to stop:\n{survivor.tail()}"
    stores = [path for path in (shared / "token_stores").iterdir() if path.is_dir()]
    built = "\n".join(node.output() for node in (lost, survivor)).count("built token store")
    assert (len(stores), built) == (1, 1), (stores, built)
    resume_and_compare(cluster, survivor, one_node)
    assert_only_rank0_writes_checkpoints(cluster)


# --- the pieces, in-process ---------------------------------------------------------------


@pytest.mark.parametrize(("trainer", "kind"), [("ddp", DDPStrategy), ("fsdp", FSDPStrategy)])
def test_the_collective_timeout_is_a_setting_of_the_strategy(trainer, kind):
    """trainer.strategy.timeout_s is the time a collective waits (1800 s unless given)."""
    default = instantiate(compose_pretrain(f"trainer={trainer}").trainer.strategy)
    given = compose_pretrain(f"trainer={trainer}", "trainer.strategy.timeout_s=20")
    strategy = instantiate(given.trainer.strategy)
    assert isinstance(strategy, kind)
    assert (default._timeout.total_seconds(), strategy._timeout.total_seconds()) == (1800, 20)


def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_with_a_fix_that_works():
    cfg = compose_pretrain("model=gpt-tiny", "trainer=ddp", "trainer.strategy.timeout_s=0")
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    message = str(refused.value)
    assert "trainer.strategy.timeout_s=0 is not a positive number of seconds" in message
    fix = re.search(r"e\.g\. (\S+)$", message)[1]
    check_config(compose_pretrain("model=gpt-tiny", "trainer=ddp", fix))


GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[::ffff:10.0.0.2]:56510: Connection reset by peer. This is typically caused by a remote "
    "worker hanging or bugs in the application."
)
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "20000ms for recv operation to complete"
)


@pytest.mark.parametrize(
    ("error", "seen"),
    [
        (RuntimeError(GLOO_RESET), ("broken", "10.0.0.2")),
        (RuntimeError("Connection closed by peer [10.0.0.3]:1234"), ("broken", "10.0.0.3")),
        (RuntimeError(GLOO_TIMEOUT), ("timeout", None)),
        (torch.distributed.DistNetworkError("Broken pipe"), ("broken", None)),
        (RuntimeError("CUDA out of memory"), None),
        (RuntimeError("the dataloader timed out"), None),  # not a collective's
    ],
)
def test_a_lost_peer_is_told_apart_from_other_errors(error, seen):
    assert lost_peer_seen(error) == seen


def test_a_lost_peer_under_another_error_is_found():
    try:
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as cause:
            raise ValueError("metric sync failed") from cause
    except ValueError as err:
        assert lost_peer_seen(err) == ("broken", "10.0.0.2")


class FakeTrainer:
    """What `peers_lost_as_error` reads of a Trainer: rank 0 of four on two nodes."""

    world_size, global_rank, global_step = 4, 0, 310

    def __init__(self, timeout_s: float | None = None) -> None:
        directory = PeerDirectory(timeout_s)
        directory.peers = [
            Peer(0, "node1", "10.0.0.1", 100),
            Peer(1, "node1", "10.0.0.1", 101),
            Peer(2, "node2", "10.0.0.2", 200),
            Peer(3, "node2", "10.0.0.2", 201),
        ]
        self.callbacks = [directory]


def test_a_broken_connection_names_the_ranks_at_the_other_end():
    with pytest.raises(PeerLostError) as lost, peers_lost_as_error(FakeTrainer()):
        raise RuntimeError(GLOO_RESET)
    assert str(lost.value) == (
        "rank 0 of 4 (pid 100 on node1) lost its connection to one of ranks 2, 3 (on node2) at "
        "10.0.0.2: that process was killed or crashed, or its node went down; training stopped "
        "at step 310"
    )


def test_a_silent_peer_names_the_timeout_setting():
    with pytest.raises(PeerLostError) as lost, peers_lost_as_error(FakeTrainer(20)):
        raise RuntimeError(GLOO_TIMEOUT)
    assert "had no answer from the other processes within 20 s (trainer.strategy.timeout_s)" in (
        str(lost.value)
    )
    assert "(the others: ranks 1, 2, 3 (on node1, node2))" in str(lost.value)


def test_other_errors_pass_through():
    with (
        pytest.raises(RuntimeError, match="CUDA out of memory"),
        peers_lost_as_error(FakeTrainer()),
    ):
        raise RuntimeError("CUDA out of memory")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "make pretrain run_name=x resume=auto"),
        (
            {"WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "wiki"},
            ".venv/bin/torchrun <the same options as before> -m pipeline.commands.pretrain "
            "'data.paths=[a b]' run_name=x resume=auto (on every node)",
        ),
        (
            {"SLURM_NTASKS": "16", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7"},
            "srun <the same options as before> .venv/bin/python -m pipeline.commands.pretrain "
            "'data.paths=[a b]' run_name=x resume=auto",
        ),
    ],
)
def test_the_command_that_continues_is_the_launchers(monkeypatch, env, expected):
    for name in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_STEP_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    overrides = ["data.paths=[a b]", "run_name=x", "resume=auto"]
    made = "make pretrain run_name=x resume=auto"
    assert relaunch_command(made, "pipeline.commands.pretrain", overrides) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 0),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 1),  # torchrun, Lightning
        ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_LOCALID": "1"}, 1),  # srun
        (
            {"SLURM_NTASKS": "4", "SLURM_LOCALID": "1"},
            0,
        ),  # an sbatch script that srun did not start
    ],
)
def test_the_rank_on_its_node_is_read_from_each_launcher(monkeypatch, env, expected):
    """Only local rank 0 of a node tells the user of a lost peer: under srun too."""
    for name in ("WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert local_rank() == expected


@pytest.mark.parametrize(("rank", "log"), [(None, "pretrain.log"), ("3", "pretrain_rank3.log")])
def test_a_rank_started_by_torchrun_logs_to_a_file_of_its_own(monkeypatch, rank, log):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    hydra = compose_pretrain(hydra_node=True).hydra
    with open_dict(hydra):
        own_log_file(hydra)
        hydra.runtime.output_dir = "run"
        hydra.job.name = "pretrain"
    filename = OmegaConf.select(hydra, "job_logging.handlers.file.filename")
    assert filename == f"run/{log}"

"""One run at a time in a run folder (pipeline/run/lock.py): a second command for a folder in
use is refused before it writes anything, and a lock left by a killed run is taken over."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from pipeline.run.errors import RunFolderBusyError
from pipeline.run.lock import LOCK_FILE, LockOwner, lock_run_folder, release_run_folder
from tests.conftest import CLI_ENV, CONF, REPO, pretrain_command, run_pretrain

HOLD = (
    "import sys; from pathlib import Path; from pipeline.run.lock import lock_run_folder; "
    "lock_run_folder(Path(sys.argv[1]), 'pretrain'); print('held', flush=True); sys.stdin.read()"
)


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process that takes `run_dir`'s lock and holds it until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_folder_in_use_is_refused_naming_the_owner_then_free_when_it_exits(tmp_path):
    holder = hold_lock(tmp_path / "run")
    with pytest.raises(RunFolderBusyError) as refused:
        lock_run_folder(tmp_path / "run", "pretrain")
    message = str(refused.value)
    assert f"pid {holder.pid} on {socket.gethostname()}" in message
    assert f"kill {holder.pid}" in message and "run_name=" in message
    holder.stdin.close()  # the owner ends normally: the lock is free and names no one
    assert holder.wait(timeout=60) == 0
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""
    lock = lock_run_folder(tmp_path / "run", "finetune")
    owner = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert owner["command"] == "finetune" and owner["host"] == socket.gethostname()
    assert lock_run_folder(tmp_path / "run", "finetune") is lock  # held already: the same
    release_run_folder(tmp_path / "run")
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = hold_lock(tmp_path / "run")
    holder.send_signal(signal.SIGKILL)  # no exit handler runs: the file still names it
    holder.wait(timeout=60)
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="pipeline.run.lock"):
        lock_run_folder(tmp_path / "run", "pretrain")
    assert f"pid {holder.pid}" in caplog.text and "ended without releasing it" in caplog.text
    release_run_folder(tmp_path / "run")


def test_every_command_with_a_run_folder_takes_its_lock():
    """`make pretrain`, `make finetune` and `make glue` write a run folder: each has the guard
    that takes the lock before Hydra writes there."""
    for name, command in (("pretrain", "pretrain"), ("finetune", "finetune"), ("glue", "glue")):
        with initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose(name, return_hydra_config=True)
        guard = cfg.hydra.callbacks.run_folder
        assert guard._target_ == "pipeline.run.folder.RunFolderGuard" and guard.command == command


def wait_until_it_holds(process: subprocess.Popen, lock_file: Path, limit: float = 600) -> None:
    """Return once `lock_file` names `process` as its owner (it has taken the folder); fail
    (the process killed) if it ends first or has not taken it within `limit` seconds."""
    deadline = time.monotonic() + limit
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError), open(lock_file) as handle:
            owner = LockOwner.read(handle)  # None while free, or while its owner writes it
            if owner is not None and owner.pid == process.pid:
                return
        time.sleep(0.02)
    process.kill()
    _, err = process.communicate(timeout=60)
    raise AssertionError(f"the first run was not seen holding {lock_file}:\n{err[-3000:]}")


def files_and_times(folder: Path) -> dict[Path, int]:
    """Every path under `folder` and its modification time (ns)."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


def files_but_locks(folder: Path) -> dict[Path, int]:
    """`files_and_times` but the lock files, which a refused sweep may have held for a moment."""
    return {p: t for p, t in files_and_times(folder).items() if p.name != LOCK_FILE}


def test_two_runs_into_one_folder_the_second_refused_the_first_as_if_alone(tmp_path):
    """Two `make pretrain run_name=cc` (other learning rates), the second started while the first
    holds the folder: the second is refused with one line naming the first's pid and host, before
    it writes anything; the folder holds the first's run alone: its record, and the weights and
    losses of the same run made alone. The first is paused (SIGSTOP) while the second runs, so a
    slow machine cannot let it finish first (a finished run's folder is refused for another
    reason: it has checkpoints)."""
    run = ("model=gpt-tiny", "debug=smoke", "logger=csv", "trainer.precision=32")
    run_dir = tmp_path / "out/gpt-tiny/cc"
    first_lr = "optim.lr=1e-3"
    first = subprocess.Popen(
        pretrain_command(tmp_path, *run, "run_name=cc", first_lr),
        cwd=REPO,
        env=CLI_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_it_holds(first, run_dir / LOCK_FILE)
        first.send_signal(signal.SIGSTOP)
        before = files_and_times(run_dir)
        second = run_pretrain(tmp_path, *run, "run_name=cc", "optim.lr=2e-3")
        assert files_and_times(run_dir) == before  # the refused run wrote nothing there
    finally:
        first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    [line] = [x for x in second.stderr.splitlines() if x.startswith("error: ")]
    assert f"is in use by pid {first.pid} on {socket.gethostname()}" in line
    assert first_lr in (run_dir / ".hydra/overrides.yaml").read_text()
    assert not list((run_dir / ".hydra").glob("resume-*"))
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not [n for n in names if "-v" in n], names
    assert (run_dir / LOCK_FILE).read_text() == ""  # released at the end
    # a process of its own, as the first: the two are compared bit for bit
    alone = run_pretrain(tmp_path, *run, "run_name=alone", first_lr, process=True)
    assert alone.returncode == 0, alone.stderr[-3000:]
    alone_dir = tmp_path / "out/gpt-tiny/alone"
    assert names == sorted(p.name for p in (alone_dir / "checkpoints").iterdir())
    ours = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    theirs = torch.load(alone_dir / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert losses(run_dir) == losses(alone_dir)


def losses(run_dir: Path) -> list[tuple[str, str, str]]:
    """(step, train loss, validation loss) of each row of a run's CSV log, in order."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    return [(r["step"], r.get("train/loss", ""), r.get("val/loss", "")) for r in rows]


def test_output_dir_on_the_command_line_is_the_whole_run_folder(tmp_path):
    """`paths.output_dir=DIR` (a folder that does not exist yet): the run's checkpoints, record,
    log and lock are all in DIR, and nothing is made under `paths.output_root`; a second run into
    DIR is refused as a second run into any run folder is."""
    run_dir = tmp_path / "elsewhere/run"
    run = ("model=gpt-tiny", "debug=smoke", "logger=csv", f"paths.output_dir={run_dir}")
    done = run_pretrain(tmp_path, *run)
    assert done.returncode == 0, done.stderr[-3000:]
    for made in (".hydra/config.yaml", "pretrain.log", LOCK_FILE, "checkpoints/last.ckpt"):
        assert (run_dir / made).is_file(), made
    assert not (tmp_path / "out").exists()
    again = run_pretrain(tmp_path, *run)
    assert again.returncode == 2 and "already has checkpoints" in again.stderr
    assert "choose another paths.output_dir=" in again.stderr  # not a run_name: DIR is named
    empty = run_pretrain(tmp_path, "model=gpt-tiny", "paths.output_dir=null")
    assert empty.returncode == 2 and "paths.output_dir=None: give the run's folder" in empty.stderr
    assert not (REPO / "None").exists() and not (tmp_path / "out").exists()
    # a sweep's jobs each have a folder: one DIR for all of them is refused before any job
    sweep = run_pretrain(tmp_path, *run[:2], f"paths.output_dir={tmp_path}/s", "seed=1,2", "-m")
    assert sweep.returncode == 2, sweep.stderr
    assert f"give hydra.sweep.dir={tmp_path}/s)" in sweep.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "out").exists()
    # a sweep's folder is named by hydra.sweep.dir, and so is the fix of a second one into it
    sweep = (*run[:2], "logger=csv", f"hydra.sweep.dir={tmp_path}/s", "seed=1", "-m")
    assert run_pretrain(tmp_path, *sweep).returncode == 0
    record = (tmp_path / "s/0/.hydra/config.yaml").read_text()
    again = run_pretrain(tmp_path, *sweep[:-1], "optim.lr=0.5", "-m")
    assert again.returncode == 2 and "choose another hydra.sweep.dir=" in again.stderr
    assert (tmp_path / "s/0/.hydra/config.yaml").read_text() == record  # refused before Hydra wrote
    # a resumed sweep keeps each job's first record and writes its own beside it; a job that it
    # starts afresh keeps its record as a first attempt's
    resumed = run_pretrain(
        tmp_path, *sweep[:-2], "seed=1,2", "trainer.max_steps=7", "resume=auto", "-m"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "s/0/.hydra/config.yaml").read_text() == record
    (attempt,) = (tmp_path / "s/0/.hydra").glob("resume-*/config.yaml")
    assert "max_steps: 7" in attempt.read_text()
    assert "max_steps: 7" in (tmp_path / "s/1/.hydra/config.yaml").read_text()
    # a sweep into the folder while another sweep runs there, or a run in one of its job
    # folders, is refused before it writes
    for held in ("s", "s/1"):
        holder = hold_lock(tmp_path / held)
        before = files_but_locks(tmp_path / "s")
        try:
            busy = run_pretrain(tmp_path, *sweep[:-1], "resume=auto", "-m")
            assert files_but_locks(tmp_path / "s") == before, held
        finally:
            holder.stdin.close()
            holder.wait()
        assert busy.returncode == 2 and "is in use by pid" in busy.stderr, busy.stderr[-3000:]
        assert f"{tmp_path / held} is in use" in busy.stderr
        assert "choose another hydra.sweep.dir=" in busy.stderr

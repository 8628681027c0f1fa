"""Checkpoints and exact resume: a training process killed with SIGKILL and resumed with
`resume=auto` logs, at every step after the resume point, the loss the uninterrupted run logged,
and ends with the same weights."""

from __future__ import annotations

import csv
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from models.config import BertConfig
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.checkpoint.saving import check_compatible
from pipeline.checkpoint.source import CheckpointSource, newest_checkpoint
from pipeline.pretrain.budget import TimeBudget
from pipeline.pretrain.run import resumed_tokenizer
from pipeline.report import read_metrics
from pipeline.run.errors import CheckpointLoadError
from tests.conftest import (
    CLI_ENV,
    REPO,
    ListCorpus,
    compose_pretrain,
    pretrain_command,
    run_command,
    run_pretrain,
    write_two_source_mixture,
)
from tests.pipeline import fake_clock_pretrain, ready_process
from tests.pipeline.resume_first_runs import (
    TEN_STEPS,
    continue_run,
    share_cache,
    ten_step_run,
)
from tests.pipeline.smoke_runs import copy_run, smoke_run
from tests.pipeline.test_blimp import write_blimp
from tests.pipeline.test_probe import probe_overrides, probe_steps, write_probe_tasks
from tokenizer import TokenizerSpec, get_tokenizer

# bert-tiny with the reference recipe (AdamW) has dropout, so the RNG state must be restored
# too (Muon has its own test below); 20 optimizer steps with a checkpoint every 5 leave time to
# kill the process mid-run (it is killed once its step-10 checkpoint exists) and 10 steps after
# the resume point to compare, with a validation at 15 and at the end, both after it (40 steps,
# validating at 20, showed the same in twice the time: each step costs a second or more here).
# Precision is pinned: null picks bf16 or fp32 by timing both in each process, so under load a
# resumed run could pick the other.
RUN = (
    "model=bert-tiny",
    "recipe=bert-reference",
    "trainer.precision=32",
    "objective.batch_size=8",
    "trainer.val_check_interval=15",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=5",
)
STEPS = 20
VALIDATED = [15, STEPS]  # the steps RUN validates at


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss from the run's CSV log (the last row of a step wins)."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {
            int(r["step"]): float(r["train/loss"])
            for r in csv.DictReader(handle)
            if r["train/loss"]
        }


def resumed_step(stdout: str) -> int:
    """The step a resumed run says it continues from ("resuming from PATH (step N)"; the
    file itself may be gone by the end of the run, dropped from the kept checkpoints)."""
    return int(stdout.split("resuming from ")[1].split("(step ")[1].split(")")[0])


# How the runs that are killed or signalled start: a process of their own (ready_process: one
# started beforehand, which has imported the pipeline and waits for its command).
SIGNALLED = {
    "cwd": REPO,
    "env": CLI_ENV,
    "stdout": subprocess.DEVNULL,
    "stderr": subprocess.PIPE,
}


def wait_for_checkpoint(process: subprocess.Popen, directory: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not (directory / f"step{step:07d}.ckpt").exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """One folder (cache and outputs) for the module's interrupted runs and their references,
    so all use one trained tokenizer (training it twice may break ties between equally frequent
    merges differently): `reference(micro_batches)` makes the uninterrupted run of RUN once and
    returns its run folder."""
    base = tmp_path_factory.mktemp("runs")
    ready_process.prepare(**SIGNALLED)  # the first run to kill imports while others train
    done_runs = {}

    def reference(micro_batches: int) -> Path:
        if micro_batches not in done_runs:
            run = (*RUN, f"trainer.accumulate_grad_batches={micro_batches}")
            name = f"reference{micro_batches}"
            done = run_pretrain(base, *run, f"trainer.max_steps={STEPS}", f"run_name={name}")
            assert done.returncode == 0, done.stderr[-3000:]
            done_runs[micro_batches] = base / f"out/bert-tiny/{name}"
        return done_runs[micro_batches]

    yield base, reference
    ready_process.stop()


def interrupt_mid_run(tmp_path: Path, run: tuple[str, ...], name: str, signum: int, **entry):
    """Start a run (`entry=`: another CLI module), send it `signum` once its step-10 checkpoint
    exists; the finished process."""
    process = ready_process.start(
        pretrain_command(tmp_path, *run, f"run_name={name}", **entry), **SIGNALLED
    )
    wait_for_checkpoint(process, tmp_path / f"out/bert-tiny/{name}/checkpoints", 10)
    process.send_signal(signum)
    process.stderr_text = process.communicate(timeout=300)[1]
    return process


def assert_resumes_exactly(
    tmp_path: Path, run, name: str, reference_dir: Path, steps: int = STEPS, pretrain=run_pretrain
) -> int:
    """Resume run `name` with resume=auto (`pretrain`: how to run the command); its losses from
    the resume point on (to step `steps`) and its final weights equal the uninterrupted
    reference's. Returns the step it resumed from."""
    run_dir = tmp_path / f"out/bert-tiny/{name}"
    before = {p.name for p in (run_dir / "checkpoints").iterdir()}
    resumed = pretrain(tmp_path, *run, f"run_name={name}", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    start = resumed_step(resumed.stdout)
    assert 10 <= start < steps
    # Only whole steps are saved: nothing new right after resuming (e.g. mid-step).
    new = {p.name for p in (run_dir / "checkpoints").iterdir()} - before
    assert f"step{start:07d}-v1.ckpt" not in new

    expected = train_losses(reference_dir)
    got = train_losses(run_dir)
    assert sorted(s for s in got if s > start) == list(range(start + 1, steps + 1))
    for step in range(start + 1, steps + 1):  # CPU kernels here are deterministic: equal
        assert got[step] == expected[step], (step, got[step], expected[step])

    final = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    reference_final = torch.load(reference_dir / "checkpoints/last.ckpt", weights_only=True)[
        "state_dict"
    ]
    assert final.keys() == reference_final.keys()
    assert all(torch.equal(final[k], reference_final[k]) for k in final)
    return start


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["plain", "accumulating"])
def test_killed_run_resumes_exactly(micro_batches, shared_runs):
    run = (*RUN, f"trainer.accumulate_grad_batches={micro_batches}", f"trainer.max_steps={STEPS}")
    tmp_path, reference = shared_runs
    reference_dir = reference(micro_batches)
    assert sorted(train_losses(reference_dir)) == list(range(1, STEPS + 1))  # steps done
    kept = sorted(p.name for p in (reference_dir / "checkpoints").iterdir())
    # the last 2 periodic ones, last.ckpt, and the 1 best by validation loss (step 15 or 20)
    assert [k for k in kept if not k.startswith("best-")] == [
        "last.ckpt",
        "step0000015.ckpt",
        "step0000020.ckpt",
    ]
    assert len([k for k in kept if k.startswith("best-")]) == 1

    name = f"killed{micro_batches}"
    process = interrupt_mid_run(tmp_path, run, name, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL  # killed mid-run, not finished
    start = assert_resumes_exactly(tmp_path, run, name, reference_dir)
    assert start % 5 == 0  # a periodic checkpoint: nothing was saved when it was killed


@pytest.mark.parametrize(
    ("signum", "micro_batches"),
    [(signal.SIGINT, 1), pytest.param(signal.SIGTERM, 2, marks=pytest.mark.slow)],
    ids=["ctrl-c", "sigterm-accumulating"],
)
def test_a_signalled_run_saves_its_step_and_resumes_exactly(signum, micro_batches, shared_runs):
    """Ctrl-C or SIGTERM: the current step is finished and saved (last.ckpt at that step), the
    process says how to resume and exits with 128 + the signal; resume=auto is exact."""
    run = (*RUN, f"trainer.accumulate_grad_batches={micro_batches}", f"trainer.max_steps={STEPS}")
    tmp_path, reference = shared_runs
    reference_dir = reference(micro_batches)
    name = f"stopped{micro_batches}"
    process = interrupt_mid_run(tmp_path, run, name, signum)
    assert process.returncode == 128 + signum, process.stderr_text[-3000:]
    stderr = process.stderr_text
    assert f"stopped by {signal.Signals(signum).name} after step" in stderr
    resume_hint = stderr.split("continue with: ")[1].splitlines()[0]
    assert resume_hint.startswith("make pretrain ") and resume_hint.endswith(
        f"run_name={name} resume=auto"
    )
    last = torch.load(tmp_path / f"out/bert-tiny/{name}/checkpoints/last.ckpt", weights_only=True)
    stopped_at = int(stderr.split("after step ")[1].split(";")[0])
    assert last["global_step"] == stopped_at >= 10
    # the stopped step's metrics were logged before the process stopped
    assert max(train_losses(tmp_path / f"out/bert-tiny/{name}")) == stopped_at
    start = assert_resumes_exactly(tmp_path, run, name, reference_dir)
    assert start == stopped_at  # resumed from the step the signal saved, not an older one


def signal_when_saved(tmp_path: Path, run, name: str, signum: int, *, first: str, after: int):
    """Start run `name`, send it `signum` once a checkpoint named `first*` of a step past
    `after` exists; the finished process (its stderr as `stderr_text`)."""
    process = ready_process.start(pretrain_command(tmp_path, *run, f"run_name={name}"), **SIGNALLED)
    directory = tmp_path / f"out/bert-tiny/{name}/checkpoints"
    deadline = time.monotonic() + 300
    while not any(int(p.stem.split("step")[1]) > after for p in directory.glob(f"{first}*.ckpt")):
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.02)
    process.send_signal(signum)
    process.stderr_text = process.communicate(timeout=300)[1]
    return process


def test_two_stops_and_resumes_leave_one_last_checkpoint_the_newest(shared_runs):
    """Ctrl-C, resume, SIGTERM, resume to the end: the folder holds one `last.ckpt`, of the
    last step, no `-v1` copy beside it, and `ckpt=<run>` loads it. (The first stop comes before
    the first periodic checkpoint, so the state it resumes from names no `last.ckpt` yet: the
    case where Lightning wrote `last-v1.ckpt` and left the stale `last.ckpt` to be loaded.)"""
    from pipeline.checkpoint.source import resolve_checkpoint

    tmp_path, _ = shared_runs
    run = (
        *RUN,
        "checkpoint.every_n_steps=10",
        "trainer.val_check_interval=5",  # the first validation's best file: a step to stop at
        f"trainer.max_steps={STEPS}",
    )
    name = "twostops"
    stopped = signal_when_saved(tmp_path, run, name, signal.SIGINT, first="best-", after=0)
    assert stopped.returncode == 130, stopped.stderr_text[-3000:]
    first_stop = int(stopped.stderr_text.split("after step ")[1].split(";")[0])
    resumed = (*run, "resume=auto")
    again = signal_when_saved(
        tmp_path, resumed, name, signal.SIGTERM, first="step", after=first_stop
    )
    assert again.returncode == 143, again.stderr_text[-3000:]
    second_stop = int(again.stderr_text.split("after step ")[1].split(";")[0])
    assert first_stop < second_stop < STEPS
    assert again.stderr_text.split("; checkpoint ")[1].split(";")[0].endswith("/last.ckpt")
    done = run_pretrain(tmp_path, *resumed, f"run_name={name}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert resumed_step(done.stdout) == second_stop
    run_dir = tmp_path / f"out/bert-tiny/{name}"
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("last")] == ["last.ckpt"], names
    assert not [n for n in names if "-v" in n], names
    assert torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)["global_step"] == STEPS
    loaded = resolve_checkpoint(run_dir)
    assert loaded.path.name == "last.ckpt" and loaded.contents["global_step"] == STEPS


def test_every_damaged_file_is_moved_aside_once_and_the_kept_counts_hold(
    tmp_path, tmp_path_factory
):
    """A torn `last.ckpt` and a periodic file cut to 5 kB (too short to be mapped): resume=auto
    moves both aside and continues from the best file of that step; the run then keeps
    `keep_best` best files (the one it resumed from is dropped like any other) and `keep_last`
    periodic ones, and a later resume finds nothing damaged."""
    run = (
        *TEN_STEPS,  # a checkpoint and (debug=smoke) a validation every 5 steps
        "run_name=torn2",
        "trainer.val_check_interval=5",
        "checkpoint.keep_last=2",
        "checkpoint.keep_best=1",
    )
    # a copy of the session's run of those settings to step 10 (checkpoints at 5 and 10)
    continue_run(ten_step_run(tmp_path_factory), tmp_path, "torn2")
    checkpoints = tmp_path / "out/gpt-tiny/torn2/checkpoints"
    assert (checkpoints / "best-step0000010.ckpt").is_file()
    for name, size in (("last.ckpt", 100_000), ("step0000010.ckpt", 5_000)):
        (checkpoints / name).write_bytes((checkpoints / name).read_bytes()[:size])
    resumed = run_pretrain(tmp_path, *run, "trainer.max_steps=15", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert "best-step0000010.ckpt (step 10)" in resumed.stdout
    for name in ("last.ckpt", "step0000010.ckpt"):
        assert f"moved aside to {name}.damaged" in output
    names = sorted(p.name for p in checkpoints.iterdir())
    best = [n for n in names if n.startswith("best-")]
    assert best in (["best-step0000010.ckpt"], ["best-step0000015.ckpt"]), names
    assert [n for n in names if n.startswith("step")] == [
        "step0000005.ckpt",
        "step0000010.ckpt.damaged",
        "step0000015.ckpt",
    ]
    later = run_pretrain(tmp_path, *run, "trainer.max_steps=20", "resume=auto")
    assert later.returncode == 0, later.stderr[-3000:]
    assert "skipping" not in later.stdout + later.stderr
    assert len(list(checkpoints.glob("best-*.ckpt"))) == 1


def fake_clock_pretrain_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`run_pretrain` in this process on the clock of tests/pipeline/fake_clock_pretrain.py,
    ticking from 0 as in a process of its own."""
    with pytest.MonkeyPatch.context() as patched:
        fake_clock_pretrain.install(patched.setattr)
        return run_pretrain(tmp_path, *overrides)


def test_killed_run_with_a_time_budget_resumes_exactly(shared_runs):
    """trainer.budget: the plan made before the kill is in the checkpoint, and the resumed run
    makes the rest of it as the uninterrupted run did. A clock ticking once per step (one
    second a tick, tests/pipeline/fake_clock_pretrain.py) makes every run's decisions equal:
    a 25 s budget less the 3 steps' time it keeps free (more than its 3% margin) holds 22
    steps. The killed run is a process of its own on that clock; the reference and the
    resumed run run here on the same clock."""
    tmp_path, _ = shared_runs
    run = (*RUN, "trainer.budget=25s", "trainer.max_steps=1000")
    done = fake_clock_pretrain_run(tmp_path, *run, "run_name=budget-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    reference_dir = tmp_path / "out/bert-tiny/budget-reference"
    steps = max(train_losses(reference_dir))
    assert steps == 25 - TimeBudget.RESERVE_STEPS  # the plan, far below max_steps
    with open(reference_dir / "logs" / "metrics.csv") as handle:
        validated = [int(r["step"]) for r in csv.DictReader(handle) if r["val/loss"]]
    assert validated == [15, steps]  # every 15 steps, and the planned last one
    entry = {"entry": "tests.pipeline.fake_clock_pretrain"}
    process = interrupt_mid_run(tmp_path, run, "budget-killed", signal.SIGKILL, **entry)
    assert process.returncode == -signal.SIGKILL
    assert_resumes_exactly(
        tmp_path, run, "budget-killed", reference_dir, steps, pretrain=fake_clock_pretrain_run
    )


def test_killed_run_with_muon_resumes_exactly(shared_runs):
    """optim=muon: both optimizers' state (Muon's momentum, AdamW's moments) is in the
    checkpoint, so the resumed run continues exactly."""
    tmp_path, _ = shared_runs
    run = (*RUN, "optim=muon", f"trainer.max_steps={STEPS}")
    done = run_pretrain(tmp_path, *run, "run_name=muon-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    process = interrupt_mid_run(tmp_path, run, "muon-killed", signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    reference_dir = tmp_path / "out/bert-tiny/muon-reference"
    assert_resumes_exactly(tmp_path, run, "muon-killed", reference_dir)


def test_killed_run_with_counted_weights_resumes_exactly(shared_runs):
    """word_vectors=ppmi and output_bias=unigram: the counted weights are set once, before a
    fresh run's first step; a resumed run keeps its checkpoint's (setting them again would
    change every loss after the resume point)."""
    tmp_path, _ = shared_runs
    run = (*RUN, "word_vectors=ppmi", "output_bias=unigram", f"trainer.max_steps={STEPS}")
    done = run_pretrain(tmp_path, *run, "run_name=vectors-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    reference_dir = tmp_path / "out/bert-tiny/vectors-reference"
    log = (reference_dir / "pretrain.log").read_text()
    assert "token embeddings set from PPMI-SVD" in log and "output bias: the unigram" in log
    process = interrupt_mid_run(tmp_path, run, "vectors-killed", signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    assert_resumes_exactly(tmp_path, run, "vectors-killed", reference_dir)


def metric_column(run_dir: Path, name: str) -> dict[int, float]:
    """step -> `name` from the run's CSV log (the last row of a step wins)."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(handle) if r.get(name)}


def killed_and_resumed(tmp_path: Path, run: tuple[str, ...], name: str) -> tuple[Path, Path, int]:
    """Run `run` uninterrupted (`<name>-reference`) and again killed (SIGKILL) at its step-10
    checkpoint, then resumed (`<name>-killed`), which must end as the uninterrupted run did:
    (the reference's folder, the resumed run's folder, the step it resumed from)."""
    done = run_pretrain(tmp_path, *run, f"run_name={name}-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    reference_dir = tmp_path / f"out/bert-tiny/{name}-reference"
    process = interrupt_mid_run(tmp_path, run, f"{name}-killed", signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    start = assert_resumes_exactly(tmp_path, run, f"{name}-killed", reference_dir)
    return reference_dir, tmp_path / f"out/bert-tiny/{name}-killed", start


def test_killed_mixture_run_resumes_exactly_and_so_do_its_sources_counts(tmp_path):
    """data=<a mixture>: the resumed run logs every step's loss and every source's sequences,
    tokens and epochs as the uninterrupted run did; resuming with other weights is refused
    before anything is written."""
    mixture = write_two_source_mixture(tmp_path)
    run = (*RUN, *mixture, f"trainer.max_steps={STEPS}")
    reference_dir, run_dir, start = killed_and_resumed(tmp_path, run, "mixture")
    for source in ("alpha", "beta"):
        for figure in ("sequences", "tokens", "epochs"):
            name = f"data/{source}/{figure}"
            expected, got = metric_column(reference_dir, name), metric_column(run_dir, name)
            assert sorted(expected) == list(range(1, STEPS + 1))
            assert all(got[s] == expected[s] for s in range(start + 1, STEPS + 1)), name
        validated = metric_column(reference_dir, f"val/{source}/loss")
        assert sorted(validated) == VALIDATED
    alpha, beta = (
        metric_column(reference_dir, "data/alpha/sequences"),
        metric_column(reference_dir, "data/beta/sequences"),
    )
    assert abs(beta[STEPS] / (alpha[STEPS] + beta[STEPS]) - 0.3) < 0.01
    report = run_command("pipeline.commands.report", str(run_dir), "--out", str(tmp_path / "r"))
    assert report.returncode == 0, report.stderr[-2000:]
    assert {"sources_read.png", "sources_val_loss.png"} <= {
        p.name for p in (tmp_path / "r").iterdir()
    }
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    reweighted = (*RUN, *write_two_source_mixture(tmp_path, "{alpha: 0.5, beta: 0.5}"))
    refused = run_pretrain(
        tmp_path, *reweighted, "trainer.max_steps=60", "run_name=mixture-killed", "resume=auto"
    )
    assert refused.returncode != 0
    assert "add data.epochs=null 'data.weights={alpha: 0.7, beta: 0.3}'" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_a_mixture_resumed_on_an_edited_source_is_refused_until_the_file_is_back(tmp_path):
    """Two paragraphs of one source swapped after a checkpoint (the same size, tokens and
    batches, a new store): `resume=auto` refuses, naming the source and its file, before any
    step or checkpoint; with the file put back, as the message says, the run resumes."""
    run = (
        "model=gpt-tiny",
        "debug=smoke",
        "trainer.precision=32",
        "trainer.val_check_interval=2",
        "checkpoint.every_n_steps=2",
        "run_name=edited",
        *write_two_source_mixture(tmp_path),
    )
    first = run_pretrain(tmp_path, *run, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    alpha = tmp_path / "alpha.txt"
    original = alpha.read_text()
    paragraphs = original.rstrip("\n").split("\n\n")
    paragraphs[0], paragraphs[1] = paragraphs[1], paragraphs[0]
    alpha.write_text("\n\n".join(paragraphs) + "\n")
    assert alpha.stat().st_size == len(original.encode())
    checkpoints = tmp_path / "out/gpt-tiny/edited/checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())

    refused = run_pretrain(tmp_path, *run, "trainer.max_steps=6", "resume=auto")
    assert refused.returncode == 2, refused.stderr[-3000:]
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(
        f"error: cannot resume the data position: data.sources.alpha ({alpha}; fingerprint "
    )
    assert "Put the files and settings back as they were and resume again" in error
    assert "data position restored" not in refused.stdout + refused.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == before

    alpha.write_text(original)
    resumed = run_pretrain(tmp_path, *run, "trainer.max_steps=6", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "data position restored" in resumed.stdout


def test_killed_streamed_run_resumes_exactly(tmp_path):
    """datamodule.streaming=true with 2 loader workers (two readers, small blocks): the resumed
    run logs every step's loss as the uninterrupted one did and ends with the same weights."""
    stream = ("datamodule.streaming=true", "datamodule.num_workers=2")
    run = (*RUN, *stream, "datamodule.shuffle_buffer_mb=0.05", f"trainer.max_steps={STEPS}")
    done = run_pretrain(tmp_path, *run, "run_name=stream-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    reference_dir = tmp_path / "out/bert-tiny/stream-reference"
    process = interrupt_mid_run(tmp_path, run, "stream-killed", signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    assert_resumes_exactly(tmp_path, run, "stream-killed", reference_dir)


def test_killed_streamed_mixture_run_resumes_exactly_and_the_weights_fix_resumes(tmp_path):
    """data=<a mixture> datamodule.streaming=true, 2 loader workers (BERT; GPT's mixed stream
    keeps its readers' states in the same code): the resumed run logs every step's loss and
    every source's sequences and tokens as the uninterrupted one did, validates each source,
    and ends with the same weights; resuming with other weights is refused naming the
    overrides, which, pasted, resume it."""
    stream = ("datamodule.streaming=true", "datamodule.num_workers=2")
    stream += ("datamodule.shuffle_buffer_mb=0.05",)
    run = (*RUN, *stream, *write_two_source_mixture(tmp_path), f"trainer.max_steps={STEPS}")
    reference_dir, run_dir, start = killed_and_resumed(tmp_path, run, "mixed")
    for source in ("alpha", "beta"):
        for figure in ("sequences", "tokens"):
            name = f"data/{source}/{figure}"
            expected, got = metric_column(reference_dir, name), metric_column(run_dir, name)
            assert sorted(expected) == list(range(1, STEPS + 1))
            assert all(got[s] == expected[s] for s in range(start + 1, STEPS + 1)), name
        assert sorted(metric_column(reference_dir, f"val/{source}/loss")) == VALIDATED
    reweighted = (*RUN, *stream, *write_two_source_mixture(tmp_path, "{alpha: 0.5, beta: 0.5}"))
    more = ("trainer.max_steps=22", "run_name=mixed-killed", "resume=auto")
    refused = run_pretrain(tmp_path, *reweighted, *more)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    [fix] = re.findall(r"\(add (.*?)\);", refused.stderr)
    assert fix == "data.epochs=null 'data.weights={alpha: 0.7, beta: 0.3}'"
    pasted = run_pretrain(tmp_path, *reweighted, *more, *shlex.split(fix))
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert resumed_step(pasted.stdout) == STEPS
    assert sorted(metric_column(run_dir, "data/beta/sequences"))[-2:] == [21, 22]


def test_rerun_without_resume_refuses_to_overwrite_and_incompatible_config_is_named(
    tmp_path, tmp_path_factory
):
    # a copy of the session's `make pretrain model=bert-tiny debug=smoke`
    copy_run(smoke_run(tmp_path_factory, "bert-tiny"), tmp_path / "out/bert-tiny/one")
    again = run_pretrain(tmp_path, "model=bert-tiny", "debug=smoke", "run_name=one")
    assert again.returncode == 2
    assert "already has checkpoints" in again.stderr and "resume=auto" in again.stderr

    wider = run_pretrain(
        tmp_path, "model=bert-tiny", "debug=smoke", "run_name=one", "resume=auto", "model.d_ff=256"
    )
    assert wider.returncode == 2
    assert "model.d_ff: checkpoint 512, this run 256" in wider.stderr


def test_final_checkpoint_and_validation_when_steps_are_not_a_multiple_of_the_intervals(
    tmp_path,
):
    result = run_pretrain(
        tmp_path,
        "model=gpt-tiny",
        "debug=smoke",
        "trainer.max_steps=7",
        "run_name=odd",
        "checkpoint.every_n_steps=5",
        "trainer.val_check_interval=5",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    directory = tmp_path / "out/gpt-tiny/odd/checkpoints"
    assert torch.load(directory / "last.ckpt", weights_only=True)["global_step"] == 7
    assert (directory / "step0000007.ckpt").is_file()
    with open(tmp_path / "out/gpt-tiny/odd/logs/metrics.csv") as handle:
        validated = [int(r["step"]) for r in csv.DictReader(handle) if r["val/loss"]]
    assert validated == [5, 7]  # the last step too, though 7 is no multiple of 5


def test_resuming_from_the_end_of_run_checkpoint_logs_the_next_steps(tmp_path, tmp_path_factory):
    """The end-of-run checkpoint is saved after Lightning counted the last batch; a run resumed
    from it must log steps 6, 7, 8 after a first run's 1-5 (steps done), not 7, 8, 9."""
    run = ("model=gpt-tiny", "debug=smoke", "run_name=ended", "logger=csv")
    # a copy of the session's `make pretrain model=gpt-tiny debug=smoke`: 5 steps, saved at the end
    run_dir = continue_run(smoke_run(tmp_path_factory, "gpt-tiny"), tmp_path, "ended")
    ended = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(ended, weights_only=True)["global_step"] == 5
    resumed = run_pretrain(tmp_path, *run, f"resume={ended}", "trainer.max_steps=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(run_dir / "logs" / "metrics.csv") as handle:
        steps = [int(r["step"]) for r in csv.DictReader(handle) if r["train/loss"]]
    assert steps == list(range(1, 9))


def test_a_resumed_run_trains_with_its_own_learning_rate(tmp_path, tmp_path_factory):
    """The checkpoint's optimizer state carries its learning rate; a run resumed with another
    `optim.lr` must train at that one (with a warning), the schedule going on from the step."""
    run = ("model=gpt-tiny", "debug=smoke", "logger=csv", "checkpoint.every_n_steps=100")
    # the end of the session's `make pretrain model=gpt-tiny debug=smoke` (5 steps), read only
    smoke = smoke_run(tmp_path_factory, "gpt-tiny")
    share_cache(smoke, tmp_path)
    ended = smoke.folder / "checkpoints/last.ckpt"
    peak = torch.load(ended, weights_only=True)["lr_schedulers"][0]["base_lrs"][0]

    def logged_lrs(name: str, *extra: str) -> tuple[dict[int, float], str]:
        result = run_pretrain(tmp_path, *run, f"run_name={name}", "trainer.max_steps=8", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(tmp_path / f"out/gpt-tiny/{name}/logs/metrics.csv") as handle:
            rows = csv.DictReader(handle)
            lrs = {int(r["step"]): float(r["train/lr"]) for r in rows if r["train/lr"]}
        return lrs, result.stdout + result.stderr  # Hydra logs to stdout

    same, same_log = logged_lrs("same", f"resume={ended}")
    halved, halved_log = logged_lrs("halved", f"resume={ended}", f"optim.lr={peak / 2}")
    fresh, _ = logged_lrs("fresh")  # 8 steps from scratch: the schedule the resumed runs follow
    assert sorted(halved) == sorted(same) == [6, 7, 8]
    for step in same:  # this run's 8-step schedule from the first resumed step on
        assert same[step] == pytest.approx(fresh[step])
        assert halved[step] == pytest.approx(same[step] / 2)
    assert "optimizer setting" not in same_log
    assert halved_log.count(f"optim.lr: {peak} -> {peak / 2}") == 1


def test_newest_checkpoint_skips_a_damaged_file(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    good = directory / "step0000005.ckpt"
    torch.save({"state_dict": {}, "global_step": 5}, good)
    best = directory / "best-step0000005.ckpt"  # saved later, after validation, same step
    torch.save({"state_dict": {}, "global_step": 5}, best)
    older = directory / "step0000003.ckpt"  # written last (e.g. copied), but an older step
    torch.save({"state_dict": {}, "global_step": 3}, older)
    damaged = directory / "step0000010.ckpt"
    damaged.write_bytes(b"not a checkpoint")
    assert newest_checkpoint(tmp_path).path == good
    assert newest_checkpoint(tmp_path / "elsewhere") is None


def test_check_compatible_lists_every_mismatched_field(small_docs, tmp_path):
    config = BertConfig.from_preset("tiny", vocab_size=1000)
    saved = {"model_config": CheckpointRecord.describe_model(config)}
    tokenizer = get_tokenizer(
        TokenizerSpec(kind="wordpiece", vocab_size=500), ListCorpus(small_docs), tmp_path
    )
    check_compatible(saved, config, tokenizer)  # no tokenizer saved: only the model is compared
    other = BertConfig.from_preset("tiny", vocab_size=1000, n_layers=3, d_ff=256)
    with pytest.raises(CheckpointLoadError) as err:
        check_compatible(saved, other, tokenizer)
    assert "model.n_layers: checkpoint 2, this run 3" in str(err.value)
    assert "model.d_ff: checkpoint 512, this run 256" in str(err.value)


def test_a_checkpoint_of_another_optimizer_names_the_recipe_it_trained_with(small_docs, tmp_path):
    """Resuming a run trained with AdamW under the fast recipe (Muon) would load AdamW's state
    into Muon: refused, naming the override that trains as the checkpoint did (for a checkpoint
    older than recipes, whose presets trained with AdamW, the reference recipe)."""
    config = BertConfig.from_preset("tiny", vocab_size=1000)
    tokenizer = get_tokenizer(
        TokenizerSpec(kind="wordpiece", vocab_size=500), ListCorpus(small_docs), tmp_path
    )
    muon = "pipeline.training.muon.MuonWithAdamW"
    before_recipes = {
        "model_config": CheckpointRecord.describe_model(config),
        "config": {"optim": {"_target_": "torch.optim.AdamW"}},
    }
    check_compatible(before_recipes, config, tokenizer, "torch.optim.AdamW")
    with pytest.raises(CheckpointLoadError) as err:
        check_compatible(before_recipes, config, tokenizer, muon)
    assert f"optim._target_: checkpoint torch.optim.AdamW, this run {muon}" in str(err.value)
    assert str(err.value).endswith("trained with: recipe=bert-reference")
    with_recipe = before_recipes | {
        "config": {"optim": {"_target_": muon}, "recipe": {"name": "bert-fast", "family": "bert"}}
    }
    with pytest.raises(CheckpointLoadError, match=r"trained with: recipe=bert-fast$"):
        check_compatible(with_recipe, config, tokenizer, "torch.optim.AdamW")
    # an optimizer chosen apart from the recipe (model=bert optim=adamw_bert) is named with it
    apart = before_recipes | {
        "config": {
            "optim": {"_target_": "torch.optim.AdamW"},
            "recipe": {"name": "bert-fast", "family": "bert"},
        }
    }
    with pytest.raises(CheckpointLoadError, match=r"with: recipe=bert-fast optim=adamw_bert$"):
        check_compatible(apart, config, tokenizer, muon)
    # before recipes, Muon was chosen on the AdamW presets (optim=muon)
    muon_before = before_recipes | {"config": {"optim": {"_target_": muon}}}
    with pytest.raises(CheckpointLoadError, match=r"with: recipe=bert-reference optim=muon_bert$"):
        check_compatible(muon_before, config, tokenizer, "torch.optim.AdamW")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("keep_best", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_keeps_exactly_keep_best_files_and_the_true_best(
    tmp_path, tmp_path_factory, keep_best
):
    """A periodic checkpoint is saved before its step's validation, so the best file that
    validation writes is newer than the state a resume starts from. The resumed run must still
    know it: `keep_best` best files in the end, the best validation losses of the whole run.
    (The resumed run trains at a tiny learning rate, so its validations tie with step 10's.)"""
    run = (*TEN_STEPS, "run_name=best", f"checkpoint.keep_best={keep_best}")
    if keep_best == 1:  # the session's ten-step run has the default keep_best=1: a copy of it
        continue_run(ten_step_run(tmp_path_factory), tmp_path, "best")
    else:
        first = run_pretrain(tmp_path, *run, "trainer.max_steps=10")
        assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_pretrain(tmp_path, *run, "trainer.max_steps=20", "resume=auto", "optim.lr=1e-12")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "out/gpt-tiny/best"
    losses = read_metrics(run_dir / "logs" / "metrics.csv")["val/loss"]
    assert sorted(losses) == [5, 10, 15, 20]
    kept = sorted((run_dir / "checkpoints").glob("best-*.ckpt"))
    assert len(kept) == keep_best, [p.name for p in kept]
    # the kept files are those of the keep_best lowest losses (the earliest of equal ones)
    expected = sorted(losses, key=lambda step: (losses[step], step))[:keep_best]
    assert sorted(int(p.stem.split("step")[1]) for p in kept) == sorted(expected)


def test_a_damaged_last_checkpoint_is_moved_aside_and_replaced(tmp_path, tmp_path_factory):
    """resume=auto falls back to the newest good checkpoint and the run ends with a good
    last.ckpt (the one `make generate ckpt=<run>` reads), the damaged file renamed, not lost."""
    run = (*TEN_STEPS, "run_name=torn")
    # a copy of the session's run of 10 steps, a checkpoint every 5
    continue_run(ten_step_run(tmp_path_factory), tmp_path, "torn")
    checkpoints = tmp_path / "out/gpt-tiny/torn/checkpoints"
    last = checkpoints / "last.ckpt"
    torn = last.read_bytes()[: last.stat().st_size // 2]
    last.write_bytes(torn)
    resumed = run_pretrain(tmp_path, *run, "trainer.max_steps=12", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the newest good checkpoint holds the same step 10 as the damaged last.ckpt
    assert resumed.stdout.split("resuming from ")[1].split()[0].endswith("/step0000010.ckpt")
    assert "moved aside to last.ckpt.damaged" in resumed.stdout + resumed.stderr
    assert (checkpoints / "last.ckpt.damaged").read_bytes() == torn
    assert torch.load(last, weights_only=True)["global_step"] == 12
    assert not list(checkpoints.glob("last-v*.ckpt"))


def test_a_refused_rerun_leaves_the_run_folder_byte_identical(tmp_path, tmp_path_factory):
    # a copy of the session's `make pretrain model=gpt-tiny debug=smoke`
    run_dir = copy_run(smoke_run(tmp_path_factory, "gpt-tiny"), tmp_path / "out/gpt-tiny/kept")
    before = folder_bytes(run_dir)
    assert ".hydra/config.yaml" in before and "pretrain.log" in before
    again = run_pretrain(
        tmp_path, "model=gpt-tiny", "debug=smoke", "run_name=kept", "logger=csv", "optim.lr=0.5"
    )
    assert again.returncode == 2 and "already has checkpoints" in again.stderr
    assert folder_bytes(run_dir) == before


def test_a_resumed_attempt_keeps_the_first_record_and_writes_its_own_apart(
    tmp_path, tmp_path_factory
):
    run = ("model=gpt-tiny", "debug=smoke", "run_name=twice", "logger=csv")
    # a copy of the session's `make pretrain model=gpt-tiny debug=smoke`
    run_dir = copy_run(smoke_run(tmp_path_factory, "gpt-tiny"), tmp_path / "out/gpt-tiny/twice")
    record = (run_dir / ".hydra" / "config.yaml").read_bytes()
    refused = run_pretrain(tmp_path, *run, "resume=auto", "model.d_ff=256")
    assert refused.returncode == 2 and "model.d_ff" in refused.stderr
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == record
    [attempt] = (run_dir / ".hydra").glob("resume-*/overrides.yaml")
    assert "model.d_ff=256" in attempt.read_text()


@pytest.mark.parametrize("name", ["../escape", "a/b", ".."])
def test_a_run_name_that_is_not_one_folder_is_refused_before_anything_is_written(tmp_path, name):
    result = run_pretrain(tmp_path, "model=gpt-tiny", "debug=smoke", f"run_name={name}")
    assert result.returncode == 2 and f"run_name={name!r} is not a folder name" in result.stderr
    assert not (tmp_path / "out").exists()  # no folder made, inside outputs or out of it


def test_resume_auto_stops_when_no_checkpoint_can_be_read(tmp_path):
    """Rather than start a run over in its own folder when every checkpoint is damaged."""
    from pipeline.checkpoint.source import resolve_resume
    from pipeline.run.errors import ConfigError

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"torn")
    (checkpoints / "step0000005.ckpt").write_bytes(b"torn too")
    with pytest.raises(ConfigError, match="none of the checkpoints .* can be read"):
        resolve_resume("auto", tmp_path)
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt.damaged",
        "step0000005.ckpt.damaged",
    ]
    assert resolve_resume("auto", tmp_path) is None  # told once; the folder starts afresh
    (checkpoints / "step0000005.ckpt").write_bytes(b"torn")
    with pytest.raises(ConfigError):
        resolve_resume("auto", tmp_path, first_process=False)
    assert (checkpoints / "step0000005.ckpt").exists()  # only the first process moves files


@pytest.mark.parametrize("kind", ["glue", "blimp"])
def test_probes_change_nothing_and_a_probed_run_resumes_exactly(shared_runs, kind):
    """probe=glue (pipeline/pretrain/probe.py) and probe=blimp (blimp_probe.py): a run with
    probes every 5 steps, killed and resumed, ends exactly as the uninterrupted run without
    probes: the probes consume no random numbers of training and read no training data."""
    tmp_path, reference = shared_runs
    if kind == "glue":
        probe, column = probe_overrides(write_probe_tasks(tmp_path / "probe-data")), None
    else:
        blimp = write_blimp(tmp_path / "blimp-data")
        probe, column = (
            ["probe=blimp", f"probe.blimp.dir={blimp}", "probe.blimp.pairs=2"],
            "probe/blimp",
        )
    run = (*RUN, f"trainer.max_steps={STEPS}", *probe, "probe.every_n_steps=5")
    name = f"probed-{kind}-killed"
    process = interrupt_mid_run(tmp_path, run, name, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    start = assert_resumes_exactly(tmp_path, run, name, reference(1))
    logged = probe_steps(tmp_path / "out/bert-tiny" / name, *([column] if column else []))
    assert {0, start + 5 - start % 5, STEPS} <= set(logged)


PHASES = (
    "objective.phases=[{share:0.5},{share:0.5,seq_len:256,batch_size:4,max_predictions_per_seq:40}]"
)


def test_a_phased_run_resumes_exactly_before_at_and_after_its_switch(shared_runs):
    """objective.phases: 10 of 20 steps at 128 tokens, then 256. Runs resumed from the
    reference's checkpoints at step 5 (phase 0), 10 (the switch) and 15 (phase 1) continue
    exactly as it did; the checkpoints record the longest length trained so far."""
    tmp_path, _ = shared_runs
    run = (*RUN, PHASES, f"trainer.max_steps={STEPS}", "checkpoint.keep_last=10")
    done = run_pretrain(tmp_path, *run, "run_name=phased-reference")
    assert done.returncode == 0, done.stderr[-3000:]
    reference_dir = tmp_path / "out/bert-tiny/phased-reference"
    saved = {
        step: torch.load(reference_dir / f"checkpoints/step{step:07d}.ckpt", weights_only=True)
        for step in (5, 10, 15)
    }
    assert [saved[s]["trained_seq_len"] for s in (5, 10, 15)] == [128, 128, 256]
    assert [saved[s]["PretrainDataModule"]["phase"] for s in (5, 10, 15)] == [0, 0, 1]
    expected = train_losses(reference_dir)
    reference_final = torch.load(reference_dir / "checkpoints/last.ckpt", weights_only=True)
    for start in (5, 10, 15):
        name = f"phased-from-{start}"
        checkpoint = reference_dir / f"checkpoints/step{start:07d}.ckpt"
        resumed = run_pretrain(tmp_path, *run, f"run_name={name}", f"resume={checkpoint}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        got = train_losses(tmp_path / f"out/bert-tiny/{name}")
        assert sorted(got) == list(range(start + 1, STEPS + 1))
        assert all(got[step] == expected[step] for step in got), start
        final = torch.load(
            tmp_path / f"out/bert-tiny/{name}/checkpoints/last.ckpt", weights_only=True
        )
        weights, reference_weights = final["state_dict"], reference_final["state_dict"]
        assert all(torch.equal(weights[k], reference_weights[k]) for k in reference_weights)


def test_a_resumed_checkpoint_with_a_damaged_tokenizer_is_named(tmp_path):
    cfg = compose_pretrain("model=bert-tiny", f"paths.output_dir={tmp_path}")
    contents = {
        "config": OmegaConf.to_container(cfg, resolve=True),  # the same tokenizer and data
        "tokenizer": {"kind": "wordpiece", "json": "{not json"},
    }
    resumed = CheckpointSource(tmp_path / "last.ckpt", contents)
    with pytest.raises(CheckpointLoadError, match=r"last\.ckpt: the stored tokenizer cannot be"):
        resumed_tokenizer(resumed, cfg)
    del contents["tokenizer"]["json"]
    with pytest.raises(CheckpointLoadError, match=r"last\.ckpt: tokenizer\['json'\] is missing"):
        resumed_tokenizer(CheckpointSource(tmp_path / "last.ckpt", contents), cfg)

"""The ends of a pretraining run that are not its planned end, through the real command: a
finished run given `resume=auto` again, a kill during the end-of-run Hugging Face export, a
second Ctrl-C, a full disk; and the partial files a killed checkpoint save leaves."""

from __future__ import annotations

import errno
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from models.hf import export_hf
from pipeline.checkpoint.load import load_pretrained
from pipeline.checkpoint.source import CheckpointSource, resolve_resume
from pipeline.checkpoint.space import disk_full_error
from pipeline.pretrain.budget import RunLength
from pipeline.pretrain.run import ended_by, refuse_another_runs_end, report_ended
from pipeline.run.errors import ConfigError, DiskFullError
from tests.conftest import CLI_ENV, REPO, run_pretrain

GPT_RUN = ("model=gpt-tiny", "debug=smoke", "logger=csv", "checkpoint.every_n_steps=5")
FINISHED_AT = 3  # at or below checkpoint.every_n_steps: the run's first save is its last


def files_of(folder: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file under `folder`: (bytes, mtime in ns, mode)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            info = path.stat()
            found[str(path.relative_to(folder))] = (
                path.read_bytes(),
                info.st_mtime_ns,
                info.st_mode,
            )
    return found


def pasted(stderr: str) -> subprocess.CompletedProcess:
    """The command after "continue with: " on the last line of `stderr`, run by a shell as a
    user pastes it."""
    command = stderr.strip().splitlines()[-1].split("continue with: ")[1]
    assert command.startswith("make pretrain ") and command.endswith(" resume=auto"), command
    return subprocess.run(
        command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=600, env=CLI_ENV
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A gpt-tiny run finished at step FINISHED_AT (its first and only save), exported; tests
    take copies of it (`copy_of_finished`), sharing its cache (tokenizer and token store)."""
    base = tmp_path_factory.mktemp("finished")
    done = run_pretrain(base, *GPT_RUN, f"trainer.max_steps={FINISHED_AT}", "run_name=done")
    assert done.returncode == 0, done.stderr[-3000:]
    return base


def copy_of_finished(finished_run: Path, name: str) -> Path:
    shutil.copytree(finished_run / "out/gpt-tiny/done", finished_run / f"out/gpt-tiny/{name}")
    return finished_run / f"out/gpt-tiny/{name}"


def test_resume_auto_on_a_finished_run_says_so_changes_nothing_and_exports_what_is_missing(
    finished_run,
):
    run_dir = copy_of_finished(finished_run, "again")
    run = (*GPT_RUN, f"trainer.max_steps={FINISHED_AT}", "run_name=again", "resume=auto")
    # what an attempt writes anyway: its config record and its log
    attempt = (".hydra", "pretrain.log", ".run.lock")
    before = {k: v for k, v in files_of(run_dir).items() if not k.startswith(attempt)}
    again = run_pretrain(finished_run, *run)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout.strip().splitlines()[-1]
    assert said.startswith(f"the run in {run_dir} has finished: step {FINISHED_AT} ")
    assert f"checkpoint {run_dir}/checkpoints/step0000003.ckpt" in said
    assert f"HF export {run_dir}/hf." in said and "written again" not in said
    assert "Traceback" not in again.stderr
    after = {k: v for k, v in files_of(run_dir).items() if not k.startswith(attempt)}
    assert after == before  # nothing trained, logged, saved or exported again

    exported = {k: v[0] for k, v in before.items() if k.startswith("hf/")}
    shutil.rmtree(run_dir / "hf")
    again = run_pretrain(finished_run, *run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(written again from the checkpoint: it was missing)" in again.stdout
    files = files_of(run_dir)
    assert {k: v[0] for k, v in files.items() if k.startswith("hf/")} == exported
    assert {oct(v[2] & 0o777) for k, v in files.items() if k.startswith("hf/")} == {"0o644"}


def test_a_kill_during_the_export_keeps_the_previous_one_and_resume_auto_completes_it(
    finished_run,
):
    run_dir = copy_of_finished(finished_run, "cut")
    previous = files_of(run_dir / "hf")
    run = (*GPT_RUN, "trainer.max_steps=5", "run_name=cut", "resume=auto")
    killed = run_pretrain(finished_run, *run, entry="tests.pipeline.killed_export_pretrain")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert files_of(run_dir / "hf") == previous  # the step-3 export, whole and untouched
    assert list(run_dir.glob(".hf.staged-*"))  # the killed export's half, beside it
    last = run_dir / "checkpoints" / "last.ckpt"
    saved = last.stat().st_mtime_ns
    assert torch.load(last, weights_only=True)["global_step"] == 5

    again = run_pretrain(finished_run, *run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished: step 5 (trainer.max_steps=5)" in again.stdout
    assert "written again from the checkpoint: it did not match it" in again.stdout
    assert not list(run_dir.glob(".hf.staged-*"))
    assert last.stat().st_mtime_ns == saved
    # the export of the step-5 checkpoint, whole
    final = load_pretrained(last)
    expected = export_hf(final.model, run_dir.parent / "expected", tokenizer=final.tokenizer)
    assert {k: v[0] for k, v in files_of(run_dir / "hf").items()} == {
        k: v[0] for k, v in files_of(expected).items()
    }
    assert files_of(run_dir / "hf").keys() == previous.keys()
    assert files_of(run_dir / "hf")["model.safetensors"][0] != previous["model.safetensors"][0]


def test_a_second_ctrl_c_aborts_and_says_the_command_that_continues(finished_run):
    run = (*GPT_RUN, "trainer.max_steps=4", "run_name=impatient")
    aborted = run_pretrain(finished_run, *run, entry="tests.pipeline.ctrl_c_twice_pretrain")
    assert aborted.returncode == 130, aborted.stderr[-3000:]
    assert "Traceback" not in aborted.stderr
    last = aborted.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "stopped by SIGINT again before the step ended; no checkpoint saved: resume=auto "
        "continues from the run's newest (if any); continue with: make pretrain "
    )
    assert not list((finished_run / "out/gpt-tiny/impatient/checkpoints").glob("*.ckpt"))
    resumed = pasted(aborted.stderr)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "finished 4 steps" in resumed.stdout


def test_remove_partial_saves_on_resume_keeps_every_complete_checkpoint(tmp_path, caplog):
    """A kill during a save leaves its temporary file (empty, or cut short) beside the
    checkpoints; the run's next start removes it, and only it."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    complete = checkpoints / "step0000005.ckpt"
    torch.save({"state_dict": {}, "global_step": 5}, complete)
    shutil.copy(complete, checkpoints / "last.ckpt")
    empty = checkpoints / ".last.ckpt.k1ll3d0.tmp"
    empty.touch()
    cut = checkpoints / ".step0000010.ckpt.x7y8z9q.tmp"
    cut.write_bytes(complete.read_bytes()[:100])
    other = checkpoints / "notes.tmp"  # not a save's: left alone
    other.write_text("mine")
    with caplog.at_level("INFO"):
        assert resolve_resume("auto", tmp_path, first_process=False).path == complete
    assert empty.exists() and cut.exists()  # only the run's first process removes files
    with caplog.at_level("INFO"):
        assert resolve_resume("auto", tmp_path).path == complete
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "last.ckpt",
        "notes.tmp",
        "step0000005.ckpt",
    ]
    assert f"removing {cut}, a checkpoint save interrupted before it was complete" in caplog.text


@pytest.fixture
def small_disk(tmp_path):
    """A 14 MB tmpfs at tmp_path/disk (root may mount one; skipped where the test cannot)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=14m", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_during_a_save_ends_with_one_line_and_the_pasted_command_continues(
    small_disk, finished_run
):
    """Two gpt-tiny checkpoints (step 5 and last.ckpt, 5.8 MB each) fit in 14 MB, a third
    (step 10) does not."""
    run = (
        *GPT_RUN,
        "trainer.max_steps=10",
        "checkpoint.keep_best=0",
        f"paths.output_root={small_disk}",
        "run_name=full",
    )
    full = run_pretrain(finished_run, *run)
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr and "iostream" not in full.stderr
    said = full.stderr.strip().splitlines()[-1]
    assert said.startswith(f"error: no space left on {small_disk} (tmpfs) to save ")
    assert "step0000010.ckpt at step 10: it needs about 5." in said
    assert "its newest complete checkpoint, step0000005.ckpt (step 5), is intact" in said
    checkpoints = small_disk / "gpt-tiny/full/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step0000005.ckpt"]

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = pasted(full.stderr)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 10


def test_a_checkpoint_at_its_runs_end_is_told_from_one_with_steps_left():
    def source(step: int, planned: int | None = None) -> CheckpointSource:
        budget = {"TimeBudget": {"pace": {"planned": planned}}} if planned else {}
        return CheckpointSource(Path("x.ckpt"), {"global_step": step, "callbacks": budget})

    assert ended_by(source(19), RunLength(20)) is None
    assert ended_by(source(20), RunLength(20)) == "trainer.max_steps=20"
    assert ended_by(source(25), RunLength(20)) == "trainer.max_steps=20"  # a shorter max_steps
    # a budgeted run ends where its budget planned, before trainer.max_steps
    ended = ended_by(source(7, planned=7), RunLength(20, budget_s=60.0))
    assert ended == "the last step its trainer.budget planned"
    assert ended_by(source(7, planned=9), RunLength(20, budget_s=60.0)) is None
    assert ended_by(source(7, planned=7), RunLength(20)) is None  # resumed without the budget


def test_a_failed_save_is_told_a_full_disk_only_when_it_was_one(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    path = checkpoints / "step0000010.ckpt"
    checkpoint = {"global_step": 10, "state_dict": {"w": torch.zeros(250_000)}}  # 1 MB
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    assert disk_full_error(path, checkpoint, torn, free=10**9) is None  # another failure
    full = disk_full_error(path, checkpoint, torn, free=300_000)
    assert isinstance(full, DiskFullError)
    assert str(full).startswith("no space left on /")
    assert "to save step0000010.ckpt at step 10: it needs about 1.0 MB, 0.3 MB were free" in str(
        full
    )
    assert "there is no earlier checkpoint of the run (resuming starts it afresh)" in str(full)

    torch.save({"state_dict": {}, "global_step": 5}, checkpoints / "step0000005.ckpt")
    quota = disk_full_error(path, checkpoint, OSError(errno.EDQUOT, "quota"), free=10**9)
    assert str(quota).startswith("the disk quota is used up on /")
    assert "its newest complete checkpoint, step0000005.ckpt (step 5), is intact" in str(quota)


def test_a_finished_run_whose_export_holds_its_model_stages_no_copy(
    finished_run, monkeypatch, capsys
):
    """Whether hf/ holds the checkpoint's model is read from hf/ itself (its small files'
    bytes, its tensors one at a time): nothing model-sized is written to find out."""
    run_dir = copy_of_finished(finished_run, "checked")
    before = files_of(run_dir)
    staged = []
    mkdir = Path.mkdir

    def spy(self, *args, **kwargs):
        if self.name.startswith(".hf.staged-"):
            staged.append(self)
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", spy)
    resumed = resolve_resume("auto", run_dir)
    report_ended(resumed, ended_by(resumed, RunLength(FINISHED_AT)), run_dir, "gpt")
    assert staged == []
    assert files_of(run_dir) == before
    said = capsys.readouterr().out
    assert f"has finished: step {FINISHED_AT} " in said and "written again" not in said


def test_a_finished_run_whose_export_cannot_be_rewritten_for_want_of_space_says_so(
    finished_run, monkeypatch
):
    """A stale hf/ on a full disk: one error (the command prints it as one line, with the
    resume command, exit status 1), hf/ and the checkpoint as they were, nothing left beside."""
    run_dir = copy_of_finished(finished_run, "stale")
    config = run_dir / "hf" / "config.json"
    config.write_text(config.read_text() + " ")  # not the checkpoint's export any more
    before = files_of(run_dir)

    def full(tensors, filename, metadata=None):  # what safetensors raises on a full disk
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr("models.hf.save_file", full)
    resumed = resolve_resume("auto", run_dir)
    with pytest.raises(DiskFullError) as raised:
        report_ended(resumed, ended_by(resumed, RunLength(FINISHED_AT)), run_dir, "gpt")
    said = str(raised.value)
    assert said.startswith("no space left on /")
    assert (
        f"to write the Hugging Face export {run_dir}/hf again from the checkpoint (it did not match it"
        in said
    )
    assert f"the checkpoint {run_dir}/checkpoints/step0000003.ckpt (step 3) is intact" in said
    assert "\n" not in said
    assert files_of(run_dir) == before
    assert not list(run_dir.glob(".hf.staged-*"))


def test_the_end_of_another_run_is_refused_with_the_command_that_trains_it_further(tmp_path):
    own = tmp_path / "own"
    checkpoint = own / "checkpoints" / "step0000003.ckpt"
    resumed = CheckpointSource(checkpoint, {"global_step": 3}, str(checkpoint))
    refuse_another_runs_end(resumed, "trainer.max_steps=3", own)  # its own run: finished
    refuse_another_runs_end(resumed, "trainer.max_steps=3", tmp_path / "." / "own")
    with pytest.raises(ConfigError) as refused:
        refuse_another_runs_end(resumed, "trainer.max_steps=3", tmp_path / "new")
    said = str(refused.value)
    assert said.startswith(f"resume={checkpoint} is at step 3, already at trainer.max_steps=3")
    assert f"nothing to train into {tmp_path / 'new'}" in said
    assert said.endswith("make pretrain trainer.max_steps=6")


def test_resume_of_another_finished_run_is_refused_and_the_fix_pastes(finished_run):
    done = finished_run / "out/gpt-tiny/done"
    before = files_of(done)
    given = done / "checkpoints" / "step0000003.ckpt"
    run = (*GPT_RUN, f"trainer.max_steps={FINISHED_AT}", "run_name=onward", f"resume={given}")
    refused = run_pretrain(finished_run, *run)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr and "has finished" not in refused.stdout
    [said] = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert said.startswith(f"error: resume={given} is at step 3, already at trainer.max_steps=3")
    assert not (finished_run / "out/gpt-tiny/onward").exists()
    assert files_of(done) == before

    command = said.split("give a larger trainer.max_steps: ")[1]
    assert command.startswith("make pretrain ") and command.endswith(" trainer.max_steps=6")
    assert shlex.split(command).count("trainer.max_steps=6") == 1
    further = subprocess.run(
        command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=600, env=CLI_ENV
    )
    assert further.returncode == 0, further.stderr[-3000:]
    assert "finished 6 steps" in further.stdout
    assert files_of(done) == before
    trained = finished_run / "out/gpt-tiny/onward/checkpoints/last.ckpt"
    assert torch.load(trained, weights_only=True)["global_step"] == 6


def test_a_sweep_stopped_in_a_job_is_continued_in_its_folder_by_the_pasted_command(finished_run):
    """A sweep's job ends early: the command given continues the sweep in its own folder (the
    stopped job and the one after it), not a run of the job's overrides in a new folder."""
    sweep_dir = finished_run / "sweep"
    runs = finished_run / "out/gpt-tiny"
    before = sorted(runs.iterdir())
    sweep = (*GPT_RUN, "trainer.max_steps=4", "seed=1,2", f"hydra.sweep.dir={sweep_dir}", "-m")
    aborted = run_pretrain(finished_run, *sweep, entry="tests.pipeline.ctrl_c_twice_pretrain")
    assert aborted.returncode == 130, aborted.stderr[-3000:]
    last = aborted.stderr.strip().splitlines()[-1]
    assert " seed=1,2 " in last and last.endswith(f"hydra.sweep.dir={sweep_dir} resume=auto")
    assert not (sweep_dir / "1").exists()
    resumed = pasted(aborted.stderr)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for job in ("0", "1"):
        last_save = torch.load(sweep_dir / job / "checkpoints/last.ckpt", weights_only=True)
        assert last_save["global_step"] == 4, job
    assert sorted(runs.iterdir()) == before  # no run of its own for the job

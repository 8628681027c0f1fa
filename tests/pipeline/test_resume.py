"""Checkpoints and exact resume: a training process killed with SIGKILL and resumed with
`resume=auto` logs, at every step after the resume point, the loss the uninterrupted run logged,
and ends with the same weights."""

from __future__ import annotations

import csv
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from models.config import BertConfig
from pipeline.checkpoints import (
    check_compatible,
    model_config_record,
    newest_checkpoint,
)
from pipeline.load import CheckpointLoadError
from tests.conftest import CLI_ENV, REPO, ListCorpus, pretrain_command, run_pretrain
from tokenizer import TokenizerSpec, get_tokenizer

# bert-tiny has dropout, so the RNG state must be restored too; 40 optimizer steps with a
# checkpoint every 5 leave time to kill the process mid-run.
RUN = (
    "model=bert-tiny",
    "objective.batch_size=8",
    "trainer.val_check_interval=20",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=5",
)
STEPS = 40


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss from the run's CSV log (the last row of a step wins)."""
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return {
            int(r["step"]): float(r["train/loss"])
            for r in csv.DictReader(handle)
            if r["train/loss"]
        }


def wait_for_checkpoint(process: subprocess.Popen, directory: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while not (directory / f"step{step:07d}.ckpt").exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 300 s"
        time.sleep(0.02)


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["plain", "accumulating"])
def test_killed_run_resumes_exactly(tmp_path, micro_batches):
    run = (*RUN, f"trainer.accumulate_grad_batches={micro_batches}", f"trainer.max_steps={STEPS}")
    reference = run_pretrain(tmp_path, *run, "run_name=reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = train_losses(tmp_path / "out/bert-tiny/reference")
    assert sorted(expected) == list(range(STEPS))
    kept = sorted(p.name for p in (tmp_path / "out/bert-tiny/reference/checkpoints").iterdir())
    # the last 2 periodic ones, last.ckpt, and the 1 best by validation loss (step 20 or 40)
    assert [k for k in kept if not k.startswith("best-")] == [
        "last.ckpt",
        "step0000035.ckpt",
        "step0000040.ckpt",
    ]
    assert len([k for k in kept if k.startswith("best-")]) == 1

    run_dir = tmp_path / "out/bert-tiny/killed"
    process = subprocess.Popen(
        pretrain_command(tmp_path, *run, "run_name=killed"),
        cwd=REPO,
        env=CLI_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_checkpoint(process, run_dir / "checkpoints", 10)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL  # killed mid-run, not finished

    before = {p.name for p in (run_dir / "checkpoints").iterdir()}
    resumed = run_pretrain(tmp_path, *run, "run_name=killed", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    start = torch.load(resumed.stdout.split("resuming from ")[1].split()[0], weights_only=True)[
        "global_step"
    ]
    assert 10 <= start < STEPS and start % 5 == 0
    # Only whole steps are saved: nothing new right after resuming (e.g. mid-step).
    new = {p.name for p in (run_dir / "checkpoints").iterdir()} - before
    assert f"step{start:07d}-v1.ckpt" not in new

    got = train_losses(run_dir)
    assert sorted(s for s in got if s >= start) == list(range(start, STEPS))
    for step in range(start, STEPS):  # CPU kernels here are deterministic: equal, not close
        assert got[step] == expected[step], (step, got[step], expected[step])

    final = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)["state_dict"]
    reference_final = torch.load(
        tmp_path / "out/bert-tiny/reference/checkpoints/last.ckpt", weights_only=True
    )["state_dict"]
    assert final.keys() == reference_final.keys()
    assert all(torch.equal(final[k], reference_final[k]) for k in final)


def test_rerun_without_resume_refuses_to_overwrite_and_incompatible_config_is_named(tmp_path):
    first = run_pretrain(tmp_path, "model=bert-tiny", "debug=smoke", "run_name=one")
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_pretrain(tmp_path, "model=bert-tiny", "debug=smoke", "run_name=one")
    assert again.returncode == 2
    assert "already has checkpoints" in again.stderr and "resume=auto" in again.stderr

    wider = run_pretrain(
        tmp_path, "model=bert-tiny", "debug=smoke", "run_name=one", "resume=auto", "model.d_ff=256"
    )
    assert wider.returncode == 2
    assert "model.d_ff: checkpoint 512, this run 256" in wider.stderr


def test_final_checkpoint_is_written_when_steps_are_not_a_multiple_of_the_interval(tmp_path):
    result = run_pretrain(
        tmp_path,
        "model=gpt-tiny",
        "debug=smoke",
        "trainer.max_steps=7",
        "run_name=odd",
        "checkpoint.every_n_steps=5",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    directory = tmp_path / "out/gpt-tiny/odd/checkpoints"
    assert torch.load(directory / "last.ckpt", weights_only=True)["global_step"] == 7
    assert (directory / "step0000007.ckpt").is_file()


def test_resuming_from_the_end_of_run_checkpoint_logs_the_next_steps(tmp_path):
    """The end-of-run checkpoint is saved after Lightning counted the last batch; a run resumed
    from it must log steps 5, 6, 7 after a first run's 0-4, not 6, 7, 8."""
    run = ("model=gpt-tiny", "debug=smoke", "run_name=ended", "logger=csv")
    first = run_pretrain(tmp_path, *run, "trainer.max_steps=5", "checkpoint.every_n_steps=100")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "out/gpt-tiny/ended"
    ended = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(ended, weights_only=True)["global_step"] == 5
    resumed = run_pretrain(tmp_path, *run, f"resume={ended}", "trainer.max_steps=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(run_dir / "logs" / "metrics.csv") as handle:
        steps = [int(r["step"]) for r in csv.DictReader(handle) if r["train/loss"]]
    assert steps == list(range(8))


def test_a_resumed_run_trains_with_its_own_learning_rate(tmp_path):
    """The checkpoint's optimizer state carries its learning rate; a run resumed with another
    `optim.lr` must train at that one (with a warning), the schedule going on from the step."""
    run = ("model=gpt-tiny", "debug=smoke", "logger=csv", "checkpoint.every_n_steps=100")
    first = run_pretrain(tmp_path, *run, "run_name=first", "trainer.max_steps=5")
    assert first.returncode == 0, first.stderr[-3000:]
    ended = tmp_path / "out/gpt-tiny/first/checkpoints/last.ckpt"
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
    assert sorted(halved) == sorted(same) == [5, 6, 7]
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
    assert newest_checkpoint(tmp_path) == good
    assert newest_checkpoint(tmp_path / "elsewhere") is None


def test_check_compatible_lists_every_mismatched_field(small_docs, tmp_path):
    config = BertConfig.from_preset("tiny", vocab_size=1000)
    saved = {"model_config": model_config_record(config)}
    tokenizer = get_tokenizer(
        TokenizerSpec(kind="wordpiece", vocab_size=500), ListCorpus(small_docs), tmp_path
    )
    check_compatible(saved, config, tokenizer)  # no tokenizer saved: only the model is compared
    other = BertConfig.from_preset("tiny", vocab_size=1000, n_layers=3, d_ff=256)
    with pytest.raises(CheckpointLoadError) as err:
        check_compatible(saved, other, tokenizer)
    assert "model.n_layers: checkpoint 2, this run 3" in str(err.value)
    assert "model.d_ff: checkpoint 512, this run 256" in str(err.value)

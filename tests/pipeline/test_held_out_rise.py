"""A pretraining run whose held-out loss ended above its lowest says so at the end, and names the
kept best checkpoint (`ckpt=<run>` loads the last one). The held-out loss is the language
model's: BERT's best checkpoints are kept by its masked-LM loss, not by MLM + NSP."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pipeline.pretrain.modules import BertPretraining, GPTPretraining
from pipeline.pretrain.run import HELD_OUT_ROSE_BY, held_out_rise
from pipeline.report import read_metrics
from tests.conftest import run_pretrain
from tests.pipeline.resume_first_runs import TEN_STEPS, continue_run, ten_step_run
from tests.pipeline.smoke_runs import smoke_run


def trainer_with_best(path: str, score: float | None, monitor: str = "val/loss"):
    best = SimpleNamespace(
        monitor=monitor,
        filename="step{step:07d}" if monitor == "step" else "best-step{step:07d}",
        best_model_path=path,
        best_model_score=None if score is None else torch.tensor(score),
    )
    periodic = SimpleNamespace(
        monitor="step", filename="step{step:07d}", best_model_path="step9.ckpt", best_model_score=9
    )
    return SimpleNamespace(checkpoint_callbacks=[periodic, best])


def test_a_loss_within_the_margin_of_its_lowest_says_nothing():
    trainer = trainer_with_best("/run/checkpoints/best-step0000200.ckpt", 4.0)
    assert held_out_rise(trainer, {"val/loss": 4.0}) is None
    assert held_out_rise(trainer, {"val/loss": 4.0 * (1 + HELD_OUT_ROSE_BY) - 1e-6}) is None
    assert held_out_rise(trainer, {}) is None  # the run never validated


def test_a_loss_above_its_lowest_names_the_best_checkpoint():
    trainer = trainer_with_best("/run/checkpoints/best-step0000200.ckpt", 4.0)
    said = held_out_rise(trainer, {"val/loss": 5.0})
    assert said is not None
    assert "held-out loss (val/loss) rose 25% above its lowest" in said
    assert "4 at best-step0000200.ckpt, 5 at the end" in said
    assert "ckpt=/run/checkpoints/best-step0000200.ckpt" in said
    assert said.endswith("a run as long as its best: trainer.max_steps=200")
    # a best checkpoint under a name the run did not write (a copy a resume took in)
    copy = trainer_with_best("/run/checkpoints/best-step0000200-copy.ckpt", 4.0)
    said = held_out_rise(copy, {"val/loss": 5.0})
    assert said is not None and said.endswith("or a shorter run (trainer.max_steps)")


def test_the_figure_checked_is_the_one_the_best_checkpoints_are_kept_by():
    """BERT's: the masked-LM loss. Its total held-out loss (MLM + NSP) may rise with the
    next-sentence loss while the masked LM still learns (BERT mini's hour on the books)."""
    assert GPTPretraining.held_out_figure() == "val/loss"
    assert BertPretraining.held_out_figure() == "val/mlm_loss"
    trainer = trainer_with_best("/run/checkpoints/best-step0000200.ckpt", 3.6, "val/mlm_loss")
    assert held_out_rise(trainer, {"val/loss": 9.0, "val/mlm_loss": 3.5}) is None
    said = held_out_rise(trainer, {"val/loss": 4.0, "val/mlm_loss": 4.5})
    assert said is not None and "held-out loss (val/mlm_loss) rose 25%" in said


def test_without_a_kept_best_checkpoint_nothing_is_said():
    assert held_out_rise(trainer_with_best("", None), {"val/loss": 9.0}) is None  # keep_best=0
    periodic_only = trainer_with_best("x.ckpt", 1.0, monitor="step")
    assert held_out_rise(periodic_only, {"val/loss": 9.0}) is None


def test_a_bert_run_keeps_its_best_checkpoint_by_its_masked_lm_loss(tmp_path_factory):
    run = smoke_run(tmp_path_factory, "bert-tiny")
    logged = read_metrics(run.folder / "logs" / "metrics.csv")
    (best,) = (run.folder / "checkpoints").glob("best-step*.ckpt")
    states = torch.load(best, weights_only=True)["callbacks"]
    (kept_by,) = [s for key, s in states.items() if "'monitor': 'val/mlm_loss'" in key]
    step = int(best.stem.removeprefix("best-step"))
    assert float(kept_by["current_score"]) == torch.tensor(logged["val/mlm_loss"][step]).item()
    assert logged["val/loss"][step] > logged["val/mlm_loss"][step]  # the NSP loss is not in it


def test_a_bert_run_that_kept_its_best_by_the_total_loss_resumes_by_the_masked_lm_loss(
    tmp_path, tmp_path_factory
):
    """A BERT run from before the masked-LM loss kept its best files by val/loss: resumed now,
    they cannot be ranked against val/mlm_loss, so they stay on disk, not counted, and the run
    says so once (Lightning does not ask for the old callback back)."""
    run = smoke_run(tmp_path_factory, "bert-tiny")
    folder = continue_run(run, tmp_path, "older")
    new = ModelCheckpoint(monitor="val/mlm_loss", mode="min")
    old = ModelCheckpoint(monitor="val/loss", mode="min")
    for path in (folder / "checkpoints").glob("*.ckpt"):  # as a run before 238be54 saved them
        contents = torch.load(path, weights_only=True)
        state = contents["callbacks"].pop(
            new.state_key.replace("ModelCheckpoint", "StepCheckpoint")
        )
        contents["callbacks"][old.state_key.replace("ModelCheckpoint", "StepCheckpoint")] = {
            **state,
            "monitor": "val/loss",
        }
        torch.save(contents, path)
    (older_best,) = (folder / "checkpoints").glob("best-step*.ckpt")
    resumed = run_pretrain(
        tmp_path,
        "model=bert-tiny",
        "debug=smoke",
        "run_name=older",
        "resume=auto",
        "trainer.max_steps=10",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert said.count("kept its best checkpoints by val/loss until now") == 1, said[-3000:]
    assert "Please add the following callbacks" not in said
    assert older_best.is_file()
    assert (folder / "checkpoints" / "best-step0000010.ckpt").is_file()


def test_a_run_whose_loss_climbs_after_its_best_names_the_file_that_holds_it(
    tmp_path, tmp_path_factory
):
    """The run trains 10 steps, then resumes at a rate far too high: its held-out loss climbs.
    The summary names the kept best checkpoint, which holds the lowest loss in the log."""
    run = (*TEN_STEPS, "run_name=rise", "checkpoint.keep_best=1")
    # the session's run of 10 steps (TEN_STEPS, keep_best=1), continued in a copy
    first = ten_step_run(tmp_path_factory)
    assert "held-out loss (val/loss) rose" not in first.done.stdout
    run_dir = continue_run(first, tmp_path, "rise")
    resumed = run_pretrain(tmp_path, *run, "trainer.max_steps=20", "resume=auto", "optim.lr=3.0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = read_metrics(run_dir / "logs" / "metrics.csv")["val/loss"]
    lowest = min(losses, key=losses.get)
    assert losses[20] > losses[lowest] * (1 + HELD_OUT_ROSE_BY), losses
    assert "held-out loss (val/loss) rose" in resumed.stdout
    named = resumed.stdout.split("ckpt=")[-1].split(". ")[0]
    assert Path(named) == run_dir / "checkpoints" / f"best-step{lowest:07d}.ckpt"
    assert Path(named).is_file()
    assert f"a run as long as its best: trainer.max_steps={lowest}\n" in resumed.stdout

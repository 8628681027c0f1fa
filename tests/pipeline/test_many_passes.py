"""A run whose plan reads its training text more times than its objective's limit (`many_passes`)
is warned when the plan is known (at the start of a run of `trainer.max_steps`, at the budget's
first plan past the limit with `trainer.budget`), with a step count that works when pasted."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest

from datamodules.corpora.corpus import EmbeddedCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective, phase_plan
from pipeline.pretrain.passes import ManyPassesWarning, many_passes_warning
from tests.conftest import run_pretrain, write_two_source_mixture
from tests.pipeline import fake_clock_pretrain

CAUSAL = CausalLMObjective().many_passes


def test_up_to_the_limit_nothing_is_said():
    assert many_passes_warning(CAUSAL, 40, 10, CAUSAL) is None
    assert many_passes_warning(1.5, 900, 600, CAUSAL, budgeted=True) is None


def test_a_masked_lm_repeats_less_per_pass_and_gets_more_passes():
    # new masks each pass; BERT itself was trained for about 40 passes
    assert MaskedLMObjective().many_passes == 40.0 and CAUSAL == 4.0
    assert MaskedLMObjective(next_sentence_prediction=False).many_passes == 40.0
    assert many_passes_warning(10.0, 300, 30, MaskedLMObjective().many_passes) is None


def test_the_fix_is_the_step_count_that_holds_the_limit():
    said = many_passes_warning(6.0, 60, 10, CAUSAL)
    assert said is not None
    assert "plans 60 steps, 6.0 passes over its training text (10 steps a pass)" in said
    assert said.endswith(f"stop at 4 passes: trainer.max_steps={int(CAUSAL * 10)}")
    # GPT mini's 10 minutes on tiny Shakespeare: 938 steps of 72 a pass
    said = many_passes_warning(938 / 72, 938, 72, CAUSAL, budgeted=True)
    assert said.endswith("stop at 4 passes, before the budget ends: trainer.max_steps=288")


def fake_trainer(max_steps=60, global_step=0, rank_zero=True, stream=None, mixture=None):
    """A trainer whose data makes 10 optimizer steps a pass, with a causal-LM objective; with
    `mixture` (name -> passes over the source per mixture epoch), a pass is a mixture epoch."""
    data = SimpleNamespace(
        objective=CausalLMObjective(),
        stream=stream,
        step_batches=[range(10)],
        phases=phase_plan(CausalLMObjective(), None),
        mixture=mixture,
        source_names=list(mixture or ()),
        train_sets=[SimpleNamespace(source_epochs=lambda: np.array(list(mixture.values())))],
    )
    return SimpleNamespace(
        datamodule=data, max_steps=max_steps, global_step=global_step, is_global_zero=rank_zero
    )


def warnings_of(caplog, callback, trainer, budget_steps=()):
    """What `callback` logs at the start of training and after steps whose budget plans are
    `budget_steps`."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline.pretrain.passes"):
        callback.on_train_start(trainer, None)
        for planned in budget_steps:
            callback.budget.decisions += 1
            callback.budget.pace.planned = planned
            callback.on_train_batch_end(trainer, None, None, None, 0)
    return [r.getMessage() for r in caplog.records]


def test_a_run_of_max_steps_is_warned_once_at_its_start(caplog):
    said = warnings_of(caplog, ManyPassesWarning(), fake_trainer(max_steps=60))
    assert len(said) == 1 and said[0].endswith("trainer.max_steps=40")
    assert warnings_of(caplog, ManyPassesWarning(), fake_trainer(max_steps=40)) == []


def test_a_budgeted_run_is_warned_at_the_first_plan_past_the_limit(caplog):
    budget = SimpleNamespace(decisions=0, pace=SimpleNamespace(planned=1000), seconds=600.0)
    callback = ManyPassesWarning(budget)
    said = warnings_of(caplog, callback, fake_trainer(max_steps=1000), budget_steps=[30, 55, 70])
    assert len(said) == 1 and "plans 55 steps, 5.5 passes" in said[0]  # once, at 55
    assert said[0].endswith("before the budget ends: trainer.max_steps=40")


def test_no_warning_past_the_limit_already_on_another_rank_or_for_a_stream(caplog):
    assert warnings_of(caplog, ManyPassesWarning(), fake_trainer(global_step=45)) == []
    assert warnings_of(caplog, ManyPassesWarning(), fake_trainer(rank_zero=False)) == []
    assert warnings_of(caplog, ManyPassesWarning(), fake_trainer(stream=object())) == []
    assert len(warnings_of(caplog, ManyPassesWarning(), fake_trainer(global_step=39))) == 1


def test_a_mixture_is_counted_by_the_source_it_reads_most_often(caplog):
    # 2 mixture epochs, but 6 passes over the upsampled source: its 4 passes are 13 steps
    mixture = {"big": 0.5, "small": 3.0}
    said = warnings_of(caplog, ManyPassesWarning(), fake_trainer(max_steps=20, mixture=mixture))
    assert len(said) == 1
    assert (
        "plans 20 steps, 6.0 passes over source small of its mixture (3.3 steps a pass)" in said[0]
    )
    assert said[0].endswith("trainer.max_steps=13")
    even = {"big": 1.0, "small": 1.0}  # 2 passes over each
    assert warnings_of(caplog, ManyPassesWarning(), fake_trainer(max_steps=20, mixture=even)) == []


SENTENCES = [
    f"Line {i} tells of a ship that sails the sea at night, and of the stars." for i in range(60)
]


def pasted_fix(log: str) -> str:
    warned = [line for line in log.splitlines() if "passes over its training text" in line]
    assert len(warned) == 1, log[-3000:]
    return warned[0].rsplit(": ", 1)[1].strip()


@pytest.mark.parametrize("length", ["max_steps", "budget"])
def test_a_run_that_repeats_its_text_is_warned_and_the_pasted_fix_is_not(
    tmp_path, monkeypatch, length
):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(SENTENCES[i : i + 6]) for i in range(0, 60, 6)) + "\n")
    run = ("model=gpt-tiny", "data=text_files", f"data.paths=[{corpus}]", "debug=smoke")
    run += ("logger=csv", "trainer.val_check_interval=100")
    # The corpus is 2 steps a pass, so the fix is 8 steps: a run of 12 (6 passes) is past the
    # limit as one of 40 is, in a third of the steps.
    if length == "max_steps":
        run += ("trainer.max_steps=12",)
    else:  # a clock that ticks a second per step: the budget holds about 12 steps
        run += ("trainer.budget=15s", "trainer.max_steps=1000")

    def pretrain(*overrides: str):
        with monkeypatch.context() as patched:
            if length == "budget":  # a clock of its own for each run, as a new process has
                fake_clock_pretrain.install(patched.setattr)
            return run_pretrain(tmp_path, *run, *overrides)

    first = pretrain("run_name=long")
    assert first.returncode == 0, first.stderr[-3000:]
    fix = pasted_fix(first.stdout)  # the run's log
    per_pass = int(re.search(r"\((\d+) steps a pass\)", first.stdout).group(1))
    assert fix == f"trainer.max_steps={int(CAUSAL * per_pass)}"
    shorter = pretrain(fix, "run_name=short")
    assert shorter.returncode == 0, shorter.stderr[-3000:]
    assert "passes over its training text" not in shorter.stdout
    steps = int(re.search(r"finished (\d+) steps", shorter.stdout).group(1))
    assert 0 < steps <= CAUSAL * per_pass


MIXTURE_STEPS = 72


def test_a_mixture_run_is_warned_about_the_source_it_upsamples(tmp_path):
    # beta, a third of the documents, is 90% of the sequences: read about 4x per mixture epoch
    mixture = write_two_source_mixture(tmp_path, "{alpha: 0.1, beta: 0.9}")
    # The helper's sources cut to documents of like sizes (so the ratio holds whichever ones
    # the validation split takes): alpha six of 4.5 to 6.4 KB, beta three of about 3.6 KB, read
    # in windows of 32 tokens. A pass over beta is 15 steps (the fix's rounding stays well
    # within the check below) and 72 steps plan 4.8 passes: a seventh of the tokens that 120
    # steps of 128-token windows over the helper's 60 documents read.
    docs = list(EmbeddedCorpus().documents())
    alpha, beta = (37, 48, 51, 52, 53, 58), (2, 9, 56)
    (tmp_path / "alpha.txt").write_text("\n\n".join(docs[i] for i in alpha) + "\n")
    (tmp_path / "beta.txt").write_text("\n\n".join(docs[i] for i in beta) + "\n")
    run = ("model=gpt-tiny", *mixture, "debug=smoke", "logger=csv", "objective.seq_len=32")
    run += (f"trainer.max_steps={MIXTURE_STEPS}", "trainer.val_check_interval=100")
    done = run_pretrain(tmp_path, *run)
    assert done.returncode == 0, done.stderr[-3000:]
    mixture_epoch = int(re.search(r"\((\d+) optimizer steps\) per epoch", done.stdout).group(1))
    said = re.search(
        rf"plans {MIXTURE_STEPS} steps, ([\d.]+) passes over source beta of its mixture "
        r"\(([\d.]+) steps a pass\)",
        done.stdout,
    )
    assert said is not None, done.stdout[-3000:]
    passes, per_pass = float(said.group(1)), float(said.group(2))
    assert passes > 2 * MIXTURE_STEPS / mixture_epoch  # more than the mixture's own epochs
    assert passes == pytest.approx(MIXTURE_STEPS / per_pass, rel=0.1)
    fix = pasted_fix(done.stdout.replace("source beta of its mixture", "its training text"))
    steps = int(fix.removeprefix("trainer.max_steps="))
    assert steps * passes / MIXTURE_STEPS == pytest.approx(CAUSAL, abs=0.1)  # 4 passes over beta

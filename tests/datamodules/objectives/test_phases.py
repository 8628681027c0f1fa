"""Objective phases (`objective.phases`): the step plan, the checks, and the batches a Trainer
gets on each side of a switch (shapes, masked-token cap, positions), from one token store."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from datamodules.objectives.objective import (
    CausalLMObjective,
    MaskedLMObjective,
    longest_seq_len,
    passes_over,
    phase_plan,
    trained_seq_len,
)
from datamodules.pretrain import PretrainDataModule
from tests.conftest import ListCorpus

LONG = {"seq_len": 256, "batch_size": 2, "max_predictions_per_seq": 5}


def phased(share: float = 0.5, **base) -> MaskedLMObjective:
    settings = {"seq_len": 64, "batch_size": 4, "max_predictions_per_seq": 10, **base}
    return MaskedLMObjective(**settings, phases=[{"share": share}, {"share": 1 - share, **LONG}])


def test_the_plan_splits_the_steps_by_share_and_the_last_phase_runs_to_the_end():
    plan = phase_plan(phased(0.9), 1000)
    assert [(p.first_step, p.end_step) for p in plan] == [(0, 900), (900, None)]
    assert plan[0].objective.seq_len == 64 and plan[0].objective.max_predictions_per_seq == 10
    assert (plan[1].objective.seq_len, plan[1].objective.batch_size) == (256, 2)
    assert plan[1].objective.max_predictions_per_seq == 5
    assert all(p.objective.phases is None for p in plan)
    assert [p.objective for p in phase_plan(MaskedLMObjective(), None)] == [MaskedLMObjective()]


def test_the_longest_trained_length_follows_the_steps_done():
    plan = phase_plan(phased(0.5), 10)
    assert [trained_seq_len(plan, done) for done in (0, 5, 6, 10)] == [64, 64, 256, 256]
    assert longest_seq_len(phased()) == 256 and longest_seq_len(MaskedLMObjective()) == 128
    shorter_first = CausalLMObjective(
        seq_len=256, phases=[{"share": 0.5, "seq_len": 64}, {"share": 0.5}]
    )
    assert longest_seq_len(shorter_first) == 256


def test_passes_count_each_phase_over_its_own_batches():
    plan = phase_plan(phased(0.5), 100)  # steps [0, 50) in short windows, [50, 100) in long
    assert passes_over(plan, [10, 25], 100) == pytest.approx(50 / 10 + 50 / 25)
    assert passes_over(plan, [10, 25], 30) == pytest.approx(3.0)  # the second not reached
    assert passes_over(plan, [10, 25], 60) == pytest.approx(5 + 10 / 25)
    assert passes_over(phase_plan(MaskedLMObjective(), None), [7], 21) == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ([{"share": 0.5}, {"share": 0.4}], "add up to 0.9"),
        ([{"share": 1.0, "seq_len": 512, "masking": 0.2}], "unknown key(s) ['masking']"),
        ([{"share": 0.5}, {"share": 0.5, "next_sentence_prediction": False}], "unknown key"),
        ([{"seq_len": 512}], "phases[0].share must be"),
        ([{"share": 0.5}, {"share": 0.5, "seq_len": 4}], "phases[1]: objective.seq_len=4"),
    ],
)
def test_bad_phases_are_named(phases, message):
    with pytest.raises(ValueError) as err:
        MaskedLMObjective(phases=phases)
    assert message in str(err.value)


def test_a_phase_without_steps_or_a_run_without_max_steps_is_refused():
    with pytest.raises(ValueError, match=r"phases\[0\] gets no step of trainer.max_steps=3"):
        phase_plan(phased(0.1), 3)
    with pytest.raises(ValueError, match="set trainer.max_steps"):
        phase_plan(phased(), -1)


class Recorder(L.LightningModule):
    """Trains nothing; records (step, batch shape, masked tokens, longest real sequence) and
    the epoch of every step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, tuple[int, int], int, int]] = []
        self.epochs: list[int] = []

    def training_step(self, batch, batch_idx):
        lengths = batch["attention_mask"].sum(dim=1)
        shape = tuple(batch["input_ids"].shape)
        self.seen.append((self.global_step, shape, len(batch["mlm_labels"]), int(lengths.max())))
        self.epochs.append(self.current_epoch)
        return self.weight * 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_trainer_gets_each_phase_s_batches_exactly_on_its_steps(embedded, wordpiece, cache_dir):
    corpus = ListCorpus(list(embedded.documents())[:8])
    settings = {"val_fraction": 0.25, "seed": 3}
    probe = PretrainDataModule(corpus, wordpiece, phased(), cache_dir, max_steps=2, **settings)
    probe.setup("fit")
    per_epoch = len(probe.train_sets[0])
    # phase 0 spans a whole epoch and 3 steps of the next; phase 1 as many steps
    steps = 2 * (per_epoch + 3)
    dm = PretrainDataModule(corpus, wordpiece, phased(), cache_dir, max_steps=steps, **settings)
    module = Recorder()
    trainer = L.Trainer(
        max_steps=steps,
        reload_dataloaders_every_n_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)

    assert [step for step, *_ in module.seen] == list(range(steps))
    switch = per_epoch + 3
    first, second = module.seen[:switch], module.seen[switch:]
    # an epoch's last batch may be partial
    assert [shape[0] for _, shape, _, _ in first].count(4) >= switch - 1
    assert [shape[0] for _, shape, _, _ in second].count(2) >= len(second) - 1
    assert all(shape[1] <= 64 and masked <= 4 * 10 for _, shape, masked, _ in first)
    assert all(shape[1] <= 256 and masked <= 2 * 5 for _, shape, masked, _ in second)
    assert max(longest for *_, longest in second) > 64  # positions past the first phase's
    # epoch 0 is whole, epoch 1 ends after 3 steps at the switch, phase 1 starts epoch 2
    assert module.epochs[:switch] == [0] * per_epoch + [1] * 3
    assert module.epochs[switch] == 2
    assert dm.state_dict()["phase"] == 1


def test_a_position_from_another_phase_plan_is_refused(embedded, wordpiece, cache_dir):
    corpus = ListCorpus(list(embedded.documents())[:8])
    dm = PretrainDataModule(corpus, wordpiece, phased(), cache_dir, max_steps=20)
    dm.setup("fit")
    state = dm.state_dict() | {"phase": 2}
    with pytest.raises(ValueError, match="objective phase 2, this run has 2 phase"):
        dm.load_state_dict(state)
    dm.load_state_dict(state | {"phase": 1, "batches_per_epoch": len(dm.train_sets[1])})
    assert dm.phase == 1 and dm.train_set is dm.train_sets[1]

"""A warning, when a run's plan is known, that it will read its training text many times over.

A language model trained for many passes over the same text learns less and less from each,
and may memorize the text: its held-out loss stops falling, then rises. How many passes are too
many depends on the objective (`Objective.many_passes`):

- a causal LM (GPT) sees the same sequences again. Muennighoff et al. 2023 ("Scaling
  Data-Constrained Language Models") found up to about 4 passes almost as good as new text and
  the returns of more fading fast; GPT mini's 10 minutes on tiny Shakespeare (1 MB, about 13
  passes) ended with its held-out loss above its lowest in every run of the recipe study
  (docs/results/recipes.md).
- a masked LM (BERT) draws new masks each pass, so a pass repeats less; BERT itself was trained
  for about 40 passes over its corpus (Devlin et al. 2019).

A mixture is counted by the source it reads most often: an upsampled small source may be read
many times while the others are read once.

A run with `trainer.max_steps` knows its length as it starts; a run with `trainer.budget` once
the budget has timed its first steps and planned (pipeline/pretrain/budget.py), and again at
each later plan. The warning names the step count that holds the objective's limit, as a
setting to paste. The end of the run says whether the held-out loss did rise
(`pipeline.pretrain.run.held_out_rise`).
"""

from __future__ import annotations

import logging
import math

import lightning as L

from datamodules.objectives.objective import passes_over
from pipeline.pretrain.budget import TimeBudget

log = logging.getLogger(__name__)


def steps_within(steps: int, passes: float, limit: float) -> int:
    """The steps of a run of `steps` steps and `passes` passes that hold `limit` passes."""
    return math.floor(steps * limit / passes + 1e-9)  # 4 passes of 7 steps: 28, not 27.99..


def many_passes_warning(
    passes: float,
    steps: int,
    steps_per_pass: float,
    limit: float,
    budgeted: bool = False,
    text: str = "its training text",
) -> str | None:
    """What to tell a run that plans `steps` optimizer steps, `passes` passes over its training
    `text` of `steps_per_pass` steps each (the first phase's, with `objective.phases`); None at
    `limit` passes (the objective's `many_passes`) or fewer. The fix it offers is a step count,
    exact on any machine; under a time budget (`budgeted`) the run then ends when it is
    reached."""
    if passes <= limit:
        return None
    per_pass = f"{steps_per_pass:.1f}".removesuffix(".0")  # 72; a mixture's source 3.3
    return (
        f"this run plans {steps} steps, {passes:.1f} passes over {text} "
        f"({per_pass} steps a pass): past about {limit:g} passes, repeated text is "
        "worth much less than new text, and a model may memorize it: its held-out loss stops "
        "falling, then rises (docs/pretraining.md). Give it more text (docs/data.md), or stop "
        f"at {limit:g} passes{', before the budget ends' if budgeted else ''}: "
        f"trainer.max_steps={steps_within(steps, passes, limit)}"
    )


class ManyPassesWarning(L.Callback):
    """Logs `many_passes_warning` once, from the first process, when the run's plan is known
    (not in a resumed run already past the limit: the end of the run says what came of it).

    Args:
        budget: the run's time budget (None: the run's length is `trainer.max_steps`).
    """

    def __init__(self, budget: TimeBudget | None = None) -> None:
        self.budget = budget
        self.done = False
        self.plans_seen = 0  # the budget's plans checked so far

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.budget is None:
            self._check(trainer, trainer.max_steps)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the budget's callback comes first: after one of its plans, the plan is the new one
        if self.budget is not None and self.budget.decisions > self.plans_seen:
            self.plans_seen = self.budget.decisions
            self._check(trainer, self.budget.pace.planned)

    def _check(self, trainer: L.Trainer, steps: int) -> None:
        data = trainer.datamodule
        # a stream is not counted in passes
        if self.done or not trainer.is_global_zero or data.stream is not None:
            return
        limit = data.objective.many_passes
        if limit is None:
            return
        per_pass = [len(batches) for batches in data.step_batches]
        passes = passes_over(data.phases, per_pass, steps)
        text, steps_per_pass = "its training text", float(per_pass[0])
        if data.mixture is not None:  # one phase: the source it reads most often
            epochs = data.train_sets[0].source_epochs()
            most = int(epochs.argmax())
            passes, steps_per_pass = passes * epochs[most], steps_per_pass / epochs[most]
            text = f"source {data.source_names[most]} of its mixture"
        message = many_passes_warning(
            passes, steps, steps_per_pass, limit, self.budget is not None, text
        )
        if message is None:  # a later plan may still go past the limit
            return
        self.done = True
        if trainer.global_step < steps_within(steps, passes, limit):  # not resumed past it
            log.warning("%s", message)

"""Zero-shot grammar while pretraining: `make pretrain probe=blimp`.

Before the first step, every `every_n_steps` optimizer steps and at the end, `BlimpProbe` scores
a fixed subset of BLiMP (the first `pairs` of each of the 67 phenomena; pipeline/infer/blimp.py)
with the model being trained, as `make evaluate-lm suite=blimp` scores a finished one: a causal
model by each sentence's log-probability, a masked one by its pseudo-log-likelihood. It logs
`probe/blimp` (the overall accuracy, percent) to every logger, which `make report` plots over
steps, and appends each probe's accuracies per linguistic term to `logs/blimp_probe.jsonl`
(one JSON line per probe: step, overall, terms; a resumed run repeats the steps after its
checkpoint, and the last line of a step is the one that counts).

Like the GLUE probe (pipeline/pretrain/probe.py), it changes nothing in training: eval mode
while it scores, the random number generators restored, no training data read. With the
defaults (10 pairs per phenomenon, 1,340 sentences) a probe took 1.8 s for GPT mini and 11 s
for BERT mini on a 2-core CPU (a BERT's pseudo-log-likelihood scores each token of each
sentence in its own masked copy); every 1,000 steps that is about 4% of a 20-minute BERT mini
run (docs/results/blimp.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer

from pipeline.checkpoint.load import Pretrained
from pipeline.infer.blimp import BlimpScores, answers, read_pairs
from pipeline.infer.sentence_scoring import PLL_METHODS, SentenceScorer
from pipeline.pretrain.probe import PREFIX, StepProbe

RECORD = "blimp_probe.jsonl"


class BlimpProbe(StepProbe):
    """BLiMP accuracy of the model being trained (see the module docstring).

    Args:
        family: the run's family name (how it scores a sentence: `SentenceScorer`).
        tokenizer: the run's tokenizer.
        folder: BLiMP's files (`<phenomenon>.jsonl(.gz)`).
        record_dir: where `blimp_probe.jsonl` is appended (the run's `logs/`).
        every_n_steps: probe after every this many optimizer steps (and at the end).
        pairs: the first this many pairs of each phenomenon.
        pll: a masked model's sentence score ("word_l2r" or "token").
        batch_size: sentences or masked copies per forward pass.
    """

    def __init__(
        self,
        family: str,
        tokenizer: Tokenizer,
        folder: str | Path,
        record_dir: Path,
        *,
        every_n_steps: int = 1000,
        pairs: int = 10,
        pll: str = "word_l2r",
        batch_size: int = 128,
    ) -> None:
        super().__init__(every_n_steps)
        if pll not in PLL_METHODS:
            raise ValueError(f"probe.blimp.pll={pll} is not one of {', '.join(PLL_METHODS)}")
        self.family, self.tokenizer = family, tokenizer
        self.pairs = read_pairs(folder, per_phenomenon=pairs, settings="probe.blimp")
        self.record = record_dir / RECORD
        self.pll, self.batch_size = pll, batch_size
        self.terms: dict[str, float] = {}  # the last probe's accuracy per linguistic term

    @torch.no_grad()
    def scores(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """`probe/blimp` of `model` as it is now (its terms kept in `self.terms`)."""
        training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                pretrained = Pretrained(self.family, model, self.tokenizer, Path("training"))
                # one batch at a time: the run's model may be compiled, its memory is the run's
                scorer = SentenceScorer(
                    pretrained, device, self.batch_size, self.pll, side_by_side=False
                )
                result = BlimpScores.of("model", self.pairs, answers(self.pairs, scorer))
        finally:
            model.train(training)
        self.terms = result.terms
        return {f"{PREFIX}/blimp": result.overall}

    def logged(self, trainer: L.Trainer, metrics: dict[str, float]) -> None:
        """Append the probe's figures to `logs/blimp_probe.jsonl` (one line, flushed)."""
        line = {
            "step": trainer.global_step,
            "overall": metrics[f"{PREFIX}/blimp"],
            "terms": self.terms,
        }
        self.record.parent.mkdir(parents=True, exist_ok=True)
        with open(self.record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

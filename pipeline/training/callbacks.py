"""Callbacks of a pretraining run: throughput and MFU, and a validation of the last step."""

from __future__ import annotations

import time

import lightning as L
import torch

from pipeline.training.lightning_compat import run_max_steps, step_boundary

# Dense bf16 peak FLOP/s by device name (datasheet figures). A device not listed gets no MFU:
# a wrong peak gives wrong numbers (nanoGPT users saw ">100% MFU" from an A100 peak on H100s).
BF16_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in name), None)


class Throughput(L.Callback):
    """Logs tokens/s, samples/s and (on a known GPU) MFU, measured between training batches.

    The clock runs from one batch's start to the next, so data loading and the optimizer step
    are included: the throughput a user actually gets.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._tokens = 0
        self._samples = 0
        self.tokens_per_second: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._start is not None and now > self._start:
            elapsed = now - self._start
            world = trainer.world_size
            self.tokens_per_second = self._tokens * world / elapsed
            pl_module.log("perf/tokens_per_s", self.tokens_per_second, prog_bar=True)
            pl_module.log("perf/samples_per_s", self._samples * world / elapsed)
            peak = device_peak_flops(pl_module.device)
            if peak:
                per_device = self.tokens_per_second / world
                pl_module.log("perf/mfu", pl_module.flops_per_token * per_device / peak)
        self._start = now
        self._tokens = pl_module.tokens_in(batch)
        self._samples = int(batch["input_ids"].shape[0])


class SourceProgress(L.Callback):
    """Logs, per source of a mixture, what training has read (`data/<source>/sequences`,
    `tokens` and `epochs`; `PretrainDataModule.source_progress`), after each optimizer step.
    Nothing for a single corpus."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        progress = getattr(trainer.datamodule, "source_progress", None)
        if progress is None or not step_boundary(trainer):
            return
        for source, figures in progress().items():
            for name, value in figures.items():
                pl_module.log(f"data/{source}/{name}", value)


class ValidateLastStep(L.Callback):
    """Validates after the run's last optimizer step when the validation interval would not
    (a step count that is not a multiple of it, or the end a time budget planned), so that the
    final model's validation metrics are logged and can make it the best checkpoint.

    Lightning validates after a batch at which `should_stop` is set; setting it at the last
    step changes nothing else, as the run stops there anyway.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if step_boundary(trainer) and 0 < run_max_steps(trainer) <= trainer.global_step:
            trainer.should_stop = True

"""The training position of a run that reads token stores, as its checkpoints record it (the
objective phase, the epoch, the optimizer steps done in it, and what fixes its batches), and the
checks that a resumed run reads exactly the batches the uninterrupted run would have read next:
a setting that changes them is refused, naming it (`PretrainDataModule.load_state_dict`)."""

from __future__ import annotations

from typing import Any

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.batches import EpochBatches

STATE_VERSION = 1


def batches_key(train_set: EpochBatches | None, seed: int, micro_batches: int) -> dict[str, Any]:
    """What fixes a run's batches besides its text and position: the data seed, the processes
    sharing each batch, the batches of an epoch (corpus, objective, batch size) and the
    micro-batches of an optimizer step."""
    return {
        "seed": seed,
        "world_size": train_set.world_size if train_set else None,
        "batches_per_epoch": len(train_set) if train_set else None,
        "micro_batches": micro_batches,
    }


def restored_phase(state: dict[str, Any], phases: int) -> int:
    """The objective phase a checkpoint's position is in, for a run of `phases` phases.

    Raises:
        DataSetupError: the run has no such phase.
    """
    phase = int(state.get("phase", 0))  # checkpoints from before phases have none
    if not 0 <= phase < phases:
        raise DataSetupError(
            f"cannot resume the data position: the checkpoint is in objective phase {phase}, "
            f"this run has {phases} phase(s). Resume with the same objective.phases"
        )
    return phase


def check_same_batches(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Raise `DataSetupError` unless a checkpoint's `batches_key` is this run's (`expected`):
    its position would otherwise point at other batches."""
    for key, value in expected.items():
        if state.get(key, 1 if key == "micro_batches" else None) != value:
            raise DataSetupError(
                f"cannot resume the data position exactly: the checkpoint has {key}="
                f"{state.get(key)!r}, this run {value!r}. Resume with the same data seed, "
                "corpus, objective (batch size, seq_len), gradient accumulation and number "
                "of processes, or start the data from the beginning"
            )

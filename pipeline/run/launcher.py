"""How this process was launched: the run stamp that names a run folder (the same in every process
of a run), the rank an external launcher gave it, and the overrides its command was given.

Library modules ask these; the command-line plumbing (`pipeline.run.cli`) uses them too.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

RUN_STAMP_ENV = "LMPIPE_RUN_STAMP"


def run_stamp() -> str:
    """Name of this run's folder: the start time, identical in every process of the run.

    The first process to ask records the stamp in the environment, so processes it starts
    (Lightning's DDP launcher, DataLoader workers) reuse it. Processes started by an external
    launcher cannot see it, so for them the launcher's own job id names the run: SLURM job and
    step ids, or the torchrun rendezvous id. `LMPIPE_RUN_STAMP` set by hand always wins.
    """
    stamp = os.environ.get(RUN_STAMP_ENV) or _launcher_stamp()
    if not stamp:
        stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    os.environ[RUN_STAMP_ENV] = stamp
    return stamp


def _launcher_stamp() -> str | None:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and run_id != "none":
        return f"torchrun-{run_id}"
    return None


def launcher_rank() -> int:
    """This process's global rank as set by an external launcher (torchrun, SLURM), else 0.
    (Processes that Lightning's own launcher starts come after rank 0 has set things up.)"""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ.get("SLURM_PROCID", "0"))
    return 0


def launcher_world_size() -> int:
    """The number of processes an external launcher (torchrun, `srun`) started, else 1. A
    process of an `sbatch` script that `srun` did not start (no `SLURM_STEP_ID`) is alone,
    whatever `SLURM_NTASKS` says."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_STEP_ID" not in os.environ:
        return 1
    return int(os.environ.get("SLURM_NTASKS", "1"))


def local_rank() -> int:
    """This process's rank among those of its node (torchrun's and Lightning's launchers set
    LOCAL_RANK, srun SLURM_LOCALID), else 0."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if launcher_world_size() > 1:  # a process that srun started among others
        return int(os.environ.get("SLURM_LOCALID", "0"))
    return 0


def external_launcher() -> str | None:
    """The launcher ("torchrun" or "srun") when it started this process among others (it started
    the run's processes on every node, and only it can start them again), else None."""
    if launcher_world_size() <= 1:
        return None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if "SLURM_STEP_ID" in os.environ:
        return "srun"
    return None


def relaunch_command(make_form: str, module: str, overrides: list[str]) -> str:
    """How to run command `module` (`pipeline.commands.pretrain`) again with `overrides`:
    `make_form` (its `make` line) for a run that one command started; for a run that torchrun or
    srun started, the line to give that launcher again on every node (its own options are not
    known to the processes it starts)."""
    launcher = external_launcher()
    if launcher is None:
        return make_form
    words = shlex.join(["-m", module, *overrides])
    if launcher == "torchrun":
        return f".venv/bin/torchrun <the same options as before> {words} (on every node)"
    return f"srun <the same options as before> .venv/bin/python {words}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)


@dataclass(frozen=True)
class GroupChoices:
    """The option of each config group (`optim` -> `muon_gpt`), and which groups the command line
    typed. An error's fix needs both: an option the user typed is replaced, since a recipe named
    instead would not override it."""

    options: Mapping[str, str | None] = field(default_factory=dict)
    typed: frozenset[str] = frozenset()

    @classmethod
    def of(cls, options: Mapping[str, str | None], overrides: Iterable[str]) -> GroupChoices:
        """From Hydra's `runtime.choices` and the command's overrides (`optim=muon`, `+probe=glue`)."""
        keys = (override_key(override) for override in overrides if "=" in override)
        return cls(dict(options), frozenset(key for key in keys if key in options))

    def apart_from(self, group: str, option: str | None) -> bool:
        """Whether `group`'s option was chosen apart from `option` (what a recipe selects): typed
        on the command line, or another option (an experiment's); False where nothing is known."""
        return group in self.typed or self.options.get(group, option) != option


def group_choices() -> GroupChoices:
    """This job's group options and typed groups (none outside a `@hydra.main` job, e.g. in tests)."""
    try:
        hydra = HydraConfig.get()
    except ValueError:
        return GroupChoices()
    return GroupChoices.of(hydra.runtime.choices, hydra.overrides.task)


def override_key(override: str) -> str:
    """The config key a command-line override sets or deletes: `a.b=1`, `+a.b=1`, `++a.b=1`
    and `~a.b` give `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


def command_overrides() -> list[str]:
    """This job's command-line overrides ([] outside a `@hydra.main` job, e.g. in tests)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []

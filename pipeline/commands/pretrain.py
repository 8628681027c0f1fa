"""`make pretrain`: pretrain a BERT or GPT on a corpus (pipeline/pretrain/run.py).

python -m pipeline.commands.pretrain model=gpt trainer.max_steps=50

However a run stops early (a signal, a second Ctrl-C, a full disk, a lost process of a
multi-node run), the last line says the command that continues it.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.checkpoint.interrupt import TrainingAborted, TrainingInterrupted
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import train
from pipeline.run.cli import entry_point, make_command, user_errors
from pipeline.run.errors import DiskFullError, PeerLostError
from pipeline.run.folder import first_process, sweep_folder
from pipeline.run.launcher import (
    command_overrides,
    group_choices,
    local_rank,
    override_key,
    relaunch_command,
)

log = logging.getLogger(__name__)


def resumed_overrides(run_name: str) -> list[str]:
    """This run's overrides, naming its run and resuming it. A sweep's job is continued with
    its sweep: the sweep's command line, naming its folder, so that the finished jobs are
    kept and the stopped one and those after it run (a job's own overrides and `run_name`
    would start a run in a new folder)."""
    sweep = sweep_folder()
    if sweep is not None:
        typed = [a for a in sys.argv[1:] if not a.startswith("-")]  # not -m, --multirun
        kept = [o for o in typed if override_key(o) not in ("hydra.sweep.dir", "resume")]
        return [*kept, f"hydra.sweep.dir={sweep}", "resume=auto"]
    kept = [o for o in command_overrides() if override_key(o) not in ("run_name", "resume")]
    return [*kept, f"run_name={run_name}", "resume=auto"]


def stop_with(cfg: DictConfig, said: str, exit_code: int, *, tell: bool = True) -> None:
    """End the command with `said` and, on the same line, the command that continues the run
    (`tell`: this process is the one that tells the user)."""
    if tell:
        overrides = resumed_overrides(cfg.run_name)
        make_form = make_command("pretrain", overrides)
        command = relaunch_command(make_form, "pipeline.commands.pretrain", overrides)
        print(f"\n{said}; continue with: {command}", file=sys.stderr)
    sys.exit(exit_code)


@hydra.main(config_path="../../conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg, group_choices())
        log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        try:
            train(cfg, plan)
        except TrainingInterrupted as stop:
            stop_with(
                cfg, f"{stop}; checkpoint {stop.checkpoint}", stop.exit_code, tell=stop.reporter
            )
        except (TrainingAborted, KeyboardInterrupt) as stop:
            said = str(stop) if isinstance(stop, TrainingAborted) else "stopped by Ctrl-C"
            code = stop.exit_code if isinstance(stop, TrainingAborted) else 130
            kept = "no checkpoint saved: resume=auto continues from the run's newest (if any)"
            stop_with(cfg, f"{said}; {kept}", code, tell=first_process())
        except DiskFullError as full:
            stop_with(cfg, f"error: {full}", 1)
        except PeerLostError as lost:  # one line per surviving node
            stop_with(cfg, f"error: {lost}", 1, tell=local_rank() == 0)


if __name__ == "__main__":
    entry_point(main)

"""`make pretrain`: pretrain a BERT or GPT on a corpus (pipeline/pretrain/run.py).

python -m pipeline.commands.pretrain model=gpt trainer.max_steps=50
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.checkpoint.interrupt import TrainingInterrupted
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import train
from pipeline.run.cli import entry_point, make_command, user_errors
from pipeline.run.launcher import command_overrides, group_choices

log = logging.getLogger(__name__)


def resumed_overrides(run_name: str) -> list[str]:
    """This run's overrides, naming its run and resuming it."""
    kept = [o for o in command_overrides() if o.split("=")[0] not in ("run_name", "resume")]
    return [*kept, f"run_name={run_name}", "resume=auto"]


@hydra.main(config_path="../../conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg, group_choices())
        log.info("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        try:
            train(cfg, plan)
        except TrainingInterrupted as stop:
            if stop.reporter:
                print(f"\n{stop}; checkpoint {stop.checkpoint}", file=sys.stderr)
                command = make_command("pretrain", resumed_overrides(cfg.run_name))
                print(f"continue with: {command}", file=sys.stderr)
            sys.exit(stop.exit_code)


if __name__ == "__main__":
    entry_point(main)

"""`make glue`: a pretrained model against its from-scratch twin and non-neural baselines on a
suite of fine-tuning tasks (pipeline/suites/glue.py).

    python -m pipeline.commands.glue ckpt=outputs/bert/<run>
    python -m pipeline.commands.glue ckpt=... suite=full seeds=5 run_name=full-5

Returns the suite's average pretrained score (GLUE's, 0-100), for Hydra sweepers.
"""

from __future__ import annotations

import math
import sys

import hydra
from hydra import compose
from omegaconf import DictConfig

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT for the registry)
from pipeline.run.cli import entry_point, make_command, unknown_choice, user_errors
from pipeline.run.errors import ConfigError, FineTuneCrashError
from pipeline.run.folder import first_process
from pipeline.run.launcher import command_overrides, override_key
from pipeline.suites.glue import run_suite
from pipeline.suites.summary import SUMMARY


def load_task(name: str) -> DictConfig:
    """conf/task/<name>.yaml, composed as `make finetune task=<name>` composes it."""
    unknown = unknown_choice("task", name)
    if unknown:  # named by tasks=[...] or the suite
        raise ConfigError(f"{unknown}; name the tasks to run with tasks=[sst2,rte]")
    return compose(config_name="glue", overrides=[f"task={name}"]).task


@hydra.main(config_path="../../conf", config_name="glue", version_base="1.3")
def main(cfg: DictConfig) -> float:
    with user_errors():
        overrides = command_overrides()
        resume = make_command(
            "glue",
            [*(o for o in overrides if override_key(o) != "run_name"), f"run_name={cfg.run_name}"],
        )
        try:
            summary = run_suite(cfg, load_task, overrides)
        except (KeyboardInterrupt, SystemExit) as stopped:  # Lightning ends fit with exit(1)
            if first_process():
                print(f"\nsuite interrupted; to resume it: {resume}")
            if isinstance(stopped, KeyboardInterrupt):  # came outside a fine-tune's fit
                raise SystemExit(1) from None
            raise
        except FineTuneCrashError as crash:  # its traceback is above, from its own process
            print(
                f"error: {crash}\nthe finished fine-tunes are kept; to resume: {resume}",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
        if summary is None:  # a multi-device suite's other process: the first one prints
            return math.nan
        folder = cfg.paths.output_dir
        print(f"\n{summary.table()}\n\nwritten to {folder}/{SUMMARY}.md and .json")
        average = summary.rows[-1].pretrained.summary if summary.rows else None
        return average.mean if average is not None and math.isfinite(average.mean) else math.nan


if __name__ == "__main__":
    entry_point(main)

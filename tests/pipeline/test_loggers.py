"""Run tracking (pipeline/training/loggers.py): the logger choices, the wandb mode that never prompts, what a
tiny run writes to an offline wandb run and its CSV log, and a resumed run continuing its wandb
run."""

from __future__ import annotations

import csv
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from models.config import GPTConfig
from models.flops import flops_per_token
from pipeline.run.errors import ConfigError
from pipeline.training import loggers as tracking
from pipeline.training.loggers import (
    AppendingCSVLogger,
    build_loggers,
    default_placement,
    git_state,
    log_run_end,
    log_run_start,
    wandb_mode,
)
from tests.conftest import CLI_ENV, REPO, compose_pretrain, run_pretrain

HEX = re.compile(r"[0-9a-f]+")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """No wandb credentials anywhere: an empty home, no key, no netrc, no WANDB_MODE."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return home


@pytest.fixture
def outside_hydra():
    """No Hydra app context (another test may have left one set), and none left behind."""
    HydraConfig.instance().cfg = None
    yield
    HydraConfig.instance().cfg = None


# wandb mode ------------------------------------------------------------------------------------


def test_auto_mode_is_offline_without_credentials_and_online_with_them(no_credentials, monkeypatch):
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.delenv("WANDB_API_KEY")
    # `wandb login` writes ~/.netrc; an entry for another host does not count
    (no_credentials / ".netrc").write_text("machine example.com login user password secret\n")
    assert wandb_mode("auto") == "offline"
    (no_credentials / ".netrc").write_text("machine api.wandb.ai login user password secret\n")
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode("auto") == "offline"  # logged in to another server than the one used


@pytest.mark.parametrize(
    ("env", "expected"),
    [("offline", "offline"), ("dryrun", "offline"), ("disabled", "disabled"), ("ONLINE", None)],
)
def test_a_set_wandb_mode_wins_over_auto(no_credentials, monkeypatch, env, expected):
    monkeypatch.setenv("WANDB_MODE", env)
    if expected is None:  # online without credentials: refused, never a login prompt
        with pytest.raises(ConfigError, match="wandb login"):
            wandb_mode("auto")
    else:
        assert wandb_mode("auto") == expected


def test_online_without_credentials_is_refused_not_prompted(no_credentials, monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ConfigError, match=r"mode=online.*wandb login.*mode=offline"):
        wandb_mode("online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("online") == "online"


def test_unknown_modes_are_named(no_credentials, monkeypatch):
    with pytest.raises(ConfigError, match="logger.wandb.mode='sometimes'"):
        wandb_mode("sometimes")
    monkeypatch.setenv("WANDB_MODE", "maybe")
    with pytest.raises(ConfigError, match="WANDB_MODE='maybe'"):
        wandb_mode("auto")


# logger choices --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), [AppendingCSVLogger, WandbLogger]),
        (("logger=csv",), [AppendingCSVLogger]),
        (("logger=wandb",), [WandbLogger]),
        (("logger=[csv,wandb,tensorboard]",), [AppendingCSVLogger, WandbLogger, TensorBoardLogger]),
        (("logger=[]",), []),
    ],
)
def test_logger_choices_build_those_loggers(
    no_credentials, tmp_path, monkeypatch, overrides, expected
):
    cfg = compose_pretrain(*overrides)
    cfg.paths.output_dir = str(tmp_path / "run")
    monkeypatch.setenv("WANDB_MODE", "offline")
    built = build_loggers(cfg, tmp_path / "run")
    assert [type(logger) for logger in built] == expected


def test_disabled_wandb_is_left_out(no_credentials, tmp_path, monkeypatch):
    cfg = compose_pretrain("logger=[csv,wandb,tensorboard]")
    cfg.paths.output_dir = str(tmp_path / "run")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert [type(x) for x in build_loggers(cfg, tmp_path)] == [
        AppendingCSVLogger,
        TensorBoardLogger,
    ]
    monkeypatch.delenv("WANDB_MODE")
    cfg.logger.wandb.mode = "disabled"
    assert [type(x) for x in build_loggers(cfg, tmp_path)] == [
        AppendingCSVLogger,
        TensorBoardLogger,
    ]


def test_wandb_run_place_and_resumed_id(no_credentials, tmp_path, monkeypatch, outside_hydra):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_pretrain("logger=wandb", "run_name=wiki")
    (logger,) = build_loggers(cfg, tmp_path / "wiki", resume_id="abc123")
    assert logger.version == "abc123"  # the run that a resumed run continues
    assert logger.name == "lmpipe"  # the project, outside a Hydra app
    cfg.logger.wandb.project = "mine"
    (logger,) = build_loggers(cfg, tmp_path / "wiki", project="finetunes")
    assert logger.name == "finetunes"  # an argument wins over the config, which wins over defaults
    assert logger.version is None  # wandb makes up a new id


def test_default_placement_follows_model_and_experiment(tmp_path, outside_hydra):
    cfg = compose_pretrain("run_name=wiki")
    assert default_placement(cfg, tmp_path / "wiki") == {
        "project": "lmpipe",
        "group": "wiki",
        "name": "wiki",
    }
    assert default_placement(cfg, tmp_path / "multirun_x" / "3")["name"] == "multirun_x-3"
    cfg = compose_pretrain("experiment=gpt-mini-wikitext2", "run_name=wiki", hydra_node=True)
    HydraConfig.instance().set_config(cfg)
    placement = default_placement(cfg, tmp_path / "wiki")
    assert placement == {"project": "lmpipe-gpt", "group": "gpt-mini-wikitext2", "name": "wiki"}


# what is logged besides metrics ----------------------------------------------------------------


def test_git_state(tmp_path):
    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}  # not a checkout
    state = git_state()
    if (REPO / ".git").exists():
        assert HEX.fullmatch(state["git_commit"]) and len(state["git_commit"]) == 40
        assert isinstance(state["git_dirty"], bool)


class RecordingLogger(CSVLogger):
    """A CSV logger that also records what it was given."""

    def __init__(self, save_dir: Path) -> None:
        super().__init__(save_dir, name="logs", version="")
        self.given: list[dict] = []

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.given.append(dict(params))
        super().log_hyperparams(params, *args, **kwargs)


def test_run_facts_and_final_values_go_to_the_loggers_on_rank_zero_only(tmp_path, monkeypatch):
    cfg = compose_pretrain("model=gpt-tiny", "trainer.max_steps=7")
    cfg.paths.output_dir = str(tmp_path)
    logger = RecordingLogger(tmp_path)
    monkeypatch.setattr(tracking.rank_zero_only, "rank", 1)
    assert log_run_start([logger], cfg, parameters=5) == {}
    assert log_run_end([logger], hf_export="x") == {}
    assert logger.given == []

    monkeypatch.setattr(tracking.rank_zero_only, "rank", 0)
    run = log_run_start([logger], cfg, parameters=5, data_fingerprint="abc")
    assert run["parameters"] == 5 and "git_commit" in run
    assert log_run_end([logger], hf_export=str(tmp_path / "hf")) == {}  # no wandb: nothing to say
    saved = yaml.safe_load((tmp_path / "logs" / "hparams.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 7  # the resolved config
    assert saved["run"]["parameters"] == 5 and saved["run"]["data_fingerprint"] == "abc"
    assert saved["hf_export"] == str(tmp_path / "hf")


# a tiny run with wandb offline -----------------------------------------------------------------


def read_wandb_run(run_dir: Path) -> dict:
    """An offline wandb run folder read back with wandb's own reader (`wandb leet inspect`):
    {"run": the run record, "config": the config, "history": rows, "summary": the summary}."""
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**CLI_ENV, "HOME": str(run_dir.parent)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    out: dict = {"run": None, "config": {}, "history": [], "summary": {}, "exit": None}
    for record in records:
        kind = record["type"]
        if kind == "run":
            out["run"] = record["run"]
            out["config"].update(record["run"].get("config", {}).get("update", {}))
        elif kind == "config":
            out["config"].update(record["config"].get("update", {}))
        elif kind == "history":
            out["history"].append(record["history"]["item"])
        elif kind == "summary":
            out["summary"].update(record["summary"].get("update", {}))
        elif kind == "exit":
            out["exit"] = record["exit"].get("exit_code", 0)
    return out


def run_with_tty(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The pretraining CLI with wandb in auto mode, no credentials, CI=true and a terminal as
    stdin: a login prompt would wait on it until the timeout."""
    env = {k: v for k, v in CLI_ENV.items() if k != "WANDB_MODE"}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), CI="true")
    leader, follower = pty.openpty()
    try:
        return run_pretrain(tmp_path, *overrides, timeout=300, env=env, stdin=follower)
    finally:
        os.close(leader)
        os.close(follower)


TINY = (
    "model=gpt-tiny",
    "debug=smoke",
    "run_name=tracked",
    "logger=[csv,wandb]",
    "checkpoint.every_n_steps=3",
)
EXPECTED_KEYS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/skipped_steps",
    "train/perplexity",
    "perf/tokens_per_s",
    "val/loss",
    "val/perplexity",
    "trainer/global_step",
}


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def test_tiny_run_logs_offline_to_wandb_and_csv_and_a_resumed_run_continues_it(tmp_path):
    first = run_with_tty(tmp_path, *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "out" / "gpt-tiny" / "tracked"
    (wandb_dir,) = offline_runs(run_dir)  # offline: no credentials, and never a prompt
    assert f"wandb sync {wandb_dir}" in first.stdout  # told how to upload it
    assert f"make report run={run_dir}" in first.stdout

    logged = read_wandb_run(wandb_dir)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    run = logged["run"]
    assert (run["project"], run["run_group"], run["display_name"], run["job_type"]) == (
        "lmpipe-gpt-tiny",
        "tracked",
        "tracked",
        "pretrain",
    )
    assert logged["exit"] == 0
    keys = {key for row in logged["history"] for key in row}
    assert keys >= EXPECTED_KEYS, EXPECTED_KEYS - keys
    train_steps = [row["trainer/global_step"] for row in logged["history"] if "train/loss" in row]
    assert train_steps == [1, 2, 3, 4, 5]  # debug=smoke: 5 steps, each logged at steps done
    # the resolved config is the run config, with the run's facts
    config = logged["config"]
    assert config["trainer"]["max_steps"] == 5 and config["model"]["d_model"] == 64
    facts = config["run"]
    parameters = int(re.search(r"([\d,]+) parameters", first.stdout)[1].replace(",", ""))
    assert facts["parameters"] == parameters
    model_config = GPTConfig(
        **{k: v for k, v in checkpoint["model_config"].items() if k != "family"}
    )
    assert facts["flops_per_token"] == pytest.approx(flops_per_token(model_config))
    assert HEX.fullmatch(facts["data_fingerprint"]) and HEX.fullmatch(
        facts["tokenizer_fingerprint"]
    )
    if (REPO / ".git").exists():
        assert len(facts["git_commit"]) == 40 and isinstance(facts["git_dirty"], bool)
    assert logged["summary"]["hf_export"] == str(run_dir / "hf")

    # the CSV log has the same columns, and hparams.yaml the config and facts
    with open(run_dir / "logs" / "metrics.csv") as handle:
        columns = set(csv.DictReader(handle).fieldnames)
    assert EXPECTED_KEYS - {"trainer/global_step"} | {"step", "epoch"} <= columns
    hparams = yaml.safe_load((run_dir / "logs" / "hparams.yaml").read_text())
    assert hparams["run"]["parameters"] == parameters
    assert hparams["hf_export"] == str(run_dir / "hf")

    assert checkpoint["wandb"] == {
        "id": run["run_id"],
        "project": "lmpipe-gpt-tiny",
        "group": "tracked",
        "name": "tracked",
    }

    # resumed from step 3 (as after a crash) and run on to step 8
    step3 = run_dir / "checkpoints" / "step0000003.ckpt"
    resumed = run_with_tty(tmp_path, *TINY, f"resume={step3}", "trainer.max_steps=8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {step3}" in resumed.stdout
    first_dir, second_dir = offline_runs(run_dir)
    assert first_dir == wandb_dir
    again = read_wandb_run(second_dir)
    assert again["run"]["run_id"] == run["run_id"]  # the same wandb run, continued
    steps = [row["trainer/global_step"] for row in again["history"] if "train/loss" in row]
    assert steps == [4, 5, 6, 7, 8]
    # metrics.csv keeps the first run's rows: steps 4 and 5 twice, the resumed run's last
    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r["train/loss"]]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]


@pytest.mark.slow
def test_only_rank_zero_logs_in_a_two_process_run(tmp_path):
    env = {**CLI_ENV, "WANDB_MODE": "offline", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = run_pretrain(
        tmp_path,
        "model=gpt-tiny",
        "debug=smoke",
        "run_name=ddp",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wandb_dir,) = offline_runs(tmp_path / "out" / "gpt-tiny" / "ddp")  # one run, not two
    history = read_wandb_run(wandb_dir)["history"]
    steps = [row["trainer/global_step"] for row in history if "train/loss" in row]
    assert steps == list(range(1, 6))

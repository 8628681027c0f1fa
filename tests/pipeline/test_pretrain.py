"""End-to-end smoke runs of `pipeline.commands.pretrain` on the embedded corpus (a few steps each)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from tokenizers import Tokenizer

from tests.conftest import run_command, run_pretrain
from tests.pipeline.smoke_runs import smoke_run


@pytest.mark.parametrize("model", ["bert-tiny", "gpt-tiny"])
def test_pretrain_smoke_run_leaves_checkpoint_logs_and_hf_export(tmp_path_factory, model):
    # `make pretrain model=<model> debug=smoke run_name=smoke`, run once in the session (other
    # files evaluate copies of it): read here, not written
    run = smoke_run(tmp_path_factory, model)
    result, run_dir = run.done, run.folder
    assert "finished 5 steps" in result.stdout

    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 5
    assert checkpoint["model_config"]["family"] == model.split("-")[0]
    assert checkpoint["config"]["trainer"]["max_steps"] == 5
    saved_tokenizer = Tokenizer.from_str(checkpoint["tokenizer"]["json"])
    assert saved_tokenizer.to_str() == Tokenizer.from_file(str(run_dir / "tokenizer.json")).to_str()
    assert len(checkpoint["rng"]) == 1  # one entry per rank
    assert {"torch", "numpy", "python"} <= set(checkpoint["rng"][0])

    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 5 and all(loss > 0 for loss in losses)
    assert any(r.get("val/loss") for r in rows)

    hf_config = json.loads((run_dir / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == (
        ["BertForPreTraining"] if model.startswith("bert") else ["LlamaForCausalLM"]
    )
    assert (run_dir / "hf" / "model.safetensors").is_file()
    assert (run_dir / "tokenizer.json").is_file()

    # The command the summary suggests works on the run folder (checkpoint with its tokenizer).
    command = (
        ["pipeline.commands.generate", "prompt=The", "max_new_tokens=5"]
        if model.startswith("gpt")
        else ["pipeline.commands.fill_mask", "text=The [MASK] statement."]
    )
    assert (
        f"next: make {command[0].split('.')[-1].replace('_', '-')} ckpt={run_dir}" in result.stdout
    )
    poke = run_command(command[0], f"ckpt={run_dir}", *command[1:])
    assert poke.returncode == 0, poke.stderr[-2000:]
    assert poke.stdout.strip()


def test_a_bert_with_rotary_positions_and_pre_norm_trains_keeps_no_hf_export_and_resumes(
    tmp_path,
):
    """The encoder options that HF BertModel lacks: the run trains, says in one line why it
    writes no Hugging Face export (one it cannot hold), and the checkpoint keeps the options,
    as `resume=auto` of the finished run, which loads it, shows."""
    options = ("model.position_encoding=rotary", "model.norm_placement=pre")
    run = ("model=bert-tiny", "debug=smoke", "run_name=rope", "trainer.max_steps=3", *options)
    done = run_pretrain(tmp_path, *run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished 3 steps" in done.stdout
    assert "no Hugging Face export: HF BertModel has learned absolute positions" in done.stdout
    run_dir = tmp_path / "out" / "bert-tiny" / "rope"
    assert not (run_dir / "hf").exists() and "or load" not in done.stdout
    hparams = (run_dir / "logs" / "hparams.yaml").read_text()  # the run record says why
    assert "hf_export: 'none: HF BertModel has learned absolute positions" in hparams
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["model_config"]["position_encoding"] == "rotary"
    assert saved["model_config"]["norm_placement"] == "pre"

    again = run_pretrain(tmp_path, *run, "resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout.strip().splitlines()
    assert said[-2].startswith("no Hugging Face export: ")
    assert said[-1].startswith(f"the run in {run_dir} has finished: step 3 ")
    assert "HF export" not in said[-1] and not (run_dir / "hf").exists()

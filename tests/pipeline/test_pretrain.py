"""End-to-end smoke runs of `pipeline.pretrain` on the embedded corpus (a few steps each)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.parametrize("model", ["bert-tiny", "gpt-tiny"])
def test_pretrain_smoke_run_leaves_checkpoint_logs_and_hf_export(tmp_path, model):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.pretrain",
            f"model={model}",
            "debug=smoke",
            f"paths.cache_dir={tmp_path}/cache",
            f"paths.output_root={tmp_path}/out",
            "+trainer.enable_progress_bar=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "LMPIPE_RUN_STAMP": "smoke", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "out" / model / "smoke"
    assert "finished 5 steps" in result.stdout

    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 5
    assert checkpoint["model_config"]["family"] == model.split("-")[0]

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

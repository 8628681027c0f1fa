"""Two-process DDP on CPU (gloo): a real pretraining run (`PretrainModule` + `PretrainDataModule`,
started by Lightning with strategy ddp, devices=2) keeps the ranks' weights identical, gives the
ranks disjoint data, and takes the gradient of the loss averaged over every prediction of the step
on both ranks (with gradient accumulation for BERT, whose micro-batches predict unequal numbers of
tokens)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from datamodules.corpus import EmbeddedCorpus
from models.config import BertConfig, GPTConfig
from pipeline.modules import module_for
from tests.conftest import CLI_ENV, REPO
from tests.pipeline.ddp_run import KIND
from tokenizer import batched, train_tokenizer

SCRIPT = Path(__file__).with_name("ddp_run.py")
TIMEOUT_S = 240
STEPS = 4


def run_ddp(tmp_path: Path, family: str, accumulate: int) -> list[dict]:
    """Train with 2 DDP ranks; returns each rank's record (see `ddp_run.py`)."""
    # WordPiece/BPE training is not reproducible across processes: train once, here, and let
    # both ranks load the file.
    vocab = 2000 if family == "bert" else 1000
    tokenizer = train_tokenizer(KIND[family], batched(EmbeddedCorpus().documents()), vocab)
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_json))
    out = tmp_path / "out"
    out.mkdir()
    args = [family, tokenizer_json, tmp_path / "cache", out, STEPS, accumulate]
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=REPO,
        env={**CLI_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: rank 1 is killed with it
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the DDP run did not finish in {TIMEOUT_S} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    missing = [r for r in range(2) if not (out / f"rank{r}.pt").is_file()]
    assert not missing, f"ranks {missing} wrote no record:\n{output[-3000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def reference_gradients(family: str, record: dict, micro_batches: list[dict]) -> dict:
    """Gradients at the initial weights of the loss the step should optimize: every loss term's
    summed cross-entropy over all micro-batches of both ranks, divided by the number of its
    predictions there."""
    config_class = BertConfig if family == "bert" else GPTConfig
    model = module_for(family)(config_class(**record["model_config"]), None, None).model
    model.load_state_dict(record["initial"])
    sums, counts = {}, {}

    def add(term: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        sums[term] = sums.get(term, 0) + loss
        counts[term] = counts.get(term, 0) + targets.numel()

    for batch in micro_batches:
        if family == "bert":
            out = model(
                batch["input_ids"],
                attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"],
                masked_positions=batch["masked_positions"],
            )
            add("mlm", out.mlm_logits, batch["mlm_labels"])
            add("nsp", out.nsp_logits, batch["nsp_labels"])
        else:
            add("lm", model(batch["input_ids"]).logits, batch["targets"])
    sum(sums[term] / counts[term] for term in sums).backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize(("family", "accumulate"), [("bert", 2), ("gpt", 1)])
def test_ddp_ranks_stay_identical_on_disjoint_data(tmp_path, family, accumulate):
    ranks = run_ddp(tmp_path, family, accumulate)
    for record in ranks:
        assert (record["strategy"], record["backend"]) == ("DDPStrategy", "gloo")
        assert (record["world_size"], record["global_step"]) == (2, STEPS)
        assert len(record["batches"]) == STEPS * accumulate

    # 1. Same weights on both ranks, at the start and after training, and training moved them.
    first, second = ranks
    assert first["final"].keys() == second["final"].keys() == first["initial"].keys()
    for name in first["final"]:
        assert torch.equal(first["initial"][name], second["initial"][name]), name
        assert torch.equal(first["final"][name], second["final"][name]), name
        assert not torch.equal(first["final"][name], first["initial"][name]), name

    # 2. Disjoint data: each rank trained on exactly its dataset's batches (0, 1, ... of epoch
    # 0), the ranks order the epoch's items alike, and no item went to both ranks.
    items = []
    for record in ranks:
        batches = record["batches"]
        assert [(b["epoch"], b["index"]) for b in batches] == [(0, i) for i in range(len(batches))]
        assert all(b["matches_dataset"] for b in batches)
        assert all(b["order"] == batches[0]["order"] for b in batches)
        items.append([item for b in batches for item in b["items"]])
    assert first["batches"][0]["order"] == second["batches"][0]["order"]
    for rank_items in items:
        assert len(rank_items) == len(set(rank_items)) > 0  # no repeats within a step run
    assert set(items[0]).isdisjoint(items[1])
    if family == "gpt":  # the windows' tokens differ too
        rows = [{tuple(r) for b in record["first_step_batches"] for r in b["input_ids"].tolist()} for record in ranks]
        assert rows[0].isdisjoint(rows[1])

    # 3. The first step's gradient (after DDP's all-reduce, the same on both ranks) is that of the
    # loss averaged over all predictions of the step's micro-batches on both ranks.
    micro_batches = first["first_step_batches"] + second["first_step_batches"]
    assert len(micro_batches) == 2 * accumulate
    expected = reference_gradients(family, first, micro_batches)
    for name, grad in first["first_step_grads"].items():
        assert torch.equal(grad, second["first_step_grads"][name]), name
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=name)

"""Two-process DDP on CPU (gloo): a real pretraining run (`PretrainModule` + `PretrainDataModule`,
launched by Lightning with a DDP strategy on 2 CPU devices, see `ddp_run.py`) keeps the ranks'
weights identical, gives the ranks disjoint data, and takes the gradient of the loss averaged
over every prediction of the step on both ranks (with gradient accumulation for BERT, whose
micro-batches predict unequal numbers of tokens)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from datamodules.corpora.corpus import EmbeddedCorpus
from models.config import BertConfig, GPTConfig
from pipeline.run.families import family_named
from tests.conftest import CLI_ENV, REPO
from tokenizer import batched, train_tokenizer

SCRIPT = Path(__file__).with_name("ddp_run.py")
# The runs of this module, (family, accumulate, optim, word vectors), trained one after another
# by one pair of DDP ranks (`ddp_records`).
RUNS = [
    ("bert", 2, "adamw", False),
    ("gpt", 1, "adamw", False),
    ("gpt", 2, "muon", False),
    ("bert", 1, "adamw", True),
]
# the four runs take ~30 s on an idle machine; ddp_run.py's own collective timeout is 120 s
TIMEOUT_S = 480
STEPS = 4


def failure_report(output: str) -> str:
    """Every rank's exception line first (the rank that crashed first is not always the last
    to print), then the end of the output."""
    errors = re.findall(r"^(?:\[rank\d+\]: )?\w*(?:Error|Exception)\b.*$", output, re.MULTILINE)
    return "\n".join(errors) + "\n--- end of output ---\n" + output[-3000:]


def run_ddp(tmp_path: Path, runs: list[tuple[str, int, str, bool]]) -> list[list[dict]]:
    """Train each run of `runs` ((family, accumulate, optim: adamw or muon, word_vectors=ppmi
    or not)) in turn with the same 2 DDP ranks; returns each run's records, one per rank (see
    `ddp_run.py`)."""
    # WordPiece/BPE training is not reproducible across processes: train once, here, and let
    # both ranks load the file.
    tokenizers = {}
    for family in sorted({family for family, *_ in runs}):
        vocab = 2000 if family == "bert" else 1000
        tokenizer = train_tokenizer(
            family_named(family).tokenizer_kind, batched(EmbeddedCorpus().documents()), vocab
        )
        tokenizers[family] = tmp_path / f"{family}-tokenizer.json"
        tokenizer.save(str(tokenizers[family]))
    settings, outs = [], []
    for i, (family, accumulate, optim, vectors) in enumerate(runs):
        outs.append(tmp_path / f"run{i}" / "out")
        outs[-1].mkdir(parents=True)
        settings.append(
            {
                "family": family,
                "tokenizer_json": str(tokenizers[family]),
                "cache_dir": str(tmp_path / f"run{i}" / "cache"),
                "out": str(outs[-1]),
                "steps": STEPS,
                "k": accumulate,
                "optim": optim,
                "word_vectors": vectors,
            }
        )
    (tmp_path / "runs.json").write_text(json.dumps(settings))
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "runs.json")],
        cwd=REPO,
        env={**CLI_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so that rank 1 is killed with it
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the DDP run did not finish in {TIMEOUT_S} s:\n{failure_report(output)}")
    assert process.returncode == 0, failure_report(output)
    missing = [(i, r) for i, out in enumerate(outs) for r in range(2) if not rank_file(out, r)]
    assert not missing, f"(run, rank) {missing} wrote no record:\n{failure_report(output)}"
    return [[torch.load(rank_file(out, r), weights_only=True) for r in range(2)] for out in outs]


def rank_file(out: Path, rank: int) -> Path | None:
    path = out / f"rank{rank}.pt"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def ddp_records(tmp_path_factory) -> dict[tuple[str, int, str, bool], list[dict]]:
    """The ranks' records of every run of RUNS, trained by one launch of 2 DDP processes."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    return dict(zip(RUNS, run_ddp(tmp_path, RUNS), strict=True))


def reference_gradients(family: str, record: dict, micro_batches: list[dict]) -> dict:
    """Gradients, at the initial weights, of the loss a step should optimize: each loss term's
    cross-entropy summed over the micro-batches of both ranks, divided by the number of its
    predictions there."""
    config = (BertConfig if family == "bert" else GPTConfig)(**record["model_config"])
    model = family_named(family).module_class(config, optimizer=None, scheduler=None).model
    model.load_state_dict(record["initial"])
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(term: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        sums[term] = sums.get(term, 0) + F.cross_entropy(logits, targets, reduction="sum")
        counts[term] = counts.get(term, 0) + len(targets)

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


@pytest.mark.parametrize(
    ("family", "accumulate", "optim"),
    [("bert", 2, "adamw"), ("gpt", 1, "adamw"), ("gpt", 2, "muon")],
)
def test_ddp_ranks_train_identical_weights_on_disjoint_data(ddp_records, family, accumulate, optim):
    ranks = ddp_records[(family, accumulate, optim, False)]
    first, second = ranks
    for record in ranks:
        assert (record["strategy"], record["backend"]) == ("DDPStrategy", "gloo")
        assert (record["world_size"], record["global_step"]) == (2, STEPS)
        assert len(record["batches"]) == STEPS * accumulate

    # 1. The same weights on both ranks, at the start and after training; training moved them.
    assert first["final"].keys() == second["final"].keys() == first["initial"].keys()
    for name, final in first["final"].items():
        assert torch.equal(first["initial"][name], second["initial"][name]), name
        assert torch.equal(final, second["final"][name]), f"{name} differs between the ranks"
        assert not torch.equal(final, first["initial"][name]), f"{name} was not trained"

    # 2. Disjoint data. Each rank trained on exactly its dataset's batches 0, 1, ... of epoch 0;
    # both read the same store in the same item order; no item, and no text, went to both.
    assert first["store"] == second["store"]
    assert first["order"] == second["order"]
    items, content = [], []
    for record in ranks:
        batches = record["batches"]
        assert [(b["epoch"], b["index"]) for b in batches] == [(0, i) for i in range(len(batches))]
        assert all(b["matches_dataset"] for b in batches), (
            "the loader's batches are not the dataset's"
        )
        items.append([item for b in batches for item in b["items"]])
        content.append([text for b in batches for text in b["content"]])
        assert len(set(items[-1])) == len(items[-1]) == len(set(content[-1]))
    shared = set(items[0]) & set(items[1])
    assert not shared, f"items {sorted(shared)} went to both ranks"
    assert set(content[0]).isdisjoint(content[1]), "the same text went to both ranks"

    # 3. The first step's gradient (after DDP's all-reduce: the same on both ranks) is that of
    # the loss averaged over every prediction of the step's micro-batches on both ranks.
    micro_batches = first["first_step_batches"] + second["first_step_batches"]
    assert len(micro_batches) == 2 * accumulate
    expected = reference_gradients(family, first, micro_batches)
    assert first["first_step_grads"].keys() == expected.keys()
    for name, grad in first["first_step_grads"].items():
        assert torch.equal(grad, second["first_step_grads"][name]), name
        torch.testing.assert_close(
            grad, expected[name], rtol=1e-4, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_ddp_ranks_start_from_the_same_counted_word_vectors(ddp_records):
    """word_vectors=ppmi with 2 ranks: the first counts, the others receive its vectors, and
    both replicas start from the same embedding, one whose counted rows all have the same norm
    (set_word_vectors scales each to the mean norm of the random rows), unlike a random one."""
    first, second = ddp_records[("bert", 1, "adamw", True)]
    name = "bert.embeddings.word.weight"
    assert torch.equal(first["initial"][name], second["initial"][name])
    norms = first["initial"][name].norm(dim=1)
    share_one_norm = ((norms - norms.median()).abs() < 1e-4).float().mean()
    assert share_one_norm > 0.5, f"only {share_one_norm:.0%} of the rows share the counted norm"

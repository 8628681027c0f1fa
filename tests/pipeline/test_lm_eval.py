"""lm-evaluation-harness on our exports: the task configs in lm_eval_tasks/ score BLiMP from the
local files exactly as `make evaluate-lm suite=blimp` does, pair for pair (`make lm-eval`); a
BERT export is refused before lm-eval is installed or run (those tests need no lm-eval)."""

from __future__ import annotations

import shlex

import pytest
import torch

from models.hf import export_hf
from pipeline.checkpoint.load import load_pretrained
from pipeline.commands.lm_eval_check import main as check_export
from pipeline.infer.blimp import answers, read_pairs
from pipeline.infer.sentence_scoring import SentenceScorer
from tests.conftest import CLI_ENV, REPO
from tests.pipeline.test_blimp import write_blimp
from tests.pipeline.test_cli import make_repo
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer

BLIMP = REPO.parent / "shared" / "data" / "blimp"  # where lm_eval_tasks/ reads it from
TASK_DIR = REPO / "lm_eval_tasks"
PHENOMENA = ["anaphor_gender_agreement", "determiner_noun_agreement_1", "wh_island"]
PAIRS = 8


def test_every_blimp_phenomenon_has_a_local_task():
    if not BLIMP.is_dir():
        pytest.skip(f"BLiMP not found at {BLIMP}")
    uids = {p.name.split(".")[0] for p in BLIMP.glob("*.jsonl.gz")}
    tasks = {
        p.stem for p in (TASK_DIR / "blimp_local").glob("*.yaml") if not p.stem.startswith("_")
    }
    assert tasks == uids
    group = (TASK_DIR / "blimp_local" / "_blimp_local.yaml").read_text()
    assert all(f"- blimp_local_{uid}\n" in group for uid in uids)


def test_lm_eval_agrees_with_our_scores_pair_for_pair(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval", reason="make lm-eval-setup installs lm-eval")
    if not BLIMP.is_dir():
        pytest.skip(f"BLiMP not found at {BLIMP}")
    monkeypatch.chdir(REPO)  # the task configs name the data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = trained_tokenizer("bpe")
    export_hf(tiny_model("gpt", tokenizer, seed=5), tmp_path / "hf", tokenizer=tokenizer)

    from lm_eval.tasks import TaskManager

    result = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
        tasks=[f"blimp_local_{uid}" for uid in PHENOMENA],
        limit=PAIRS,
        device="cpu",
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        log_samples=True,
    )
    pretrained = load_pretrained(tmp_path / "hf")
    scorer = SentenceScorer(pretrained, torch.device("cpu"))
    for uid in PHENOMENA:
        samples = sorted(result["samples"][f"blimp_local_{uid}"], key=lambda s: s["doc_id"])
        pairs = read_pairs(BLIMP, PAIRS, [uid])
        assert [s["doc"]["sentence_good"] for s in samples] == [p.good for p in pairs]
        theirs = [[r[0] for r in s["filtered_resps"]] for s in samples]
        ours_good = scorer([p.good for p in pairs])
        ours_bad = scorer([p.bad for p in pairs])
        assert [t[0] for t in theirs] == pytest.approx(ours_good, abs=1e-3)
        assert [t[1] for t in theirs] == pytest.approx(ours_bad, abs=1e-3)
        assert [s["acc"] == 1.0 for s in samples] == answers(pairs, scorer)


def test_make_lm_eval_refuses_a_bert_export_before_lm_eval_with_the_command_that_scores_it(
    tmp_path, capsys
):
    """`make lm-eval ckpt=<a BERT run>` stops at once (lm-eval would fail deep inside with a
    TypeError), without installing lm-eval, naming `make evaluate-lm ... suite=blimp`, which
    runs when pasted; a GPT export passes the same check."""
    tokenizer = trained_tokenizer("wordpiece")
    run = tmp_path / "bert"
    export_hf(tiny_model("bert", tokenizer), run / "hf", tokenizer=tokenizer)
    refused = make_repo("lm-eval", f"ckpt={run}", env=CLI_ENV)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "installing lm-evaluation-harness" not in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr and "lm_eval" not in refused.stdout
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert "is a masked language model (BertForPreTraining)" in error
    pasted = error.partition("score this one on BLiMP with: ")[2]
    assert shlex.split(pasted) == ["make", "evaluate-lm", f"ckpt={run}", "suite=blimp"]
    blimp = {"BLIMP_DIR": str(write_blimp(tmp_path / "blimp"))}
    scored = make_repo(*shlex.split(pasted)[1:], env=CLI_ENV | blimp)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "| **overall** |" in scored.stdout

    gpt = trained_tokenizer("bpe")
    export_hf(tiny_model("gpt", gpt), tmp_path / "gpt" / "hf", tokenizer=gpt)
    assert check_export([str(tmp_path / "gpt" / "hf"), str(tmp_path / "gpt")]) == 0
    assert check_export([str(tmp_path / "none"), str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err

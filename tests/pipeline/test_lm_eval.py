"""lm-evaluation-harness on our exports: the task configs in lm_eval_tasks/ score BLiMP from the
local files exactly as `make evaluate-lm suite=blimp` does, pair for pair (`make lm-eval`)."""

from __future__ import annotations

import pytest
import torch

from models.hf import export_hf
from pipeline.checkpoint.load import load_pretrained
from pipeline.infer.blimp import answers, read_pairs
from pipeline.infer.sentence_scoring import SentenceScorer
from tests.conftest import REPO
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="make lm-eval-setup installs lm-eval")

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

"""`make finetune` / `make evaluate` / `make predict` end to end on slices of the real GLUE data
and the long IMDB reviews, with tiny BERT and GPT checkpoints written as `make pretrain`
writes them."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from datamodules.tasks.labels import load_labels
from datamodules.tasks.spec import TaskSpec
from pipeline.checkpoint.load import load_backbone, load_finetuned
from pipeline.finetune.evaluation import evaluate, predict
from pipeline.finetune.run import finetune, split_metrics
from pipeline.finetune.settings import default_epochs, default_lr
from pipeline.run import folder as run_folder
from pipeline.run.errors import CheckpointLoadError, ConfigError
from tests.conftest import CONF, REPO, SHARED_DATA
from tests.pipeline.test_generate import run_cli
from tests.pipeline.tiny_models import write_run
from tokenizer import tokenizer_kind

GLUE = SHARED_DATA / "glue"
LONG_DOCS = SHARED_DATA / "long_docs"
pytestmark = pytest.mark.skipif(not GLUE.is_dir(), reason=f"GLUE data not found at {GLUE}")

# task config -> folder with train.tsv and dev.tsv in ../shared/data/glue
GLUE_TASKS = {
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "stsb": "STS-B",
    "rte": "RTE",
    "wnli": "WNLI",
}


def compose_config(name: str, *overrides: str, run_dir: Path | None = None):
    """conf/<name>.yaml composed as the CLI would, CPU-only, quiet, outputs in `run_dir`."""
    from pipeline.run.launcher import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            name,
            overrides=[
                "trainer.accelerator=cpu",
                "+trainer.enable_progress_bar=false",
                "+trainer.enable_model_summary=false",
                "logger=csv",
                *overrides,
            ],
        )
    OmegaConf.set_struct(cfg, False)
    cfg.paths.output_dir = str(run_dir or "unused")
    return cfg


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pretrained") / "bert"
    write_run(run, "bert")
    return run


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pretrained") / "gpt"
    write_run(run, "gpt")
    return run


QUICK = ("datamodule.max_examples=48", "datamodule.batch_size=16", "trainer.max_epochs=1")


def run_finetune(tmp_path, ckpt, *overrides, data_dir: Path | None = None):
    run_dir = tmp_path / "run"
    extra = [f"task.data_dir={data_dir}"] if data_dir is not None else []
    cfg = compose_config("finetune", f"ckpt={ckpt}", *QUICK, *extra, *overrides, run_dir=run_dir)
    return finetune(cfg), run_dir


# One batch of 16 examples (QUICK's batch size): for tests whose checks (a setting kept, an
# architecture, a file written) do not depend on how many steps train.
ONE_STEP = "datamodule.max_examples=16"


@pytest.fixture(scope="module")
def quick_run(bert_ckpt, tmp_path_factory):
    """`quick_run(task)`: (results, run folder) of the tiny BERT fine-tuned on a GLUE task with
    the QUICK settings, trained once for the module on first use and shared by the tests that
    read such a run (one that changes the folder copies it first)."""
    runs = {}

    def run(task: str):
        if task not in runs:
            folder = tmp_path_factory.mktemp(f"quick-{task}")
            runs[task] = run_finetune(
                folder, bert_ckpt, f"task={task}", data_dir=GLUE / GLUE_TASKS[task]
            )
        return runs[task]

    return run


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_every_glue_task_trains_and_reports_its_metrics(task, quick_run):
    results, run_dir = quick_run(task)
    on_disk = json.loads((run_dir / "results.json").read_text())
    assert on_disk == results.to_dict()
    spec = instantiate(compose_config("finetune", f"task={task}").task)
    metrics = results.best.metrics["dev"]
    assert set(spec.metrics) <= set(metrics)
    assert results.main_metric == spec.main_metric and results.main_split == "dev"
    for name in spec.metrics:
        low = -1.0 if name in ("matthews", "pearson", "spearman") else 0.0
        assert low <= metrics[name] <= 1.0
    assert results.best.step == 3  # 48 examples / 16 per batch, one epoch
    assert (run_dir / "checkpoints" / "best.ckpt").is_file()
    labels = load_labels(run_dir / "labels.json")
    assert labels.kind == spec.kind and list(labels.labels) == list(spec.labels or [])


def test_best_checkpoint_is_chosen_by_the_main_metric_and_evaluate_reproduces_it(
    bert_ckpt, tmp_path
):
    results, run_dir = run_finetune(
        tmp_path,
        bert_ckpt,
        "task=mrpc",
        "trainer.max_epochs=3",
        "task=sst2",
        "optim.lr=1e-3",  # big steps: the dev accuracy moves between epochs
        "datamodule.max_examples=96",
        data_dir=GLUE / "SST-2",
    )
    history = read_metrics(run_dir / "logs" / "metrics.csv", "val/dev/accuracy")
    assert len(history) == 3
    best_epoch = max(range(3), key=lambda e: (history[e], -e))  # the first of equal bests
    assert results.best.epoch == best_epoch + 1  # epochs are numbered from 1
    # One numbering in metrics.csv, results.json and the checkpoint: step N = after N steps.
    with open(run_dir / "logs" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("val/dev/accuracy")]
    steps_per_epoch = 96 // 16  # datamodule.batch_size=16 (QUICK)
    assert [(int(r["step"]), int(float(r["epoch"]))) for r in rows] == [
        (steps_per_epoch * e, e) for e in (1, 2, 3)
    ]
    best_row = rows[best_epoch]
    assert (int(best_row["step"]), int(float(best_row["epoch"]))) == (
        results.best.step,
        results.best.epoch,
    )
    saved = torch.load(results.best.checkpoint, weights_only=True)
    assert saved["global_step"] == results.best.step
    assert results.best.metrics["dev"]["accuracy"] == pytest.approx(history[best_epoch])
    assert results.final.metrics["dev"]["accuracy"] == pytest.approx(history[-1])

    cfg = compose_config(
        "evaluate", f"ckpt={run_dir}", "datamodule.max_examples=96", run_dir=tmp_path / "eval"
    )
    again = evaluate(cfg)
    for name, value in results.best.metrics["dev"].items():
        assert again["dev"][name] == pytest.approx(value, abs=1e-5), name
    assert json.loads((run_dir / "eval_sst2-max96.json").read_text())["metrics"] == again


def read_metrics(path: Path, column: str) -> list[float]:
    with open(path) as handle:
        return [float(row[column]) for row in csv.DictReader(handle) if row.get(column)]


def test_mnli_matched_and_mismatched_are_reported_apart(bert_ckpt, tmp_path):
    # conf/task/mnli.yaml on files in the MNLI layout, built from RTE rows; the mismatched dev
    # file has the labels flipped, so a pooled score would differ from each split's own.
    data = tmp_path / "mnli"
    data.mkdir()
    rows = [r.split("\t") for r in (GLUE / "RTE" / "dev.tsv").read_text().splitlines()[1:41]]
    to_mnli = {"entailment": "entailment", "not_entailment": "contradiction"}
    flip = {"entailment": "contradiction", "contradiction": "entailment"}
    header = "index\tsentence1\tsentence2\tgold_label"
    labelled = [[i, a, b, to_mnli[y]] for i, a, b, y in rows]
    for name, part in (
        ("train", labelled),
        ("dev_matched", labelled),
        ("dev_mismatched", [[i, a, b, flip[y]] for i, a, b, y in labelled]),
    ):
        lines = [header, *("\t".join(r) for r in part)]
        (data / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    results, run_dir = run_finetune(
        tmp_path, bert_ckpt, "task=mnli", "datamodule.eval_batch_size=7", data_dir=data
    )
    best = results.best.metrics
    assert set(best) == {"dev_matched", "dev_mismatched"}
    assert results.main_split == "dev_matched"
    # Each split's accuracy is that of the model's own predictions (make predict, rows put
    # back in file order across batches of 7) against that split's labels alone.
    for split, part in (("dev_matched", labelled), ("dev_mismatched", None)):
        gold = [r[3] for r in (part or [[i, a, b, flip[y]] for i, a, b, y in labelled])]
        cfg = compose_config(
            "predict",
            f"ckpt={run_dir}",
            f"predict.file={data / (split + '.tsv')}",
            f"predict.out_dir={tmp_path / split}",
            "datamodule.eval_batch_size=7",
        )
        [path] = predict(cfg)
        with open(path) as handle:
            rows = list(csv.DictReader(handle, delimiter="\t"))
        assert [r["index"] for r in rows] == [r[0] for r in labelled]
        accuracy = sum(r["prediction"] == y for r, y in zip(rows, gold, strict=True)) / len(gold)
        assert best[split]["accuracy"] == pytest.approx(accuracy), split


def test_gpt_backbone_fine_tunes_on_the_last_token(gpt_ckpt, tmp_path):
    results, run_dir = run_finetune(tmp_path, gpt_ckpt, "task=rte", ONE_STEP, data_dir=GLUE / "RTE")
    assert 0 <= results.best.metrics["dev"]["accuracy"] <= 1
    tuned = load_finetuned(run_dir)
    assert tuned.family == "gpt" and tokenizer_kind(tuned.tokenizer) == "bpe"


def test_from_scratch_keeps_the_architecture_but_not_the_weights(bert_ckpt, tmp_path):
    pretrained = load_backbone(bert_ckpt).model
    _, run_dir = run_finetune(
        tmp_path, bert_ckpt, "task=sst2", "from_scratch=true", ONE_STEP, data_dir=GLUE / "SST-2"
    )
    tuned = load_finetuned(run_dir).model.backbone
    assert tuned.config == pretrained.config
    word = "embeddings.word.weight"
    before = dict(pretrained.named_parameters())
    after = dict(tuned.named_parameters())
    name = next(n for n in after if n.endswith(word) or "word" in n)
    assert not torch.allclose(after[name], before[f"bert.{name}"], atol=1e-2)


def test_backbone_dropout_is_a_fine_tuning_setting_kept_with_the_model(bert_ckpt, tmp_path):
    pretrained = load_backbone(bert_ckpt).model.config
    _, run_dir = run_finetune(
        tmp_path,
        bert_ckpt,
        "task=sst2",
        "backbone.dropout=0.25",
        "from_scratch=true",  # the twin takes the same setting
        ONE_STEP,
        data_dir=GLUE / "SST-2",
    )
    tuned = load_finetuned(run_dir).model.backbone.config
    assert (tuned.dropout, tuned.attn_dropout) == (0.25, pretrained.attn_dropout)


def test_fine_tuned_model_can_be_fine_tuned_again(quick_run, tmp_path):
    _, first = quick_run("sst2")  # read only: fine-tuning it again writes elsewhere
    loaded = load_backbone(first)
    backbone = loaded.model
    tuned = load_finetuned(first).model.backbone
    assert backbone is tuned or torch.equal(next(backbone.parameters()), next(tuned.parameters()))
    assert (loaded.family, tokenizer_kind(loaded.tokenizer)) == ("bert", "wordpiece")
    results, _ = run_finetune(tmp_path / "b", first, "task=rte", ONE_STEP, data_dir=GLUE / "RTE")
    assert results.backbone == str(first)


def test_predict_writes_the_glue_submission_format(quick_run, tmp_path):
    _, run_dir = quick_run("rte")
    # GLUE's test.tsv: an index column and the texts, no label
    test = tmp_path / "test.tsv"
    rows = (GLUE / "RTE" / "dev.tsv").read_text().splitlines()[:11]
    test.write_text("\n".join("\t".join(r.split("\t")[:3]) for r in rows) + "\n")
    cfg = compose_config(
        "predict",
        f"ckpt={run_dir}",
        "task=rte",
        f"task.data_dir={tmp_path}",
        "task.predict.files={test: test.tsv}",
        f"predict.out_dir={tmp_path / 'out'}",
    )
    [path] = predict(cfg)
    assert path.name == "RTE.tsv"
    lines = path.read_text().splitlines()
    assert lines[0] == "index\tprediction"
    assert [line.split("\t")[0] for line in lines[1:]] == [r.split("\t")[0] for r in rows[1:]]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"entailment", "not_entailment"}


def test_evaluate_refuses_a_task_with_other_labels(quick_run):
    _, run_dir = quick_run("stsb")
    cfg = compose_config("evaluate", f"ckpt={run_dir}", "task=rte")
    with pytest.raises(ConfigError, match="does not match the model's head"):
        evaluate(cfg)


def test_evaluate_refuses_a_pretraining_checkpoint(bert_ckpt):
    cfg = compose_config("evaluate", f"ckpt={bert_ckpt}")
    with pytest.raises(CheckpointLoadError, match="fine-tune it first"):
        evaluate(cfg)


def test_custom_task_from_jsonl_collects_and_saves_its_labels(bert_ckpt, tmp_path):
    data = tmp_path / "reviews"
    data.mkdir()
    sentences = [
        line.split("\t") for line in (GLUE / "SST-2" / "train.tsv").read_text().splitlines()[1:91]
    ]
    stars = {"0": "bad", "1": "good"}
    for split, part in (("train", sentences[:60]), ("dev", sentences[60:])):
        with open(data / f"{split}.jsonl", "w") as handle:
            for text, label in part:
                handle.write(json.dumps({"review": text, "stars": stars[label]}) + "\n")
    results, run_dir = run_finetune(
        tmp_path,
        bert_ckpt,
        "task=custom",
        f"task.data_dir={data}",
        "task.files={train: train.jsonl, dev: dev.jsonl}",
        "task.text_columns=[review]",
        "task.label_column=stars",
    )
    assert list(load_labels(run_dir / "labels.json").labels) == ["bad", "good"]
    assert list(load_finetuned(run_dir).head.label_map.labels) == ["bad", "good"]
    assert "accuracy" in results.best.metrics["dev"]


def test_labels_spelled_two_ways_are_one_class_and_a_word_among_numbers_is_refused(
    bert_ckpt, tmp_path
):
    """`python -m pipeline.commands.finetune` on a CSV whose labels read 1, 1.0, 0, 0.0 and
    positive: refused with each label's rows; the `task.labels` of the message, pasted, trains
    three classes (1 and 1.0 are one)."""
    data = tmp_path / "reviews"
    data.mkdir()
    spellings = ["1", "1.0", "0", "0.0"] * 6
    for split, labels in (("train", [*spellings, "positive"]), ("dev", spellings[:8])):
        rows = "".join(f"review {i},{label}\n" for i, label in enumerate(labels))
        (data / f"{split}.csv").write_text("text,label\n" + rows)
    task = (
        "task=custom",
        f"task.data_dir={data}",
        "task.files={train: train.csv, dev: dev.csv}",
        "task.text_columns=[text]",
        "task.label_column=label",
        f"ckpt={bert_ckpt}",
        "trainer.max_epochs=1",
        "logger=csv",
        f"paths.output_root={tmp_path / 'out'}",
    )
    refused = run_cli("pipeline.commands.finetune", *task, "run_name=mixed", tmp_path=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "mix numbers and words: 0 (12 rows), 1 (12 rows), positive (1 row)" in error
    fix = shlex.split(re.search(r"list them in id order: (\S+)$", error)[1])
    pasted = run_cli("pipeline.commands.finetune", *task, *fix, "run_name=three", tmp_path=tmp_path)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    three = load_labels(tmp_path / "out/finetune/custom/three/labels.json")
    assert three.labels == ("0", "1", "positive")  # 1 and 1.0 one class, the word another


@pytest.mark.skipif(not LONG_DOCS.is_dir(), reason=f"long documents not found at {LONG_DOCS}")
@pytest.mark.parametrize(
    "mode",
    [
        ("task.long_text.mode=window", "task.long_text.aggregate=mean"),
        (
            "task.long_text.mode=window",
            "task.long_text.aggregate=attention",
            "task.long_text.train_chunks=2",
        ),
        (
            "task.long_text.mode=truncate",
            "task.long_text.truncate=head_tail",
            "task.long_text.head=16",
        ),
    ],
    ids=["window-mean", "window-attention", "truncate-head-tail"],
)
def test_long_documents_get_one_prediction_each(mode, bert_ckpt, tmp_path):
    overrides = (
        "task=imdb_long",
        f"task.data_dir={LONG_DOCS}",
        "datamodule.max_seq_len=64",
        "task.long_text.stride=48",
        "datamodule.max_examples=8",
        "datamodule.batch_size=4",
        *mode,
    )
    results, run_dir = run_finetune(tmp_path, bert_ckpt, *overrides)
    assert set(results.best.metrics["dev"]) >= {"accuracy", "f1"}
    # predict on a file of long documents: one row per document
    docs = tmp_path / "docs.jsonl"
    lines = (LONG_DOCS / "imdb_long_train.jsonl").read_text().splitlines()[:5]
    docs.write_text("\n".join(lines) + "\n")
    # evaluate needs no file to label (the task's predict settings are for predict only)
    scored = evaluate(compose_config("evaluate", f"ckpt={run_dir}", "datamodule.max_examples=4"))
    assert set(scored["dev"]) >= {"accuracy", "f1"}
    cfg = compose_config("predict", f"ckpt={run_dir}", f"predict.file={docs}")
    [path] = predict(cfg)
    with open(path) as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    assert [r["index"] for r in rows] == [json.loads(line)["id"] for line in lines]
    for row in rows:
        assert row["prediction"] in ("0", "1")
        assert float(row["p_0"]) + float(row["p_1"]) == pytest.approx(1.0, abs=1e-3)


def test_a_finished_run_folder_is_not_reused(bert_ckpt, quick_run, tmp_path):
    _, finished = quick_run("rte")
    shutil.copytree(finished, tmp_path / "run")  # where run_finetune(tmp_path, ...) runs
    with pytest.raises(ConfigError, match="already holds a fine-tuning run"):
        run_finetune(tmp_path, bert_ckpt, "task=rte", data_dir=GLUE / "RTE")


def test_sequences_longer_than_the_model_are_refused(bert_ckpt, tmp_path):
    with pytest.raises(ConfigError, match="exceeds the model's 128 positions"):
        run_finetune(tmp_path, bert_ckpt, "task=rte", "datamodule.max_seq_len=256")


def test_missing_ckpt_and_bad_task_settings_are_one_line_errors(tmp_path):
    out = f"paths.output_root={tmp_path / 'out'}"  # Hydra makes the run folder first
    result = run_cli("pipeline.commands.finetune", "task=rte", out, tmp_path=tmp_path)
    assert result.returncode == 2
    assert "error: ckpt is not set" in result.stderr
    result = run_cli(
        "pipeline.commands.finetune",
        "task=imdb_long",
        "ckpt=x",
        "task.long_text.aggregate=median",
        out,
        tmp_path=tmp_path,
    )
    assert result.returncode == 2 and "task.long_text.aggregate='median'" in result.stderr
    result = run_cli(
        "pipeline.commands.finetune", "task=rte", "ckpt=x", "optim.lr=-1", out, tmp_path=tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "error: optim.lr=-1: give a learning rate > 0, e.g. optim.lr=1e-4 (or optim.lr=null for the"
        in result.stderr
    )
    # neither refused attempt left its run folder behind
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


def test_a_refused_glue_suite_leaves_no_folder_and_keeps_one_that_holds_work(tmp_path):
    out = f"paths.output_root={tmp_path / 'out'}"
    missing = ("pipeline.commands.glue", "ckpt=nope", out)
    result = run_cli(*missing, "run_name=fresh", tmp_path=tmp_path)
    assert result.returncode == 2 and "ckpt='nope' does not exist" in result.stderr
    assert not (tmp_path / "out" / "glue" / "fresh").exists()
    kept = tmp_path / "out" / "glue" / "kept"
    (kept / "sst2").mkdir(parents=True)
    (kept / "sst2" / "results.json").write_text("{}")  # a finished run of an earlier attempt
    result = run_cli(*missing, "run_name=kept", tmp_path=tmp_path)
    assert result.returncode == 2
    assert (kept / "sst2" / "results.json").read_text() == "{}"


def test_a_folder_this_attempt_created_is_removed_only_while_it_holds_no_work(
    tmp_path, monkeypatch
):
    for made, removed in (
        ([".hydra/config.yaml", "finetune.log"], True),
        (
            [".hydra/config.yaml", "finetune.log", "checkpoints/last.ckpt"],
            False,
        ),
    ):
        run_dir = tmp_path / f"run-{removed}"
        for name in made:
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text("x")
        monkeypatch.setattr(run_folder, "_created_run_dir", run_dir)
        assert (run_folder.remove_unused_run_folder() == run_dir) == removed
        assert run_dir.exists() != removed
        assert run_folder.remove_unused_run_folder() is None  # forgotten once handled


def test_default_lr_and_epochs_follow_model_width(bert_ckpt):
    backbone = load_backbone(bert_ckpt).model
    assert default_lr(backbone.config) == 1e-4  # d_model 64
    assert default_epochs(backbone.config) == 10
    base = type(backbone.config)(vocab_size=100, n_layers=2, d_model=768, n_heads=12)
    assert default_lr(base) == 3e-5
    assert default_epochs(base) == 3


def test_null_epochs_train_the_widths_default(bert_ckpt, tmp_path):
    """trainer.max_epochs null (the config's default): the run trains default_epochs of its
    model (8 examples in batches of 4: 2 steps an epoch)."""
    cfg = compose_config(
        "finetune",
        f"ckpt={bert_ckpt}",
        "datamodule.max_examples=8",
        "datamodule.batch_size=4",
        run_dir=tmp_path / "run",
    )
    assert cfg.trainer.max_epochs is None
    results = finetune(cfg, announce=False)
    assert results.final.step == 2 * default_epochs(load_backbone(bert_ckpt).model.config)


def test_split_metrics_folds_lightning_dataloader_suffixes():
    logged = {
        "val/dev_matched/accuracy/dataloader_idx_0": 0.5,
        "val/dev_mismatched/accuracy/dataloader_idx_1": 0.25,
        "train/loss": 1.0,
    }
    assert split_metrics(logged, ["dev_matched", "dev_mismatched"]) == {
        "dev_matched": {"accuracy": 0.5},
        "dev_mismatched": {"accuracy": 0.25},
    }


def test_comma_separated_seeds_run_a_sweep_with_a_summary(bert_ckpt, tmp_path):
    result = run_cli(
        "pipeline.commands.finetune",
        "task=rte",
        f"task.data_dir={GLUE / 'RTE'}",
        f"ckpt={bert_ckpt}",
        "seed=1,2",
        "logger=csv",
        "datamodule.max_examples=16",
        "trainer.max_epochs=1",
        "trainer.accelerator=cpu",
        "+trainer.enable_progress_bar=false",
        f"paths.output_root={tmp_path / 'out'}",
        tmp_path=tmp_path,
        env={"WANDB_MODE": "disabled"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [sweep] = (tmp_path / "out" / "finetune" / "rte").glob("multirun_*")
    seeds = sorted(json.loads(p.read_text())["seed"] for p in sweep.glob("*/results.json"))
    assert seeds == [1, 2]
    [row] = json.loads((sweep / "sweep_summary.json").read_text())
    assert row["seeds"] == [1, 2] and row["setting"] == "(default)"
    assert "sweep summary (median and spread over seeds)" in result.stdout


# ----------------------------------------------------------------------------------------------
# make evaluate / make predict as a user types them


def ours(folder: Path) -> list[str]:
    """What is in `folder` (a TMPDIR), less torch's compile cache that importing torch makes."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("torchinductor"))


@pytest.fixture(scope="module")
def sst2_run(quick_run) -> Path:
    """A fine-tuned SST-2 model (48 examples read, as `datamodule.max_examples=48`)."""
    _, run_dir = quick_run("sst2")
    return run_dir


def test_predict_on_a_glue_dev_file_without_an_index_numbers_the_rows(sst2_run, tmp_path):
    """SST-2's dev.tsv has no `index` column (its test.tsv does): rows are numbered from 0.
    Nothing is written but the predictions: no run folder, nothing in TMPDIR or the cwd."""
    rows = (GLUE / "SST-2" / "dev.tsv").read_text().splitlines()[:6]
    texts = tmp_path / "texts.tsv"
    texts.write_text("\n".join(rows) + "\n")
    out = tmp_path / "predicted"
    result = run_cli(
        "pipeline.commands.predict",
        f"ckpt={sst2_run}",
        f"predict.file={texts}",
        f"predict.out_dir={out}",
        tmp_path=tmp_path,  # TMPDIR
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "predictions.tsv") as handle:
        predicted = list(csv.DictReader(handle, delimiter="\t"))
    assert [r["index"] for r in predicted] == [str(i) for i in range(5)]
    assert ours(tmp_path) == ["predicted", "texts.tsv"]


def test_predict_errors_print_hints_that_work_when_pasted(sst2_run, tmp_path):
    """The task's test file is missing: the error names `task.predict.files.test` and
    `task.data_dir`; pasted onto `make predict` (no task=), each amends the saved task."""
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = run_cli("pipeline.commands.predict", f"ckpt={sst2_run}", tmp_path=tmp_path)
    assert missing.returncode == 2, missing.stderr[-3000:]
    [error] = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    assert "task.data_dir=DIR" in error and "task.predict.files.test=FILE" in error
    test = tmp_path / "glue"
    test.mkdir()
    rows = (GLUE / "SST-2" / "dev.tsv").read_text().splitlines()[:4]
    (test / "test.tsv").write_text(
        "index\tsentence\n"
        + "".join(f"{i}\t{r.split(chr(9))[0]}\n" for i, r in enumerate(rows[1:]))
    )
    for hint in (f"task.data_dir={test}", f"task.predict.files.test={test / 'test.tsv'}"):
        out = tmp_path / hint.split("=")[0]
        pasted = run_cli(
            "pipeline.commands.predict",
            f"ckpt={sst2_run}",
            hint,
            f"predict.out_dir={out}",
            tmp_path=tmp_path,
        )
        assert pasted.returncode == 0, (hint, pasted.stderr[-3000:])
        assert len((out / "SST-2.tsv").read_text().splitlines()) == 1 + 3


def test_predict_reads_a_test_file_path_typed_from_the_working_directory(sst2_run, tmp_path):
    """`task.predict.files.test=PATH` with a folder in it is read from where the command runs,
    not from the task's data_dir (a path relative to the working directory used to come out
    as `<data_dir>/<path>`); the error's hint for a file there, pasted, reads it."""
    here = tmp_path / "here"
    here.mkdir()
    rows = (GLUE / "SST-2" / "dev.tsv").read_text().splitlines()[1:4]
    (here / "test.tsv").write_text(
        "index\tsentence\n" + "".join(f"{i}\t{r.split(chr(9))[0]}\n" for i, r in enumerate(rows))
    )
    relative = os.path.relpath(here / "test.tsv", REPO)  # typed from the repository
    out = tmp_path / "out"
    typed = run_cli(
        "pipeline.commands.predict",
        f"ckpt={sst2_run}",
        f"task.predict.files.test={relative}",
        f"predict.out_dir={out}",
        tmp_path=tmp_path,
    )
    assert typed.returncode == 0, typed.stderr[-3000:]
    assert len((out / "SST-2.tsv").read_text().splitlines()) == 1 + 3
    missing = run_cli("pipeline.commands.predict", f"ckpt={sst2_run}", tmp_path=tmp_path, cwd=here)
    assert missing.returncode == 2, missing.stderr[-3000:]
    [error] = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
    hint = re.search(r"\./test\.tsv exists: (\S+)$", error)
    assert hint is not None, error
    pasted = run_cli(
        "pipeline.commands.predict",
        f"ckpt={sst2_run}",
        *shlex.split(hint[1]),
        "predict.out_dir=pasted",
        tmp_path=tmp_path,
        cwd=here,
    )
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert len((here / "pasted" / "SST-2.tsv").read_text().splitlines()) == 1 + 3


def test_predict_on_a_task_without_test_files_asks_for_predict_file(bert_ckpt, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = (GLUE / "SST-2" / "train.tsv").read_text().splitlines()
    (data / "train.tsv").write_text("\n".join(rows[:41]) + "\n")
    (data / "dev.tsv").write_text("\n".join(rows[:1] + rows[41:61]) + "\n")
    _, run_dir = run_finetune(
        tmp_path,
        bert_ckpt,
        "task=custom",
        f"task.data_dir={data}",
        "task.files={train: train.tsv, dev: dev.tsv}",
        "task.text_columns=[sentence]",
        "task.label_column=label",
    )
    result = run_cli("pipeline.commands.predict", f"ckpt={run_dir}", tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "give one with predict.file=PATH" in result.stderr and "sentence" in result.stderr


def test_evaluate_says_which_examples_it_scored(sst2_run, tmp_path):
    dev = len((GLUE / "SST-2" / "dev.tsv").read_text().splitlines()) - 1
    result = run_cli("pipeline.commands.evaluate", f"ckpt={sst2_run}", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("sst2 dev (")]
    assert line.startswith(f"sst2 dev ({dev:,} examples): ") and "accuracy" in line
    assert "fine-tuned with datamodule.max_examples=48" in result.stdout
    record = json.loads((sst2_run / "eval_sst2.json").read_text())
    assert record["examples"] == {"dev": dev} and record["max_examples"] is None
    cut = run_cli(
        "pipeline.commands.evaluate",
        f"ckpt={sst2_run}",
        "datamodule.max_examples=10",
        tmp_path=tmp_path,
    )
    assert "sst2 dev (10 examples)" in cut.stdout
    assert "scored the first 10 examples of each split" in cut.stdout
    assert ours(tmp_path) == []  # no folder of its own, in TMPDIR or elsewhere
    # results of other settings go to a file of their own; the same settings replace, saying so
    assert f"written to {sst2_run / 'eval_sst2-max10.json'}\n" in cut.stdout
    assert json.loads((sst2_run / "eval_sst2-max10.json").read_text())["examples"] == {"dev": 10}
    assert json.loads((sst2_run / "eval_sst2.json").read_text()) == record
    again = run_cli("pipeline.commands.evaluate", f"ckpt={sst2_run}", tmp_path=tmp_path)
    assert "(replacing an evaluation with the same settings)" in again.stdout
    assert json.loads((sst2_run / "eval_sst2.json").read_text())["metrics"] == record["metrics"]


def test_evaluations_with_other_settings_get_other_file_names():
    from pipeline.finetune.evaluation import evaluation_file_name, evaluation_settings

    task = TaskSpec(
        name="sst2",
        data_dir="glue/SST-2",
        text_columns=["sentence"],
        label_column="label",
        files={"train": "t.tsv", "dev": "d.tsv"},
    )
    default = evaluation_settings(task, {"max_seq_len": 128, "max_examples": None})
    names = {
        evaluation_file_name("sst2", evaluation_settings(t, settings), default)
        for t, settings in (
            (task, {"max_seq_len": 128, "max_examples": None}),
            (task, {"max_seq_len": 128, "max_examples": 10}),
            (task, {"max_seq_len": 256, "max_examples": 10}),
            (dataclasses.replace(task, data_dir="elsewhere"), {"max_seq_len": 128}),
            (dataclasses.replace(task, files={"dev": "other.tsv"}), {"max_seq_len": 128}),
        )
    }
    assert "eval_sst2.json" in names and "eval_sst2-max10.json" in names
    assert "eval_sst2-max10-len256.json" in names and len(names) == 5


def test_a_regression_task_needs_only_its_kind(bert_ckpt, tmp_path):
    """`task.kind=regression` picks Spearman (main) and Pearson, as STS-B reports them."""
    data = tmp_path / "pairs"
    data.mkdir()
    lines = (GLUE / "STS-B" / "train.tsv").read_text().splitlines()
    for split, part in (("train", lines[1:49]), ("dev", lines[49:73])):
        (data / f"{split}.tsv").write_text("\n".join([lines[0], *part]) + "\n")
    results, _ = run_finetune(
        tmp_path,
        bert_ckpt,
        "task=custom",
        f"task.data_dir={data}",
        "task.files={train: train.tsv, dev: dev.tsv}",
        "task.text_columns=[sentence1,sentence2]",
        "task.label_column=score",
        "task.kind=regression",
    )
    assert results.main_metric == "spearman"
    assert set(results.best.metrics["dev"]) >= {"spearman", "pearson"}


def test_fine_tuning_past_the_pretrained_length_warns_and_records_the_new_length(tmp_path, caplog):
    """A checkpoint pretrained on 32-token sequences, fine-tuned on 64: a warning names both
    lengths, and the fine-tuned checkpoint records 64 as trained."""
    run = tmp_path / "short"
    *_, path = write_run(run, "bert")
    saved = torch.load(path, weights_only=True)
    saved["trained_seq_len"] = 32
    torch.save(saved, path)
    with caplog.at_level(logging.WARNING):
        results, run_dir = run_finetune(
            tmp_path,
            run,
            "task=rte",
            "datamodule.max_seq_len=64",
            ONE_STEP,  # the positions, not the steps, are what is checked
            data_dir=GLUE / "RTE",
        )
    warned = [r.getMessage() for r in caplog.records if "positions 32-63" in r.getMessage()]
    assert len(warned) == 1 and "sequences of up to 64 tokens" in warned[0]
    tuned = torch.load(results.best.checkpoint, weights_only=True)
    assert tuned["trained_seq_len"] == 64
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # within the length trained: quiet
        run_finetune(
            tmp_path / "again",
            run_dir,
            "task=rte",
            "datamodule.max_seq_len=64",
            ONE_STEP,
            data_dir=GLUE / "RTE",
        )
    assert not [r for r in caplog.records if "start untrained" in r.getMessage()]


def test_a_refused_fine_tuning_rerun_leaves_the_folder_as_it_was(tmp_path):
    """Refused before Hydra writes: no .hydra/ record or log over the finished run's."""
    run_dir = tmp_path / "out" / "finetune" / "rte" / "done"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text("{}\n")
    result = run_cli(
        "pipeline.commands.finetune",
        "task=rte",
        "ckpt=anything",
        "run_name=done",
        f"paths.output_root={tmp_path / 'out'}",
        tmp_path=tmp_path,
    )
    assert result.returncode == 2 and "already holds a fine-tuning run" in result.stderr
    assert [p.name for p in run_dir.iterdir()] == ["results.json"]

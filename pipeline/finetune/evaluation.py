"""`make evaluate` and `make predict`: a fine-tuned model's dev metrics, and its labels for
unlabelled texts.

Both read the task the model was fine-tuned on from its checkpoint (`task.*` settings amend it,
`task=<name>` replaces it) and write only beside the model: `eval_<task>*.json` (a file per
evaluation settings, `evaluation_file_name`) and `predictions/`.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from datamodules.tasks.labels import LabelMap
from datamodules.tasks.spec import TaskSpec
from pipeline.checkpoint.load import Finetuned, load_finetuned
from pipeline.checkpoint.source import resolve_checkpoint
from pipeline.finetune.results import Evaluation
from pipeline.finetune.run import merge, split_metrics
from pipeline.finetune.settings import (
    build_datamodule,
    check_datamodule_keys,
    task_from,
    warn_untrained_positions,
)
from pipeline.finetune.task_module import TaskModule
from pipeline.run.errors import ConfigError
from pipeline.run.folder import run_folder_of
from pipeline.training.precision import best_precision
from tokenizer import atomic_path

log = logging.getLogger(__name__)


def saved_or_given(cfg: DictConfig, tuned: Finetuned) -> tuple[TaskSpec, dict[str, Any]]:
    """The task and batch settings of an evaluate/predict run.

    The task is the one given on the command line (`task=<name>`), else the one the model was
    fine-tuned on (saved in its checkpoint, long-text settings included) with the command
    line's `task.*` settings on top (`task.data_dir=DIR`, which `pipeline.run.cli.entry_point`
    passes as `+task.data_dir`: a node without `_target_`). `datamodule.max_seq_len` null
    means the fine-tuning value; the other batch settings are the command line's."""
    saved = OmegaConf.create(tuned.config)
    given = cfg.get("task")
    chosen = given is not None and "_target_" in given
    task_node = given if chosen else saved.get("task")
    if task_node is None:
        raise ConfigError(f"{tuned.source} records no task; give one with task=<name>")
    if given is not None and not chosen:
        task_node = OmegaConf.merge(task_node, given)
    task = task_from(task_node)
    saved_long_text = OmegaConf.select(saved, "task.long_text")
    if chosen and saved_long_text is not None:
        # the head was trained on windows (or truncations) of this shape: keep it
        task = dataclasses.replace(task, long_text=task_from(saved.task).long_text)
    settings = dict(OmegaConf.to_container(cfg.datamodule, resolve=True))
    if settings.get("max_seq_len") is None:
        settings["max_seq_len"] = OmegaConf.select(saved, "datamodule.max_seq_len", default=128)
    return task, settings


def check_labels(task: TaskSpec, model_labels: LabelMap) -> None:
    given = LabelMap(task.kind, tuple(task.labels or ())) if task.labels is not None else None
    if model_labels.kind != task.kind or (given is not None and given != model_labels):
        raise ConfigError(
            f"task {task.name!r} ({task.kind}, labels {task.labels}) does not match the model's "
            f"head ({model_labels.kind}, labels {list(model_labels.labels)}); evaluate on the "
            "task it was fine-tuned on"
        )


def inference_setup(cfg: DictConfig, *, predicting: bool = False):
    """The fine-tuned model, its task, datamodule and a Trainer; with `predicting`, the
    datamodule also reads the unlabelled texts (`predict.file`, else `task.predict.files`)."""
    check_datamodule_keys(cfg)
    tuned = load_finetuned(resolve_checkpoint(cfg.ckpt, fine_tuned=True))  # read once
    task, settings = saved_or_given(cfg, tuned)
    check_labels(task, tuned.head.label_map)
    windowed = task.long_text is not None and task.long_text.mode == "window"
    if windowed != (tuned.head.aggregate is not None):
        raise ConfigError(
            f"task {task.name!r} {'splits' if windowed else 'does not split'} documents into "
            f"sliding windows, but the model was fine-tuned {'with' if not windowed else 'without'} "
            "them; use the task settings it was fine-tuned with (leave task= out)"
        )
    if tuned.head.siamese and not task.is_pair:
        raise ConfigError(
            f"task {task.name!r} has one text column, but the model reads pairs of texts apart "
            "(head.siamese); use a pair task (leave task= out for the one it was fine-tuned on)"
        )
    predict_task = task.prediction_spec(cfg.predict.file) if predicting else None
    module = TaskModule(tuned.model, tuned.head, task.eval_splits).eval()
    datamodule = build_datamodule(
        task,
        tuned.tokenizer,
        settings,
        cfg.seed,
        label_map=tuned.head.label_map,
        predict_task=predict_task,
        siamese=tuned.head.siamese,
        family=tuned.family,
    )
    warn_untrained_positions(datamodule.sequence_length, tuned.trained_seq_len, tuned.source)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=1,
        precision=cfg.trainer.precision or best_precision(),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return tuned, task, settings, module, datamodule, trainer


def evaluate(cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Dev metrics of a fine-tuned model; printed and written beside its checkpoint."""
    tuned, task, settings, module, datamodule, trainer = inference_setup(cfg)
    datamodule.setup("validate")
    metrics = split_metrics(
        merge(trainer.validate(module, datamodule=datamodule, verbose=False)),
        datamodule.eval_splits,
    )
    scored = {split: len(datamodule.examples(split)) for split in datamodule.eval_splits}
    limit = cfg.datamodule.get("max_examples")
    evaluated = evaluation_settings(task, settings)
    out = run_folder_of(tuned.source) / evaluation_file_name(
        task.name, evaluated, evaluation_settings(*saved_or_given(DEFAULT_EVALUATION, tuned))
    )
    replaces = out.is_file()
    evaluation = Evaluation(
        task=task.name,
        checkpoint=str(tuned.source),
        metrics=metrics,
        examples=scored,
        max_examples=limit,
        settings=evaluated,
    )
    evaluation.write(out)
    for split, values in metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in values.items())
        print(f"{task.name} {split} ({scored[split]:,} examples): {shown}")
    tuned_limit = OmegaConf.select(OmegaConf.create(tuned.config), "datamodule.max_examples")
    if limit is not None:
        print(f"scored the first {limit:,} examples of each split (datamodule.max_examples)")
    elif tuned_limit is not None:
        print(
            f"scored every example; the model was fine-tuned with datamodule.max_examples="
            f"{tuned_limit} (its dev scores during fine-tuning were on the first {tuned_limit})"
        )
    print(
        f"written to {out}"
        + (" (replacing an evaluation with the same settings)" if replaces else "")
    )
    return metrics


# `make evaluate ckpt=...` with nothing else: the task and settings the model was fine-tuned with,
# every example.
DEFAULT_EVALUATION = OmegaConf.create({"datamodule": {"max_seq_len": None, "max_examples": None}})
# The datamodule settings that change an evaluation's result (the rest, batch sizes and workers,
# change only its speed).
SCORING_SETTINGS = ("max_seq_len", "max_examples")


def evaluation_settings(task: TaskSpec, settings: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation's result depends on besides the checkpoint: the task (files, splits,
    columns, long-text settings) and the scoring settings, as plain data."""
    return {
        "task": json.loads(json.dumps(dataclasses.asdict(task), default=str)),
        **{key: settings.get(key) for key in SCORING_SETTINGS},
    }


def evaluation_file_name(task: str, settings: dict[str, Any], default: dict[str, Any]) -> str:
    """`eval_<task>.json` for the default evaluation; an evaluation with other settings gets a
    name of its own, so that results that differ are never written over each other:
    `eval_<task>-max<N>-len<L>.json` names the scoring settings that differ, and a hash of the
    settings is added when anything else does (another task file, split or data folder)."""
    parts = [f"eval_{task}"]
    if settings["max_examples"] is not None:
        parts.append(f"max{settings['max_examples']}")
    if settings["max_seq_len"] != default["max_seq_len"]:
        parts.append(f"len{settings['max_seq_len']}")
    if settings["task"] != default["task"]:
        digest = hashlib.sha256(json.dumps(settings["task"], sort_keys=True).encode())
        parts.append(digest.hexdigest()[:8])
    return "-".join(parts) + ".json"


def predict(cfg: DictConfig) -> list[Path]:
    """Predictions for the task's unlabelled splits (or `predict.file`), one file per split:
    GLUE submission TSVs (`index`, `prediction`), or for `predict.file` one row per document
    with the class probabilities too."""
    file = cfg.predict.file
    tuned, task, _, module, datamodule, trainer = inference_setup(cfg, predicting=True)
    datamodule.setup("predict")
    outputs = trainer.predict(module, datamodule=datamodule)
    if len(datamodule.predict_splits) == 1:
        outputs = [outputs]
    out_dir = (
        Path(cfg.predict.out_dir)
        if cfg.predict.out_dir
        else run_folder_of(tuned.source) / "predictions"
    )
    label_map = module.head.label_map
    written = []
    for split, batches in zip(datamodule.predict_splits, outputs, strict=True):
        order = torch.cat([b["example_index"] for b in batches])
        scores = torch.cat([b["scores"] for b in batches])[order.argsort()]
        examples = datamodule.examples(split)
        name = "predictions.tsv" if file else task.submission_name(split)
        path = out_dir / name
        write_predictions(path, examples, scores, label_map, with_scores=bool(file))
        written.append(path)
        print(f"{split}: {len(examples):,} predictions -> {path}")
    return written


def write_predictions(
    path: Path, examples, scores: torch.Tensor, label_map: LabelMap, *, with_scores: bool
) -> None:
    if label_map.kind == "regression":
        values = [f"{float(v):.4f}" for v in scores.squeeze(-1)]
        header, extra = ["index", "prediction"], [[] for _ in values]
    else:
        ids = scores.argmax(-1).tolist()
        values = [label_map.labels[i] for i in ids]
        probs = scores.softmax(-1)
        header = ["index", "prediction"] + (
            [f"p_{label}" for label in label_map.labels] if with_scores else []
        )
        extra = [[f"{p:.4f}" for p in row.tolist()] if with_scores else [] for row in probs]
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, delimiter="\t", lineterminator="\n")
        writer.writerow(header)
        for example, value, more in zip(examples, values, extra, strict=True):
            writer.writerow([example.id, value, *more])

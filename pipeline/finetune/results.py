"""The records of fine-tuning: `results.json` of a run, one definition through which
fine-tuning writes it (`pipeline.finetune.run`) and the sweep summary and the report read it;
`eval_<task>*.json`, what `make evaluate` measured (`pipeline.finetune.evaluation`); and a
suite task's `baselines.json`, its non-neural baselines' scores (`pipeline.finetune.baselines`).
Each is written and read through its dataclass, in the file form it always had.

    results = FinetuneResults.read(run_dir / RESULTS)
    results.main_score()            # the main metric on the main split, at the best checkpoint
    results.scores("final")         # split -> the main metric, at the end of training
    Evaluation.read(run_dir / "eval_sst2.json").metrics

Steps and epochs are numbered from 1 (step N: after N optimizer steps), as every log names them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run.errors import ResultsError
from tokenizer import write_text_atomic

Metrics = dict[str, dict[str, float]]  # split -> metric -> value
Scores = dict[str, float]  # metric -> value


def write_record(path: str | os.PathLike, data: Any) -> None:
    """Write a record as JSON indented by two, atomically (a reader never sees half a file)."""
    write_text_atomic(Path(path), json.dumps(data, indent=2) + "\n")


def read_record(
    path: str | os.PathLike, error: type[Exception] = ResultsError, fix: str = ""
) -> Any:
    """The parsed JSON of a record file.

    Raises:
        error: naming the file, when it cannot be read or is not JSON (`fix` is added).
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise error(f"{path} is not readable JSON ({err}){fix}") from err


@dataclass(frozen=True)
class BestCheckpoint:
    """The checkpoint chosen by the main metric: when it was saved and its metrics."""

    epoch: int
    step: int
    checkpoint: str
    metrics: Metrics


@dataclass(frozen=True)
class FinalScores:
    """The metrics at the end of training."""

    step: int
    metrics: Metrics


@dataclass(frozen=True)
class FinetuneResults:
    """What a fine-tuning run reached, as `results.json` holds it (in this field order).

    Attributes:
        task: the task name.
        seed: the run's seed.
        lr: the peak learning rate it trained with.
        init: the pretrained model, or "random" for a from-scratch twin.
        backbone: the model whose architecture (and, unless random, weights) it started from.
        main_metric: the metric that chose the best checkpoint.
        main_split: the evaluation split it was chosen on.
        overrides: the command-line overrides (a sweep groups its jobs by them).
        best: the best checkpoint.
        final: the end of training.
    """

    task: str
    seed: int
    lr: float
    init: str
    backbone: str
    main_metric: str
    main_split: str
    overrides: list[str]
    best: BestCheckpoint
    final: FinalScores

    def scores(self, which: str = "best") -> dict[str, float]:
        """split -> the main metric, at the best checkpoint or at the end ("final")."""
        metrics = self.best.metrics if which == "best" else self.final.metrics
        return {s: m[self.main_metric] for s, m in metrics.items() if self.main_metric in m}

    def main_score(self, which: str = "best") -> float | None:
        """The main metric on the main split (None if it was not scored)."""
        return self.scores(which).get(self.main_split)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        write_record(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, source: object = "results") -> FinetuneResults:
        """The record of a parsed results.json. Fields that files written by earlier versions
        (or by hand) lack get neutral values; the task, the main metric and the best metrics
        are required.

        Raises:
            ResultsError: naming `source` and what is missing or malformed.
        """
        if not isinstance(data, dict):
            raise ResultsError(f"{source}: expected a JSON object, got {type(data).__name__}")
        best, final = data.get("best") or {}, data.get("final") or {}
        try:
            metrics = _metrics(best["metrics"])
            return cls(
                task=str(data["task"]),
                seed=int(data.get("seed", 0)),
                lr=float(data.get("lr", 0.0)),
                init=str(data.get("init", "")),
                backbone=str(data.get("backbone", data.get("init", ""))),
                main_metric=str(data["main_metric"]),
                main_split=str(data.get("main_split") or next(iter(metrics), "dev")),
                overrides=[str(o) for o in data.get("overrides", [])],
                best=BestCheckpoint(
                    epoch=int(best.get("epoch", 0)),
                    step=int(best.get("step", 0)),
                    checkpoint=str(best.get("checkpoint", "")),
                    metrics=metrics,
                ),
                final=FinalScores(
                    step=int(final.get("step", 0)), metrics=_metrics(final.get("metrics", {}))
                ),
            )
        except KeyError as err:
            raise ResultsError(f"{source}: no {err.args[0]!r} entry") from err
        except (TypeError, ValueError, AttributeError) as err:
            raise ResultsError(f"{source}: malformed ({err})") from err

    @classmethod
    def read(cls, path: str | os.PathLike) -> FinetuneResults:
        return cls.from_dict(read_record(path), source=path)


def _metrics(value: Any) -> Metrics:
    return {str(split): {str(k): float(v) for k, v in m.items()} for split, m in value.items()}


@dataclass(frozen=True)
class Evaluation:
    """What `make evaluate` measured, as `eval_<task>*.json` holds it (in this field order).

    Attributes:
        task: the task name.
        checkpoint: the fine-tuned checkpoint evaluated.
        metrics: split -> metric -> value.
        examples: split -> how many examples were scored.
        max_examples: the cap on examples per split (`datamodule.max_examples`), or None.
        settings: what the result depends on besides the checkpoint (the task, the scoring
            settings), which names the file (`evaluation_file_name`).
    """

    task: str
    checkpoint: str
    metrics: Metrics
    examples: dict[str, int]
    max_examples: int | None
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        write_record(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, source: object = "evaluation") -> Evaluation:
        """The record of a parsed eval_<task>.json; the task and the metrics are required.

        Raises:
            ResultsError: naming `source` and what is missing or malformed.
        """
        if not isinstance(data, dict):
            raise ResultsError(f"{source}: expected a JSON object, got {type(data).__name__}")
        try:
            limit = data.get("max_examples")
            return cls(
                task=str(data["task"]),
                checkpoint=str(data.get("checkpoint", "")),
                metrics=_metrics(data["metrics"]),
                examples={str(k): int(v) for k, v in (data.get("examples") or {}).items()},
                max_examples=None if limit is None else int(limit),
                settings=dict(data.get("settings") or {}),
            )
        except KeyError as err:
            raise ResultsError(f"{source}: no {err.args[0]!r} entry") from err
        except (TypeError, ValueError, AttributeError) as err:
            raise ResultsError(f"{source}: malformed ({err})") from err

    @classmethod
    def read(cls, path: str | os.PathLike) -> Evaluation:
        return cls.from_dict(read_record(path), source=path)


@dataclass(frozen=True)
class Baselines:
    """A task's non-neural baselines, as `baselines.json` holds them: baseline name -> its dev
    metrics (metric -> value)."""

    scores: dict[str, Scores]

    def best(self, score: Callable[[Scores], float]) -> tuple[str, float]:
        """The baseline whose metrics `score` highest, and that score."""
        name = max(self.scores, key=lambda n: score(self.scores[n]))
        return name, score(self.scores[name])

    def write(self, path: str | os.PathLike) -> None:
        write_record(path, self.scores)

    @classmethod
    def from_dict(cls, data: Any, source: object = "baselines") -> Baselines:
        """The scores of a parsed baselines.json.

        Raises:
            ResultsError: naming `source`, for anything but names mapped to metrics.
        """
        try:
            return cls({str(n): {str(k): float(v) for k, v in m.items()} for n, m in data.items()})
        except (TypeError, ValueError, AttributeError) as err:
            raise ResultsError(
                f"{source}: malformed ({err}); expected baseline names mapped to their metrics"
            ) from err

    @classmethod
    def read(cls, path: str | os.PathLike) -> Baselines:
        """The scores in file `path`.

        Raises:
            ResultsError: naming the file: not readable JSON, or not baselines' scores.
        """
        return cls.from_dict(read_record(path), source=path)

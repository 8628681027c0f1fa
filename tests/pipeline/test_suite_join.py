"""Joining the tables of several `make glue` folders (`pipeline.suites.summary.summarize_suites`):
suites of one checkpoint and settings that ran other tasks side by side make one table with one
average; anything else keeps a table of its own. Folders are written by hand, no training."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pipeline.commands.report import main as report_main
from pipeline.finetune.results import BestCheckpoint, FinalScores, FinetuneResults
from pipeline.run.errors import SuiteRecordError
from pipeline.run.folder import RESULTS, SUITE_RECORD
from pipeline.suites.summary import BASELINES, summarize_suite, summarize_suites

SETTINGS = {"optim": {"lr": 1e-4}}


def write_suite(
    folder: Path,
    scores: dict[str, dict[str, list[float]]],
    ckpt: str = "outputs/bert/a",
    settings: dict = SETTINGS,
    task_settings: dict | None = None,
    first_seed: int = 1,
) -> Path:
    """A suite folder as `make glue` leaves it: task -> init -> accuracy per seed (first_seed,
    first_seed + 1, ...)."""
    seeds = sorted({n for inits in scores.values() for s in inits.values() for n in range(len(s))})
    record = {
        "ckpt": ckpt,
        "tasks": {t: task_settings or {} for t in scores},
        "seeds": [s + first_seed for s in seeds],
    }
    folder.mkdir(parents=True)
    (folder / SUITE_RECORD).write_text(json.dumps(record | {"finetune": settings}))
    for task, inits in scores.items():
        (folder / task).mkdir()
        (folder / task / BASELINES).write_text(json.dumps({"majority": {"accuracy": 0.5}}))
        for init, values in inits.items():
            for seed, value in enumerate(values, start=first_seed):
                metrics = {"dev": {"accuracy": value, "loss": 1.0}}
                job = folder / task / f"{init}-seed{seed}"
                job.mkdir()
                FinetuneResults(
                    task=task,
                    seed=seed,
                    lr=1e-4,
                    init=init,
                    backbone=ckpt,
                    main_metric="accuracy",
                    main_split="dev",
                    overrides=[],
                    best=BestCheckpoint(epoch=1, step=10, checkpoint="best.ckpt", metrics=metrics),
                    final=FinalScores(step=10, metrics=metrics),
                ).write(job / RESULTS)
    return folder


def test_suites_of_other_tasks_join_into_one_table_with_one_average(tmp_path):
    a = write_suite(tmp_path / "a", {"sst2": {"pretrained": [0.8, 0.9], "scratch": [0.6, 0.7]}})
    b = write_suite(tmp_path / "b", {"rte": {"pretrained": [0.6, 0.7], "scratch": [0.6, 0.5]}})
    (joined,) = summarize_suites([a, b])
    assert [row.task for row in joined.rows] == ["sst2", "rte", "average"]
    average = joined.rows[-1]
    assert average.pretrained.summary.mean == pytest.approx(statistics.fmean([70, 80]))
    assert average.scratch.summary.mean == pytest.approx(statistics.fmean([60, 60]))
    assert average.difference.n == 2  # paired by seed across the two folders
    assert average.baseline_score == pytest.approx(50.0)
    assert [r.task for r in summarize_suite(a).rows] == ["sst2"]  # one folder: its own table


def test_suites_of_other_seeds_join_into_one_row_per_task(tmp_path):
    """One `make glue seeds=[...]` per seed, side by side: each task's row holds every seed,
    and the average pairs them."""
    one = {"sst2": {"pretrained": [0.8], "scratch": [0.6]}, "rte": {"pretrained": [0.6]}}
    a = write_suite(tmp_path / "a", one)
    b = write_suite(
        tmp_path / "b", one | {"rte": {"pretrained": [0.7], "scratch": [0.5]}}, first_seed=2
    )
    c = write_suite(tmp_path / "c", {"sst2": {"pretrained": [0.9, 1.0]}}, first_seed=3)
    (joined,) = summarize_suites([a, b, c])
    sst2, rte, average = joined.rows
    assert sst2.pretrained.scores == pytest.approx({1: 80, 2: 80, 3: 90, 4: 100})
    assert sst2.difference.n == 2  # seeds 1 and 2 have both inits
    assert rte.pretrained.scores == pytest.approx({1: 60, 2: 70})
    assert average.pretrained.scores == pytest.approx({1: 70, 2: 75})  # seeds every task has
    assert average.difference.n == 1  # rte's scratch ran seed 2 only
    assert joined.folders == [str(a), str(b), str(c)]


def test_a_suite_cut_short_joins_the_folders_that_ran_its_missing_tasks(tmp_path):
    """The whole suite was planned in one folder and stopped during rte, which ran in another
    folder side by side: one table, since no task and seed finished twice. Only what finished
    counts: the cut-short folder's rte baselines (fitted before its first job) are not read."""
    cut_short = write_suite(tmp_path / "a", {"sst2": {"pretrained": [0.8], "scratch": [0.6]}})
    record = json.loads((cut_short / SUITE_RECORD).read_text())
    record["tasks"]["rte"] = {"datamodule.train_examples": 99}  # planned, never finished
    (cut_short / SUITE_RECORD).write_text(json.dumps(record))
    (cut_short / "rte" / "pretrained-seed1").mkdir(parents=True)  # cut short mid-run
    (cut_short / "rte" / BASELINES).write_text(json.dumps({"majority": {"accuracy": 0.9}}))
    rte = write_suite(tmp_path / "b", {"rte": {"pretrained": [0.6], "scratch": [0.5]}})
    (joined,) = summarize_suites([cut_short, rte])
    assert [row.task for row in joined.rows] == ["sst2", "rte", "average"]
    assert joined.rows[1].baseline_score == pytest.approx(50.0)  # b's, not a's 90
    assert joined.rows[-1].difference.n == 1
    # rte's seed 1 finished again, by one init only (beside a task it could join by): a table
    # of its own
    again = write_suite(
        tmp_path / "c",
        {"rte": {"pretrained": [0.7]}, "cola": {"pretrained": [0.1], "scratch": [0]}},
    )
    assert [t.folders for t in summarize_suites([cut_short, rte, again])] == [
        [str(cut_short), str(rte)],
        [str(again)],
    ]
    # a folder that finished nothing joins nothing
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / SUITE_RECORD).write_text((rte / SUITE_RECORD).read_text())
    tables = summarize_suites([cut_short, rte, tmp_path / "d"])
    assert [t.folders for t in tables][-1] == [str(tmp_path / "d")] and not tables[-1].rows


def test_suites_that_differ_in_what_they_ran_stay_apart(tmp_path):
    """Another checkpoint, fine-tuning settings or per-task settings (a quick suite's sample
    against all the data), or the same task and seed again: a table each."""
    sst2 = {"sst2": {"pretrained": [0.8], "scratch": [0.6]}}
    rte = {"rte": {"pretrained": [0.6], "scratch": [0.5]}}
    first = write_suite(tmp_path / "a", sst2)
    others = [
        write_suite(tmp_path / "ckpt", rte, ckpt="outputs/x"),
        write_suite(tmp_path / "lr", rte, settings={"optim": {"lr": 1}}),
        write_suite(tmp_path / "sample", rte, task_settings={"datamodule.train_examples": 99}),
        write_suite(tmp_path / "again", sst2),
    ]
    tables = summarize_suites([first, *others])
    assert [[r.task for r in t.rows] for t in tables] == [["sst2"]] + [["rte"]] * 3 + [["sst2"]]
    assert [t.folders for t in tables] == [[str(f)] for f in [first, *others]]


def test_the_same_checkpoint_written_two_ways_joins(tmp_path):
    a = write_suite(tmp_path / "a", {"sst2": {"pretrained": [0.8]}}, ckpt="outputs/bert/a")
    b = write_suite(tmp_path / "b", {"rte": {"pretrained": [0.6]}}, ckpt="outputs/bert/a/")
    (table,) = summarize_suites([a, b])
    assert table.folders == [str(a), str(b)]


def test_a_record_without_its_keys_is_named(tmp_path):
    folder = write_suite(tmp_path / "a", {"sst2": {"pretrained": [0.8]}})
    (folder / SUITE_RECORD).write_text(json.dumps({"ckpt": "x", "tasks": {}}))
    with pytest.raises(SuiteRecordError, match="lacks seeds, finetune"):
        summarize_suites([folder])


def test_make_report_prints_the_joined_table(tmp_path, capsys):
    a = write_suite(tmp_path / "a", {"sst2": {"pretrained": [0.8], "scratch": [0.6]}})
    b = write_suite(tmp_path / "b", {"rte": {"pretrained": [0.6], "scratch": [0.5]}})
    assert report_main([f"{a},{b}", "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert f"suite of outputs/bert/a ({a}, {b}):" in printed
    assert "| average | GLUE score | 50.0 (best per task) | 70.0 | 55.0 | +15.0 | 1 |" in printed
    assert (tmp_path / "report" / "suite_1.png").is_file()


def test_a_suite_with_no_finished_fine_tune_takes_corrected_settings(tmp_path):
    """A command whose first fine-tune refused a setting, corrected, keeps its run_name: the
    folder takes the new record and refits its baselines. Once a fine-tune has finished, other
    settings are refused."""
    from pipeline.run.errors import ConfigError
    from pipeline.suites.glue import check_or_write_record
    from pipeline.suites.record import SuiteRecord

    def record(lr: int) -> SuiteRecord:
        return SuiteRecord(ckpt="x", tasks={"sst2": {}}, seeds=[1], finetune={"lr": lr})

    folder = tmp_path / "suite"
    assert check_or_write_record(folder, record(1)) is False
    (folder / "sst2").mkdir()
    (folder / "sst2" / BASELINES).write_text("{}")
    assert check_or_write_record(folder, record(2)) is False
    assert json.loads((folder / SUITE_RECORD).read_text()) == record(2).to_dict()
    assert not (folder / "sst2" / BASELINES).exists()
    (folder / "sst2" / "pretrained-seed1").mkdir()
    (folder / "sst2" / "pretrained-seed1" / RESULTS).write_text("{}")
    assert check_or_write_record(folder, record(2)) is True
    with pytest.raises(ConfigError, match="started with other finetune"):
        check_or_write_record(folder, record(3))
    assert json.loads((folder / SUITE_RECORD).read_text()) == record(2).to_dict()

"""Sweeps: `make finetune ... seed=1,2,3` runs as a Hydra multirun, summarized per setting."""

from __future__ import annotations

import json
import statistics

import pytest

from pipeline.finetune.results import FinetuneResults
from pipeline.run.cli import is_sweep
from pipeline.suites.sweep import (
    SweepRow,
    setting_of,
    summarize_results,
    summarize_sweep,
    summary_table,
)


def result(lr: str, seed: int, accuracy: float) -> dict:
    return {
        "task": "rte",
        "seed": seed,
        "main_metric": "accuracy",
        "main_split": "dev",
        "overrides": [f"optim.lr={lr}", f"seed={seed}", "task=rte"],
        "best": {"metrics": {"dev": {"accuracy": accuracy, "loss": 0.7}}},
    }


def test_settings_group_jobs_by_everything_but_the_seed():
    assert setting_of(["seed=3", "optim.lr=2e-5", "task=rte"]) == "optim.lr=2e-5 task=rte"
    assert setting_of(["seed=1"]) == ""
    assert setting_of(["seed=1", "optim.lr=2e-5", "task=rte"], common={"task=rte"}) == (
        "optim.lr=2e-5"
    )


def test_summary_is_the_median_and_spread_over_seeds():
    values = {"2e-5": [0.60, 0.64, 0.55], "5e-5": [0.52, 0.70, 0.66]}
    results = [result(lr, seed, v) for lr, vs in values.items() for seed, v in enumerate(vs, 1)]
    rows = summarize_results([FinetuneResults.from_dict(r) for r in results])
    assert [r.setting for r in rows] == ["optim.lr=2e-5", "optim.lr=5e-5"]  # task=rte: all
    for row, (_, vs) in zip(rows, values.items(), strict=True):
        assert row.seeds == [1, 2, 3] and row.metric == "dev/accuracy"
        assert row.median == statistics.median(vs)
        assert (row.min, row.max) == (min(vs), max(vs))
        assert row.std == pytest.approx(statistics.stdev(vs))
    table = summary_table(rows)
    assert "| optim.lr=5e-5 | rte dev/accuracy | 3 | 0.6600 | 0.5200 | 0.7000 |" in table


def test_each_value_stands_beside_its_seed_whatever_order_the_jobs_finished_in():
    """A multirun's job folders list in any order (job 10 before job 2): the row pairs each
    seed with its own job's metric."""
    jobs = [result("1e-4", 3, 0.3), result("1e-4", 1, 0.1), result("1e-4", 2, 0.2)]
    [row] = summarize_results([FinetuneResults.from_dict(r) for r in jobs])
    assert row.seeds == [1, 2, 3]
    assert row.values == [0.1, 0.2, 0.3]


def test_sweep_folder_summary_files(tmp_path):
    for job, (seed, v) in enumerate([(1, 0.5), (2, 0.7)]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "results.json").write_text(json.dumps(result("1e-4", seed, v)))
    [row] = summarize_sweep(tmp_path)
    assert row.median == pytest.approx(0.6)
    assert json.loads((tmp_path / "sweep_summary.json").read_text()) == [row.to_dict()]
    assert SweepRow.read_all(tmp_path / "sweep_summary.json") == [row]
    assert "0.6000" in (tmp_path / "sweep_summary.md").read_text()


def test_a_sweep_summary_keeps_its_file_form(tmp_path):
    """sweep_summary.json as every earlier sweep wrote it: a list of rows, keys in this order."""
    written = [
        {
            "setting": "optim.lr=1e-4",
            "task": "rte",
            "metric": "dev/accuracy",
            "seeds": [1, 2],
            "values": [0.5, 0.7],
            "median": 0.6,
            "min": 0.5,
            "max": 0.7,
            "std": 0.1414,
        }
    ]
    path = tmp_path / "sweep_summary.json"
    path.write_text(json.dumps(written, indent=2) + "\n")
    rows = SweepRow.read_all(path)
    assert rows[0].setting == "optim.lr=1e-4" and rows[0].values == [0.5, 0.7]
    again = tmp_path / "again.json"
    SweepRow.write_all(again, rows)
    assert again.read_text() == path.read_text()


def test_empty_sweep_folder_says_no_job_finished(tmp_path):
    with pytest.raises(FileNotFoundError, match="no job of the sweep finished"):
        summarize_sweep(tmp_path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["task=rte", "seed=1,2,3"], True),
        (["optim.lr=2e-5,3e-5"], True),
        (["seed=range(3)"], True),
        (["task=rte", "task.text_columns=[a,b]"], False),
        (["prompt='a, b'"], False),
        (["--multirun", "task=rte"], False),
    ],
)
def test_sweep_values_are_detected(args, expected):
    assert is_sweep(args) is expected

"""`make bench` (bench/run_all.py): one JSON and one Markdown file holding every benchmark."""

from __future__ import annotations

import json
import socket

import pytest

from bench import bench_data, bench_models, bench_time_to_loss, run_all
from bench.common import figure
from pipeline.training.precision import native_bf16_flags


def fake_reports(monkeypatch) -> dict[str, list]:
    """Replace each benchmark by a canned report; returns the arguments each was given."""
    calls: dict[str, list] = {}
    process = {"wall_s": 10.0, "peak_rss_mb": 500.0, "log": "x.log"}
    canned = {
        "models": {
            "figures": [figure("model step, fp32", "bert-mini", 3.0, 1.0, "tok/s", at_least=2)]
        },
        "data": {"figures": [figure("data", "bert store", 0.6, 1.0, "MB/s", at_least=0.7)]},
        "loss": {
            "figures": [figure("time to loss", "bert time", 40.0, 100.0, "s", at_most=0.6)],
            "results": {
                "bert": {
                    "processes": {
                        "prepare": process,
                        "reference": {**process, "peak_rss_mb": 1000.0},
                        "ours": process,
                    }
                }
            },
        },
    }
    modules = {"models": bench_models, "data": bench_data, "loss": bench_time_to_loss}
    for name, module in modules.items():

        def main(argv, name=name):
            calls[name] = argv
            return canned[name]

        monkeypatch.setattr(module, "main", main)
        monkeypatch.setattr(module, "table", lambda report, name=name: f"TABLE {name}")
    return calls


def test_writes_dated_json_and_markdown_with_every_figure(tmp_path, monkeypatch):
    calls = fake_reports(monkeypatch)
    report = run_all.main(
        ["--quick", "--results-dir", str(tmp_path / "res"), "--work-dir", str(tmp_path / "w"),
         "--data-args", "--corpus embedded --reps 1"]
    )  # fmt: skip
    assert calls["data"][0] == "--quick"
    assert calls["data"][-4:] == ["--corpus", "embedded", "--reps", "1"]
    stem = tmp_path / "res" / run_all.result_name(report["date"], socket.gethostname())
    saved = json.loads(stem.with_name(stem.name + ".json").read_text())
    assert set(saved["benchmarks"]) == {"models", "data", "loss"}
    names = [f["name"] for f in saved["figures"]]
    assert names == [
        "bert-mini",
        "bert store",
        "bert time",
        "bert training peak RSS",
        "bert data preparation peak RSS",
    ]
    memory = saved["figures"][3]
    assert memory["ratio"] == pytest.approx(0.5) and memory["met"] is None
    text = stem.with_name(stem.name + ".md").read_text()
    for section in ("## Summary", "## Model step throughput\n\nTABLE models", "## Data pipeline",
                    "## Time to loss\n\nTABLE loss", "## Memory"):  # fmt: skip
        assert section in text
    assert "| data | bert store (MB/s) | 0.6 | 1 | 0.6x | >= 0.7 | **no** |" in text


def test_only_runs_the_chosen_benchmarks(tmp_path, monkeypatch):
    calls = fake_reports(monkeypatch)
    report = run_all.main(
        ["--only", "models", "--results-dir", str(tmp_path), "--work-dir", str(tmp_path)]
    )
    assert set(calls) == {"models"} and set(report["benchmarks"]) == {"models"}
    with pytest.raises(SystemExit):
        run_all.main(["--only", "speed", "--results-dir", str(tmp_path)])


def test_result_names_are_safe_file_names():
    assert run_all.result_name("2026-01-02", "host/a b") == "2026-01-02_host-a-b"


@pytest.mark.slow
def test_end_to_end_at_trivial_sizes(tmp_path):
    tiny = "data=embedded tokenizer.vocab_size=1000 objective.batch_size=4"
    report = run_all.main(
        [
            "--only", "models,data,loss", "--results-dir", str(tmp_path / "res"),
            "--work-dir", str(tmp_path / "w"),
            "--models-args", "--size tiny --steps 1 --warmup 0 --device cpu",
            "--data-args", "--corpus embedded --size tiny --reps 1 --batches 3 --model-steps 1 "
            "--vocab-size 500 --device cpu",
            "--loss-args", "--models gpt --budget-s 5 --val-points 2 --val-batches 2 "
            "--set model=gpt-tiny " + " ".join(f"--set {o}" for o in tiny.split()),
        ]
    )  # fmt: skip
    benchmarks = {f["benchmark"] for f in report["figures"]}
    expected = {"model step, fp32", "data", "time to loss", "memory"}
    if native_bf16_flags():  # else bench_models skips bf16 and says why
        expected.add("model step, bf16")
    assert expected <= benchmarks
    for f in report["figures"]:
        if f["ours"] is not None and f["reference"] is not None:
            assert f["ratio"] == pytest.approx(f["ours"] / f["reference"])
        if f["target"] is None:
            assert f["met"] is None
    assert len(list((tmp_path / "res").glob("*.md"))) == 1


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"], "avx2 fma avx512f avx512_bf16 amx_bf16; native bf16"),
        (["avx2", "fma"], "avx2 fma; no native bf16"),
        ([], "no AVX2; no native bf16"),
        (None, "flags not recorded"),  # a record older than the flags
    ],
)  # fmt: skip
def test_the_report_says_which_cpu_flags_and_whether_bf16_is_native(flags, text):
    assert run_all.cpu_flags_text(flags) == text


def test_the_machine_record_keeps_the_cpu_flags_that_decide_the_speeds(monkeypatch):
    from bench import common

    monkeypatch.setattr(
        "pipeline.training.precision.cpu_flags", lambda: {"avx2", "sse4_2", "amx_bf16"}
    )
    assert common.machine()["cpu_flags"] == ["avx2", "amx_bf16"]

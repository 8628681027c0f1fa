"""`make report` (pipeline/report/): the HTML and PNGs of a real tiny run, overlays, fine-tuning
results, run folders it only partly understands, and bad paths."""

from __future__ import annotations

import base64
import csv
import json
import re
import struct
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from pipeline.commands.report import main
from pipeline.infer.blimp import BlimpScores
from pipeline.report import read_metrics, smooth, write_report
from pipeline.suites.blimp import BlimpReport
from tests.conftest import run_command
from tests.pipeline.smoke_runs import copy_run, smoke_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIZE = (900, 450)  # pipeline.report.FIGSIZE x DPI
PRETRAIN_PLOTS = {"loss", "accuracy", "perplexity", "learning_rate", "grad_norm", "throughput"}


class Links(HTMLParser):
    """The <img src> and <a href> values of an HTML page, and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        elif tag == "a":
            self.links.append(attrs["href"])

    def handle_data(self, data) -> None:
        self.text.append(data)


def parse(path: Path) -> Links:
    links = Links()
    links.feed(path.read_text())
    return links


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_embeds_every_plot(html_path: Path, names: set[str]) -> Links:
    """The folder holds exactly these PNGs, each a real 900x450 picture, and the HTML embeds
    each one (a data URI with the same bytes) and links to its file."""
    folder = html_path.parent
    assert {p.stem for p in folder.glob("*.png")} == names
    page = parse(html_path)
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in page.images]
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    for name in names:
        data = (folder / f"{name}.png").read_bytes()
        assert png_size(data) == SIZE, name
        assert data in embedded, f"{name}.png is not embedded in the HTML"
        assert f"{name}.png" in page.links
        pixels = imread(folder / f"{name}.png")
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20, name  # not blank
    return page


def write_metrics(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = sorted({key for row in rows for key in row})
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)


def pretrain_rows(steps: int, start_loss: float) -> list[dict]:
    """Sparse rows as Lightning writes them: training rows, and a validation row every 10."""
    rows = []
    for step in range(steps):
        rows.append(
            {
                "step": step,
                "train/loss": start_loss - 0.01 * step,
                "train/lr": 1e-3,
                "train/grad_norm": 1.0,
                "perf/tokens_per_s": 1000.0 + step,
            }
        )
        if step % 10 == 9:
            rows.append({"step": step, "val/loss": start_loss - 0.01 * step + 0.1})
    return rows


def test_report_of_a_real_tiny_run(tmp_path, tmp_path_factory):
    # the session's BERT smoke run (5 steps, validated at the last), copied: the report is
    # written into the run folder
    shared = smoke_run(tmp_path_factory, "bert-tiny")
    run, run_dir = shared.done, copy_run(shared, tmp_path / "out" / "bert-tiny" / "r")
    done = run_command("pipeline.commands.report", str(run_dir))
    assert done.returncode == 0, done.stderr
    html_path = run_dir / "report" / "report.html"
    assert f"wrote {html_path} with 6 plots" in done.stdout
    page = check_embeds_every_plot(html_path, PRETRAIN_PLOTS)
    text = " ".join(page.text)
    assert "no MFU" in text  # a CPU run has none, and the report says so
    parameters = re.search(r"([\d,]+) parameters", run.stdout)[1]
    assert parameters in text  # the config summary has the logged facts
    assert str(shared.folder / "hf") in text  # as the run logged it, before the copy


def test_last_row_of_a_step_wins_and_sparse_rows_merge(tmp_path):
    path = tmp_path / "metrics.csv"
    write_metrics(
        path,
        [
            {"step": 0, "train/loss": 5.0},
            {"step": 1, "train/loss": 4.0},
            {"step": 1, "val/loss": 4.5},
            {"step": 2, "train/loss": 3.0},  # crashed after this; resumed from step 1
            {"step": 1, "train/loss": 3.9},
            {"step": 2, "train/loss": 2.9},
            {"step": 2, "train/loss": "nan"},
        ],
    )
    metrics = read_metrics(path)
    assert metrics["train/loss"] == {0: 5.0, 1: 3.9, 2: pytest.approx(float("nan"), nan_ok=True)}
    assert metrics["val/loss"] == {1: 4.5}


def test_smoothing_follows_a_trend_without_lag_and_removes_noise():
    ramp = np.linspace(10.0, 2.0, 200)
    assert np.allclose(smooth(ramp, 21), ramp)  # a centered mean of a line is the line
    assert np.allclose(smooth(np.exp(ramp), 21, log=True), np.exp(ramp))
    noisy = ramp + np.random.default_rng(0).normal(0, 0.5, ramp.shape)
    assert np.std(smooth(noisy, 21) - ramp) < 0.3 * np.std(noisy - ramp)


def test_overlay_of_two_runs_with_the_same_name(tmp_path):
    for parent, loss in (("bert", 9.0), ("gpt", 7.0)):
        rows = pretrain_rows(40, loss)
        if parent == "gpt":  # a GPU run: MFU logged
            rows = [{**row, "perf/mfu": 0.4} if "perf/tokens_per_s" in row else row for row in rows]
        write_metrics(tmp_path / parent / "wiki" / "logs" / "metrics.csv", rows)
    report = write_report(
        [tmp_path / "bert" / "wiki", tmp_path / "gpt" / "wiki"], out=tmp_path / "cmp"
    )
    page = check_embeds_every_plot(
        report.html, {"loss", "learning_rate", "grad_norm", "throughput"}
    )
    html = report.html.read_text()
    assert "<th>bert/wiki</th><th>gpt/wiki</th>" in html  # one column per run
    # final val/loss of each run (last validation at step 39)
    assert re.search(r"final val/loss</td><td>8\.71</td><td>6\.71</td>", html)
    text = " ".join(page.text)
    for missing in ("MLM and NSP accuracy", "Perplexity"):
        assert f"not plotted: {missing}" in text  # said, not silently dropped
    assert "no MFU" not in text
    assert re.search(r"median MFU \(%\)</td><td></td><td>40</td>", html)
    assert report.notes and all("not plotted" in n for n in report.notes)

    # a later report into the same folder drops the plots it does not draw again
    write_report([tmp_path / "gpt" / "wiki"], out=tmp_path / "cmp")
    write_metrics(tmp_path / "lr-only" / "logs" / "metrics.csv", [{"step": 0, "train/lr": 1.0}])
    write_report([tmp_path / "lr-only"], out=tmp_path / "cmp")
    assert [p.name for p in (tmp_path / "cmp").glob("*.png")] == ["learning_rate.png"]


def test_best_row_follows_the_loss_the_family_keeps_its_best_checkpoints_by(tmp_path):
    # BERT's best checkpoints follow the masked-LM loss, not MLM + NSP; GPT's follow val/loss.
    # Here BERT's total loss is lowest at step 19 and its masked-LM loss at step 39.
    rows = [{"step": 0, "train/loss": 5.0}]
    rows += [{"step": 19, "val/loss": 3.0, "val/mlm_loss": 2.9}]
    rows += [{"step": 39, "val/loss": 3.1, "val/mlm_loss": 2.5}]
    for name, target in (("bert", "models.config.BertConfig"), ("gpt", "models.config.GPTConfig")):
        write_metrics(tmp_path / name / "logs" / "metrics.csv", rows)
        hparams = f"model:\n  _target_: {target}\n"
        (tmp_path / name / "logs" / "hparams.yaml").write_text(hparams)
    report = write_report([tmp_path / "bert", tmp_path / "gpt"], out=tmp_path / "cmp")
    html = report.html.read_text()
    assert re.search(r"best val/mlm_loss</td><td>2\.5 at step 39</td><td></td>", html)
    assert re.search(r"best val/loss</td><td></td><td>3 at step 19</td>", html)


def write_finetune(folder: Path, task: str, seed: int, scores: dict[str, list[float]]) -> None:
    """A fine-tuning run folder: results.json and metrics.csv (dev scores per epoch)."""
    metric = "accuracy"
    first_split = next(iter(scores.values()))
    best = int(np.argmax(first_split))
    results = {
        "task": task,
        "seed": seed,
        "lr": 2e-5,
        "init": "outputs/bert/wiki/checkpoints/last.ckpt",
        "main_metric": metric,
        "best": {
            "epoch": best,
            "step": 100 * (best + 1),
            "metrics": {s: {metric: v[best]} for s, v in scores.items()},
        },
        "final": {"metrics": {s: {metric: v[-1]} for s, v in scores.items()}},
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    rows = [{"step": s, "train/loss": 0.7 - 0.001 * s, "lr": 2e-5} for s in range(0, 300, 10)]
    for epoch in range(len(first_split)):
        rows.append(
            {
                "step": 100 * (epoch + 1) - 1,
                "epoch": epoch,
                **{f"val/{split}/{metric}": v[epoch] for split, v in scores.items()},
            }
        )
    write_metrics(folder / "logs" / "metrics.csv", rows)


def test_finetune_report_shows_each_task_and_seed(tmp_path):
    multirun = tmp_path / "multirun"
    write_finetune(multirun / "0", "sst2", 1, {"dev": [0.85, 0.90, 0.89]})
    write_finetune(multirun / "1", "sst2", 2, {"dev": [0.86, 0.92, 0.91]})
    write_finetune(
        multirun / "2", "mnli", 1, {"dev_matched": [0.7, 0.8], "dev_mismatched": [0.71, 0.79]}
    )
    write_finetune(multirun / "3", "rte", 1, {"dev": [0.6, 0.65]})
    (multirun / "3" / "logs" / "metrics.csv").unlink()  # a run without its log

    report = write_report([multirun])
    assert report.html == multirun / "report" / "report.html"
    page = check_embeds_every_plot(
        report.html, {"finetune_scores", "finetune_sst2", "finetune_mnli"}
    )
    html = report.html.read_text()
    # best dev per seed: sst2 0.90 and 0.92 -> mean 0.91, sample std 0.0141
    assert "<td>sst2</td><td>dev</td><td>accuracy</td><td>2</td><td>0.9100 ± 0.0141</td>" in html
    assert "<td>mnli</td><td>dev_mismatched</td><td>accuracy</td><td>1</td><td>0.7900</td>" in html
    assert "dev_matched 0.8000; dev_mismatched 0.7900" in html  # per-run row, both splits
    assert "not plotted: rte: dev accuracy over steps" in " ".join(page.text)


def test_bad_paths_are_named_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"run={tmp_path / 'missing'}: no such folder" in err
    (tmp_path / "empty").mkdir()
    assert main([f"{tmp_path / 'empty'}"]) == 2
    err = capsys.readouterr().err
    assert "found neither logs/metrics.csv" in err and "results.json" in err
    assert main([","]) == 2
    assert "no run given" in capsys.readouterr().err
    (tmp_path / "r" / "logs").mkdir(parents=True)
    assert main([f"{tmp_path / 'r'},{tmp_path}/r/../r"]) == 2
    assert f"run={tmp_path / 'r'} is named twice; name each run once" in capsys.readouterr().err


def write_blimp_record(run: Path, accuracy: dict[str, float], pairs: int, name="blimp.json"):
    """A run folder with a `make evaluate-lm suite=blimp` record of a model row (the
    phenomena's accuracies, two of them per linguistic term) and a twin row."""
    write_metrics(run / "logs" / "metrics.csv", pretrain_rows(10, 5.0))
    term_of = {uid: f"term{i // 2}" for i, uid in enumerate(accuracy)}
    rows = []
    for row_name, values in (("model", accuracy), ("random twin", dict.fromkeys(accuracy, 50.0))):
        terms = {}
        for uid, value in values.items():
            terms.setdefault(term_of[uid], []).append(value)
        rows.append(
            BlimpScores(
                row_name,
                values,
                {term: float(np.mean(v)) for term, v in terms.items()},
                float(np.mean(list(values.values()))),
                pairs,
            )
        )
    report = BlimpReport(str(run), "causal", rows, {"pairs": None})
    (run / name).write_text(json.dumps(report.record()))


def test_runs_blimp_records_compared_phenomenon_by_phenomenon(tmp_path, capsys):
    # a screen: the preset and a lever, the same BLiMP record in each run folder
    preset = {"p1": 60.0, "p2": 70.0, "p3": 55.0, "p4": 80.0}
    lever = {"p1": 63.0, "p2": 71.0, "p3": 59.0, "p4": 80.0}  # +3, +1, +4, 0: mean +2
    write_blimp_record(tmp_path / "preset", preset, 4000)
    write_blimp_record(tmp_path / "lever", lever, 4000)
    write_blimp_record(tmp_path / "capped", lever, 400)  # 100 pairs each: not paired
    write_blimp_record(tmp_path / "lever", lever, 400, name="blimp-pairs100.json")  # one run
    runs = ",".join(str(tmp_path / name) for name in ("preset", "lever", "capped"))
    assert main([runs, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    # the differences +3, +1, +4, 0: mean 2, sample sd 1.826, t(0.975, 3 df) = 3.182
    half = 3.182446 * float(np.std([3, 1, 4, 0], ddof=1)) / 2
    assert f"+2.0 [{2 - half:+.1f}, {2 + half:+.1f}]" == "+2.0 [-0.9, +4.9]"
    assert "BLiMP across runs (blimp.json):" in printed
    assert "| overall | 66.2 | 68.2 |" in printed
    assert "| term0 | 65.0 | 67.0 |" in printed and "| term1 | 67.5 | 69.5 |" in printed
    assert "| minus preset |  | +2.0 [-0.9, +4.9] |" in printed
    assert "4,000 pairs of 4 phenomena" in printed
    assert "BLiMP blimp.json: capped is not compared with preset: 400 pairs, not 4,000" in printed
    assert printed.count("BLiMP across runs") == 1  # blimp-pairs100.json: one run has it
    page = (tmp_path / "cmp" / "report.html").read_text()
    assert "<h2>BLiMP across runs (blimp.json)</h2>" in page
    assert "<td>minus preset</td><td></td><td>+2.0 [-0.9, +4.9]</td>" in page
    assert "not from one seed to another" in page  # what the interval is

    # another method, or other phenomena, are not paired either
    record = json.loads((tmp_path / "capped" / "blimp.json").read_text())
    record["method"] = "pll_word_l2r"
    for row in record["rows"]:
        row["pairs"] = 4000
    (tmp_path / "capped" / "blimp.json").write_text(json.dumps(record))
    write_blimp_record(tmp_path / "fewer", {"p1": 60.0, "p2": 70.0}, 4000)
    runs += f",{tmp_path / 'fewer'}"
    assert main([runs, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "capped is not compared with preset: scored by pll_word_l2r, not causal" in printed
    assert "fewer is not compared with preset: other phenomena" in printed
    assert "| minus preset |  | +2.0 [-0.9, +4.9] |" in printed  # the two that pair still are

    # a damaged record is named, with the command that remakes it (exit 2, no traceback)
    for damage, why in (
        (lambda r: r["rows"].reverse(), "its first row is 'random twin', not the 'model'"),
        (lambda r: r["rows"][0].update(phenomena={}), "row 'model' has no accuracy per phenomenon"),
        (lambda r: r["rows"][1].pop("phenomena"), "row 'random twin' has no phenomena"),
    ):
        record = json.loads((tmp_path / "lever" / "blimp.json").read_text())
        damage(record)
        (tmp_path / "fewer" / "blimp.json").write_text(json.dumps(record))
        assert main([runs, "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err
        assert (
            f"{tmp_path / 'fewer' / 'blimp.json'} is not a BLiMP record (ValueError: {why})" in err
        )
        assert f"make evaluate-lm ckpt={tmp_path / 'fewer'} suite=blimp" in err

"""`make report run=PATH[,PATH2,...]`: plots and tables of runs, from their run folders alone.

    python -m pipeline.commands.report outputs/gpt/wiki                      # one run
    python -m pipeline.commands.report outputs/gpt/wiki,outputs/gpt/wiki2    # overlaid, one colour per run
    python -m pipeline.commands.report outputs/bert/wiki --out /tmp/report

Writes `report.html` and one PNG per plot into the output folder (default: `<first run>/report`).
The HTML embeds the PNGs as data URIs, so that the one file can be moved or mailed; the PNG files
beside it are the same images.

A pretraining run folder (`logs/metrics.csv`; the config from `logs/hparams.yaml`, written by
pipeline/training/loggers.py, else `.hydra/config.yaml`) gets the curves in `PRETRAIN_PLOTS` plus
throughput and MFU, a config summary and its final metrics. A fine-tuning run folder
(`results.json`), or a multirun folder whose subfolders hold one each, gets a table of the main
metric per task and seed, a plot of it per task, and the dev metric over steps per seed.

- `runs`: finding and reading run folders; `ReportError` for one that cannot be reported on.
- `plots`: the matplotlib figures.
- `tables`: the HTML tables.
- `page`: `write_report`, which assembles the page and writes it with its PNGs.
"""

from pipeline.report.page import Report, write_report
from pipeline.report.plots import DPI, FIGSIZE, PRETRAIN_PLOTS, Curves, smooth
from pipeline.report.runs import FinetuneRun, PretrainRun, ReportError, find_runs, read_metrics

__all__ = [
    "DPI",
    "FIGSIZE",
    "PRETRAIN_PLOTS",
    "Curves",
    "FinetuneRun",
    "PretrainRun",
    "Report",
    "ReportError",
    "find_runs",
    "read_metrics",
    "smooth",
    "write_report",
]

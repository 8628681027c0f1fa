"""`make report`: parse the arguments, write the report (pipeline/report/), print what it wrote.

python -m pipeline.commands.report outputs/gpt/wiki                   # one run
python -m pipeline.commands.report outputs/gpt/wiki,outputs/gpt/wiki2 # overlaid
python -m pipeline.commands.report outputs/bert/wiki --out /tmp/report
python -m pipeline.commands.report outputs/glue/a,outputs/glue/b  # suites: one table, printed
python -m pipeline.commands.report outputs/gpt/a,outputs/gpt/b    # their BLiMP compared, printed
"""

from __future__ import annotations

import argparse
import sys

from pipeline.report.page import write_report
from pipeline.report.runs import ReportError


def main(argv: list[str] | None = None) -> int:
    """Write the report of the runs named in `argv` (default: the command's arguments).

    Returns:
        The exit status: 0, or 2 when a run folder cannot be reported on.
    """
    parser = argparse.ArgumentParser(
        prog="make report",
        description="HTML report with PNG plots of runs, from their run folders alone.",
    )
    parser.add_argument(
        "runs", help="run folder(s), comma-separated: outputs/gpt/wiki[,outputs/gpt/wiki2]"
    )
    parser.add_argument("--out", help="output folder (default: <first run>/report)")
    args = parser.parse_args(argv)
    paths = [p.strip() for p in args.runs.split(",") if p.strip()]
    try:
        report = write_report(paths, args.out)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for summary in report.suites:
        print(f"suite of {summary.ckpt} ({', '.join(summary.folders)}):\n{summary.table()}\n")
    for compared in report.blimp_compared:
        print(f"BLiMP across runs ({compared.name}):\n{compared.table()}")
    for note in report.notes:
        print(f"note: {note}")
    names = ", ".join(p.name for p in report.plots)
    print(f"wrote {report.html} with {len(report.plots)} plots ({names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

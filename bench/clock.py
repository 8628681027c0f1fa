"""`WallClockLogger`: a Lightning logger that stamps every logged row with the wall time since
training began, so that the time-to-loss benchmark can read when each validation loss of a real
`make pretrain` run was reached.

Added to a run from the command line, without touching the pipeline:

    python -m pipeline.commands.pretrain ... +logger.clock._target_=bench.clock.WallClockLogger \
        +logger.clock.path=outputs/bench/clock.jsonl

Each row of the JSON-lines file is {"elapsed_s", "step", "metrics"}. The clock starts when
Lightning first hands the loggers the model (`log_graph`, once per fit, after setup and before
the sanity validation and the first training batch), or else at the first logged row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only


class WallClockLogger(Logger):
    """Appends (elapsed seconds, step, metrics) to `path` for every logged row.

    Args:
        path: the JSON-lines file; its folder is created, an existing file is replaced.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)
        self._start: float | None = None

    @property
    def name(self) -> str:
        return "wall_clock"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self._begin()

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # only times are recorded

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = time.perf_counter()
        self._begin(now)
        row = {"elapsed_s": now - self._start, "step": step, "metrics": metrics}
        with self.path.open("a") as handle:  # a line per row: complete even if the run is killed
            handle.write(json.dumps(row) + "\n")

    def _begin(self, now: float | None = None) -> None:
        if self._start is None:
            self._start = time.perf_counter() if now is None else now
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")


def read_clock(path: str | Path) -> list[dict]:
    """The rows a `WallClockLogger` wrote, in order."""
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]

"""The record of a `make glue` suite folder, `glue_suite.json`: the settings the suite was
started with. One definition, through which `pipeline.suites.glue` writes it (and checks a
resumed folder against it) and `pipeline.suites.summary` (and so the report) reads it.

    record = SuiteRecord.in_folder(folder)     # FileNotFoundError: not a suite folder
    record.tasks, record.seeds, record.ckpt

The file's form is the one every suite folder was written in (a resumed folder of an earlier
version reads and resumes): a JSON object of `ckpt`, `tasks`, `seeds` and `finetune`, in that
order, indented by two.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.finetune.results import read_record, write_record
from pipeline.run.errors import SuiteRecordError
from pipeline.run.folder import SUITE_RECORD


@dataclass(frozen=True)
class SuiteRecord:
    """What a suite folder was started with; a resumed suite must match it.

    Attributes:
        ckpt: the pretrained model, as `ckpt=` gave it.
        tasks: task config name -> the fine-tuning settings (dotted key -> value) its jobs ran
            with, in the suite's order.
        seeds: the seeds every task runs.
        finetune: the fine-tuning settings every job shares (config node -> its values:
            datamodule, head, optim, schedule, trainer, and backbone when any is set).
    """

    ckpt: str
    tasks: dict[str, dict[str, Any]]
    seeds: list[int]
    finetune: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        write_record(path, self.to_dict())

    def changed(self, started: SuiteRecord) -> list[str]:
        """The fields in which this record differs from the one a folder was `started` with."""
        return [
            f.name
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(started, f.name)
        ]

    def join_key(self, finished: Collection[str]) -> str:
        """What suite folders must share to join into one table: the checkpoint (as a path),
        the fine-tuning settings, and the per-task settings their `finished` tasks ran with."""
        per_task = sorted({json.dumps(self.tasks[t], sort_keys=True) for t in finished})
        ckpt = os.path.normpath(self.ckpt)
        return json.dumps([ckpt, self.finetune, per_task], sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any, source: object = SUITE_RECORD) -> SuiteRecord:
        """The record of a parsed glue_suite.json (keys it does not know are ignored).

        Raises:
            SuiteRecordError: naming `source` and what is missing or malformed.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if not isinstance(data, dict) or n not in data]
        if missing:
            raise SuiteRecordError(
                f"{source} lacks {', '.join(missing)}: not a record `make glue` wrote; move the "
                "folder aside"
            )
        tasks, seeds, finetune = data["tasks"], data["seeds"], data["finetune"]
        malformed = (
            not isinstance(tasks, dict)
            or not all(isinstance(s, dict) for s in tasks.values())
            or not isinstance(seeds, list)
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
            or not isinstance(finetune, dict)
        )
        if malformed:
            raise SuiteRecordError(
                f"{source}: malformed (tasks must map names to settings, seeds be a list of "
                "integers, finetune a mapping); move the folder aside"
            )
        return cls(str(data["ckpt"]), tasks, seeds, finetune)

    @classmethod
    def read(cls, path: str | os.PathLike) -> SuiteRecord:
        """The record in file `path`.

        Raises:
            SuiteRecordError: naming the file: not readable JSON, or not a suite record.
        """
        data = read_record(path, SuiteRecordError, fix="; move the folder aside")
        return cls.from_dict(data, source=path)

    @classmethod
    def in_folder(cls, folder: str | os.PathLike) -> SuiteRecord:
        """The record of suite folder `folder`.

        Raises:
            FileNotFoundError: `folder` holds no suite record.
            SuiteRecordError: a record that is not readable.
        """
        path = Path(folder) / SUITE_RECORD
        if not path.is_file():
            raise FileNotFoundError(f"{folder} holds no {SUITE_RECORD}: not a `make glue` folder")
        return cls.read(path)

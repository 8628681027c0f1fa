"""A pretraining corpus made of the unlabelled texts of fine-tuning tasks' training splits
(data=glue_texts), read through the task configs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from datamodules.corpora.corpus import CorpusError, _join
from datamodules.corpora.fingerprint import _NOT_IN_KEY, _files_key, _fingerprint
from datamodules.tasks.files import read_examples, task_examples


@dataclass
class TaskTextsCorpus:
    """The unlabelled texts of fine-tuning tasks' training splits, as pretraining documents.

    Pretraining on the text of the tasks a model will be fine-tuned on (task-adaptive
    pretraining, Gururangan et al. 2020, "Don't Stop Pretraining") puts a small budget where the
    tasks are: their vocabulary, their domain, their sentence shapes. Only each task's training
    split is read, labels ignored; a dev, test or carved-out dev split never is, so nothing that
    is scored later is seen while pretraining.

    Documents: a pair task's example is one document of its two texts (one per line); a
    single-text task's examples are grouped, `texts_per_document` per document, in file order.

    Attributes:
        tasks: task name -> `datamodules.tasks.spec.TaskSpec` (in a config: `defaults` entries
            `/task@tasks.<name>: <name>`, as `conf/data/glue_texts.yaml` does). The task
            settings that decide the training split (`dev_fraction`, `split_seed`) must be the
            ones fine-tuning uses, or its carved-out dev split may have been pretrained on.
        texts_per_document: single texts per document.
    """

    tasks: dict[str, Any] = field(
        default_factory=dict,
        metadata={_NOT_IN_KEY: "every setting of every task, and its training file, are in it"},
    )
    texts_per_document: int = 16

    def __post_init__(self) -> None:
        if not self.tasks:
            raise CorpusError(
                "the task-texts corpus names no task; name the tasks whose training texts to "
                "read, as conf/data/glue_texts.yaml does"
            )
        if self.texts_per_document < 1:
            raise CorpusError(f"texts_per_document={self.texts_per_document}: use 1 or more")
        self.tasks = dict(self.tasks)
        self._digests: dict = {}
        for name, spec in self.tasks.items():
            source = spec.source(spec.train_split)
            if not source.is_file():
                raise CorpusError(
                    f"task {name}: training file {source} does not exist; point GLUE_DIR at "
                    f"the folder that holds {source.parent.name}/ (e.g. GLUE_DIR=/data/glue "
                    "make pretrain ...), or drop the task"
                )

    def documents(self) -> Iterator[str]:
        for spec in self.tasks.values():
            texts = [_join(list(example.texts)) for example in _training_examples(spec)]
            if spec.is_pair:
                yield from (t for t in texts if t)
                continue
            for start in range(0, len(texts), self.texts_per_document):
                if doc := _join(texts[start : start + self.texts_per_document]):
                    yield doc

    def fingerprint(self) -> str:
        # every task setting: columns, format, header, bad rows and the carve (labels, kind,
        # dev_fraction, split_seed) all decide what is read
        content: list[Any] = [[name, dataclasses.asdict(spec)] for name, spec in self.tasks.items()]
        files = [str(spec.source(spec.train_split)) for spec in self.tasks.values()]
        content.append(_files_key(files, "auto", self._digests))
        return _fingerprint(self, content)

    def describe(self) -> str:
        return f"training texts of task(s) {', '.join(self.tasks)} (labels unused)"


def _training_examples(spec) -> list:
    """The examples of a task's training split; with `dev_fraction`, only the part that is not
    carved out as its dev split."""
    if spec.dev_fraction is not None:
        return task_examples(spec, spec.train_split)
    return read_examples(spec, spec.train_split, labelled=False)

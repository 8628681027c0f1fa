"""BLiMP (Warstadt et al. 2020): 67 phenomena of English grammar, 1,000 minimal pairs each, a
grammatical sentence and an ungrammatical one. A model is right on a pair when it gives the
grammatical sentence the higher score (`pipeline.infer.sentence_scoring`: the log-probability
for a causal model, the pseudo-log-likelihood for a masked one; a tie is wrong). Accuracy is
counted per phenomenon, averaged over the phenomena of each linguistic term (12), and over all
phenomena for the overall figure, as the paper does.

The pairs are read from the dataset's own files (`<UID>.jsonl`, or gzipped), and the paper's
results of its models per phenomenon from its `models_summary.jsonl`, so its rows can stand
beside ours over the very phenomena evaluated here.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.run.errors import ConfigError

PAPER_SUMMARY = "models_summary.jsonl"
# The paper's models, as its summary file names them.
PAPER_MODELS = {
    "ngram": "5-gram (paper)",
    "lstm": "LSTM (paper)",
    "txl": "Transformer-XL (paper)",
    "gpt2": "GPT-2 1.5B (paper)",
}
CHANCE = 50.0
FILES = "BLiMP's <phenomenon>.jsonl(.gz) files"


@dataclass(frozen=True)
class Pair:
    """One minimal pair: the phenomenon (`uid`), its linguistic term, and the two sentences."""

    uid: str
    term: str
    good: str
    bad: str


def read_pairs(
    folder: str | Path,
    per_phenomenon: int | None = None,
    phenomena: Sequence[str] | None = None,
    *,
    settings: str = "suite",
) -> list[Pair]:
    """The pairs of every phenomenon in `folder` (or of `phenomena`), in file order, the first
    `per_phenomenon` of each when given. `settings`: the config node the messages name
    (`suite` of make evaluate-lm, `probe.blimp` of probe=blimp).

    Raises:
        ConfigError: no such folder, no phenomenon files in it, an unknown phenomenon, or a
            line that is not a BLiMP pair (naming the file and line).
    """
    folder = Path(folder)
    fix = f"set {settings}.dir=PATH (or BLIMP_DIR) to a folder of {FILES}"
    if not folder.is_dir():
        raise ConfigError(f"{settings}.dir={folder} does not exist; {fix}")
    files = {
        path.name.split(".")[0]: path
        for path in sorted(folder.iterdir())
        if path.name.endswith((".jsonl", ".jsonl.gz")) and path.name != PAPER_SUMMARY
    }
    if not files:
        raise ConfigError(f"{settings}.dir={folder} holds no {FILES}; {fix}")
    wanted = list(files) if phenomena is None else list(phenomena)
    unknown = [uid for uid in wanted if uid not in files]
    if unknown:
        raise ConfigError(
            f"{settings}.phenomena: {', '.join(unknown)} not in {folder}; the phenomena are "
            f"{', '.join(sorted(files)[:5])}, ... ({len(files)} in all)"
        )
    if per_phenomenon is not None and per_phenomenon < 1:
        raise ConfigError(f"{settings}.pairs={per_phenomenon} must be at least 1 (null: all pairs)")
    paper_terms = _paper_terms(folder)
    pairs = []
    for uid in wanted:
        pairs.extend(_read_file(files[uid], uid, per_phenomenon, paper_terms.get(uid), fix))
    return pairs


def _paper_terms(folder: Path) -> dict[str, str]:
    """The paper's linguistic term of each phenomenon, from its results file (none without
    it). The paper groups the phenomena into 12 terms; the data files label two of them
    (animate_subject_passive, animate_subject_trans) "s-selection", which the paper counts under
    argument_structure, so the paper's grouping is the one used when it is there."""
    path = folder / PAPER_SUMMARY
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["UID"]: row["linguistics_term"] for row in rows if row["UID"] != "overall"}


def _read_file(path: Path, uid: str, limit: int | None, term: str | None, fix: str) -> list[Pair]:
    opener = gzip.open if path.suffix == ".gz" else open
    pairs = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(pairs) >= limit:
                break
            try:
                row = json.loads(line)
                pairs.append(
                    Pair(
                        uid,
                        term or row["linguistics_term"],
                        row["sentence_good"],
                        row["sentence_bad"],
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ConfigError(
                    f"{path}:{number} is not a BLiMP pair ({type(err).__name__}: {err}); {fix}"
                ) from err
    return pairs


@dataclass(frozen=True)
class BlimpScores:
    """One row of the table: a model's accuracies (percent) per phenomenon, per linguistic term
    (the mean over its phenomena) and overall (the mean over phenomena).

    Attributes:
        name: what was scored ("model", "random twin", "3-gram of the corpus", a paper row).
        phenomena: accuracy per phenomenon (UID).
        terms: accuracy per linguistic term.
        overall: the mean over `phenomena`.
        pairs: pairs scored (0 for the paper's rows, which scored all 1,000 per phenomenon).
    """

    name: str
    phenomena: dict[str, float]
    terms: dict[str, float]
    overall: float
    pairs: int = 0

    @classmethod
    def of(cls, name: str, pairs: Sequence[Pair], correct: Sequence[bool]) -> BlimpScores:
        """The accuracies of right/wrong answers to `pairs`."""
        by_uid: dict[str, list[bool]] = defaultdict(list)
        for pair, right in zip(pairs, correct, strict=True):
            by_uid[pair.uid].append(bool(right))
        phenomena = {uid: 100.0 * sum(rows) / len(rows) for uid, rows in by_uid.items()}
        terms = _terms(phenomena, {p.uid: p.term for p in pairs})
        return cls(name, phenomena, terms, statistics.fmean(phenomena.values()), len(pairs))

    @classmethod
    def paper(cls, folder: str | Path, phenomena: Sequence[str]) -> list[BlimpScores]:
        """The paper's rows (`PAPER_MODELS`) over `phenomena`, from `models_summary.jsonl` in
        `folder`; none when the file is absent."""
        path = Path(folder) / PAPER_SUMMARY
        if not path.is_file():
            return []
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_uid = {row["UID"]: row for row in rows if row["UID"] != "overall"}
        kept = [uid for uid in phenomena if uid in by_uid]
        if not kept:
            return []
        term_of = {uid: by_uid[uid]["linguistics_term"] for uid in kept}
        out = []
        for key, name in PAPER_MODELS.items():
            accuracy = {uid: 100.0 * by_uid[uid][key] for uid in kept}
            out.append(
                cls(name, accuracy, _terms(accuracy, term_of), statistics.fmean(accuracy.values()))
            )
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BlimpScores:
        """The row that `record` wrote (a row of a `blimp*.json` record)."""
        return cls(
            record["name"],
            dict(record["phenomena"]),
            dict(record["terms"]),
            record["overall"],
            record.get("pairs", 0),
        )

    def record(self) -> dict[str, Any]:
        """The figures, for JSON (without the per-pair answers)."""
        return {
            "name": self.name,
            "overall": self.overall,
            "terms": self.terms,
            "phenomena": self.phenomena,
            "pairs": self.pairs,
        }


def _terms(phenomena: dict[str, float], term_of: dict[str, str]) -> dict[str, float]:
    grouped: dict[str, list[float]] = defaultdict(list)
    for uid, accuracy in phenomena.items():
        grouped[term_of[uid]].append(accuracy)
    return {term: statistics.fmean(values) for term, values in sorted(grouped.items())}


def answers(pairs: Sequence[Pair], score: Callable[[list[str]], Sequence[float]]) -> list[bool]:
    """Whether `score` (sentences -> scores, higher = more likely) prefers each pair's
    grammatical sentence, strictly (a tie is wrong: a model that cannot tell them apart does
    not know)."""
    scores = score([p.good for p in pairs] + [p.bad for p in pairs])
    half = len(pairs)
    return [scores[i] > scores[half + i] for i in range(half)]

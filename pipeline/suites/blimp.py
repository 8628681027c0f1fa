"""`make evaluate-lm ckpt=<run> suite=blimp`: has the model learned the language, beyond what
counting words gives? BLiMP's minimal pairs (pipeline/infer/blimp.py) scored zero-shot by the
model, and in the same command by what it must beat:

- its from-scratch twin: the same architecture and tokenizer with random weights (chance, give
  or take what a random model's preferences for shorter sentences give);
- an n-gram model of its own corpus: interpolated Kneser-Ney (`pipeline/infer/ngram.py`, order
  3 by default) counted from the very training documents the run pretrained on, with its
  tokenizer; a model that does not beat it is marked, as `make glue` marks one below its
  baseline;
- the paper's models (a 5-gram of 3 billion words, an LSTM, Transformer-XL, GPT-2), read from
  the dataset's results file, over the same phenomena.

The table (overall and per linguistic term) is printed and written as JSON and markdown into
the run's folder (`blimp.json`, `blimp-pairs100.json` for a capped run, ...) or to `out=`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.checkpoint.load import Pretrained, load_pretrained
from pipeline.checkpoint.source import CheckpointSource
from pipeline.infer import ngram as ngram_module
from pipeline.infer.blimp import CHANCE, BlimpScores, Pair, answers, read_pairs
from pipeline.infer.ngram import KneserNey
from pipeline.infer.sentence_scoring import PLL_METHODS, SentenceScorer
from pipeline.pretrain.documents import TrainingText, run_training_text
from pipeline.run.errors import ConfigError, ResultsError
from pipeline.run.families import family_named
from pipeline.run.folder import run_folder_of
from pipeline.suites.seeds import PairedDifference, paired_difference
from tokenizer.cache import write_text_atomic

MODEL, TWIN = "model", "random twin"
NGRAM_CACHE = "ngram"  # the n-gram row's cached scores, in the cache folder (`paths.cache_dir`)
DEFAULT_PLL = "word_l2r"
ROW_KEYS = {"name", "overall", "terms", "phenomena"}  # what a record's row holds


@dataclass
class BlimpReport:
    """The rows of one `suite=blimp` evaluation and what they were measured with.

    Attributes:
        source: the checkpoint or folder evaluated.
        method: how sentences were scored ("causal", "pll_word_l2r", "pll_token").
        rows: the model first, then its twin, the n-gram model and the paper's rows.
        settings: the `blimp` settings (pairs, phenomena, ...).
        seconds: time each scored row took.
        ngram_skipped: why there is no n-gram row, when there is none.
    """

    source: str
    method: str
    rows: list[BlimpScores]
    settings: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    ngram_skipped: str | None = None

    def row(self, name: str) -> BlimpScores | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def ngram(self) -> BlimpScores | None:
        return next((r for r in self.rows if r.name.endswith("of the corpus")), None)

    def versus(self, other: BlimpScores | None) -> PairedDifference | None:
        """The model's overall accuracy minus `other`'s, with a 95% t interval over the
        phenomena (paired: the same phenomena on both sides)."""
        model = self.row(MODEL)
        if other is None or model is None or len(model.phenomena) < 2:
            return None
        return paired_difference(model.phenomena, other.phenomena)

    @property
    def below_ngram(self) -> bool:
        """Whether the model does not beat the n-gram model of its corpus overall."""
        model, ngram = self.row(MODEL), self.ngram
        return model is not None and ngram is not None and model.overall <= ngram.overall

    def record(self) -> dict[str, Any]:
        versus = {
            name: None if diff is None else vars(diff)
            for name, diff in (
                ("twin", self.versus(self.row(TWIN))),
                ("ngram", self.versus(self.ngram)),
            )
        }
        return {
            "source": self.source,
            "method": self.method,
            "settings": self.settings,
            "rows": [row.record() for row in self.rows],
            "model_minus": versus,
            "below_ngram": self.below_ngram,
            "ngram_skipped": self.ngram_skipped,
            "seconds": self.seconds,
        }

    def table(self) -> str:
        """Markdown: a column per row, overall first and then each linguistic term."""
        terms = list(self.rows[0].terms)
        header = "| | " + " | ".join(r.name for r in self.rows) + " |"
        lines = [header, "|---|" + "---:|" * len(self.rows)]
        lines.append(
            "| **overall** | " + " | ".join(f"**{r.overall:.1f}**" for r in self.rows) + " |"
        )
        for term in terms:
            cells = [f"{r.terms[term]:.1f}" if term in r.terms else "" for r in self.rows]
            lines.append(f"| {term} | " + " | ".join(cells) + " |")
        model = self.row(MODEL)
        pairs = model.pairs if model else 0
        notes = [
            f"Accuracy (%) on {pairs:,} pairs of {len(self.rows[0].phenomena)} phenomena, "
            f"mean over phenomena; chance {CHANCE:.0f}. Scored by {self.method}."
        ]
        for name, other in (
            ("its random twin", self.row(TWIN)),
            ("the n-gram model of its corpus", self.ngram),
        ):
            diff = self.versus(other)
            if diff is not None and diff.low is not None:
                notes.append(f"Model minus {name}: {diff.text()} (95% interval over phenomena).")
        if self.below_ngram:
            notes.append(
                "**Below the n-gram model of its own corpus**: the model has not learned more "
                "grammar than counting its corpus gives."
            )
        if self.ngram_skipped:
            notes.append(f"No n-gram row: {self.ngram_skipped}.")
        return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def random_twin(pretrained: Pretrained, seed: int) -> Pretrained:
    """The same architecture and tokenizer with the random weights a fresh run starts from."""
    model_class = family_named(pretrained.family).model_class
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(pretrained.model.config)
    return Pretrained(pretrained.family, model.eval(), pretrained.tokenizer, pretrained.source)


def ngram_row(
    source: CheckpointSource, pretrained: Pretrained, pairs: Sequence[Pair], settings: DictConfig
) -> tuple[BlimpScores, dict[str, float]]:
    """The pairs scored by the Kneser-Ney model of `settings.ngram_order` of the run's training
    documents, tokenized as the model reads them, each sentence read as the start of a
    document; and the seconds it took, by what was done.

    Counting that model reads the whole corpus (books: about 3 minutes), so its scores are
    cached in the run's cache folder (`paths.cache_dir`/`NGRAM_CACHE`), keyed by what
    identifies its training text (`TrainingText.key`: a corpus edited since is counted again;
    another run of the same text, another length or model, reads them), the order, and the
    code that counts and scores (pipeline/infer/ngram.py). On a miss it counts, scores every
    pair of BLiMP's folder (`settings.dir`), not only those asked for, and writes them all, so
    a later call (every pair after a quick look, another phenomenon) reads them."""
    started = time.perf_counter()
    tokenizer = pretrained.tokenizer
    text = run_training_text(source.record.config, tokenizer)
    order = settings.ngram_order
    path = ngram_cache_path(text, order)
    name = f"{order}-gram of the corpus"
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    cached = read_ngram_cache(path)
    if all(s in cached for s in sentences):
        print(f"BLiMP: the {order}-gram model's scores, from {path}", file=sys.stderr)
        scores = cached
        seconds = {"reading the cached n-gram scores": time.perf_counter() - started}
    else:
        print(f"BLiMP: counting a {order}-gram model of the run's corpus", file=sys.stderr)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        lm = KneserNey.fit(text.documents(), vocab_size, order)
        seconds = {"counting the n-gram model": time.perf_counter() - started}
        started = time.perf_counter()
        every = read_pairs(settings.dir)
        wanted = sorted({s for p in every for s in (p.good, p.bad)} | set(sentences))
        counted = lm.sentence_logprobs(wanted, tokenizer)
        scores = {**cached, **dict(zip(wanted, counted, strict=True))}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(scores))
        except OSError as err:  # a read-only or full cache folder: scored all the same
            print(f"BLiMP: could not keep the n-gram scores in {path}: {err}", file=sys.stderr)
        seconds[name] = time.perf_counter() - started
    row = BlimpScores.of(name, pairs, answers(pairs, lambda batch: [scores[s] for s in batch]))
    return row, seconds


def ngram_cache_path(text: TrainingText, order: int) -> Path:
    """Where the scores of the `order`-gram model of `text` are cached (sentence -> log p)."""
    code = hashlib.sha256(Path(ngram_module.__file__).read_bytes()).hexdigest()[:8]
    folder = Path(text.datamodule.cache_dir).expanduser() / NGRAM_CACHE
    return folder / f"{text.key}-order{order}-{code}.json"


def read_ngram_cache(path: Path) -> dict[str, float]:
    """The cached scores at `path`; none when it is missing or unreadable (a file that is
    not such a cache is replaced when the model is counted again)."""
    try:
        scores = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        print(f"BLiMP: ignoring the n-gram cache {path} ({err}): counting again", file=sys.stderr)
        return {}
    if not isinstance(scores, dict) or not all(isinstance(v, float) for v in scores.values()):
        print(
            f"BLiMP: ignoring the n-gram cache {path} (not scores): counting again", file=sys.stderr
        )
        return {}
    return scores


def check_settings(settings: DictConfig, vocab_size: int) -> None:
    """The settings that would otherwise fail only after the model was scored.

    Raises:
        ConfigError: naming the `suite.` key and the values it takes.
    """
    if settings.pll not in PLL_METHODS:
        raise ConfigError(f"suite.pll={settings.pll} is not one of {', '.join(PLL_METHODS)}")
    for key in ("batch_size", "twin_seed"):
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (key == "batch_size"):
            raise ConfigError(
                f"suite.{key}={value!r}: use an integer of at least {int(key == 'batch_size')}"
            )
    order, longest = settings.ngram_order, KneserNey.longest_order(vocab_size)
    if order is not None and (not isinstance(order, int) or not 1 <= order <= longest):
        raise ConfigError(
            f"suite.ngram_order={order!r}: choose 1 to {longest} for a {vocab_size:,}-token "
            "vocabulary (3 by default), or null for no n-gram row"
        )


def evaluate_blimp(
    source: CheckpointSource, settings: DictConfig, device: torch.device
) -> BlimpReport:
    """Score BLiMP with the model of `source`, its twin, the n-gram model of its corpus and the
    paper's rows, as `settings` (the `suite` node, conf/suite/blimp.yaml) say. What can fail
    (the settings, the data, the run's corpus) fails before the model is scored."""
    pairs = read_pairs(settings.dir, settings.pairs, settings.phenomena)
    pretrained = load_pretrained(
        source, instead="score that instead: make evaluate-lm ckpt={ckpt} suite=blimp"
    )
    tokenizer = pretrained.tokenizer
    check_settings(settings, tokenizer.get_vocab_size(with_added_tokens=True))
    seconds: dict[str, float] = {}
    ngram, skipped = None, None
    if settings.ngram_order is not None:
        if source.contents is None:
            skipped = "an HF folder records no corpus (give the run's folder or a *.ckpt)"
        else:
            ngram, took = ngram_row(source, pretrained, pairs, settings)
            seconds.update(took)
    scored: list[tuple[str, Pretrained]] = [(MODEL, pretrained)]
    if settings.twin:
        scored.append((TWIN, random_twin(pretrained, settings.twin_seed)))
    rows = []
    method = ""
    for name, model in scored:
        started = time.perf_counter()
        model.model.to(device)
        scorer = SentenceScorer(model, device, settings.batch_size, settings.pll, progress=True)
        method = scorer.method
        print(f"BLiMP: {len(pairs):,} pairs with the {name} ({scorer.method})", file=sys.stderr)
        rows.append(BlimpScores.of(name, pairs, answers(pairs, scorer)))
        model.model.cpu()
        seconds[name] = time.perf_counter() - started
    if ngram is not None:
        rows.append(ngram)
    rows.extend(BlimpScores.paper(settings.dir, list(rows[0].phenomena)))
    record_settings = OmegaConf.to_container(settings, resolve=True)
    return BlimpReport(str(source.path), method, rows, record_settings, seconds, skipped)


def report_path(source: CheckpointSource, settings: DictConfig, out: str | None) -> Path:
    """Where the JSON goes (the markdown beside it): `out`, else the run's folder, named by the
    settings that change the figures (`blimp.json` for the whole set scored the default way).

    Raises:
        ConfigError: `out` does not end in .json (an `out=x.md` would have had the table
            written over the JSON).
    """
    if out:
        path = Path(out)
        if path.suffix != ".json":
            raise ConfigError(
                f"out={out}: out names the JSON record, and the markdown table is written beside "
                f"it as .md; give a .json path: out={path.with_suffix('.json')}"
            )
        return path
    parts = ["blimp"]
    if settings.pairs is not None:
        parts.append(f"pairs{settings.pairs}")
    if settings.pll != DEFAULT_PLL:
        parts.append(settings.pll)
    if settings.phenomena is not None:
        parts.append(hashlib.sha256(" ".join(settings.phenomena).encode()).hexdigest()[:8])
    return run_folder_of(source.path) / ("-".join(parts) + ".json")


def read_reports(folder: Path) -> dict[str, dict[str, Any]]:
    """The `blimp*.json` records in a run folder, by file name (what `make report` draws).

    Raises:
        ResultsError: a file that is not such a record, naming it.
    """
    records = {}
    for path in sorted(folder.glob("blimp*.json")):
        try:
            record = json.loads(path.read_text())
            _check_rows(record["rows"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ResultsError(
                f"{path} is not a BLiMP record ({type(err).__name__}: {err}); remake it with "
                f"make evaluate-lm ckpt={folder} suite=blimp, or move it away"
            ) from err
        records[path.name] = record
    return records


def _check_rows(rows: Any) -> None:
    """The rows of a record as `evaluate_blimp` writes them: the model's first, each with its
    accuracy per phenomenon (what `compare_runs` pairs) and per term.

    Raises:
        ValueError: naming what is not.
    """
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError("no rows")
    if rows[0].get("name") != MODEL:
        raise ValueError(f"its first row is {rows[0].get('name')!r}, not the {MODEL!r}")
    for row in rows:
        missing = ROW_KEYS - row.keys()
        if missing:
            raise ValueError(f"row {row.get('name')!r} has no {', '.join(sorted(missing))}")
        phenomena = row["phenomena"]
        if not isinstance(phenomena, dict) or not phenomena:
            raise ValueError(f"row {row['name']!r} has no accuracy per phenomenon")
        if not all(isinstance(v, int | float) for v in phenomena.values()):
            raise ValueError(f"row {row['name']!r} has a phenomenon's accuracy that is no number")


def write_report(report: BlimpReport, path: Path) -> Path:
    """The JSON at `path` and the markdown table beside it (`.md`), each written atomically;
    returns the markdown's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report.record(), indent=2) + "\n")
    markdown = path.with_suffix(".md")
    title = f"# BLiMP: {report.source}\n\n"
    write_text_atomic(markdown, title + report.table())
    return markdown


@dataclass(frozen=True)
class RunsCompared:
    """The model rows of one BLiMP record (`name`: `blimp.json`, `blimp-pairs100.json`, ...)
    in several runs, each against the first run's: how a change to a run (a learning rate, a
    width, a corpus) moved BLiMP, with an interval over phenomena rather than by its overall
    figure alone.

    Attributes:
        name: the record's file name, the same in every run.
        labels: the runs, the first the one the others are compared against.
        rows: each run's model row.
        versus_first: each run's overall accuracy minus the first's, with a 95% t interval
            over the phenomena (paired: the same phenomena, the same pairs); None for the first.
    """

    name: str
    labels: list[str]
    rows: list[BlimpScores]
    versus_first: list[PairedDifference | None]

    def body(self) -> list[list[str]]:
        """The table's rows, first cell the row's name: overall, each linguistic term, then
        each run minus the first."""
        rows = [["overall", *(f"{r.overall:.1f}" for r in self.rows)]]
        for term in self.rows[0].terms:
            rows.append(
                [term, *(f"{r.terms[term]:.1f}" if term in r.terms else "" for r in self.rows)]
            )
        differences = ["" if d is None else d.text() for d in self.versus_first]
        return [*rows, [f"minus {self.labels[0]}", *differences]]

    def note(self) -> str:
        """What the table holds and what its intervals measure."""
        pairs, phenomena = self.rows[0].pairs, len(self.rows[0].phenomena)
        note = f"The model rows of {self.name}: {pairs:,} pairs of {phenomena} phenomena."
        if phenomena < 2:
            return note + f" Each run minus {self.labels[0]} (no interval over one phenomenon)."
        return note + (
            f" Each run minus {self.labels[0]}, with a 95% interval over the phenomena "
            "(paired): how much the difference varies from one phenomenon to another, not "
            "from one seed to another; runs of one seed each can differ by more than it."
        )

    def table(self) -> str:
        """Markdown: a column per run (`body`), and the note."""
        lines = ["| | " + " | ".join(self.labels) + " |", "|---|" + "---:|" * len(self.rows)]
        lines += ["| " + " | ".join(row) + " |" for row in self.body()]
        return "\n".join(lines) + "\n\n" + self.note() + "\n"


def compare_runs(
    records: Sequence[tuple[str, dict[str, dict[str, Any]]]],
) -> tuple[list[RunsCompared], list[str]]:
    """The BLiMP records that several runs share, compared (`RunsCompared`), and why any such
    record was not.

    Args:
        records: each run's label and its records by file name (`read_reports`), the first
            run first.

    Returns:
        One comparison per file name that at least two runs hold, among the runs that scored
        it as the first did (the same method, phenomena and pairs); and a line for each run
        left out, naming the difference.
    """
    compared, left_out = [], []
    names = dict.fromkeys(name for _, by_name in records for name in by_name)
    for name in names:
        holders = [(label, by_name[name]) for label, by_name in records if name in by_name]
        if len(holders) < 2:
            continue
        (first_label, first), *others = holders
        first_row = _model_row(first)
        labels, rows = [first_label], [first_row]
        for label, record in others:
            row = _model_row(record)
            why = _not_paired(first, first_row, record, row)
            if why:
                left_out.append(f"BLiMP {name}: {label} is not compared with {first_label}: {why}")
            else:
                labels.append(label)
                rows.append(row)
        if len(rows) > 1:
            versus = [None] + [
                paired_difference(r.phenomena, first_row.phenomena) for r in rows[1:]
            ]
            compared.append(RunsCompared(name, labels, rows, versus))
    return compared, left_out


def _model_row(record: dict[str, Any]) -> BlimpScores:
    return BlimpScores.from_record(record["rows"][0])  # the model's (`read_reports` checks)


def _not_paired(
    first: dict[str, Any], first_row: BlimpScores, other: dict[str, Any], row: BlimpScores
) -> str | None:
    """Why `other`'s model row cannot be paired with `first`'s, phenomenon by phenomenon."""
    if other.get("method") != first.get("method"):
        return f"scored by {other.get('method')}, not {first.get('method')}"
    if set(row.phenomena) != set(first_row.phenomena):
        return "other phenomena"
    if row.pairs != first_row.pairs:
        return f"{row.pairs:,} pairs, not {first_row.pairs:,}"
    return None

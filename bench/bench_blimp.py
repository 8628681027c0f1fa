"""BLiMP scoring speed of a masked model: our pseudo-log-likelihood scorer against the one it
replaced, on the same model, sentences, batch size and threads, with the answers compared
pair for pair.

    python bench/bench_blimp.py [--ckpt RUN ...] [--sizes tiny,mini] [--pairs 20] [--repeats 3]
                                [--threads N] [--against REV] [--out outputs/bench/blimp.json]
    make bench-blimp            # QUICK=1: 2 pairs per phenomenon, one repeat

The reference is `pipeline/infer/sentence_scoring.py` as git revision `--against` has it (by
default the last one whose scorer ran the whole model on every masked copy, in padded batches),
read from the repository's history and run in this process beside ours. The two alternate after
a warm-up, so that other load on the machine and clock drift hit both alike; each scores the
first `--pairs` pairs of each of BLiMP's 67 phenomena (both sentences), as
`make evaluate-lm suite=blimp` does (pll=word_l2r, 128 masked copies per forward pass, fp32).

Per model: the median wall seconds of each (and their CPU seconds), the speed-up (reference
seconds / ours), the largest difference of a sentence's score between the two, and how many
pairs they answer differently (0 expected: a pair whose two scores are closer than that
difference is reported as the smallest margin). The target is issue 59's: at least 3x for
BERT tiny.

Models: `--ckpt` runs (trained BERTs, scored as they are), else BERT tiny and mini (`--sizes`)
with random weights (as the random twin is scored) over a WordPiece tokenizer of `--vocab-size`
tokens (8,192, as `make pretrain` trains) trained on WikiText-2's validation text.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch

import pipeline.pretrain.families  # noqa: F401 (registers BERT and GPT, which loading asks for)
from bench.common import (
    REPO,
    SHARED,
    BenchError,
    command_line,
    figure,
    figures_table,
    finish,
    machine,
    markdown_table,
    number,
    require_data,
)
from models.bert import BertConfig, BertForPreTraining
from pipeline.checkpoint.load import Pretrained, load_pretrained
from pipeline.infer.blimp import read_pairs
from pipeline.infer.sentence_scoring import SentenceScorer
from tokenizer import batched, train_tokenizer

SCORER = "pipeline/infer/sentence_scoring.py"
# the last revision whose scorer ran a whole forward pass per masked copy (padded batches)
REFERENCE_REVISION = "49f0301"
TARGET = 3.0  # issue 59: the BERT tiny scorer at least 3x faster
BATCH_SIZE = 128  # conf/suite/blimp.yaml's
WIKITEXT_VALID = SHARED / "wikitext" / "wikitext-2-raw" / "wiki.valid.raw"


def reference_scorer(revision: str) -> type:
    """The `SentenceScorer` class of `revision`'s scorer module (run against today's models,
    whose full forward pass it calls as it did)."""
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:{SCORER}"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        raise BenchError(
            f"cannot read {SCORER} at git revision {revision} ({shown.stderr.strip()}); run "
            "from a clone with the full history (git fetch --unshallow), or pass --against REV"
        )
    module = types.ModuleType(f"reference_sentence_scoring_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(shown.stdout, f"{revision}:{SCORER}", "exec"), module.__dict__)
    return module.SentenceScorer


def random_berts(sizes: list[str], vocab_size: int) -> list[tuple[str, Pretrained]]:
    """BERTs of the `sizes` presets, random weights, over a tokenizer trained on WikiText-2."""
    text = require_data(WIKITEXT_VALID, "WikiText-2's raw validation text").read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    tokenizer = train_tokenizer("wordpiece", batched(lines), vocab_size=vocab_size)
    models = []
    for size in sizes:
        torch.manual_seed(0)
        config = BertConfig.from_preset(size, vocab_size=tokenizer.get_vocab_size())
        model = BertForPreTraining(config).eval()
        models.append((f"bert-{size}", Pretrained("bert", model, tokenizer, Path(size))))
    return models


def timed(scorer, sentences: list[str]) -> tuple[float, float, list[float]]:
    """(wall seconds, CPU seconds of this process, scores) of one scoring."""
    wall, cpu = time.perf_counter(), time.process_time()
    scores = scorer(sentences)
    return time.perf_counter() - wall, time.process_time() - cpu, scores


def compare(name: str, pretrained: Pretrained, pairs, reference_class, args) -> dict:
    """Time the reference and ours alternately on `pairs`; compare their scores and answers."""
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    device = torch.device(args.device)
    pretrained.model.to(device)
    scorers = {
        "reference": reference_class(pretrained, device, BATCH_SIZE, "word_l2r"),
        "ours": SentenceScorer(pretrained, device, BATCH_SIZE, "word_l2r"),
    }
    for scorer in scorers.values():  # warm-up: allocator, kernels, first-call costs
        scorer(sentences[:64])
    walls, cpus, scores = {k: [] for k in scorers}, {k: [] for k in scorers}, {}
    for repeat in range(args.repeats):
        for label, scorer in scorers.items():
            wall, cpu, scores[label] = timed(scorer, sentences)
            walls[label].append(wall)
            cpus[label].append(cpu)
            print(f"{name} {label} {repeat + 1}/{args.repeats}: {wall:.1f} s", flush=True)
    pretrained.model.cpu()
    ours, reference = scores["ours"], scores["reference"]
    half = len(pairs)
    differing = [
        i for i in range(half) if (ours[i] > ours[half + i]) != (reference[i] > reference[half + i])
    ]
    return {
        "model": name,
        "sentences": len(sentences),
        **{
            label: {
                "wall_s": walls[label],
                "cpu_s": cpus[label],
                "median_s": statistics.median(walls[label]),
                "sentences_per_s": len(sentences) / statistics.median(walls[label]),
            }
            for label in scorers
        },
        "speedup": statistics.median(walls["reference"]) / statistics.median(walls["ours"]),
        "max_score_difference": max(abs(a - b) for a, b in zip(ours, reference, strict=True)),
        "answers_differing": len(differing),
        "differing_pairs": [  # the first few, to look at
            {
                "phenomenon": pairs[i].uid,
                "good": pairs[i].good,
                "bad": pairs[i].bad,
                "ours_good_minus_bad": ours[i] - ours[half + i],
                "reference_good_minus_bad": reference[i] - reference[half + i],
            }
            for i in differing[:10]
        ],
        "smallest_margin": min(abs(reference[i] - reference[half + i]) for i in range(half)),
    }


def table(rows: list[dict]) -> str:
    headers = [
        "model",
        "sentences",
        "reference s",
        "ours s",
        "speed-up",
        "max |score diff| (nats)",
        "answers differing",
        "smallest margin (nats)",
    ]
    cells = [
        [
            r["model"],
            f"{r['sentences']:,}",
            number(r["reference"]["median_s"]),
            number(r["ours"]["median_s"]),
            f"{r['speedup']:.2f}x",
            f"{r['max_score_difference']:.1e}",
            str(r["answers_differing"]),
            f"{r['smallest_margin']:.1e}",
        ]
        for r in rows
    ]
    return markdown_table(headers, cells)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", action="append", help="a BERT run (or .ckpt, hf/); repeatable")
    parser.add_argument("--sizes", default="tiny,mini", help="random BERTs without --ckpt")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--pairs", type=int, default=20, help="the first N of each phenomenon")
    parser.add_argument("--phenomena", help="comma list (default: all 67)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each scorer")
    parser.add_argument("--quick", action="store_true", help="2 pairs per phenomenon, 1 repeat")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--against", default=REFERENCE_REVISION, help="the reference's revision")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/blimp.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.repeats = 2, 1
    torch.set_num_threads(args.threads)
    folder = require_data(SHARED / "blimp", "BLiMP")
    phenomena = args.phenomena.split(",") if args.phenomena else None
    pairs = read_pairs(folder, args.pairs, phenomena)
    reference_class = reference_scorer(args.against)
    if args.ckpt:
        models = [("/".join(Path(c).parts[-2:]), load_pretrained(c)) for c in args.ckpt]
        if bad := [n for n, p in models if p.family != "bert"]:
            raise BenchError(f"--ckpt {', '.join(bad)}: not a BERT (PLL scores masked models)")
    else:
        models = random_berts(args.sizes.split(","), args.vocab_size)
    rows = [compare(name, p, pairs, reference_class, args) for name, p in models]
    figures = []
    for row in rows:
        figures.append(
            figure(
                "blimp",
                f"{row['model']} PLL sentences/s",
                row["ours"]["sentences_per_s"],
                row["reference"]["sentences_per_s"],
                "sentences/s",
                at_least=TARGET,
            )
        )
        figures.append(
            figure(
                "blimp",
                f"{row['model']} answers differing",
                row["answers_differing"],
                None,
                "pairs",
                at_most=0,
                target_on="ours",
            )
        )
    report = {
        "benchmark": "BLiMP pseudo-log-likelihood scoring, ours vs the scorer it replaced",
        "machine": machine(),
        "device": args.device,
        "threads": args.threads,
        "against": args.against,
        "pairs_per_phenomenon": args.pairs,
        "batch_size": BATCH_SIZE,
        "results": rows,
        "figures": figures,
    }
    return finish(report, table(rows) + "\n\n" + figures_table(figures), args.out)


if __name__ == "__main__":
    command_line(main)

"""Data-pipeline throughput: token-store building against raw `tokenizers`, DataLoader batches/s
against the mini models' training-step rate.

    python bench/bench_data.py [--quick] [--corpus full] [--shards GLOB|none] [--reps 3]
                               [--batches 200] [--out bench/results/data.json]
    make bench-data

1. Store building: MB of raw text per second for building the BERT store (read, sentence-split,
   encode, write, checksum) and the GPT store (read, encode, EOS, write, checksum), against
   `Tokenizer.encode_batch` on the same documents already in memory, in the same run, with the
   same tokenizer. Runs alternate and the median is reported (shared CPUs are noisy).
   Target: the store reaches >= 70% of raw `encode_batch` throughput. The documents, repeated
   to at least `--parallel-mb` MB (100; a parallel build's start-up is a few tenths of a second
   per process, which a corpus of seconds would mostly measure) and written to `PARALLEL_FILES`
   files, are then built by 1 process and by 2 (`make prepare prepare.workers=2`,
   datamodules/stores/parallel.py): MB/s of each, and their ratio.
2. DataLoader: batches/s of the training loader for BERT (NSP pairs, dynamic masking, seq 128,
   batch 32) and GPT (packed windows, seq 256, batch 16) with 0 and 2 workers, after the first
   batch (worker start-up excluded).
   The same with `datamodule.streaming=true` (no store: the workers read and tokenize the
   text as they go, datamodules/streaming/read.py), and the seconds to its first batch.
3. Mini models: fwd + bwd + AdamW steps/s of BERT-mini and GPT-mini (models/) on the same
   batches, on `--device` (CUDA when present, else this CPU). Target: the loader's batches/s
   >= 20x the training-step rate.

Corpus (`--corpus`): WikiText-2 train (tokenized, 10.8 MB) from ../shared/data through the
local-files source; `--quick` uses the 1.1 MB raw validation split; `embedded` (the built-in
corpus) or a text file of your own.

4. A corpus of real size (`--shards`, by default the 16 Gutenberg training shards of
   ../shared/data, 407 MB of books; none with `--quick`): `make prepare` builds each family's store of the shards
   with 1 and 2 processes (MB/s of text and peak memory, bench/shards.py), and the streamed
   loader reads them (batches/s, 0 and 2 workers) against the mini model's step.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.common import (
    SHARED,
    WIKITEXT2,
    BenchError,
    command_line,
    figure,
    finish,
    machine,
    markdown_table,
    number,
    require_data,
)
from bench.shards import GUTENBERG_SHARDS, Shards
from datamodules.corpora.corpus import EmbeddedCorpus, TextFilesCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from datamodules.run_stores import store_settings
from datamodules.stores.build import build_store
from datamodules.stores.parallel import build_in_parallel
from tokenizer import batched, train_tokenizer

CORPORA = {
    "full": WIKITEXT2 / "train.txt.gz",
    "quick": SHARED / "wikitext/wikitext-2-raw/wiki.valid.raw",
}
# size -> model -> (tokenizer kind, objective); the model preset is the size ("tiny" is for the
# smoke test).
SIZES = {
    "mini": {
        "bert": ("wordpiece", MaskedLMObjective(seq_len=128, batch_size=32)),
        "gpt": ("bpe", CausalLMObjective(seq_len=256, batch_size=16)),
    },
    "tiny": {
        "bert": ("wordpiece", MaskedLMObjective(seq_len=32, batch_size=4)),
        "gpt": ("bpe", CausalLMObjective(seq_len=32, batch_size=4)),
    },
}
PARALLEL_FILES = 8  # files the documents are written to for the parallel build
# Targets of issue 8: store MB/s / encode_batch MB/s, loader batches/s / mini-model steps/s.
STORE_TARGET, LOADER_TARGET = 0.70, 20.0
STREAM_BLOCK_MB = 0.25  # text per streamed block in the loader rows (a run's default: 4)


def load_corpus(choice: str):
    """`full` (WikiText-2 train), `quick` (its raw validation split), `embedded` or a file."""
    if choice == "embedded":
        return EmbeddedCorpus(), "embedded corpus"
    path = CORPORA.get(choice, Path(choice))
    if choice in CORPORA:
        require_data(path, f"WikiText-2 ({choice} corpus)")
    elif not path.is_file():
        raise BenchError(f"--corpus {choice}: no such file; give full, quick, embedded or a file")
    return TextFilesCorpus(str(path), doc_split="wikitext"), path.name


def read_shards(choice: str) -> Shards | None:
    """`--shards`: none, gutenberg (../shared/data's books) or a glob of JSON Lines files."""
    if choice == "none":
        return None
    if choice == "gutenberg":
        require_data(GUTENBERG_SHARDS.parent, "the Gutenberg shards")
        choice = str(GUTENBERG_SHARDS)
    return Shards.read(choice)


def bench_store(
    corpus, docs: list[str], tokenizer, objective, reps: int, parallel_mb: float = 100.0
) -> dict:
    """Median MB/s of raw encode_batch, encode_batch_fast and the store build, interleaved."""
    settings = store_settings(objective, tokenizer)
    megabytes = sum(len(d.encode()) for d in docs) / 1e6
    fingerprint = corpus.fingerprint()
    rates: dict[str, list[float]] = {"encode_batch": [], "encode_batch_fast": [], "store": []}
    for _ in range(reps):
        for name in ("encode_batch", "encode_batch_fast"):
            start = time.perf_counter()
            getattr(tokenizer, name)(docs, add_special_tokens=False)
            rates[name].append(megabytes / (time.perf_counter() - start))
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            stats = build_store(corpus, tokenizer, settings, Path(tmp) / "store", fingerprint)
            rates["store"].append(megabytes / (time.perf_counter() - start))
    repeat = max(1, round(parallel_mb / megabytes))
    with tempfile.TemporaryDirectory() as tmp:
        files = as_files(docs * repeat, Path(tmp), PARALLEL_FILES)
        rates |= {"files_1_process": [], "files_2_processes": []}
        for rep in range(reps):
            for workers in (1, 2):
                name = "files_1_process" if workers == 1 else "files_2_processes"
                start = time.perf_counter()
                if workers == 1:
                    target = Path(tmp) / f"one{rep}"
                    build_store(files, tokenizer, settings, target, files.fingerprint())
                else:
                    cache = Path(tmp) / f"cache{rep}"
                    build_in_parallel(files, tokenizer, settings, cache, workers=workers)
                rates[name].append(repeat * megabytes / (time.perf_counter() - start))
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "text_mb": megabytes,
        "documents": stats.documents,
        "tokens": stats.tokens,
        "mb_per_s": median,
        "runs_mb_per_s": rates,
        "store_vs_encode_batch": median["store"] / median["encode_batch"],
        "store_vs_encode_batch_fast": median["store"] / median["encode_batch_fast"],
        "parallel_text_mb": repeat * megabytes,
        "two_processes_vs_one": median["files_2_processes"] / median["files_1_process"],
    }


def as_files(docs: list[str], folder: Path, count: int) -> TextFilesCorpus:
    """The documents written to `count` text files (a blank line between documents, their
    paragraphs on single lines), read back as one corpus of the same documents."""
    for i in range(count):
        share = docs[i * len(docs) // count : (i + 1) * len(docs) // count]
        (folder / f"docs{i:02d}.txt").write_text("\n\n".join(share) + "\n")
    return TextFilesCorpus(str(folder / "docs*.txt"), doc_split="blank_line")


def bench_loader(dm: PretrainDataModule, workers: int, batches: int) -> dict:
    """batches/s of the training loader after its first batch (and, streaming, the seconds
    to that batch: worker start-up and the first block's tokenization)."""
    dm.num_workers = workers
    start = time.perf_counter()
    loader = dm.train_dataloader()
    iterator = iter(loader)
    next(iterator)  # worker start-up and first epoch's instances are not steady state
    first_s = time.perf_counter() - start
    count = batches if dm.stream is not None else min(batches, len(loader) - 1)
    start = time.perf_counter()
    for _ in range(count):
        next(iterator)
    seconds = time.perf_counter() - start
    del iterator
    return {
        "workers": workers,
        "batches": count,
        "batches_per_s": count / seconds,
        "first_batch_s": first_s,
    }


def bench_streaming(corpus, tokenizer, objective, cache: str, batches: int) -> list[dict]:
    """`bench_loader` of a streamed run's loader with 0 and 2 workers (each a new datamodule:
    the workers are the stream's readers)."""
    rows = []
    for workers in (0, 2):
        dm = PretrainDataModule(
            corpus,
            tokenizer,
            objective,
            cache,
            val_fraction=0.0,
            streaming=True,
            shuffle_buffer_mb=STREAM_BLOCK_MB,
            num_workers=workers,
        )
        dm.setup("fit")
        rows.append(bench_loader(dm, workers, 3 * batches))
    return rows


def mini_model_step(
    model_name: str,
    vocab_size: int,
    batches: list[dict],
    steps: int,
    device: torch.device,
    preset: str = "mini",
) -> dict:
    """Median fwd + bwd + AdamW step time of the mini model on real batches."""
    from models import GPT, BertConfig, BertForPreTraining, GPTConfig, pretraining_loss

    torch.manual_seed(0)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    if model_name == "bert":
        model = BertForPreTraining(BertConfig.from_preset(preset, vocab_size=vocab_size))

        def loss_of(batch):
            out = model(
                batch["input_ids"],
                attention_mask=batch["attention_mask"],
                token_type_ids=batch["token_type_ids"],
                masked_positions=batch["masked_positions"],
            )
            return pretraining_loss(out, batch["mlm_labels"], batch["nsp_labels"]).total

    else:
        model = GPT(GPTConfig.from_preset(preset, vocab_size=vocab_size))

        def loss_of(batch):
            return model(batch["input_ids"], targets=batch["targets"]).loss

    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss_of(batches[i % len(batches)]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    return {"median_step_s": statistics.median(times), "steps_per_s": 1 / statistics.median(times)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small corpus, 1 rep, few batches")
    parser.add_argument(
        "--corpus", help="full (WikiText-2 train), quick (its validation split), embedded or a file"
    )
    parser.add_argument("--reps", type=int, default=3, help="store-building repetitions")
    parser.add_argument("--batches", type=int, default=200, help="timed loader batches")
    parser.add_argument(
        "--parallel-mb", type=float, default=100.0, help="text of the 1- vs 2-process builds"
    )
    parser.add_argument(
        "--shards",
        help="a glob of JSON Lines shards for the real-size rows (default: the Gutenberg books "
        "of ../shared/data; none with --quick), or none",
    )
    parser.add_argument("--model-steps", type=int, default=5, help="timed mini-model steps")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--size", choices=sorted(SIZES), default="mini", help="model preset")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results/data.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.batches, args.model_steps, args.parallel_mb = 1, 50, 2, 10.0
    logging.basicConfig(level=logging.WARNING)

    corpus, corpus_name = load_corpus(args.corpus or ("quick" if args.quick else "full"))
    shards = read_shards(args.shards or ("none" if args.quick else "gutenberg"))
    docs = list(corpus.documents())
    cache = tempfile.TemporaryDirectory()
    results = {}
    for name, (kind, objective) in SIZES[args.size].items():
        tokenizer = train_tokenizer(kind, batched(docs[: max(50, len(docs) // 3)]), args.vocab_size)
        row = {
            "store": bench_store(corpus, docs, tokenizer, objective, args.reps, args.parallel_mb)
        }
        dm = PretrainDataModule(corpus, tokenizer, objective, cache.name, val_fraction=0.0)
        dm.setup("fit")
        row["loader"] = [bench_loader(dm, workers, args.batches) for workers in (0, 2)]
        row["streaming"] = bench_streaming(corpus, tokenizer, objective, cache.name, args.batches)
        dm.num_workers = 0
        sample = [batch for batch, _ in zip(dm.train_dataloader(), range(4), strict=False)]
        row["mini_model"] = mini_model_step(
            name,
            tokenizer.get_vocab_size(),
            sample,
            args.model_steps,
            torch.device(args.device),
            preset=args.size,
        )
        if shards is not None:
            shard_tokenizer = shards.tokenizer(kind, args.vocab_size)
            row["shards"] = shards.builds(name, shard_tokenizer)
            row["shards"]["streaming"] = bench_streaming(
                shards.corpus, shard_tokenizer, objective, cache.name, args.batches
            )
            best = max(r["batches_per_s"] for r in row["shards"]["streaming"])
            row["shards"]["best_streaming_batches_per_s"] = best
            row["shards"]["streaming_vs_model_steps"] = best / row["mini_model"]["steps_per_s"]
        row["best_loader_batches_per_s"] = max(r["batches_per_s"] for r in row["loader"])
        row["best_streaming_batches_per_s"] = max(r["batches_per_s"] for r in row["streaming"])
        row["loader_vs_model_steps"] = (
            row["best_loader_batches_per_s"] / row["mini_model"]["steps_per_s"]
        )
        results[name] = row
    cache.cleanup()

    report = {
        "benchmark": "token-store MB/s vs raw tokenizers; DataLoader batches/s vs mini-model steps/s",
        "corpus": corpus_name,
        "shards": None if shards is None else shards.pattern,
        "machine": machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "model_device": args.device,
        "model_size": args.size,
        "torch": torch.__version__,
        "quick": args.quick,
        "results": results,
    }
    report["figures"] = figures(report)
    return finish(report, table(report), args.out)


def figures(report: dict) -> list[dict]:
    """Store MB/s against raw `encode_batch` MB/s, and the faster loader's batches/s against
    the mini model's training steps/s, per model."""
    rows = []
    for name, row in report["results"].items():
        rates = row["store"]["mb_per_s"]
        rows.append(
            figure(
                "data",
                f"{name} token store vs encode_batch",
                rates["store"],
                rates["encode_batch"],
                "MB/s",
                at_least=STORE_TARGET,
            )
        )
        for loader, best in (("loader", "loader"), ("streaming loader", "streaming")):
            rows.append(
                figure(
                    "data",
                    f"{name} {loader} batches/s vs model steps/s",
                    row[f"best_{best}_batches_per_s"],
                    row["mini_model"]["steps_per_s"],
                    "per s",
                    at_least=LOADER_TARGET,
                )
            )
        if "shards" in row:
            rows.append(
                figure(
                    "data",
                    f"{name} streaming loader on the shards batches/s vs model steps/s",
                    row["shards"]["best_streaming_batches_per_s"],
                    row["mini_model"]["steps_per_s"],
                    "per s",
                    at_least=LOADER_TARGET,
                )
            )
    return rows


def table(report: dict) -> str:
    """The report as Markdown: a heading line and one row per model."""
    head = (
        f"{report['corpus']}, {report['cpus']} CPUs, {report['model_size']} models on "
        f"{report['model_device']}, medians"
    )
    rows = []
    for name, row in report["results"].items():
        store, rates = row["store"], row["store"]["mb_per_s"]
        rows.append(
            [
                name,
                f"{store['text_mb']:.1f}",
                f"{rates['encode_batch']:.2f}",
                f"{rates['encode_batch_fast']:.2f}",
                f"{rates['store']:.2f}",
                f"{store['store_vs_encode_batch']:.0%}",
                f"{store['parallel_text_mb']:.0f} MB: {rates['files_1_process']:.2f} / "
                f"{rates['files_2_processes']:.2f} ({store['two_processes_vs_one']:.2f}x)",
                " / ".join(number(r["batches_per_s"]) for r in row["loader"]),
                streaming_cell(row["streaming"]),
                f"{row['mini_model']['steps_per_s']:.2f}",
                f"{row['loader_vs_model_steps']:,.0f}x",
            ]
        )
    headers = [
        "model",
        "text MB",
        "encode_batch MB/s",
        "encode_batch_fast MB/s",
        "store MB/s",
        "store / encode_batch",
        f"store MB/s, {PARALLEL_FILES} files: 1 / 2 processes",
        "loader batches/s (0 / 2 workers)",
        "streaming batches/s (0 / 2 workers)",
        "model step/s",
        "loader / step",
    ]
    tables = [f"{head}\n\n{markdown_table(headers, rows)}"]
    if report.get("shards"):
        tables.append(shards_table(report))
    return "\n\n".join(tables)


def streaming_cell(rows: list[dict]) -> str:
    """Streamed batches/s with 0 / 2 workers, and the seconds to the 2 workers' first batch."""
    rates = " / ".join(number(r["batches_per_s"]) for r in rows)
    return f"{rates} (first {rows[1]['first_batch_s']:.1f} s)"


def shards_table(report: dict) -> str:
    """The rows of the JSON Lines shards: `make prepare` with 1 and 2 processes, and the
    streamed loader against the model's step."""
    rows = []
    for name, row in report["results"].items():
        shards = row["shards"]
        one, two = shards["builds"]
        rows.append(
            [
                name,
                f"{shards['text_mb']:.0f} MB, {shards['documents']:,} documents, "
                f"{shards['files']} files",
                f"{one['mb_per_s']:.2f} MB/s ({one['seconds']:.0f} s), {one['peak_rss_mb']:,.0f} MB",
                f"{two['mb_per_s']:.2f} MB/s ({two['seconds']:.0f} s), {two['peak_rss_mb']:,.0f} MB",
                f"{shards['two_processes_vs_one']:.2f}x",
                streaming_cell(shards["streaming"]),
                f"{shards['streaming_vs_model_steps']:,.0f}x",
            ]
        )
    headers = [
        "model",
        "shards",
        "make prepare, 1 process: text MB/s (s), peak RSS",
        "2 processes",
        "2 / 1",
        "streaming batches/s (0 / 2 workers)",
        "streaming / step",
    ]
    return f"{report['shards']}:\n\n{markdown_table(headers, rows)}"


if __name__ == "__main__":
    command_line(main)

"""Write a large text corpus for scale tests of the data pipeline, from the English texts in
../shared/data: WikiText-2 (train, tokenized, and the raw validation and test splits), tiny
Shakespeare, and the long IMDB reviews, about 21 MB in all, copied until the corpus reaches
`--gb` gigabytes.

    python bench/make_big_corpus.py outputs/big_corpus --gb 2 [--files 32] [--seed 0]

Each copy is perturbed so that no two copies are the same text (a store or a tokenizer that
deduplicated, or cached by content, would otherwise flatter the figures): its documents come
in a seeded order, and in each document a seeded tenth of the sentences is dropped and the words
of another tenth are swapped pairwise. Documents are written to `--files` plain text files, a
blank line between documents (read them with `data=text_files`, `doc_split=blank_line`). Nothing
here is committed: the folder is the caller's (outputs/ is ignored by git). Memory stays at one
copy of the source texts, whatever the size written.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.common import SHARED, WIKITEXT2, command_line, require_data

_ARTICLE = re.compile(r"^ = [^=].* = $")
_SENTENCE_END = re.compile(r"(?<=[.!?]) +")


def source_documents() -> list[str]:
    """The source texts as documents (paragraphs on single lines, separated by "\\n")."""
    documents: list[str] = []
    wikitext = [
        WIKITEXT2 / "train.txt.gz",
        SHARED / "wikitext/wikitext-2-raw/wiki.valid.raw",
        SHARED / "wikitext/wikitext-2-raw/wiki.test.raw",
    ]
    for path in wikitext:
        require_data(path, "WikiText-2")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            article: list[str] = []
            for line in handle:
                if _ARTICLE.match(line.rstrip("\n")) and article:
                    documents.append("\n".join(article))
                    article = []
                if line.strip():
                    article.append(line.strip())
            documents.append("\n".join(article))
    shakespeare = SHARED / "tinyshakespeare/input.txt"
    require_data(shakespeare, "tiny Shakespeare")
    for scene in shakespeare.read_text(encoding="utf-8").split("\n\n"):
        if scene.strip():
            documents.append(" ".join(scene.split()))
    reviews = SHARED / "long_docs/imdb_long_train.jsonl"
    require_data(reviews, "long IMDB reviews")
    with open(reviews, encoding="utf-8") as handle:
        documents.extend(json.loads(line)["text"].replace("\n", " ") for line in handle)
    return [d for d in documents if d.strip()]


def perturbed(document: str, rng: random.Random) -> str:
    """The document with a tenth of its sentences dropped and the words of a tenth swapped in
    pairs (at least one sentence is kept)."""
    paragraphs = []
    for paragraph in document.split("\n"):
        sentences = _SENTENCE_END.split(paragraph)
        kept = []
        for sentence in sentences:
            roll = rng.random()
            if roll < 0.1 and len(sentences) > 1:
                continue
            if roll < 0.2:
                words = sentence.split()
                for i in range(0, len(words) - 1, 2):
                    words[i], words[i + 1] = words[i + 1], words[i]
                sentence = " ".join(words)
            kept.append(sentence)
        if kept:
            paragraphs.append(" ".join(kept))
    return "\n".join(paragraphs) or document


def copies(documents: list[str], rng: random.Random) -> Iterator[str]:
    """Perturbed copies of the documents, each copy in a new order, without end; each text
    ends with the blank line that separates documents."""
    while True:
        order = list(range(len(documents)))
        rng.shuffle(order)
        for index in order:
            yield perturbed(documents[index], rng) + "\n\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where the files go (created)")
    parser.add_argument("--gb", type=float, default=2.0, help="size to write, in 10^9 bytes")
    parser.add_argument("--files", type=int, default=32, help="files to spread it over")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    documents = source_documents()
    args.folder.mkdir(parents=True, exist_ok=True)
    target = int(args.gb * 1e9)
    per_file = -(-target // args.files)
    texts = copies(documents, random.Random(args.seed))
    written = count = 0
    for i in range(args.files):
        in_file = 0
        with open(args.folder / f"part{i:04d}.txt", "w", encoding="utf-8") as handle:
            while in_file < per_file and written < target:
                text = next(texts)
                size = len(text.encode())
                handle.write(text)
                written, in_file, count = written + size, in_file + size, count + 1
    summary = {"folder": str(args.folder), "bytes": written, "documents": count}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    command_line(main)

"""`make tokenizer`: train (or reuse from the cache) the tokenizer a run would use and print
where it is, its size, a sample encoding and its encoding throughput. Nothing is written but the
cache (no run folder: conf/prepare.yaml).

    python -m pipeline.commands.tokenizer model=gpt tokenizer.vocab_size=16000
"""

from __future__ import annotations

import time

import hydra
from omegaconf import DictConfig
from tokenizers import Tokenizer

from pipeline.pretrain.checks import check_config
from pipeline.run.cli import entry_point, user_errors
from pipeline.run.families import family_named
from pipeline.run.launcher import group_choices
from tokenizer import batched, get_tokenizer, tokenizer_cache_path

SAMPLE_PAIR = ("The quick brown fox jumps over the lazy dog.", "It was not amused.")
SAMPLE_TEXT = "Tokenizers turn text into ids: naïve café, 東京, emoji 🙂, tabs\tand newlines\n."


def measure_throughput(tokenizer: Tokenizer, corpus) -> tuple[int, int, int, float]:
    """Encode the whole corpus in batches; returns (documents, bytes, tokens, seconds)."""
    documents = n_bytes = n_tokens = 0
    start = time.perf_counter()
    for batch in batched(corpus.documents()):
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        documents += len(batch)
        n_bytes += sum(len(text.encode()) for text in batch)
        n_tokens += sum(len(e.ids) for e in encodings)
    return documents, n_bytes, n_tokens, time.perf_counter() - start


@hydra.main(config_path="../../conf", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with user_errors():
        plan = check_config(cfg, group_choices())
        cache = tokenizer_cache_path(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
        reused = not plan.tokenizer.path and cache.is_file()
        start = time.perf_counter()
        tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
        elapsed = time.perf_counter() - start
        documents, n_bytes, n_tokens, seconds = measure_throughput(tokenizer, plan.corpus)

    how = (
        f"loaded from {plan.tokenizer.path}"
        if plan.tokenizer.path
        else "reused from cache"
        if reused
        else f"trained in {elapsed:.1f} s"
    )
    print(f"tokenizer   {plan.tokenizer.kind}, vocabulary {tokenizer.get_vocab_size():,} ({how})")
    print(f"corpus      {plan.corpus.describe()}")
    print(f"file        {plan.tokenizer.path or cache}")
    if family_named(plan.family).input_template.segments:  # a pair, with its segment ids
        encoding = tokenizer.encode(*SAMPLE_PAIR)
        print(f"sample      {SAMPLE_PAIR[0]!r} + {SAMPLE_PAIR[1]!r}")
        print(f"tokens      {encoding.tokens}")
        print(f"type ids    {encoding.type_ids}")
    else:
        encoding = tokenizer.encode(SAMPLE_TEXT)
        decoded = tokenizer.decode(encoding.ids)
        print(f"sample      {SAMPLE_TEXT!r}")
        print(f"tokens      {encoding.tokens}")
        print(f"round trip  {'exact' if decoded == SAMPLE_TEXT else 'DIFFERS: ' + repr(decoded)}")
    print(f"ids         {encoding.ids}")
    print(
        f"throughput  {n_bytes / 1e6 / seconds:.2f} MB/s, {n_tokens / seconds:,.0f} tokens/s "
        f"({documents:,} documents, {n_bytes / 1e6:.2f} MB, {n_tokens:,} tokens, "
        f"{n_bytes / max(n_tokens, 1):.2f} bytes/token)"
    )


if __name__ == "__main__":
    entry_point(main)

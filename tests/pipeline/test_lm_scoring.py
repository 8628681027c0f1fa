"""Scoring a text with a causal model in bits per byte (pipeline/infer/lm_scoring.py and
`make evaluate-lm`)."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.checkpoint.load import Pretrained
from pipeline.infer.lm_scoring import read_text, score_text
from pipeline.run.errors import ConfigError
from tests.conftest import run_command
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer, write_run
from tokenizer import batched, train_tokenizer
from tokenizer.special import EOT
from tokenizer.token_bytes import token_byte_counts

TEXT = "The café opened in 1921. Its owner, Zoë, served tea — and nothing else — for years.\n"


def pretrained_gpt(model, tokenizer) -> Pretrained:
    return Pretrained("gpt", model.eval(), tokenizer, Path("memory"))


def test_bits_per_byte_is_the_texts_nats_over_its_bytes(small_docs):
    tokenizer = trained_tokenizer("bpe")
    model = tiny_model("gpt", tokenizer).eval()
    text = TEXT * 2
    # by hand: one window, every token after the end-of-text start predicted
    stream = [tokenizer.token_to_id(EOT), *tokenizer.encode(text).ids]
    assert len(stream) - 1 <= model.config.max_seq_len
    with torch.no_grad():
        logits = model(torch.tensor([stream[:-1]])).logits[0]
    nats = F.cross_entropy(logits.double(), torch.tensor(stream[1:]), reduction="sum").item()

    score = score_text(pretrained_gpt(model, tokenizer), text, torch.device("cpu"), progress=False)
    assert score.tokens == len(stream) - 1 and score.bytes == len(text.encode("utf-8"))
    assert score.nats == pytest.approx(nats, rel=1e-5)
    assert score.bits_per_byte == pytest.approx(nats / score.bytes / math.log(2), rel=1e-5)
    # short windows, several per batch and a padded last one: the same predictions, each with
    # less context, so the same count and a different total
    windowed = score_text(
        pretrained_gpt(model, tokenizer),
        text,
        torch.device("cpu"),
        seq_len=7,
        batch_size=3,
        progress=False,
    )
    assert (windowed.tokens, windowed.bytes) == (score.tokens, score.bytes)
    assert windowed.nats != pytest.approx(score.nats, rel=1e-6)


class UniformBytes(nn.Module):
    """A 'model' that gives every token the probability of its bytes drawn uniformly,
    256 ** -bytes: 8 bits per byte of any text, whatever the tokenizer."""

    def __init__(self, tokenizer, max_seq_len: int = 64) -> None:
        super().__init__()
        self.config = type("Config", (), {"max_seq_len": max_seq_len})()
        self.token_bytes = torch.from_numpy(token_byte_counts(tokenizer))

    def forward(self, input_ids, *, targets, reduction):
        counted = targets != -100
        nats = self.token_bytes[targets[counted]].double() * math.log(256)
        return type("Out", (), {"loss": nats.sum()})()


def test_two_tokenizers_give_the_same_bits_per_byte_for_a_byte_uniform_model(small_docs):
    text = "\n\n".join(small_docs[:3])
    scores = []
    for vocab in (300, 2000):
        tokenizer = train_tokenizer("bpe", batched(small_docs), vocab_size=vocab)
        pretrained = pretrained_gpt(UniformBytes(tokenizer), tokenizer)
        scores.append(score_text(pretrained, text, torch.device("cpu"), progress=False))
    assert scores[0].tokens > 1.5 * scores[1].tokens  # really different tokenizations
    assert [s.bits_per_byte for s in scores] == pytest.approx([8.0, 8.0], rel=1e-9)


def test_bad_inputs_are_named(small_docs):
    tokenizer = trained_tokenizer("bpe")
    pretrained = pretrained_gpt(tiny_model("gpt", tokenizer), tokenizer)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="empty"):
        score_text(pretrained, "", cpu)
    with pytest.raises(ConfigError, match="seq_len=100000"):
        score_text(pretrained, TEXT, cpu, seq_len=100_000)


def test_a_file_that_is_missing_or_not_utf8_is_named(tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text.*iconv -f latin1"):
        read_text(latin1)
    with pytest.raises(ConfigError, match="does not exist"):
        read_text(tmp_path / "nope.txt")


def run_evaluate_lm(*overrides: str) -> subprocess.CompletedProcess:
    return run_command("pipeline.commands.evaluate_lm", *overrides)


def test_make_evaluate_lm_scores_a_file_and_names_bad_ones(tmp_path):
    write_run(tmp_path / "run", "gpt")
    run = tmp_path / "run"
    text_file = tmp_path / "test.txt"
    text_file.write_text(TEXT * 3, encoding="utf-8")
    done = run_evaluate_lm(f"ckpt={run}", f"file={text_file}", f"out={tmp_path / 'score.json'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bits per byte" in done.stdout
    assert f"{len((TEXT * 3).encode()):,} bytes" in done.stdout
    assert (tmp_path / "score.json").exists()

    write_run(tmp_path / "bert", "bert")
    bert = tmp_path / "bert"
    wrong = run_evaluate_lm(f"ckpt={bert}", f"file={text_file}")
    assert wrong.returncode != 0 and "needs a GPT (a causal model to score a text)" in wrong.stderr

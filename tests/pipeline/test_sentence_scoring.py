"""A masked model's sentence scores (`pipeline.infer.sentence_scoring`): the batched scorer gives
a real trained BERT's pseudo-log-likelihoods on real BLiMP pairs as a plain one-sentence-at-a-
time computation does, and it skips the work PLL does not read (padding, the last block at the
columns nobody scores)."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from models.bert import BertForPreTraining
from pipeline.checkpoint.load import Pretrained
from pipeline.infer.blimp import Pair, answers, read_pairs
from pipeline.infer.sentence_scoring import SentenceScorer
from tests.pipeline.test_modules import fixed_wordpiece
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer
from tokenizer import special_ids

CPU = torch.device("cpu")
# fp32 rounding of a sum of ~20 log-probabilities, each from a differently shaped batch: the
# scores seen differ by a few 1e-6 nats; a tie closer than this would be a coin toss
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trained(small_docs, tmp_path_factory) -> tuple[BertForPreTraining, Tokenizer]:
    """The tiny test BERT after 30 MLM steps on real prose: its predictions follow the text
    (the pairs' margins are far wider than fp32's rounding), unlike a random model's. Its
    WordPiece vocabulary is built deterministically (a trained one differs from process to
    process, and with it the model: a pair's margin came out at 1.97e-4 in one of them)."""
    tokenizer = fixed_wordpiece(
        small_docs, tmp_path_factory.mktemp("wordpiece") / "vocab.txt", 1000
    )
    model = tiny_model("bert", tokenizer, seed=0).train()
    specials = special_ids(tokenizer)
    stream = [i for e in tokenizer.encode_batch(small_docs) for i in e.ids]
    windows = torch.tensor(stream[: len(stream) // 32 * 32]).view(-1, 32)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights on every machine, however loaded
    try:
        for _ in range(30):
            ids = windows[torch.randint(len(windows), (16,), generator=generator)]
            masked = torch.rand(ids.shape, generator=generator) < 0.15
            logits = model(ids.masked_fill(masked, specials.mask)).mlm_logits
            loss = F.cross_entropy(logits[masked], ids[masked])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), tokenizer


def plain_pll(model, tokenizer: Tokenizer, sentence: str, word_l2r: bool) -> float:
    """The pseudo-log-likelihood by its definition: for each token but the specials, the
    sentence with it masked (and, for word_l2r, the later pieces of its word), the whole model
    run on that copy (the copies of this one sentence side by side, none padded), and the
    log-probability of the token at its place."""
    encoding = tokenizer.encode(sentence)
    ids, words = encoding.ids, encoding.word_ids
    scored = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
    mask = special_ids(tokenizer).mask
    copies = [
        [
            mask if j == i or (word_l2r and j > i and words[j] == words[i]) else token
            for j, token in enumerate(ids)
        ]
        for i in scored
    ]
    with torch.no_grad():
        logits = model(torch.tensor(copies)).mlm_logits  # (copies, T, V)
    logp = logits.log_softmax(-1)
    return sum(float(logp[row, i, ids[i]]) for row, i in enumerate(scored))


@pytest.mark.parametrize("pll", ["word_l2r", "token"])
def test_batched_scores_of_real_pairs_are_the_plain_ones(trained, shared_data, pll):
    """Every pair's answer is the plain computation's, and every sentence's score within
    `TOLERANCE`, on the first pair of each of BLiMP's 67 phenomena."""
    model, tokenizer = trained
    pairs = read_pairs(shared_data / "blimp", per_phenomenon=1)
    sentences = [p.good for p in pairs] + [p.bad for p in pairs]
    plain = [plain_pll(model, tokenizer, s, pll == "word_l2r") for s in sentences]
    pretrained = Pretrained("bert", model, tokenizer, Path("trained"))
    batched = SentenceScorer(pretrained, CPU, batch_size=64, pll=pll)(sentences)
    assert batched == pytest.approx(plain, abs=TOLERANCE, rel=0)
    half = len(pairs)
    margins = [abs(plain[i] - plain[half + i]) for i in range(half)]
    closest = min(range(half), key=margins.__getitem__)
    # so that no answer below is decided by rounding
    assert margins[closest] > 2 * TOLERANCE, (pairs[closest], margins[closest])
    assert answers(pairs, lambda _: batched) == answers(pairs, lambda _: plain)


def test_copies_are_not_padded_and_the_last_block_runs_at_the_scored_token_only():
    """A copy's feed-forward runs on its own length in the first block (no padding rows), and
    on one row, its masked token, in the last: PLL reads nothing else there."""
    tokenizer = trained_tokenizer("wordpiece")
    model = tiny_model("bert", tokenizer, seed=1)
    sentences = [
        "The cat sat.",
        "Who should Derek hug after shocking Richard?",
        "Unquestionably, the astronomers disagreed about the comet's orbit.",
        "It is.",
    ]
    encodings = [tokenizer.encode(s) for s in sentences]
    copies = [e.special_tokens_mask.count(0) for e in encodings]
    rows = {"first": 0, "last": 0}
    counting = threading.Lock()  # batches may run on several threads at once

    def count(name):
        def hook(module, args):
            with counting:
                rows[name] += args[0].shape[:-1].numel()

        return hook

    model.bert.layers[0].ff_in.register_forward_pre_hook(count("first"))
    model.bert.layers[-1].ff_in.register_forward_pre_hook(count("last"))
    scorer = SentenceScorer(Pretrained("bert", model, tokenizer, Path("tiny")), CPU, batch_size=5)
    scorer(sentences)
    assert rows["first"] == sum(n * len(e.ids) for n, e in zip(copies, encodings, strict=True))
    assert rows["last"] == sum(copies)


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_the_same_sentence_twice_gets_one_score_whichever_batches_it_falls_in(family):
    """BLiMP holds a few pairs whose two sentences are the same text: the pair must be a tie
    (a wrong answer), not ordered by how two differently shaped batches round."""
    tokenizer = trained_tokenizer("bpe" if family == "gpt" else "wordpiece")
    overrides = {"init_std": 0.1} if family == "gpt" else {}
    model = tiny_model(family, tokenizer, seed=2, **overrides)
    pretrained = Pretrained(family, model, tokenizer, Path("tiny"))
    same = "Who should Derek hug after shocking Richard?"
    others = [
        "The cat sat.",
        "Unquestionably, the astronomers disagreed about the comet's orbit.",
        "It is.",
        "Many girls have found themselves in the library this afternoon.",
    ]
    for batch_size in (1, 2, 3, 4, 5, 7):
        scorer = SentenceScorer(pretrained, CPU, batch_size=batch_size)
        scores = scorer([same, *others, same])
        assert scores[0] == scores[-1], batch_size
        assert answers([Pair("p", "t", same, same)], scorer) == [False]


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_batches_scored_side_by_side_on_several_threads_are_the_one_thread_scores(family):
    """On a CPU of 3 torch threads the scorer runs 2 batches at once, each on one thread (3 // 2):
    every score equals, to the last bit, the score of one batch at a time on one thread, and
    the process's thread count is as it was, also after a failing batch."""
    tokenizer = trained_tokenizer("bpe" if family == "gpt" else "wordpiece")
    model = tiny_model(family, tokenizer, seed=3)
    pretrained = Pretrained(family, model, tokenizer, Path("tiny"))
    sentences = [
        "The cat sat.",
        "Who should Derek hug after shocking Richard?",
        "Unquestionably, the astronomers disagreed about the comet's orbit.",
        "It is.",
        "Many girls have found themselves in the library this afternoon.",
        "Some waiters who had boasted about the soup were hiding.",
    ]
    scorer = SentenceScorer(pretrained, CPU, batch_size=2)
    seen = {}  # thread -> the torch threads it ran the model's layers with

    def note_thread(module, args) -> None:
        seen[threading.get_ident()] = torch.get_num_threads()

    for module in model.modules():
        module.register_forward_pre_hook(note_thread)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = scorer(sentences)
        torch.set_num_threads(3)
        seen.clear()
        side_by_side = scorer(sentences)
        assert seen and threading.get_ident() not in seen  # run by the pool's threads
        assert set(seen.values()) == {1}
        assert torch.get_num_threads() == 3
        calls, counting = itertools.count(1), threading.Lock()

        def fails_on_the_third(*args, **kwargs):
            with counting:
                call = next(calls)
            if call == 3:
                raise RuntimeError("out of memory")
            return forward(*args, **kwargs)

        name = "mlm_logits_at" if family == "bert" else "forward"
        forward = getattr(model, name)
        setattr(model, name, fails_on_the_third)
        with pytest.raises(RuntimeError, match="out of memory"):
            SentenceScorer(pretrained, CPU, batch_size=1)(sentences)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert side_by_side == alone


def test_a_scorer_told_not_to_runs_one_batch_at_a_time_on_all_threads():
    """`side_by_side=False` (the probe inside a training run) scores in the calling thread."""
    tokenizer = trained_tokenizer("bpe")
    model = tiny_model("gpt", tokenizer, seed=3)
    seen = set()
    model.register_forward_pre_hook(lambda module, args: seen.add(threading.get_ident()))
    scorer = SentenceScorer(Pretrained("gpt", model, tokenizer, Path("tiny")), CPU, batch_size=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        replace(scorer, side_by_side=False)(["The cat sat.", "It is.", "A dog ran home."])
    finally:
        torch.set_num_threads(threads)
    assert seen == {threading.get_ident()}

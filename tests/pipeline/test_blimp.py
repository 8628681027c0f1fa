"""BLiMP (`make evaluate-lm suite=blimp`): sentence scores of known models computed by hand, the
accuracies of known answers, the Kneser-Ney model's distributions, the random twin, the
paper's rows, and the whole command on a real pretraining run."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from models.bert import BertConfig, BertForPreTraining
from models.gpt import GPTOutput
from pipeline.checkpoint.load import Pretrained, load_pretrained
from pipeline.checkpoint.source import resolve_checkpoint
from pipeline.infer.blimp import BlimpScores, Pair, answers, read_pairs
from pipeline.infer.ngram import KneserNey
from pipeline.infer.sentence_scoring import SentenceScorer
from pipeline.pretrain import documents
from pipeline.pretrain.documents import run_training_text
from pipeline.report import write_report
from pipeline.report.runs import ReportError
from pipeline.run.errors import ConfigError
from pipeline.suites.blimp import (
    NGRAM_CACHE,
    check_settings,
    ngram_row,
    random_twin,
    report_path,
)
from tests.conftest import CLI_ENV, REPO, run_command, run_pretrain
from tests.pipeline.smoke_runs import copy_run, smoke_run
from tests.pipeline.test_cli import make_repo
from tests.pipeline.test_probe import probe_steps
from tests.pipeline.tiny_models import tiny_model, trained_tokenizer, write_fine_tuned
from tokenizer import special_ids

CPU = torch.device("cpu")


# --- a causal model: a bigram table -----------------------------------------------------------


class BigramModel(nn.Module):
    """A causal LM whose next-token logits are a fixed table row of the current token."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__()
        self.table = nn.Parameter(
            torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        )
        self.config = SimpleNamespace(max_seq_len=64)

    def forward(self, input_ids: torch.Tensor) -> GPTOutput:
        return GPTOutput(logits=self.table[input_ids], loss=None, hidden_states=None)


def test_a_causal_sentence_score_is_the_sum_of_its_bigram_log_probabilities():
    tokenizer = trained_tokenizer("bpe")
    model = BigramModel(tokenizer.get_vocab_size())
    scorer = SentenceScorer(Pretrained("gpt", model, tokenizer, Path("bigram")), CPU, batch_size=2)
    sentences = ["The cat sat.", "Who should Derek hug after shocking Richard?", "A"]
    table = model.table.detach().double()
    start = special_ids(tokenizer).eot
    expected = []
    for sentence in sentences:
        ids = [start, *tokenizer.encode(sentence, add_special_tokens=False).ids]
        total = 0.0
        for prev, token in itertools.pairwise(ids):
            row = table[prev]
            total += float(row[token]) - math.log(float(row.exp().sum()))
        expected.append(total)
    assert scorer.method == "causal"
    assert scorer(sentences) == pytest.approx(expected, abs=1e-4)  # padded batches of 2


# --- a masked model whose prediction is fixed ------------------------------------------------


class FixedMLM(BertForPreTraining):
    """A BERT whose masked prediction depends only on how many [MASK]s its input holds: the
    log-probabilities `log_q[k - 1]` with k masks, whatever the words."""

    def __init__(self, vocab: int, mask: int) -> None:
        super().__init__(
            BertConfig(vocab_size=vocab, n_layers=1, d_model=32, n_heads=2, max_seq_len=64)
        )
        generator = torch.Generator().manual_seed(1)
        self.log_q = torch.randn(4, vocab, generator=generator).log_softmax(-1)
        self.mask = mask

    def mlm_logits_at(self, input_ids, at_B, *, attention_mask=None):
        padding = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        masks = ((input_ids == self.mask) & (padding == 1)).sum(-1).clamp(max=4)
        return self.log_q[masks - 1]  # (B, V): one position per row


@pytest.mark.parametrize("pll", ["token", "word_l2r"])
def test_pseudo_log_likelihood_masks_a_token_or_the_rest_of_its_word(pll):
    tokenizer = trained_tokenizer("wordpiece")
    mask = special_ids(tokenizer).mask
    model = FixedMLM(tokenizer.get_vocab_size(), mask).eval()
    sentences = ["Unquestionably, the astronomers disagreed.", "It is."]
    expected = []
    for sentence in sentences:
        encoding = tokenizer.encode(sentence)
        words, specials = encoding.word_ids, encoding.special_tokens_mask
        scored = [i for i, s in enumerate(specials) if not s]
        total = 0.0
        for i in scored:
            later_pieces = [j for j in scored if j > i and words[j] == words[i]]
            masks = 1 + (len(later_pieces) if pll == "word_l2r" else 0)
            total += float(model.log_q[min(masks, 4) - 1, encoding.ids[i]])
        expected.append(total)
    # the first sentence has a word of several pieces, so the two methods differ on it
    pieces = tokenizer.encode(sentences[0]).word_ids
    assert len(pieces) > len(set(pieces))
    scorer = SentenceScorer(
        Pretrained("bert", model, tokenizer, Path("fixed")), CPU, batch_size=3, pll=pll
    )
    assert scorer.method == f"pll_{pll}"
    assert scorer(sentences) == pytest.approx(expected, abs=1e-5)


def test_a_head_less_bert_cannot_score_sentences():
    tokenizer = trained_tokenizer("wordpiece")
    backbone = tiny_model("bert", tokenizer).backbone()
    scorer = SentenceScorer(Pretrained("bert", backbone, tokenizer, Path("hf")), CPU)
    with pytest.raises(ConfigError, match="without its MLM head"):
        scorer(["A sentence."])


# --- precision: fp32 everywhere ----------------------------------------------------------------

# minimal pairs of several lengths, so that batches of them pad
PAIR_SENTENCES = [
    "The cat sat.",
    "The cat sit.",
    "Who should Derek hug after shocking Richard?",
    "Who should Derek hug Richard after shocking?",
    "Unquestionably, the astronomers disagreed about the comet's orbit.",
    "Unquestionably, the astronomers disagrees about the comet's orbit.",
    "It is.",
    "Is it.",
    "Many girls have found themselves in the library this afternoon.",
    "Many girls have found herself in the library this afternoon.",
]


def test_sentences_are_scored_in_fp32_inside_a_bf16_autocast_region():
    """A probe in a bf16-mixed run may score inside autocast; the scores stay fp32's (a minimal
    pair's margin is often below bf16's rounding)."""
    tokenizer = trained_tokenizer("bpe")
    model = tiny_model("gpt", tokenizer, seed=2, init_std=0.1)
    scorer = SentenceScorer(Pretrained("gpt", model, tokenizer, Path("tiny")), CPU, batch_size=4)
    plain = scorer(PAIR_SENTENCES)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert scorer(PAIR_SENTENCES) == pytest.approx(plain, abs=1e-4)
        with torch.no_grad():
            in_bf16 = model(torch.tensor([[1, 2, 3]])).logits
    assert in_bf16.dtype == torch.bfloat16  # the region does turn the model to bf16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("family", "pll"), [("gpt", "word_l2r"), ("bert", "word_l2r"), ("bert", "token")]
)
def test_sentence_scores_on_a_gpu_are_the_cpus_in_fp32(family, pll):
    """Padded batches on the GPU score each sentence as the CPU does one sentence at a time, to
    fp32's rounding (1e-3 nats), also inside a bf16 autocast region (a probe in a bf16 run), and
    so rank every pair the same way."""
    tokenizer = trained_tokenizer("bpe" if family == "gpt" else "wordpiece")
    overrides = {"init_std": 0.1} if family == "gpt" else {}
    model = tiny_model(family, tokenizer, seed=2, **overrides)
    pretrained = Pretrained(family, model, tokenizer, Path("tiny"))
    on_cpu = SentenceScorer(pretrained, CPU, batch_size=1, pll=pll)(PAIR_SENTENCES)
    model.cuda()
    cuda = torch.device("cuda")
    on_gpu = SentenceScorer(pretrained, cuda, batch_size=4, pll=pll)(PAIR_SENTENCES)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        in_autocast = SentenceScorer(pretrained, cuda, batch_size=4, pll=pll)(PAIR_SENTENCES)
    assert len(set(on_cpu)) == len(on_cpu)  # the model tells the sentences apart
    assert on_gpu == pytest.approx(on_cpu, abs=1e-3)
    assert in_autocast == pytest.approx(on_gpu, abs=1e-3)
    for i in range(0, len(PAIR_SENTENCES), 2):
        if abs(on_cpu[i] - on_cpu[i + 1]) > 2e-3:  # wider than the rounding allowed above
            assert (on_gpu[i] > on_gpu[i + 1]) == (on_cpu[i] > on_cpu[i + 1]), PAIR_SENTENCES[i]


# --- accuracies --------------------------------------------------------------------------------


def test_accuracy_per_phenomenon_per_term_and_overall_as_the_paper_counts_them():
    pairs = (
        [Pair("a", "t1", "g", "b")] * 4
        + [Pair("b", "t1", "g", "b")] * 2
        + [Pair("c", "t2", "g", "b")] * 5
    )
    correct = [True, True, True, False] + [False, True] + [True] * 5
    scores = BlimpScores.of("m", pairs, correct)
    assert scores.phenomena == {"a": 75.0, "b": 50.0, "c": 100.0}
    assert scores.terms == {"t1": 62.5, "t2": 100.0}
    assert scores.overall == pytest.approx(75.0)  # the mean over phenomena, not over pairs (81.8)
    assert scores.pairs == 11


def test_a_pair_is_right_only_when_the_grammatical_sentence_scores_strictly_higher():
    pairs = [Pair("a", "t", "good1", "bad1"), Pair("a", "t", "good2", "bad2")]
    given = {"good1": -1.0, "bad1": -2.0, "good2": -3.0, "bad2": -3.0}
    assert answers(pairs, lambda sentences: [given[s] for s in sentences]) == [True, False]


def test_the_papers_overall_figures_are_the_mean_over_its_phenomena(shared_data):
    folder = shared_data / "blimp"
    uids = sorted({p.uid for p in read_pairs(folder, per_phenomenon=1)})
    assert len(uids) == 67
    rows = {r.name: r for r in BlimpScores.paper(folder, uids)}
    summary = [
        json.loads(line) for line in (folder / "models_summary.jsonl").read_text().splitlines()
    ]
    overall = next(
        r for r in summary if r["UID"] == "overall" and r["linguistics_term"] == "overall"
    )
    assert rows["5-gram (paper)"].overall == pytest.approx(100 * overall["ngram"], abs=0.05)  # 61.2
    assert rows["GPT-2 1.5B (paper)"].overall == pytest.approx(100 * overall["gpt2"], abs=0.05)
    assert len(rows["LSTM (paper)"].terms) == 12


def test_reading_the_pairs_caps_each_phenomenon_and_names_bad_input(tmp_path):
    folder = write_blimp(tmp_path / "blimp", per_phenomenon=5)
    pairs = read_pairs(folder, per_phenomenon=2)
    assert [p.uid for p in pairs] == ["agreement", "agreement", "island", "island"]
    assert read_pairs(folder, phenomena=["island"])[0].good == "What did she see?"
    with pytest.raises(ConfigError, match="suite.dir=.*does not exist"):
        read_pairs(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="nonesuch not in"):
        read_pairs(folder, phenomena=["nonesuch"])
    (folder / "broken.jsonl").write_text('{"sentence_good": "x"}\n')
    with pytest.raises(ConfigError, match="broken.jsonl:1 is not a BLiMP pair"):
        read_pairs(folder)


# --- the n-gram model --------------------------------------------------------------------------


def test_kneser_ney_by_hand():
    """Documents [0 1 0 1], vocabulary 3, order 2; the counts give no discount estimate, so the
    discounts are 0.5 / 1 / 1.5. Unigram continuation counts: 0 after two distinct tokens, 1
    after one: p1 = ((2 - 1) + 1.5 / 3) / 3, ((1 - 0.5) + 0.5) / 3, 0.5 / 3 = 1/2, 1/3, 1/6.
    After 0 (c(0 1) = 2, so D = 1 and gamma = 1): p(. | 0) = (0 + p1(0), 1 + p1(1), p1(2)) / 2."""
    lm = KneserNey.fit([np.array([0, 1, 0, 1])], vocab_size=3, order=2)
    assert lm.distribution([2]) == pytest.approx([1 / 2, 1 / 3, 1 / 6])  # an unseen context
    assert lm.distribution([0]) == pytest.approx([1 / 4, 2 / 3, 1 / 12])
    assert lm.logprob([0, 1]) == pytest.approx(math.log(lm.distribution([lm.start])[0] * 2 / 3))


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_kneser_ney_distributions_sum_to_one(order):
    rng = np.random.default_rng(order)
    documents = [rng.zipf(1.3, size=rng.integers(1, 60)) % 40 for _ in range(200)]
    lm = KneserNey.fit(documents, vocab_size=40, order=order)
    contexts = [[lm.start] * (order - 1), list(documents[0][: order - 1]), [39] * (order - 1)]
    for context in contexts:
        distribution = lm.distribution(context)
        assert distribution.sum() == pytest.approx(1.0, abs=1e-9)
        assert distribution.min() > 0


@pytest.mark.parametrize("chunk_tokens", [1, 37, 500])
def test_kneser_ney_counted_in_chunks_is_the_model_counted_at_once(chunk_tokens):
    """Counting a few n-grams at a time and merging the counts (what bounds memory on a large
    corpus) gives every order exactly the counts and statistics of one count of the whole."""
    rng = np.random.default_rng(7)
    documents = [rng.zipf(1.3, size=rng.integers(1, 60)) % 40 for _ in range(200)]
    whole = KneserNey.fit(documents, vocab_size=40, order=3, chunk_tokens=10**9)
    chunked = KneserNey.fit(documents, vocab_size=40, order=3, chunk_tokens=chunk_tokens)
    for ours, theirs in zip(chunked._orders, whole._orders, strict=True):
        for name in ("grams", "counts", "contexts", "context_totals", "context_gamma"):
            assert np.array_equal(getattr(ours, name), getattr(theirs, name)), name
        assert ours.counts.dtype == np.int64
    assert chunked.logprob(documents[3]) == whole.logprob(documents[3])


def test_kneser_ney_refuses_what_it_cannot_count():
    with pytest.raises(ConfigError, match="an n-gram order of 6 is not possible"):
        KneserNey.fit([np.array([1, 2])], vocab_size=30_000, order=6)
    with pytest.raises(ConfigError, match="no tokens"):
        KneserNey.fit([np.array([], dtype=np.int64)], vocab_size=10, order=3)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        KneserNey.fit([np.array([1, 12])], vocab_size=10, order=3)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"pll": "words"}, "suite.pll=words is not one of word_l2r, token"),
        ({"ngram_order": 5}, "suite.ngram_order=5: choose 1 to 4 for a 8,192-token vocabulary"),
        ({"batch_size": 0}, "suite.batch_size=0: use an integer of at least 1"),
    ],
)
def test_settings_that_would_fail_late_fail_first(override, message):
    settings = OmegaConf.load(REPO / "conf" / "suite" / "blimp.yaml")
    check_settings(settings, 8192)  # the shipped settings pass
    settings.merge_with(override)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_settings(settings, 8192)


def test_out_must_name_the_json_record_that_the_table_goes_beside(tmp_path, tmp_path_factory):
    settings = OmegaConf.load(REPO / "conf" / "suite" / "blimp.yaml")
    assert report_path(None, settings, str(tmp_path / "b.json")) == tmp_path / "b.json"
    # out=b.md would have written the JSON and then the table over it, both to b.md; it is
    # refused before any scoring, with the .json path to give instead
    run = smoke_run(tmp_path_factory, "gpt-tiny")
    result = run_command(
        "pipeline.commands.evaluate_lm",
        f"ckpt={run.folder}",
        "suite=blimp",
        f"out={tmp_path / 'b.md'}",
    )
    assert result.returncode != 0
    assert f"give a .json path: out={tmp_path / 'b.json'}" in result.stderr
    assert "pairs with the model" not in result.stderr and not list(tmp_path.iterdir())


# --- the twin ----------------------------------------------------------------------------------


def test_the_twin_has_random_weights_the_same_architecture_and_tokenizer():
    tokenizer = trained_tokenizer("bpe")
    trained = tiny_model("gpt", tokenizer, seed=3)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)  # far from any initialization
    pretrained = Pretrained("gpt", trained, tokenizer, Path("run"))
    twin = random_twin(pretrained, seed=0)
    assert twin.tokenizer is tokenizer and twin.model.config == trained.config
    twin_state, trained_state = twin.model.state_dict(), trained.state_dict()
    assert twin_state.keys() == trained_state.keys()
    changed = [k for k in twin_state if not torch.equal(twin_state[k], trained_state[k])]
    assert len(changed) == len(twin_state)
    again = random_twin(pretrained, seed=0).model.state_dict()
    assert all(torch.equal(again[k], twin_state[k]) for k in twin_state)  # seeded
    state = torch.random.get_rng_state()
    random_twin(pretrained, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone


# --- the probe while pretraining ---------------------------------------------------------------


def test_probe_blimp_logs_the_accuracy_and_appends_the_terms(tmp_path):
    blimp = write_blimp(tmp_path / "blimp")
    done = run_pretrain(
        tmp_path,
        "model=gpt-tiny",
        "debug=smoke",
        # 5 steps, a probe every 2: at the start, at two multiples and at an end that is not
        # one, as 12 steps and every 5 would show (each step and probe costs a second or more)
        "trainer.max_steps=5",
        "logger=csv",
        "run_name=probed",
        "probe=blimp",
        f"probe.blimp.dir={blimp}",
        "probe.every_n_steps=2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "out" / "gpt-tiny" / "probed"
    rows = probe_steps(run, "probe/blimp")
    assert sorted(rows) == [0, 2, 4, 5]
    assert all(0.0 <= float(row["probe/blimp"]) <= 100.0 for row in rows.values())
    lines = [
        json.loads(line) for line in (run / "logs" / "blimp_probe.jsonl").read_text().splitlines()
    ]
    assert [line["step"] for line in lines] == [0, 2, 4, 5]
    assert set(lines[0]["terms"]) == {"determiner_noun_agreement", "island_effects"}
    assert [line["overall"] for line in lines] == [
        float(rows[s]["probe/blimp"]) for s in (0, 2, 4, 5)
    ]


def test_probe_blimp_settings_are_checked_before_the_run(tmp_path):
    done = run_pretrain(
        tmp_path, "model=gpt-tiny", "debug=smoke", "probe=blimp", "probe.blimp.pairs=0"
    )
    assert done.returncode == 2 and "probe.blimp.pairs=0: use a positive integer" in done.stderr
    done = run_pretrain(
        tmp_path, "model=gpt-tiny", "debug=smoke", "probe=blimp", f"probe.blimp.dir={tmp_path}/none"
    )
    assert done.returncode == 2 and "probe.blimp.dir=" in done.stderr
    assert "does not exist" in done.stderr


# --- the command on a real run -----------------------------------------------------------------

PAIRS = {
    "agreement": (
        "determiner_noun_agreement",
        [("The dogs bark.", "The dogs barks."), ("A cat runs.", "A cat run.")],
    ),
    "island": (
        "island_effects",
        [("What did she see?", "What did she see it?"), ("Who left?", "Who left him?")],
    ),
}


def write_blimp(folder: Path, per_phenomenon: int = 2) -> Path:
    """BLiMP-format files of two phenomena (gzipped and plain) and a paper summary."""
    folder.mkdir(parents=True)
    for index, (uid, (term, pairs)) in enumerate(PAIRS.items()):
        rows = [
            {
                "sentence_good": g,
                "sentence_bad": b,
                "linguistics_term": term,
                "UID": uid,
                "pairID": str(i),
            }
            for i, (g, b) in enumerate((pairs * per_phenomenon)[:per_phenomenon])
        ]
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if index == 0:
            with gzip.open(folder / f"{uid}.jsonl.gz", "wt") as handle:
                handle.write(text)
        else:
            (folder / f"{uid}.jsonl").write_text(text)
    summary = [
        {"UID": uid, "linguistics_term": term, "ngram": 0.6, "lstm": 0.7, "txl": 0.7, "gpt2": 0.9}
        for uid, (term, _) in PAIRS.items()
    ]
    (folder / "models_summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary))
    return folder


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_evaluate_lm_suite_blimp_on_a_pretraining_run(tmp_path, tmp_path_factory, family):
    # the session's smoke run, copied: the command writes its record into the run folder
    model = f"{family}-tiny"
    run = copy_run(smoke_run(tmp_path_factory, model), tmp_path / "out" / model / "r")
    blimp = write_blimp(tmp_path / "blimp")
    result = run_command(
        "pipeline.commands.evaluate_lm",
        f"ckpt={run}",
        "suite=blimp",
        f"suite.dir={blimp}",
        "suite.pairs=2",
        "suite.batch_size=3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((run / "blimp-pairs2.json").read_text())
    names = [row["name"] for row in record["rows"]]
    assert names == [
        "model",
        "random twin",
        "3-gram of the corpus",
        *[f"{m} (paper)" for m in ("5-gram", "LSTM", "Transformer-XL")],
        "GPT-2 1.5B (paper)",
    ]
    assert record["method"] == ("causal" if family == "gpt" else "pll_word_l2r")
    assert all(row["pairs"] == 4 for row in record["rows"][:3])
    assert record["rows"][3]["overall"] == pytest.approx(60.0)
    table = (run / "blimp-pairs2.md").read_text()
    assert "| **overall** |" in table and "island_effects" in table
    assert "| **overall** |" in result.stdout
    report = write_report([run], tmp_path / "report")
    assert (tmp_path / "report" / "r-blimp-pairs2.png") in report.plots
    page = report.html.read_text()
    assert "BLiMP: r (blimp-pairs2.json)" in page and "3-gram of the corpus" in page
    (run / "blimp-broken.json").write_text("{}")
    with pytest.raises(ReportError, match="blimp-broken.json is not a BLiMP record"):
        write_report([run], tmp_path / "report")


def test_the_ngram_row_is_counted_once_then_read_from_the_cache(
    tmp_path, tmp_path_factory, capsys, monkeypatch
):
    """Counting the n-gram model reads the whole corpus (minutes for books): a later call on
    the same training text, with more pairs, reads its scores from the cache folder, the same
    answers; a damaged cache is counted again, and other training text has another key."""
    run = copy_run(smoke_run(tmp_path_factory, "gpt-tiny"), tmp_path / "out" / "gpt-tiny" / "r")
    blimp = write_blimp(tmp_path / "blimp")
    source = resolve_checkpoint(str(run))
    # a cache folder of this test's own (the session's smoke run's is shared)
    source.record.config["paths"]["cache_dir"] = str(tmp_path / "cache")
    pretrained = load_pretrained(source)
    tokenizer = pretrained.tokenizer
    settings = OmegaConf.create({"dir": str(blimp), "ngram_order": 3})
    text = run_training_text(source.record.config, tokenizer)
    lm = KneserNey.fit(text.documents(), tokenizer.get_vocab_size(with_added_tokens=True), 3)

    def by_hand(pairs: list[Pair]) -> BlimpScores:
        correct = answers(pairs, lambda batch: lm.sentence_logprobs(batch, tokenizer))
        return BlimpScores.of("3-gram of the corpus", pairs, correct)

    quick, every = read_pairs(blimp, 1), read_pairs(blimp)
    assert len(every) > len(quick)
    row, took = ngram_row(source, pretrained, quick, settings)
    assert "counting the n-gram model" in took and row == by_hand(quick)
    # every pair of the folder was scored when counted, not only the ones asked for
    (cache,) = (tmp_path / "cache" / NGRAM_CACHE).glob("*.json")
    row, took = ngram_row(source, pretrained, every, settings)
    assert list(took) == ["reading the cached n-gram scores"] and row == by_hand(every)
    cache.write_text('{"The dogs bark.": ')
    row, took = ngram_row(source, pretrained, every, settings)
    assert "counting the n-gram model" in took and row == by_hand(every)
    assert len(json.loads(cache.read_text())) == 2 * len(every)
    cache.unlink()
    cache.parent.rmdir()
    cache.parent.write_text("a file where the cache folder goes")  # it cannot be written
    row, took = ngram_row(source, pretrained, every, settings)
    assert row == by_hand(every) and cache.parent.is_file()
    assert "could not keep the n-gram scores" in capsys.readouterr().err
    reseeded = {**source.record.config, "seed": source.record.config["seed"] + 1}
    assert run_training_text(reseeded, tokenizer).key != text.key
    assert run_training_text(dict(source.record.config), tokenizer).key == text.key
    monkeypatch.setattr(documents, "TRAINING_DOCUMENTS_FORMAT", 2)  # the hold-out changed
    assert run_training_text(dict(source.record.config), tokenizer).key != text.key


def test_evaluate_lm_suite_blimp_on_a_fine_tuned_run_names_its_pretraining_run(
    tmp_path, tmp_path_factory
):
    """`make evaluate-lm suite=blimp ckpt=<a fine-tuning run>` (fine-tuned from `ckpt=out/...`,
    relative to where it ran): one short line that says it is a fine-tuned sst2 classifier and
    names the pretraining run, with the command that scores it, which runs when pasted."""
    # the session's smoke run, copied: the pasted command writes its record into the run folder
    run = copy_run(smoke_run(tmp_path_factory, "gpt-tiny"), tmp_path / "out" / "gpt-tiny" / "r")
    last = run / "checkpoints" / "last.ckpt"
    tuned = write_fine_tuned(tmp_path / "ft", last, "out/gpt-tiny/r", cwd=tmp_path)
    env = {"BLIMP_DIR": str(write_blimp(tmp_path / "blimp"))}
    result = run_command(
        "pipeline.commands.evaluate_lm", f"ckpt={tuned}", "suite=blimp", env=CLI_ENV | env
    )
    assert result.returncode == 2, result.stderr[-3000:]
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert f"{tuned} is a fine-tuned sst2 classifier" in error
    assert f"fine-tuned from the pretraining run {run}: " in error
    assert "different version" not in error and "backbone.layers" not in error
    pasted = error.partition("score that instead: ")[2]
    assert pasted == f"make evaluate-lm ckpt={run} suite=blimp"
    scored = make_repo(*shlex.split(pasted)[1:], env=CLI_ENV | env)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert "| **overall** |" in scored.stdout and (run / "blimp.json").is_file()

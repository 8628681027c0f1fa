"""Bounded validation (`datamodule.val_max_tokens`) and named extra validation sets
(`datamodule.extra_validation`): the bound holds for every kind of validation set, the batches
stay fixed for any number of workers and after a resume, extra sets are logged under
val/<name>/ in real runs without changing val/loss, and bad settings are refused."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.corpora.corpus import DataSetupError, TextFilesCorpus
from datamodules.corpora.mixture import MixtureCorpus
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from datamodules.validation import VAL_SET
from tests.conftest import ListCorpus, run_pretrain

SEQ_LEN = 32
CAP = 10 * SEQ_LEN + 1  # ten whole windows (and the last target) of the bounded stream


def gpt_module(corpus, tokenizer, cache_dir, **options) -> PretrainDataModule:
    objective = CausalLMObjective(seq_len=SEQ_LEN, batch_size=4)
    dm = PretrainDataModule(corpus, tokenizer, objective, cache_dir, **options)
    dm.setup("fit")
    return dm


def loaders(dm: PretrainDataModule) -> list:
    found = dm.val_dataloader()
    return found if isinstance(found, list) else [found]


def batches_of(loader) -> list[dict[str, torch.Tensor]]:
    return list(loader)


def read_tokens(batches: list[dict[str, torch.Tensor]]) -> int:
    """Tokens of text GPT validation batches read: every target, and the first input."""
    return sum(int(b["targets"].numel()) for b in batches) + 1


def first_tokens_of(store, documents) -> np.ndarray:
    return np.concatenate([store.document(int(d)) for d in documents])


def test_held_out_split_reads_the_first_tokens_up_to_the_bound(embedded, bpe, cache_dir):
    whole = gpt_module(embedded, bpe, cache_dir, val_fraction=0.1)
    held_out = first_tokens_of(whole.store, whole.val_documents)
    assert len(held_out) > CAP  # so that the bound cuts
    capped = gpt_module(embedded, bpe, cache_dir, val_fraction=0.1, val_max_tokens=CAP)
    [loader] = loaders(capped)
    batches = batches_of(loader)
    assert read_tokens(batches) == CAP
    first = batches[0]["input_ids"][0].numpy()
    assert np.array_equal(first, held_out[:SEQ_LEN])  # the first tokens, in store order
    last = batches[-1]["targets"][-1].numpy()
    assert np.array_equal(last, held_out[CAP - SEQ_LEN : CAP])
    # the training documents are those of the unbounded run
    assert np.array_equal(capped.train_documents, whole.train_documents)
    # a bound above the set's size leaves it whole
    larger = gpt_module(embedded, bpe, cache_dir, val_fraction=0.1, val_max_tokens=10**9)
    assert len(larger.val_set.stream) == len(whole.val_set.stream) == len(held_out)


def test_val_corpus_and_an_extra_set_are_bounded(embedded, bpe, cache_dir, small_docs):
    val_corpus, extra = ListCorpus(small_docs[:6]), ListCorpus(small_docs[10:16])
    dm = gpt_module(
        embedded,
        bpe,
        cache_dir,
        val_corpus=val_corpus,
        val_max_tokens=CAP,
        extra_validation={"other": extra},
    )
    own, other = loaders(dm)
    assert [s.documents for s in dm.stats[1:]] == [6, 6]  # the validation corpus, the extra set
    assert dm.extra_validation.names == ["other"]
    for loader in (own, other):
        assert read_tokens(batches_of(loader)) == CAP
    extra_batches = batches_of(other)
    assert all(int(b[VAL_SET]) == 0 for b in extra_batches)
    assert all(VAL_SET not in b for b in batches_of(own))
    # the extra set's first tokens, in corpus order
    text = bpe.encode(small_docs[10]).ids
    assert extra_batches[0]["input_ids"][0].tolist() == text[:SEQ_LEN]


def test_each_source_of_a_mixture_is_bounded(tmp_path, bpe, cache_dir, small_docs):
    mixture = two_sources(tmp_path, small_docs)
    dm = gpt_module(mixture, bpe, cache_dir, val_fraction=0.2, val_max_tokens=CAP)
    assert [len(source.stream) for source in dm.val_set.sources] == [CAP, CAP]


def test_a_small_extra_set_is_read_whole(embedded, bpe, cache_dir, small_docs):
    extra = ListCorpus(small_docs[20:22])
    dm = gpt_module(
        embedded, bpe, cache_dir, val_max_tokens=10**8, extra_validation={"small": extra}
    )
    _, small = loaders(dm)
    tokens = dm.stats[-1].tokens
    assert tokens < 10**8
    assert read_tokens(batches_of(small)) == (tokens - 1) // SEQ_LEN * SEQ_LEN + 1


def test_bert_sets_are_cut_inside_a_sentence(embedded, wordpiece, cache_dir):
    objective = MaskedLMObjective(seq_len=64, batch_size=4)
    cap = 5000
    dm = PretrainDataModule(
        embedded, wordpiece, objective, cache_dir, val_fraction=0.1, val_max_tokens=cap
    )
    dm.setup("fit")
    store = dm.val_set.store
    whole = first_tokens_of(dm.store, dm.val_documents)
    assert len(store.tokens) == cap and np.array_equal(store.tokens, whole[:cap])
    assert store.doc_offsets[-1] == store.sentence_offsets[-1] == cap
    assert store.doc_sentences[-1] == len(store.sentence_offsets) - 1
    # every kept sentence is the original one (the last cut at the bound)
    starts, done = [], 0
    for d in dm.val_documents:
        sentences = dm.store.sentence_offsets[
            dm.store.doc_sentences[d] : dm.store.doc_sentences[d + 1]
        ]
        starts.append(sentences - dm.store.doc_offsets[d] + done)
        done += int(dm.store.doc_offsets[d + 1] - dm.store.doc_offsets[d])
    starts = np.concatenate(starts)
    assert np.array_equal(store.sentence_offsets[:-1], starts[starts < cap])
    batch = next(iter(dm.val_dataloader()))
    assert batch["input_ids"].shape[0] == 4


def test_same_batches_for_any_workers_and_after_a_resume(embedded, bpe, cache_dir, small_docs):
    options = {
        "val_fraction": 0.1,
        "val_max_tokens": CAP,
        "extra_validation": {"other": ListCorpus(small_docs[10:16])},
    }
    first = gpt_module(embedded, bpe, cache_dir, **options)
    expected = [batches_of(loader) for loader in loaders(first)]
    state = first.state_dict()
    two = gpt_module(embedded, bpe, cache_dir, num_workers=2, **options)
    objective = CausalLMObjective(seq_len=SEQ_LEN, batch_size=4)
    resumed = PretrainDataModule(embedded, bpe, objective, cache_dir, **options)
    resumed.load_state_dict(state)
    resumed.setup("fit")
    for dm in (two, resumed):
        got = [batches_of(loader) for loader in loaders(dm)]
        assert [len(b) for b in got] == [len(b) for b in expected]
        for mine, theirs in zip(got, expected, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "many", True])
def test_a_bad_bound_is_refused(embedded, bpe, cache_dir, bad):
    objective = CausalLMObjective(seq_len=SEQ_LEN, batch_size=4)
    with pytest.raises(DataSetupError, match="datamodule.val_max_tokens=") as err:
        PretrainDataModule(embedded, bpe, objective, cache_dir, val_max_tokens=bad)
    assert "\n" not in str(err.value) and "e.g. datamodule.val_max_tokens=" in str(err.value)


def test_a_bound_below_a_window_is_refused(embedded, bpe, cache_dir):
    with pytest.raises(DataSetupError, match="raise datamodule.val_max_tokens") as err:
        gpt_module(embedded, bpe, cache_dir, val_fraction=0.1, val_max_tokens=SEQ_LEN)
    assert "\n" not in str(err.value)


def test_a_bound_inside_the_only_document_below_a_window_per_process_is_refused(
    embedded, bpe, cache_dir, small_docs
):
    """One long validation document cut inside by the bound: 1.5 windows cannot give each of 2
    processes a window, which is refused as a cut between documents is, not left empty."""
    book = ListCorpus([" ".join(small_docs)])
    with pytest.raises(DataSetupError, match="raise datamodule.val_max_tokens") as err:
        gpt_module(
            embedded,
            bpe,
            cache_dir,
            val_corpus=book,
            val_max_tokens=3 * SEQ_LEN // 2,
            rank=0,
            world_size=2,
        )
    assert "\n" not in str(err.value)
    # two windows and the last target are enough
    dm = gpt_module(
        embedded,
        bpe,
        cache_dir,
        val_corpus=book,
        val_max_tokens=2 * SEQ_LEN + 1,
        rank=0,
        world_size=2,
    )
    assert read_tokens(batches_of(loaders(dm)[0])) == SEQ_LEN + 1


def test_extra_sets_without_the_runs_own_validation_are_refused(embedded, bpe, cache_dir):
    objective = CausalLMObjective(seq_len=SEQ_LEN, batch_size=4)
    extra = {"held": ListCorpus(["x y"])}
    with pytest.raises(DataSetupError, match="needs the run's own validation") as err:
        PretrainDataModule(
            embedded, bpe, objective, cache_dir, val_fraction=0, extra_validation=extra
        )
    assert "\n" not in str(err.value) and "datamodule.val_fraction=0.05" in str(err.value)


def two_sources(folder: Path, docs: list[str]) -> MixtureCorpus:
    (folder / "alpha.txt").write_text("\n\n".join(docs[:15]))
    (folder / "beta.txt").write_text("\n\n".join(docs[15:30]))
    sources = {n: TextFilesCorpus(str(folder / f"{n}.txt")) for n in ("alpha", "beta")}
    return MixtureCorpus(sources=sources, weights={"alpha": 0.5, "beta": 0.5})


def test_a_set_named_like_a_mixture_source_is_refused(tmp_path, bpe, cache_dir, small_docs):
    mixture = two_sources(tmp_path, small_docs)
    objective = CausalLMObjective(seq_len=SEQ_LEN, batch_size=4)
    with pytest.raises(DataSetupError, match="extra_validation.beta takes the name") as err:
        PretrainDataModule(
            mixture, bpe, objective, cache_dir, extra_validation={"beta": ListCorpus(["x y"])}
        )
    assert "\n" not in str(err.value) and "beta_extra" in str(err.value)


# Real tiny runs ---------------------------------------------------------------------------------


def logged(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "logs" / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def values(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key)]


def extra_set_overrides(folder: Path, docs: list[str], name: str = "held") -> list[str]:
    """The overrides that add a text file of `docs` as extra validation set `name`."""
    path = folder / f"{name}.txt"
    path.write_text("\n\n".join(docs) + "\n")
    key = f"datamodule.extra_validation.{name}"
    return [f"+data@{key}=text_files", f"{key}.paths=[{path}]"]


@pytest.mark.parametrize(
    ("model", "metrics"),
    [
        ("gpt-tiny", ["loss", "bits_per_byte", "perplexity"]),
        ("bert-tiny", ["mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "loss"]),
    ],
)
def test_extra_set_is_logged_apart_and_leaves_val_loss_alone(tmp_path, small_docs, model, metrics):
    base = [f"model={model}", "debug=smoke", "datamodule.val_max_tokens=4000"]
    plain = run_pretrain(tmp_path, *base, "run_name=plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    extra = extra_set_overrides(tmp_path, small_docs[:8])
    done = run_pretrain(tmp_path, *base, *extra, "run_name=extra")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = logged(tmp_path / "out" / model / "extra")
    for name in metrics:
        assert values(rows, f"val/held/{name}"), f"val/held/{name} not logged"
    own = values(rows, "val/loss")
    assert own and own == values(logged(tmp_path / "out" / model / "plain"), "val/loss")
    assert values(rows, "val/held/loss") != own


def test_streaming_with_a_bound_and_an_extra_set(tmp_path, small_docs):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(small_docs[8:]) + "\n")
    overrides = [
        "model=gpt-tiny",
        "debug=smoke",
        "data=text_files",
        f"data.paths=[{corpus}]",
        "datamodule.streaming=true",
        "datamodule.val_fraction=0.2",
        "datamodule.val_max_tokens=3000",
        *extra_set_overrides(tmp_path, small_docs[:8], "other"),
    ]
    done = run_pretrain(tmp_path, *overrides, "run_name=streamed")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = logged(tmp_path / "out" / "gpt-tiny" / "streamed")
    for key in ("val/loss", "val/bits_per_byte", "val/other/loss", "val/other/bits_per_byte"):
        assert values(rows, key), f"{key} not logged"

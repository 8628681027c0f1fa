"""Corpora too small for the run: one error that says how many documents (or tokens) the run
needs and why, with a fix that works (tests/pipeline/test_small_corpus_cli.py pastes them)."""

import pytest

from datamodules.corpora.corpus import DataSetupError
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from tests.conftest import ListCorpus

# prose with sentence ends, as NSP needs (a pair starts at a sentence that has a next one)
PROSE = " ".join(f"Sentence number {i} talks about the weather and the sea." for i in range(60))


def datamodule(corpus, tokenizer, objective, cache_dir, **kwargs) -> PretrainDataModule:
    return PretrainDataModule(corpus, tokenizer, objective, cache_dir, **kwargs)


def test_one_document_gpt_needs_no_validation_and_then_trains(bpe, tmp_path):
    objective = CausalLMObjective(seq_len=32, batch_size=2)
    dm = datamodule(ListCorpus([PROSE]), bpe, objective, tmp_path, val_fraction=0.05)
    with pytest.raises(DataSetupError) as caught:
        dm.check_documents()
    message = str(caught.value)
    assert "has 1 document (" in message and "validation needs at least 1 document" in message
    assert message.endswith("train without validation: datamodule.val_fraction=0")
    with pytest.raises(DataSetupError, match="has 1 document"):
        dm.setup("fit")  # setup says the same
    fixed = datamodule(ListCorpus([PROSE]), bpe, objective, tmp_path, val_fraction=0)
    fixed.check_documents()
    fixed.setup("fit")
    assert len(fixed.train_documents) == 1 and fixed.val_set is None
    assert len(fixed.train_set) > 0


def test_one_document_bert_says_nsp_needs_two_and_the_masked_lm_alone_trains(wordpiece, tmp_path):
    nsp = MaskedLMObjective(seq_len=32, batch_size=2)
    dm = datamodule(ListCorpus([PROSE]), wordpiece, nsp, tmp_path, val_fraction=0.05)
    with pytest.raises(DataSetupError) as caught:
        dm.check_documents()
    message = str(caught.value)
    assert "has 1 document (" in message
    assert "next-sentence prediction needs at least 2 documents per split" in message
    assert "another document" in message and "Add documents (4 or more in all)" in message
    assert message.endswith(
        "masked LM alone: objective.next_sentence_prediction=false datamodule.val_fraction=0"
    )
    without = datamodule(ListCorpus([PROSE]), wordpiece, nsp, tmp_path, val_fraction=0)
    with pytest.raises(DataSetupError) as caught:
        without.check_documents()
    assert "Add documents (2 or more in all)" in str(caught.value)
    assert str(caught.value).endswith("objective.next_sentence_prediction=false")
    mlm = MaskedLMObjective(seq_len=32, batch_size=2, next_sentence_prediction=False)
    fixed = datamodule(ListCorpus([PROSE]), wordpiece, mlm, tmp_path, val_fraction=0)
    fixed.check_documents()
    fixed.setup("fit")
    assert len(fixed.train_documents) == 1 and len(fixed.train_set) > 0


def test_two_documents_bert_trains_without_validation(wordpiece, tmp_path):
    corpus = ListCorpus([PROSE, PROSE.replace("sea", "hills")])
    nsp = MaskedLMObjective(seq_len=32, batch_size=2)
    dm = datamodule(corpus, wordpiece, nsp, tmp_path, val_fraction=0.05)
    with pytest.raises(DataSetupError) as caught:
        dm.check_documents()
    message = str(caught.value)
    assert "has 2 documents (" in message and "2 for training and 2 for validation" in message
    assert message.endswith("train without validation: datamodule.val_fraction=0")
    fixed = datamodule(corpus, wordpiece, nsp, tmp_path, val_fraction=0)
    fixed.check_documents()
    fixed.setup("fit")
    assert len(fixed.train_documents) == 2 and len(fixed.train_set) > 0


def test_documents_of_one_sentence_make_no_nsp_pair(wordpiece, tmp_path):
    corpus = ListCorpus(["one long sentence without an end " * 20] * 3)
    nsp = MaskedLMObjective(seq_len=32, batch_size=2)
    dm = datamodule(corpus, wordpiece, nsp, tmp_path, val_fraction=0)
    with pytest.raises(DataSetupError, match="the 3 training documents hold one sentence each"):
        dm.check_documents()
    with pytest.raises(DataSetupError, match="objective.next_sentence_prediction=false"):
        dm.setup("fit")


@pytest.mark.parametrize("val_fraction", [0.05, 0])
def test_too_little_text_for_a_gpt_window_names_a_window_that_fits(bpe, tmp_path, val_fraction):
    objective = CausalLMObjective(seq_len=128, batch_size=2)
    dm = datamodule(ListCorpus(["Tiny text."]), bpe, objective, tmp_path, val_fraction=val_fraction)
    with pytest.raises(DataSetupError, match=r"objective\.seq_len=(\d+)") as caught:
        dm.check_documents()
    seq_len = int(caught.value.args[0].split("objective.seq_len=")[-1].split()[0])
    assert ("datamodule.val_fraction=0" in str(caught.value)) == (val_fraction > 0)
    fits = CausalLMObjective(seq_len=seq_len, batch_size=2)
    fixed = datamodule(ListCorpus(["Tiny text."]), bpe, fits, tmp_path, val_fraction=0)
    fixed.check_documents()
    fixed.setup("fit")
    assert len(fixed.train_set) == 1


@pytest.mark.parametrize("val_fraction", [1, -0.1])
def test_a_validation_share_out_of_range_names_the_full_key(bpe, tmp_path, val_fraction):
    with pytest.raises(DataSetupError, match=rf"datamodule\.val_fraction={val_fraction} is not"):
        datamodule(
            ListCorpus([PROSE]), bpe, CausalLMObjective(), tmp_path, val_fraction=val_fraction
        )

"""Weights a fresh run counts from its training documents (pipeline/pretrain/corpus_init.py): the masked-LM
output bias at the unigram log frequencies (`output_bias=unigram`), which lowers the starting
loss, and the settings that cannot work refused. Word vectors: tests/pipeline/test_word_vectors.py;
resume exactness: tests/pipeline/test_resume.py."""

from __future__ import annotations

import copy
import math

import lightning as L
import numpy as np
import pytest
import torch

from pipeline.pretrain.checks import check_config
from pipeline.pretrain.corpus_init import output_bias, unigram_log_frequencies
from pipeline.run.errors import ConfigError
from tests.conftest import compose_pretrain
from tests.pipeline.test_modules import tiny_run


def test_unigram_log_frequencies_are_the_smoothed_counts():
    docs = [np.array([1, 2, 2]), np.array([2, 3])]
    got = unigram_log_frequencies(docs, vocab_size=5, smoothing=0.5)
    counts = [0.5, 1.5, 3.5, 1.5, 0.5]  # each count + 0.5
    expected = torch.tensor([math.log(c / sum(counts)) for c in counts])
    assert torch.allclose(got, expected)
    assert torch.allclose(got.exp().sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"token ids outside \[0, 3\)"):
        unigram_log_frequencies(docs, vocab_size=3)


def test_unigram_counting_stops_after_max_tokens_of_whole_documents():
    """A streamed corpus of any size is read only as far as the count needs."""

    def documents():
        yield np.array([1, 1, 2])
        yield np.array([3, 3])  # the count reaches max_tokens=4 inside this document
        raise AssertionError("read past the documents the count needed")

    got = unigram_log_frequencies(documents(), vocab_size=4, smoothing=0.5, max_tokens=4)
    counts = [0.5, 2.5, 1.5, 2.5]
    assert torch.allclose(got, torch.tensor([math.log(c / sum(counts)) for c in counts]))


class _StartingModel(L.Callback):
    """A copy of the model as the first step receives it."""

    model: torch.nn.Module | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.model = copy.deepcopy(pl_module.model)


def test_a_fresh_bert_run_starts_from_the_unigram_bias_and_a_lower_loss(tmp_path, small_docs):
    module, datamodule, trainer = tiny_run(
        tmp_path, small_docs, "model=bert-tiny", "trainer.max_steps=1", "output_bias=unigram"
    )
    assert torch.count_nonzero(output_bias(module.model)) == 0  # built with the paper's zeros
    start = _StartingModel()
    trainer.callbacks.append(start)
    trainer.fit(module, datamodule=datamodule)

    documents = [datamodule.store.document(int(i)) for i in datamodule.train_documents]
    vocab_size = output_bias(module.model).numel()
    expected = unigram_log_frequencies(documents, vocab_size)
    assert torch.equal(output_bias(start.model), expected)

    # the masked-LM loss of the starting model on held-out batches, with and without the bias
    batches = list(datamodule.val_dataloader())[:4]
    assert batches

    def mlm_loss(model: torch.nn.Module) -> float:
        module.model = model.eval()
        with torch.no_grad():
            return sum(float(module.losses(batch)["mlm_loss"][0]) for batch in batches)

    counted = mlm_loss(start.model)
    zeroed = copy.deepcopy(start.model)
    output_bias(zeroed).data.zero_()
    assert counted < mlm_loss(zeroed) - 0.5 * len(batches)  # at least half a nat a batch lower


def test_output_bias_settings_that_cannot_work_are_config_errors():
    with pytest.raises(ConfigError, match=r"output_bias='ones': use one of zeros, unigram"):
        check_config(compose_pretrain("output_bias=ones"))
    with pytest.raises(ConfigError, match="gpt model's output layer has none"):
        check_config(compose_pretrain("model=gpt-tiny", "output_bias=unigram"))
    with pytest.raises(ConfigError, match="not supported with trainer=fsdp"):
        check_config(
            compose_pretrain("recipe=bert-reference", "output_bias=unigram", "trainer=fsdp")
        )
    check_config(compose_pretrain("model=gpt-tiny", "output_bias=zeros"))  # the default: fine

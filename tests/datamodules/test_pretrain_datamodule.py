"""The LightningDataModule end to end: stores, splits, batch contracts with models/, errors."""

import numpy as np
import pytest
import torch

from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from models.bert import BertForPreTraining, pretraining_loss
from models.config import BertConfig, GPTConfig
from models.gpt import GPT
from tests.conftest import ListCorpus
from tokenizer import special_ids


@pytest.fixture
def bert_dm(embedded, wordpiece, cache_dir):
    objective = MaskedLMObjective(seq_len=128, batch_size=8)
    dm = PretrainDataModule(embedded, wordpiece, objective, cache_dir, val_fraction=0.1)
    dm.setup("fit")
    return dm


@pytest.fixture
def gpt_dm(embedded, bpe, cache_dir):
    objective = CausalLMObjective(seq_len=64, batch_size=4, document_masking=True)
    dm = PretrainDataModule(embedded, bpe, objective, cache_dir, val_fraction=0.1)
    dm.setup("fit")
    return dm


def test_bert_batch_feeds_bert_for_pretraining(bert_dm, wordpiece):
    batch = next(iter(bert_dm.train_dataloader()))
    B, T = batch["input_ids"].shape
    N = len(batch["masked_positions"])
    assert B == 8 and T <= 128 and T % 8 == 0
    shapes = {k: tuple(v.shape) for k, v in batch.items()}
    assert shapes == {
        "input_ids": (B, T),
        "token_type_ids": (B, T),
        "attention_mask": (B, T),
        "masked_positions": (N,),
        "mlm_labels": (N,),
        "nsp_labels": (B,),
        "step_total_masked": (),
        "step_total_sequences": (),
    }
    assert batch["step_total_masked"] == N and batch["step_total_sequences"] == B
    assert all(v.dtype == torch.int64 for v in batch.values())
    config = BertConfig.from_preset("tiny", vocab_size=wordpiece.get_vocab_size())
    model = BertForPreTraining(config)
    out = model(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        token_type_ids=batch["token_type_ids"],
        masked_positions=batch["masked_positions"],
    )
    assert out.mlm_logits.shape == (N, config.vocab_size)
    loss = pretraining_loss(out, batch["mlm_labels"], batch["nsp_labels"])
    assert torch.isfinite(loss.total)
    assert loss.mlm.item() == pytest.approx(np.log(config.vocab_size), rel=0.1)


def test_gpt_batch_feeds_gpt(gpt_dm, bpe):
    batch = next(iter(gpt_dm.train_dataloader()))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {
        **{k: (4, 64) for k in ("input_ids", "targets", "doc_ids", "position_ids")},
        "step_total_targets": (),
    }
    config = GPTConfig.from_preset("tiny", vocab_size=bpe.get_vocab_size())
    model = GPT(config)
    out = model(batch["input_ids"], targets=batch["targets"], doc_ids=batch["doc_ids"])
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(np.log(config.vocab_size), rel=0.1)


def test_validation_documents_are_held_out(gpt_dm, bert_dm):
    for dm in (gpt_dm, bert_dm):
        val = dm.val_dataloader()
        first = next(iter(val))
        val.sampler.set_epoch(3)
        assert all(torch.equal(first[k], next(iter(val))[k]) for k in first)  # fixed batches
    train, val = set(gpt_dm.train_documents), set(gpt_dm.val_documents)
    assert len(val) == 8 and train.isdisjoint(val) and len(train | val) == 79
    lengths = np.diff(gpt_dm.store.doc_offsets)
    assert len(gpt_dm.train_set.stream) == lengths[gpt_dm.train_documents].sum()
    assert len(gpt_dm.val_set.stream) == lengths[gpt_dm.val_documents].sum()


def test_val_corpus_and_no_validation(embedded, wordpiece, cache_dir, small_docs):
    objective = MaskedLMObjective(seq_len=64, batch_size=4)
    dm = PretrainDataModule(
        embedded,
        wordpiece,
        objective,
        cache_dir,
        val_corpus=ListCorpus(small_docs[:6]),
    )
    dm.setup("fit")
    assert len(dm.stats) == 2 and dm.stats[1].documents == 6
    assert len(dm.val_dataloader()) > 0
    none = PretrainDataModule(embedded, wordpiece, objective, cache_dir, val_fraction=0)
    none.setup("fit")
    assert none.val_dataloader() == []


def test_ranks_read_disjoint_shares(embedded, bpe, cache_dir):
    objective = CausalLMObjective(seq_len=64, batch_size=4)
    shares = []
    for rank in (0, 1):
        dm = PretrainDataModule(embedded, bpe, objective, cache_dir, rank=rank, world_size=2)
        dm.setup("fit")
        shares.append(
            np.concatenate([dm.train_set.batch_items(0, i) for i in range(len(dm.train_set))])
        )
        assert dm.state_dict()["world_size"] == 2
    assert set(shares[0]).isdisjoint(shares[1])


def test_objective_and_tokenizer_must_match(embedded, bpe, cache_dir):
    with pytest.raises(ValueError, match="needs a wordpiece tokenizer"):
        PretrainDataModule(embedded, bpe, MaskedLMObjective(), cache_dir)


def test_dataloader_before_setup_is_an_error(embedded, bpe, cache_dir):
    dm = PretrainDataModule(embedded, bpe, CausalLMObjective(), cache_dir)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()


def test_prepare_data_then_setup_reads_the_same_store(embedded, bpe, tmp_path):
    dm = PretrainDataModule(embedded, bpe, CausalLMObjective(), tmp_path)
    dm.prepare_data()
    assert dm.stats[0].built
    dm.setup("fit")
    assert len(dm.stats) == 1 and special_ids(bpe).eot == dm.settings.eos_id


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_accumulation_hands_out_whole_steps_of_the_same_batches(
    embedded, wordpiece, cache_dir, micro_batches
):
    """With k micro-batches per step the loader yields the batches a k=1 run sees, in order,
    (dropping only the epoch's last partial step), each stamped with its step's totals."""
    objective = MaskedLMObjective(seq_len=64, batch_size=4)

    def batches(k: int) -> list[dict[str, torch.Tensor]]:
        dm = PretrainDataModule(embedded, wordpiece, objective, cache_dir, micro_batches=k)
        dm.setup("fit")
        loader = dm.train_dataloader()
        out = list(loader)
        assert len(out) == len(loader) == len(dm.train_set) // k * k
        return out

    plain, stepped = batches(1), batches(micro_batches)
    for a, b in zip(plain, stepped, strict=False):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["mlm_labels"], b["mlm_labels"])
    for start in range(0, len(stepped), micro_batches):
        step = stepped[start : start + micro_batches]
        masked = sum(len(b["mlm_labels"]) for b in step)
        assert all(int(b["step_total_masked"]) == masked for b in step)
        sequences = sum(len(b["nsp_labels"]) for b in step)
        assert all(int(b["step_total_sequences"]) == sequences for b in step)

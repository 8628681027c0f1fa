import numpy as np
import pytest

from datamodules.objectives.batches import TRAIN
from datamodules.objectives.bert_batches import BertBatches
from datamodules.objectives.gpt_batches import GPTBatches
from datamodules.objectives.masking import MLMMasker
from datamodules.objectives.objective import CausalLMObjective, MaskedLMObjective
from datamodules.objectives.sharding import EpochSampler, ShardPlan, split_documents
from tests.datamodules.helpers import all_documents
from tokenizer import special_ids


def covered(plan: ShardPlan, rank: int) -> list[np.ndarray]:
    return [np.arange(*plan.bounds(i, rank)) for i in range(plan.num_batches)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_items", [1, 5, 32, 97, 100, 1001])
def test_ranks_are_disjoint_complete_and_in_step(num_items, world_size):
    plan = ShardPlan(num_items, batch_size=8, world_size=world_size)
    per_rank = [covered(plan, rank) for rank in range(world_size)]
    everything = np.concatenate([np.concatenate(b) for b in per_rank if b] or [[]])
    assert len(np.unique(everything)) == len(everything)  # disjoint
    assert set(everything) == set(range(len(everything)))  # a prefix of the epoch order
    assert num_items - len(everything) < world_size  # only < world_size items may be left out
    for batches in per_rank:
        assert len(batches) == plan.num_batches  # every rank takes the same number of steps
        assert all(1 <= len(b) <= 8 for b in batches)


def test_validation_split_holds_out_whole_documents():
    lengths = np.full(1000, 50)
    train, val = split_documents(lengths, 0.05, seed=1)
    assert len(val) == 50 and len(train) == 950
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(1000))
    again, _ = split_documents(lengths, 0.05, seed=1)
    other, _ = split_documents(lengths, 0.05, seed=2)
    assert np.array_equal(train, again) and not np.array_equal(train, other)
    assert len(split_documents(lengths[:79], 0.001, seed=1, min_val=2)[1]) == 2
    assert len(split_documents(lengths[:79], 0.001, seed=1, min_val_tokens=220)[1]) == 5
    assert len(split_documents(lengths[:10], 0.0, seed=1)[1]) == 0
    with pytest.raises(ValueError, match="too few"):
        split_documents(lengths[:3], 0.5, seed=1, min_val=2, min_train=2)
    with pytest.raises(ValueError, match="too few"):
        split_documents(lengths[:3], 0.1, seed=1, min_val_tokens=1000)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        split_documents(lengths[:10], 1.0, seed=1)


def datasets(kind: str, store, tokenizer, world_size: int) -> list:
    shard = {"world_size": world_size, "seed": 9, "split": TRAIN, "shuffle": True}
    if kind == "gpt":
        objective = CausalLMObjective(seq_len=64, batch_size=8)
        return [
            GPTBatches(store, all_documents(store), objective, rank=r, **shard)
            for r in range(world_size)
        ]
    objective = MaskedLMObjective(seq_len=64, batch_size=8)
    special = special_ids(tokenizer)
    masker = MLMMasker(objective, special, tokenizer.get_vocab_size())
    return [
        BertBatches(store, all_documents(store), objective, masker, special, rank=r, **shard)
        for r in range(world_size)
    ]


@pytest.mark.parametrize("kind", ["bert", "gpt"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_real_datasets_cover_each_epoch_once(kind, world_size, request):
    store = request.getfixturevalue("bert_store" if kind == "bert" else "gpt_store")
    tokenizer = request.getfixturevalue("wordpiece" if kind == "bert" else "bpe")
    ranks = datasets(kind, store, tokenizer, world_size)
    num_items = ranks[0].plan.num_items
    assert len({len(d) for d in ranks}) == 1
    for epoch in (0, 1, 2):
        items = [np.concatenate([d.batch_items(epoch, i) for i in range(len(d))]) for d in ranks]
        everything = np.concatenate(items)
        assert num_items - len(everything) < world_size
        # BERT epochs have their own instances; the epoch size is fixed at epoch 0's count, so
        # a smaller epoch repeats a few (and a larger one leaves a few out).
        available = len(ranks[0].instances(epoch)) if kind == "bert" else num_items
        repeats = len(everything) - len(np.unique(everything))
        assert repeats <= max(0, num_items - available)
        if available <= num_items - world_size:
            assert len(np.unique(everything)) == available  # every instance is used
    if world_size == 2:  # the batches themselves differ between ranks
        assert not np.array_equal(ranks[0][(0, 0)]["input_ids"], ranks[1][(0, 0)]["input_ids"])


def test_sampler_resumes_mid_epoch_and_moves_on():
    sampler = EpochSampler(5)
    assert list(sampler) == [(0, i) for i in range(5)]
    sampler.resume(2, 3)
    sampler.set_epoch(2)
    assert list(sampler) == [(2, 3), (2, 4)]
    assert list(sampler) == [(2, 3), (2, 4)]  # until the epoch is finished or changed
    sampler.set_epoch(3)
    assert next(iter(sampler)) == (3, 0)
    sampler.resume(3, 5)  # a finished epoch resumes at the start of the next
    assert next(iter(sampler)) == (4, 0)
    pinned = EpochSampler(2, follow_epochs=False)
    pinned.set_epoch(7)
    assert list(pinned) == [(0, 0), (0, 1)]

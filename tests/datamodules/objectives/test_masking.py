"""Dynamic MLM masking statistics over many real batches (embedded corpus, NSP pairs)."""

import numpy as np
import pytest

from datamodules.objectives.batches import TRAIN
from datamodules.objectives.bert_batches import BertBatches
from datamodules.objectives.masking import MLMMasker, continuation_table
from datamodules.objectives.objective import MaskedLMObjective
from tests.datamodules.helpers import all_documents
from tokenizer import special_ids


def batches_of(store, tokenizer, epochs: int = 3, **objective_settings) -> list[dict]:
    objective = MaskedLMObjective(**objective_settings)
    special = special_ids(tokenizer)
    vocab = tokenizer.get_vocab_size()
    table = continuation_table(tokenizer) if objective.whole_word_masking else None
    dataset = BertBatches(
        store,
        all_documents(store),
        objective,
        MLMMasker(objective, special, vocab, table),
        special,
        rank=0,
        world_size=1,
        seed=11,
        split=TRAIN,
        shuffle=True,
    )
    return [dataset[(epoch, i)] for epoch in range(epochs) for i in range(len(dataset))]


def original_ids(batch: dict) -> np.ndarray:
    ids = batch["input_ids"].copy()
    ids.reshape(-1)[batch["masked_positions"]] = batch["mlm_labels"]
    return ids


@pytest.fixture(scope="module")
def batches(bert_store, wordpiece):
    return batches_of(bert_store, wordpiece)


@pytest.fixture(scope="module")
def special(wordpiece):
    return special_ids(wordpiece)


def is_special(ids: np.ndarray, special) -> np.ndarray:
    return np.isin(ids, sorted(special.all()))


def test_fifteen_percent_of_eligible_tokens_are_chosen(batches, special):
    chosen = sum(len(b["masked_positions"]) for b in batches)
    eligible = sum((~is_special(original_ids(b), special)).sum() for b in batches)
    assert eligible > 100_000
    assert abs(chosen / eligible - 0.15) < 0.005


def test_replacements_are_80_10_10_and_never_special(batches, special):
    masked = np.concatenate([b["input_ids"].reshape(-1)[b["masked_positions"]] for b in batches])
    labels = np.concatenate([b["mlm_labels"] for b in batches])
    to_mask = masked == special.mask
    unchanged = masked == labels
    to_random = ~to_mask & ~unchanged
    assert abs(to_mask.mean() - 0.8) < 0.015
    assert abs(to_random.mean() - 0.1) < 0.015
    assert abs(unchanged.mean() - 0.1) < 0.015
    assert not is_special(masked[to_random], special).any()


def test_special_and_padding_tokens_are_never_chosen(batches, special):
    for b in batches:
        original = original_ids(b).reshape(-1)
        positions = b["masked_positions"]
        assert not is_special(original[positions], special).any()
        assert (b["attention_mask"].reshape(-1)[positions] == 1).all()
        assert (np.diff(positions) > 0).all()  # ascending, no duplicates
        unchosen = np.ones(original.size, dtype=bool)
        unchosen[positions] = False
        assert (b["input_ids"].reshape(-1)[unchosen] == original[unchosen]).all()


def test_pairs_are_laid_out_and_padded_to_a_multiple_of_8(bert_store, wordpiece, special):
    widths = set()
    for b in batches_of(bert_store, wordpiece, epochs=1, batch_size=1):
        ids, types, attention = original_ids(b), b["token_type_ids"], b["attention_mask"]
        lengths = attention.sum(1)
        width = ids.shape[1]
        widths.add(width)
        assert width % 8 == 0 and width <= 128 and width - lengths.max() < 8
        assert (ids[:, 0] == special.cls).all()
        assert ((ids == special.sep).sum(1) == 2).all()
        assert (ids[attention == 0] == special.pad).all()
        second = np.argmax(ids == special.sep, axis=1) + 1  # first token of B
        columns = np.arange(width)
        expected_types = (columns >= second[:, None]) & (columns < lengths[:, None])
        assert (types == expected_types).all()
        assert set(np.unique(b["nsp_labels"])) <= {0, 1}
    assert len(widths) > 3  # padded to the batch's longest, not to seq_len


def test_cap_on_predictions_per_sequence(bert_store, wordpiece):
    for b in batches_of(bert_store, wordpiece, epochs=1, max_predictions_per_seq=5):
        width = b["input_ids"].shape[1]
        rows = b["masked_positions"] // width
        assert np.bincount(rows, minlength=len(b["input_ids"])).max() <= 5


def test_masks_are_fresh_per_epoch_and_reproducible(bert_store, wordpiece):
    first = batches_of(bert_store, wordpiece, epochs=2)
    again = batches_of(bert_store, wordpiece, epochs=1)
    for a, b in zip(first[: len(again)], again, strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(first[0]["input_ids"], first[len(again)]["input_ids"])


def test_whole_word_masking_takes_every_piece_of_a_word(bert_store, wordpiece, special):
    table = continuation_table(wordpiece)
    chosen_total = eligible_total = 0
    for b in batches_of(bert_store, wordpiece, epochs=1, whole_word_masking=True):
        original = original_ids(b)
        chosen = np.zeros(original.shape, dtype=bool)
        chosen.reshape(-1)[b["masked_positions"]] = True
        eligible = ~is_special(original, special)
        # a piece continuing a word is chosen exactly when the piece before it is
        continuing = table[original][:, 1:] & eligible[:, 1:] & eligible[:, :-1]
        assert (chosen[:, 1:][continuing] == chosen[:, :-1][continuing]).all()
        chosen_total += chosen.sum()
        eligible_total += eligible.sum()
    assert 0.13 < chosen_total / eligible_total < 0.155
    assert table.sum() > 100  # the tokenizer does have ## pieces


def test_masker_needs_a_mask_token(bpe):
    with pytest.raises(ValueError, match=r"\[MASK\]"):
        MLMMasker(MaskedLMObjective(), special_ids(bpe), bpe.get_vocab_size())

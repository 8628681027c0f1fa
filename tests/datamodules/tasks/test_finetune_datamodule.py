"""FinetuneDataModule on small slices of the real GLUE data: BERT pair templates and token types,
truncation, GPT end-of-text joins, padding, labels, per-epoch shuffling, separate eval splits."""

from __future__ import annotations

import itertools

import pytest
import torch

from datamodules.finetune import FinetuneDataModule
from datamodules.tasks.files import read_examples
from datamodules.tasks.spec import TaskDataError, TaskSpec
from tests.conftest import SHARED_DATA
from tests.datamodules.tasks.test_tasks import task_spec
from tokenizer import batched, special_ids, train_tokenizer

GLUE = SHARED_DATA / "glue"
N = 200  # examples per split: enough for several batches, fast to encode


@pytest.fixture(scope="session")
def glue_sentences() -> list[str]:
    if not GLUE.is_dir():
        pytest.skip(f"shared datasets not found at {SHARED_DATA} (set LMPIPE_SHARED_DATA)")
    texts: list[str] = []
    for name, folder in (("sst2", "SST-2"), ("rte", "RTE"), ("mrpc", "MRPC")):
        spec = task_spec(name, f"task.data_dir={GLUE / folder}")
        texts += [t for e in read_examples(spec, "train", limit=300) for t in e.texts]
    return texts


@pytest.fixture(scope="session")
def glue_wordpiece(glue_sentences):
    return train_tokenizer("wordpiece", batched(glue_sentences), 2000)


@pytest.fixture(scope="session")
def glue_bpe(glue_sentences):
    return train_tokenizer("bpe", batched(glue_sentences), 600)


def glue_module(name: str, folder: str, tokenizer, **kwargs):
    spec = task_spec(name, f"task.data_dir={GLUE / folder}")
    dm = FinetuneDataModule(spec, tokenizer, max_examples=N, **kwargs)
    dm.setup()
    return dm


def rows(batch: dict[str, torch.Tensor]):
    """(ids, type ids) of each row's real tokens."""
    for ids, types, mask in zip(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], strict=True
    ):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # right padding
        yield ids[:n].tolist(), types[:n].tolist()


def test_pair_template_and_token_types(glue_wordpiece):
    dm = glue_module("rte", "RTE", glue_wordpiece, max_seq_len=512)
    special = special_ids(glue_wordpiece)
    batch = next(iter(dm.val_dataloader()[0]))
    for ids, types in rows(batch):
        seps = [i for i, t in enumerate(ids) if t == special.sep]
        assert ids[0] == special.cls and len(seps) == 2 and seps[1] == len(ids) - 1
        assert types == [0] * (seps[0] + 1) + [1] * (len(ids) - seps[0] - 1)
    pad = batch["attention_mask"] == 0
    assert (batch["input_ids"][pad] == special.pad).all()
    assert (batch["token_type_ids"][pad] == 0).all()
    assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())


def test_first_pair_decodes_to_both_texts(glue_wordpiece):
    dm = glue_module("rte", "RTE", glue_wordpiece, max_seq_len=512)
    batch = next(iter(dm.val_dataloader()[0]))
    example = dm.examples("dev")[int(batch["example_index"][0])]
    ids, types = next(rows(batch))
    first = glue_wordpiece.decode([i for i, t in zip(ids, types, strict=True) if t == 0])
    second = glue_wordpiece.decode([i for i, t in zip(ids, types, strict=True) if t == 1])
    assert first.replace(" ", "") == example.texts[0].lower().replace(" ", "")
    assert second.replace(" ", "") == example.texts[1].lower().replace(" ", "")


def test_truncation_respects_max_len_and_keeps_both_segments(glue_wordpiece):
    dm = glue_module("rte", "RTE", glue_wordpiece, max_seq_len=24, eval_batch_size=N)
    sep = special_ids(glue_wordpiece).sep
    batch = next(iter(dm.val_dataloader()[0]))
    assert batch["input_ids"].shape[1] == 24  # RTE premises are long: some rows hit the limit
    for ids, types in rows(batch):
        assert len(ids) <= 24
        first_sep = ids.index(sep)
        assert first_sep >= 2 and len(ids) - first_sep - 1 >= 2  # A and B both keep tokens
        assert types.count(1) == len(ids) - first_sep - 1


def test_tokenizer_of_the_caller_is_not_changed(glue_wordpiece):
    glue_module("rte", "RTE", glue_wordpiece, max_seq_len=16)
    assert glue_wordpiece.truncation is None
    assert len(glue_wordpiece.encode("word " * 100).ids) > 16


def test_single_sentence_labels_and_sizes(glue_wordpiece):
    dm = glue_module("sst2", "SST-2", glue_wordpiece, batch_size=32)
    assert dm.num_labels == 2 and dm.label_to_id == {"0": 0, "1": 1}
    assert dm.eval_splits == ["dev"]
    batch = next(iter(dm.train_dataloader()))
    assert batch["labels"].dtype == torch.int64 and batch["labels"].shape == (32,)
    assert (batch["token_type_ids"] == 0).all()
    train = dm.examples("train")
    expected = [dm.label_to_id[train[i].label] for i in batch["example_index"].tolist()]
    assert batch["labels"].tolist() == expected


def test_regression_targets_are_float(glue_wordpiece):
    dm = glue_module("stsb", "STS-B", glue_wordpiece)
    assert dm.num_labels == 1
    batch = next(iter(dm.val_dataloader()[0]))
    assert batch["labels"].dtype == torch.float32
    assert batch["labels"][0].item() == pytest.approx(5.0)  # "A man with a hard hat ..."


def test_training_order_is_seeded_and_changes_per_epoch(glue_wordpiece):
    def orders(seed):
        dm = glue_module("sst2", "SST-2", glue_wordpiece, batch_size=50, seed=seed)
        loader = dm.train_dataloader()
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            epochs.append(torch.cat([b["example_index"] for b in loader]).tolist())
        return epochs

    first, second = orders(1)
    assert sorted(first) == list(range(N)) and first != second
    assert orders(1) == [first, second] and orders(2)[0] != first


def test_eval_splits_are_kept_apart(tmp_path):
    (tmp_path / "train.tsv").write_text("text\tlabel\na b\tx\nc d\ty\n")
    (tmp_path / "m.tsv").write_text("text\tlabel\na\tx\n")
    (tmp_path / "mm.tsv").write_text("text\tlabel\nb\ty\nc\tx\nd\tx\n")
    spec = TaskSpec(
        name="nli",
        data_dir=str(tmp_path),
        files={"train": "train.tsv", "matched": "m.tsv", "mismatched": "mm.tsv"},
        text_columns=["text"],
        label_column="label",
    )
    tok = train_tokenizer("wordpiece", iter([["a b c d"] * 5]), 60, min_frequency=1)
    dm = FinetuneDataModule(spec, tok)
    dm.setup()
    assert dm.eval_splits == ["matched", "mismatched"] and dm.label_to_id == {"x": 0, "y": 1}
    loaders = dm.val_dataloader()
    sizes = [sum(len(b["labels"]) for b in loader) for loader in loaders]
    assert sizes == [1, 3]
    assert next(iter(loaders[1]))["labels"].tolist() == [1, 0, 0]


def test_dev_label_unseen_in_training_names_file_and_line(tmp_path):
    (tmp_path / "train.tsv").write_text("text\tlabel\na\tx\nb\ty\n")
    (tmp_path / "dev.tsv").write_text("text\tlabel\na\tx\nb\tz\n")
    spec = TaskSpec(name="t", data_dir=str(tmp_path), text_columns=["text"], label_column="label")
    tok = train_tokenizer("wordpiece", iter([["a b"] * 5]), 60, min_frequency=1)
    with pytest.raises(TaskDataError, match=r"dev.tsv:3: label 'z'"):
        FinetuneDataModule(spec, tok).setup()


def test_gpt_pairs_are_joined_by_end_of_text(glue_bpe):
    dm = glue_module("rte", "RTE", glue_bpe, max_seq_len=40)
    eot = special_ids(glue_bpe).eot
    batch = next(iter(dm.val_dataloader()[0]))
    assert (batch["token_type_ids"] == 0).all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == eot).all()  # pad = eot
    for ids, _ in rows(batch):
        assert len(ids) <= 40 and ids[-1] == eot and ids.count(eot) == 2
        assert 1 <= ids.index(eot) < len(ids) - 2  # A and B both keep tokens
    single = glue_module("sst2", "SST-2", glue_bpe)
    ids, _ = next(rows(next(iter(single.val_dataloader()[0]))))
    assert ids[-1] == eot and ids.count(eot) == 1


def test_too_short_max_seq_len_is_rejected(glue_wordpiece):
    spec = task_spec("rte", f"task.data_dir={GLUE / 'RTE'}")
    with pytest.raises(ValueError, match="max_seq_len=4"):
        FinetuneDataModule(spec, glue_wordpiece, max_seq_len=4)
    FinetuneDataModule(spec, glue_wordpiece, max_seq_len=5)


def test_every_example_is_served_once_per_epoch(glue_wordpiece):
    dm = glue_module("mrpc", "MRPC", glue_wordpiece, batch_size=64, eval_batch_size=64)
    seen = [b["example_index"].tolist() for b in dm.train_dataloader()]
    assert sorted(itertools.chain(*seen)) == list(range(N))
    assert [len(s) for s in seen] == [64, 64, 64, 8]


def test_an_eval_loader_sample_is_a_fixed_random_choice_kept_in_order(glue_wordpiece):
    """`eval_loader(split, sample=k)` (an alignment head's fit before training): k distinct
    examples spread over the split, in file order, the same every time; all of them when the
    split is no larger."""
    dm = glue_module("mrpc", "MRPC", glue_wordpiece, eval_batch_size=32, siamese=True)

    def served(sample):
        loader = dm.eval_loader("train", sample=sample)
        return list(itertools.chain(*(b["example_index"].tolist() for b in loader)))

    picked = served(50)
    assert picked == sorted(set(picked)) and len(picked) == 50
    assert picked == served(50) and picked[-1] > N // 2  # not a prefix of a sorted file
    assert served(N) == served(None) == list(range(N))


def test_train_examples_is_one_random_sample_for_every_seed(glue_wordpiece):
    spec = task_spec("stsb", f"task.data_dir={GLUE / 'STS-B'}")
    everything = read_examples(spec, "train")
    samples = []
    for seed in (1, 2):
        dm = FinetuneDataModule(spec, glue_wordpiece, seed=seed, train_examples=300)
        dm.setup()
        samples.append([e.id for e in dm.examples("train")])
        assert len(dm.examples("dev")) == len(read_examples(spec, "dev"))  # dev is whole
    assert samples[0] == samples[1] and len(samples[0]) == 300
    order = {e.id: i for i, e in enumerate(everything)}
    positions = [order[i] for i in samples[0]]
    assert positions == sorted(positions)  # file order kept
    # STS-B's training file is sorted by genre: a sample reaches its last part, a prefix not
    assert positions[-1] > len(everything) * 0.9
    whole = FinetuneDataModule(spec, glue_wordpiece, train_examples=10**6)
    whole.setup("fit")
    assert len(whole.examples("train")) == len(everything)


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_siamese_pairs_are_two_rows_each_with_one_label(kind, glue_wordpiece, glue_bpe):
    """siamese=True: pair i is rows 2i and 2i+1, each one text alone in the single template;
    labels and example indices stay one per pair, in training and evaluation."""
    tokenizer = glue_wordpiece if kind == "wordpiece" else glue_bpe
    dm = glue_module("mrpc", "MRPC", tokenizer, siamese=True, batch_size=8)
    special = special_ids(tokenizer)
    for batch in (next(iter(dm.train_dataloader())), next(iter(dm.val_dataloader()[0]))):
        n = len(batch["labels"])
        assert batch["input_ids"].shape[0] == 2 * n and batch["example_index"].shape == (n,)
        split = "train" if n == 8 else "dev"
        texts = [r for r in rows(batch)]
        for i, index in enumerate(batch["example_index"].tolist()):
            example = dm.examples(split)[index]
            for text, (ids, types) in zip(example.texts, texts[2 * i : 2 * i + 2], strict=True):
                assert set(types) == {0}
                if kind == "wordpiece":
                    assert ids[0] == special.cls and ids[-1] == special.sep
                    assert special.sep not in ids[1:-1]
                else:
                    assert ids[-1] == special.eot and special.eot not in ids[:-1]
                assert tokenizer.decode(ids).replace(" ", "") == (
                    tokenizer.decode(tokenizer.encode(text).ids).replace(" ", "")
                )
            assert batch["labels"][i] == dm.label_to_id[example.label]


def test_siamese_is_ignored_by_single_text_tasks(glue_wordpiece):
    dm = glue_module("sst2", "SST-2", glue_wordpiece, siamese=True, batch_size=8)
    batch = next(iter(dm.train_dataloader()))
    assert not dm.siamese and batch["input_ids"].shape[0] == len(batch["labels"]) == 8

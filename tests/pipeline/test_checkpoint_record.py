"""The pipeline's checkpoint entries (pipeline/checkpoint/record.py): written and read through
one definition, older and damaged checkpoints read as what they hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from models.config import BertConfig, GPTConfig
from pipeline.checkpoint.record import CheckpointRecord
from pipeline.run.errors import CheckpointLoadError


def word_tokenizer(model=models.WordPiece) -> Tokenizer:
    tokenizer = Tokenizer(model({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_a_written_record_reads_back_as_itself_and_rebuilds_model_and_tokenizer():
    config = GPTConfig.from_preset("tiny", vocab_size=300)
    written = CheckpointRecord(
        model_config=CheckpointRecord.describe_model(config),
        tokenizer=CheckpointRecord.describe_tokenizer(word_tokenizer()),
        config={"objective": {"seq_len": 64}},
        trained_seq_len=128,
        wandb={"id": "x1", "project": "p"},
        rng=[{"torch": [1, 2]}],
    )
    checkpoint = {"state_dict": {}}
    written.write_into(checkpoint)
    assert set(checkpoint) == {"state_dict", "model_config", "tokenizer", "config"} | {
        "trained_seq_len",
        "wandb",
        "rng",
    }  # no 'finetune' entry: a pretrained model
    read = CheckpointRecord.of(checkpoint)
    assert read == written
    assert read.model(Path("x.ckpt")) == ("gpt", config)
    assert checkpoint["tokenizer"]["kind"] == "wordpiece"  # for a reader of the file
    assert read.stored_tokenizer(Path("x.ckpt")).encode("the cat").ids == [1, 2]


def test_an_older_checkpoint_reads_its_trained_length_from_its_config_and_has_no_extras():
    read = CheckpointRecord.of({"state_dict": {}, "config": {"objective": {"seq_len": 96}}})
    assert read.trained_seq_len == 96  # written before the entry existed
    assert read.wandb == {} and read.rng == [] and read.finetune is None
    assert read.model_config is None and read.tokenizer is None
    assert CheckpointRecord.of(None) == CheckpointRecord()
    recorded = {"trained_seq_len": 512, "config": {"objective": {"seq_len": 128}}}
    assert CheckpointRecord.of(recorded).trained_seq_len == 512  # the record wins


def test_entries_of_the_wrong_type_read_as_absent_and_accessors_name_the_problem():
    damaged = CheckpointRecord.of(
        {"wandb": "x1", "rng": {"torch": 1}, "config": [1], "model_config": "bert"}
    )
    assert damaged.wandb == {} and damaged.rng == [] and damaged.config == {}
    with pytest.raises(CheckpointLoadError, match=r"x\.ckpt: model_config\['family'\] is None"):
        damaged.model(Path("x.ckpt"))
    with pytest.raises(CheckpointLoadError, match=r"x\.ckpt: tokenizer\['json'\] is missing"):
        damaged.stored_tokenizer(Path("x.ckpt"))
    fields = CheckpointRecord.describe_model(BertConfig.from_preset("tiny", vocab_size=100))
    fields["n_heads"] = 5  # no longer divides the width
    with pytest.raises(CheckpointLoadError, match="not make a valid BertConfig"):
        CheckpointRecord(model_config=fields).model(Path("x.ckpt"))
    broken = CheckpointRecord(tokenizer={"kind": "wordpiece", "json": "{not json"})
    with pytest.raises(CheckpointLoadError, match="stored tokenizer cannot be read"):
        broken.stored_tokenizer(Path("x.ckpt"))
    other = CheckpointRecord(tokenizer={"json": word_tokenizer(models.WordLevel).to_str()})
    with pytest.raises(CheckpointLoadError, match="x.ckpt: the tokenizer is a WordLevel model"):
        other.stored_tokenizer(Path("x.ckpt"))

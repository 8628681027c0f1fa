"""`pipeline.checkpoint.load`: one loader for our checkpoints, run folders and HF exports, with clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.bert import BertForPreTraining, BertModel
from models.gpt import GPT
from models.hf import export_hf
from pipeline.checkpoint.load import expect_inference, load_pretrained, resolve_device
from pipeline.checkpoint.source import resolve_checkpoint
from pipeline.run.errors import CheckpointLoadError, ConfigError, WrongFamilyError
from tests.pipeline.tiny_models import (
    checkpoint_dict,
    tiny_model,
    trained_tokenizer,
    write_fine_tuned,
    write_run,
)
from tokenizer import tokenizer_kind


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, GPT):
            return model(ids).logits
        return model(ids, token_type_ids=torch.zeros_like(ids)).mlm_logits


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_checkpoint_run_folder_and_hf_export_load_the_same_model(tmp_path, family):
    model, tokenizer, ckpt = write_run(tmp_path / "run", family)
    export_hf(model, tmp_path / "run" / "hf", tokenizer=tokenizer)
    ids = torch.tensor([tokenizer.encode("The interpreter reads the module once.").ids])
    expected = logits(model, ids)

    sources = {
        "ckpt": load_pretrained(ckpt),
        "run": load_pretrained(tmp_path / "run"),
        "hf": load_pretrained(tmp_path / "run" / "hf"),
    }
    assert sources["ckpt"].source == sources["run"].source == ckpt
    assert sources["hf"].source == tmp_path / "run" / "hf"
    for how, loaded in sources.items():
        assert loaded.family == family, how
        assert tokenizer_kind(loaded.tokenizer) == ("bpe" if family == "gpt" else "wordpiece"), how
        assert type(loaded.model) is type(model), how
        assert not loaded.model.training, how
        assert loaded.model.config == model.config, how
        assert loaded.tokenizer.encode("Modules are objects.").ids == (
            tokenizer.encode("Modules are objects.").ids
        ), how
        assert torch.equal(logits(loaded.model, ids), expected), how


def test_hf_export_of_bert_without_heads_and_of_a_vocab_txt(tmp_path):
    tokenizer = trained_tokenizer("wordpiece")
    encoder = tiny_model("bert", tokenizer).bert
    export_hf(encoder, tmp_path, tokenizer=tokenizer)
    (tmp_path / "tokenizer.json").unlink()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    (tmp_path / "vocab.txt").write_text("".join(f"{token}\n" for token, _ in vocab))
    loaded = load_pretrained(tmp_path)
    assert isinstance(loaded.model, BertModel)
    assert (loaded.family, tokenizer_kind(loaded.tokenizer)) == ("bert", "wordpiece")
    assert loaded.tokenizer.encode("Hello there").ids == tokenizer.encode("Hello there").ids


def test_checkpoint_weights_are_assigned_without_a_random_init(tmp_path, monkeypatch):
    _, _, ckpt = write_run(tmp_path, "gpt")
    monkeypatch.setattr(GPT, "init_weights", lambda self: pytest.fail("init on load"))
    loaded = load_pretrained(ckpt).model
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_models_built_from_one_read_checkpoint_do_not_share_weights(tmp_path, family):
    """`make glue` reads its checkpoint once and builds a model from it per fine-tune; training
    one in place must leave the next one at the checkpoint's weights."""
    _, _, ckpt = write_run(tmp_path, family)
    source = resolve_checkpoint(ckpt)
    first = load_pretrained(source).model
    expected = {k: v.clone() for k, v in first.state_dict().items()}
    with torch.no_grad():
        for param in first.parameters():
            param.add_(1.0)
    second = load_pretrained(source).model
    for name, value in second.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointLoadError, match=r"nope\.ckpt.*does not exist"):
        load_pretrained(tmp_path / "nope.ckpt")


def test_folder_without_a_model(tmp_path):
    with pytest.raises(CheckpointLoadError, match=r"folder without a model.*last\.ckpt"):
        load_pretrained(tmp_path)


def test_garbage_and_truncated_files_are_unreadable(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\x00\x17 not a checkpoint \xff" * 100)
    with pytest.raises(CheckpointLoadError, match=r"garbage\.ckpt is not a readable checkpoint"):
        load_pretrained(garbage)
    _, _, ckpt = write_run(tmp_path / "run", "gpt")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointLoadError, match="truncated or corrupt"):
        load_pretrained(ckpt)


@pytest.mark.parametrize("key", ["model_config", "tokenizer"])
def test_checkpoint_of_an_older_format(tmp_path, key):
    tokenizer = trained_tokenizer("bpe")
    checkpoint = checkpoint_dict(tiny_model("gpt", tokenizer), tokenizer, "gpt")
    del checkpoint[key]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(CheckpointLoadError, match=f"no '{key}' entry: it predates"):
        load_pretrained(tmp_path / "old.ckpt")


def test_plain_state_dict_is_not_a_lightning_checkpoint(tmp_path):
    tokenizer = trained_tokenizer("bpe")
    torch.save(tiny_model("gpt", tokenizer).state_dict(), tmp_path / "weights.pt")
    with pytest.raises(CheckpointLoadError, match="not a Lightning checkpoint"):
        load_pretrained(tmp_path / "weights.pt")


def test_pickled_objects_are_refused(tmp_path):
    tokenizer = trained_tokenizer("bpe")
    model = tiny_model("gpt", tokenizer)
    checkpoint = checkpoint_dict(model, tokenizer, "gpt")
    checkpoint["model_config"] = model.config  # a class instance, not plain values
    torch.save(checkpoint, tmp_path / "objects.ckpt")
    with pytest.raises(CheckpointLoadError, match=r"Python objects \(models\.config\.GPTConfig\)"):
        load_pretrained(tmp_path / "objects.ckpt")


def test_weights_that_do_not_fit_the_config_are_listed(tmp_path):
    tokenizer = trained_tokenizer("wordpiece")
    model = tiny_model("bert", tokenizer)
    checkpoint = checkpoint_dict(model, tokenizer, "bert")
    checkpoint["model_config"]["d_ff"] = 128
    del checkpoint["state_dict"]["model.nsp.bias"]
    checkpoint["state_dict"]["model.extra.weight"] = torch.zeros(3)
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.raises(CheckpointLoadError) as info:
        load_pretrained(tmp_path / "bad.ckpt")
    message = str(info.value)
    assert "bad.ckpt" in message
    assert "missing: nsp.bias" in message
    assert "unexpected: extra.weight" in message
    assert "bert.layers.0.ff_in.weight (256, 64) != (128, 64)" in message


def test_invalid_model_config_and_foreign_family(tmp_path):
    tokenizer = trained_tokenizer("bpe")
    checkpoint = checkpoint_dict(tiny_model("gpt", tokenizer), tokenizer, "gpt")
    checkpoint["model_config"]["n_heads"] = 5
    torch.save(checkpoint, tmp_path / "heads.ckpt")
    with pytest.raises(CheckpointLoadError, match="not make a valid GPTConfig.*n_heads=5"):
        load_pretrained(tmp_path / "heads.ckpt")
    checkpoint["model_config"]["family"] = "t5"
    torch.save(checkpoint, tmp_path / "t5.ckpt")
    with pytest.raises(CheckpointLoadError, match="'t5', expected one of"):
        load_pretrained(tmp_path / "t5.ckpt")


def test_tokenizer_larger_than_the_embedding(tmp_path):
    tokenizer = trained_tokenizer("wordpiece")
    model = BertForPreTraining(
        dataclasses.replace(tiny_model("bert", tokenizer).config, vocab_size=500)
    )
    torch.save(checkpoint_dict(model, tokenizer, "bert"), tmp_path / "small.ckpt")
    with pytest.raises(CheckpointLoadError, match="1000 tokens but the model only 500"):
        load_pretrained(tmp_path / "small.ckpt")


def test_hf_folder_without_tokenizer(tmp_path):
    export_hf(tiny_model("gpt", trained_tokenizer("bpe")), tmp_path)
    with pytest.raises(CheckpointLoadError, match="no tokenizer.json or vocab.txt"):
        load_pretrained(tmp_path)


def test_hf_folder_whose_tokenizer_is_of_another_kind_than_its_model(tmp_path):
    export_hf(tiny_model("gpt", trained_tokenizer("bpe")), tmp_path)
    trained_tokenizer("wordpiece").save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(CheckpointLoadError, match="a gpt model, which reads bpe tokens, but the"):
        load_pretrained(tmp_path)


def test_expect_inference(tmp_path):
    _, _, ckpt = write_run(tmp_path, "bert")
    loaded = load_pretrained(ckpt)
    expect_inference(loaded, "fill-mask")
    with pytest.raises(
        WrongFamilyError, match="holds a BERT model, but make generate needs a GPT.*make fill-mask"
    ):
        expect_inference(loaded, "generate")
    with pytest.raises(
        WrongFamilyError, match="make evaluate-lm needs a GPT \\(a causal model to score a text"
    ):
        expect_inference(loaded, "score")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ConfigError, match="device='gpu' is not a device"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_a_fine_tuned_model_where_a_pretrained_one_is_needed_names_its_pretraining_run(
    tmp_path, monkeypatch
):
    """RTE fine-tuned from an MNLI model fine-tuned from a pretraining run, each `ckpt=` given
    relative to the folder the fine-tuning ran in (not this one): the error names the RTE
    classifier, the pretraining run by its full path, the MNLI model on the way, and the command
    with the run; not the weight names of a mismatch."""
    _, _, pretrained = write_run(tmp_path / "work" / "pre", "gpt")
    work = tmp_path / "work"
    mnli = write_fine_tuned(work / "ft" / "mnli", pretrained, "pre", work, task="mnli")
    mnli_ckpt = mnli / "checkpoints" / "best.ckpt"
    rte = write_fine_tuned(work / "ft" / "rte", mnli_ckpt, "ft/mnli", work, task="rte")
    monkeypatch.chdir(tmp_path)  # neither recorded path exists from here
    with pytest.raises(CheckpointLoadError) as raised:
        load_pretrained(rte)
    message = str(raised.value)
    assert message.startswith(f"{rte} is a fine-tuned rte classifier (best.ckpt: a task head")
    assert (
        f"fine-tuned from the pretraining run {work / 'pre'} by way of the fine-tuned " in message
    )
    assert message.endswith(f"model {work / 'ft' / 'mnli'}: give it instead: ckpt={work / 'pre'}")
    assert "missing" not in message and "different version" not in message
    # copied away from its run folder, the record's relative path cannot be found: it is named
    alone = tmp_path / "alone.ckpt"
    alone.write_bytes(mnli_ckpt.read_bytes())
    with pytest.raises(
        CheckpointLoadError, match="its fine-tuning was given ckpt=pre, which is not"
    ):
        load_pretrained(alone)

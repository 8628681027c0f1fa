"""Hugging Face import/export: round trips through transformers, legacy formats, clear errors."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.bert import BertConfig, BertForPreTraining, BertModel
from models.gpt import GPT
from models.hf import (
    UnsupportedCheckpointError,
    export_hf,
    export_refusal,
    load_hf,
    load_hf_bert,
    load_hf_gpt,
    write_hf_export,
)
from models.hf_bert import bert_hf_config
from models.hf_mapping import HFMapping
from tests.models.oracles import hf_bert, hf_llama, padded_batch, transformers

V = 1000


def load_with_report(auto_class, directory, caplog):
    """`from_pretrained` that fails on missing/unexpected weights or logged warnings about them."""
    with caplog.at_level(logging.WARNING):
        model, info = auto_class.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not [r for r in caplog.records if "newly initialized" in r.getMessage()]
    return model.eval()


def test_bert_export_loads_in_transformers_and_matches(tmp_path, caplog):
    ours = load_hf_bert(hf_bert("mini")).eval()
    export_hf(ours, tmp_path)
    hf = load_with_report(transformers.AutoModelForPreTraining, tmp_path, caplog)
    assert type(hf).__name__ == "BertForPreTraining"
    ids, mask = padded_batch(2, 20, V, [20, 13])
    token_types = torch.zeros_like(ids)
    token_types[:, 8:] = 1
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=token_types)
        out = ours(ids, attention_mask=mask, token_type_ids=token_types)
    real = mask.bool()
    assert (out.mlm_logits[real] - ref.prediction_logits[real]).abs().max() < 1e-4
    assert (out.nsp_logits - ref.seq_relationship_logits).abs().max() < 1e-4
    # and back again: import of our own export gives identical weights
    again = load_hf_bert(tmp_path)
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_export_loads_in_transformers_and_matches(tmp_path, caplog, tied):
    ours = load_hf_gpt(hf_llama("tiny-gqa", tied=tied)).eval()
    export_hf(ours, tmp_path)
    hf = load_with_report(transformers.AutoModelForCausalLM, tmp_path, caplog)
    ids = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        assert (ours(ids).logits - hf(input_ids=ids).logits).abs().max() < 1e-4
    again = load_hf_gpt(tmp_path)
    assert again.config == ours.config
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bert_model_without_heads_round_trip(tmp_path, caplog):
    hf_body = hf_bert("tiny").bert
    ours = load_hf_bert(hf_body)
    assert isinstance(ours, BertModel)
    export_hf(ours, tmp_path)
    hf = load_with_report(transformers.AutoModel, tmp_path, caplog)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        ref = hf(input_ids=ids)
        out = ours.eval()(ids)
    assert (out.hidden_states - ref.last_hidden_state).abs().max() < 1e-4
    assert (out.pooled - ref.pooler_output).abs().max() < 1e-4


def test_import_from_saved_directories_and_pytorch_bin(tmp_path):
    hf = hf_bert("tiny")
    hf.save_pretrained(tmp_path / "st")
    from_dir = load_hf(tmp_path / "st")
    assert isinstance(from_dir, BertForPreTraining)
    # legacy format: pytorch_model.bin with TF-era LayerNorm.gamma/beta names
    legacy = tmp_path / "bin"
    legacy.mkdir()
    (legacy / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in hf.state_dict().items()
    }
    torch.save(state, legacy / "pytorch_model.bin")
    from_bin = load_hf(legacy)
    for a, b in zip(from_dir.state_dict().values(), from_bin.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    llama = hf_llama("tiny-mqa")
    llama.save_pretrained(tmp_path / "llama")
    assert isinstance(load_hf(tmp_path / "llama"), GPT)
    # only the classes asked for are candidates: a BERT folder is no GPT
    with pytest.raises(UnsupportedCheckpointError, match=r"supported: LlamaForCausalLM$"):
        load_hf(tmp_path / "st", model_classes=(GPT,))


def _corrupt(tmp_path, edit_config=None, edit_state=None):
    hf_llama("tiny-gqa").save_pretrained(tmp_path)
    if edit_config:
        config = json.loads((tmp_path / "config.json").read_text())
        edit_config(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    if edit_state:
        state = load_file(tmp_path / "model.safetensors")
        edit_state(state)
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize(
    ("edit_config", "edit_state", "message"),
    [
        (lambda c: c.update(architectures=["GPT2LMHeadModel"]), None, "unsupported architecture"),
        (
            lambda c: c.update(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
            ),
            None,
            "yarn",
        ),
        (lambda c: c.update(hidden_act="gelu"), None, "hidden_act"),
        (lambda c: c.update(head_dim=8), None, "head_dim"),
        (None, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing.*up_proj"),
        (
            None,
            lambda s: s.update({"model.extra.weight": torch.zeros(2)}),
            "unexpected.*model.extra",
        ),
        (None, lambda s: s.update({"model.norm.weight": torch.ones(3)}), "shape"),
    ],
)
def test_unsupported_checkpoints_fail_clearly(tmp_path, edit_config, edit_state, message):
    source = _corrupt(tmp_path, edit_config, edit_state)
    with pytest.raises(UnsupportedCheckpointError, match=message):
        load_hf(source)


def test_missing_weights_file_and_untied_decoder_fail_clearly(tmp_path):
    hf = hf_bert("tiny")
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf(tmp_path)
    state = dict(hf.state_dict())
    state["cls.predictions.decoder.weight"] = state["cls.predictions.decoder.weight"] + 1
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsupportedCheckpointError, match="untied"):
        load_hf(tmp_path)


def _wordpiece_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials)
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 20, trainer)
    return tok


def test_tokenizer_files_load_with_auto_tokenizer(tmp_path):
    tok = _wordpiece_tokenizer()
    ours = load_hf_bert(hf_bert("tiny", vocab_size=tok.get_vocab_size()))
    export_hf(ours, tmp_path, tokenizer=tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.cls_token == "[CLS]" and hf_tok.mask_token == "[MASK]"
    assert hf_tok.pad_token_id == tok.token_to_id("[PAD]")
    assert hf_tok("the cat sat")["input_ids"] == tok.encode("the cat sat").ids


def test_gpt_tokenizer_export_sets_special_token_ids(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["hello world, hello there"] * 20, trainer)
    ours = load_hf_gpt(hf_llama("tiny-gqa", vocab_size=tok.get_vocab_size()))
    export_hf(ours, tmp_path, tokenizer=tok)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == tok.token_to_id("<|endoftext|>")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tok.eos_token == "<|endoftext|>"
    assert hf_tok("hello world")["input_ids"] == tok.encode("hello world").ids


def test_export_rejects_other_modules(tmp_path):
    with pytest.raises(TypeError, match="Linear.*names no HF mapping"):
        export_hf(torch.nn.Linear(2, 2), tmp_path)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"position_encoding": "rotary"}, "not model.position_encoding=rotary;"),
        ({"norm_placement": "pre"}, "not model.norm_placement=pre;"),
    ],
)
def test_a_bert_that_hf_bert_cannot_hold_is_refused_and_nothing_is_written(
    tmp_path, options, named
):
    """HF BertModel has a position table and post-LN blocks: an encoder with rotary positions
    or pre-norm blocks would load there with its weights misread, so it is not exported."""
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V, **options))
    assert named in export_refusal(model)
    with pytest.raises(
        UnsupportedCheckpointError, match=f"cannot export BertForPreTraining.*{named}"
    ):
        export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UnsupportedCheckpointError, match=named):  # nor a reference model built
        bert_hf_config(model.config, "BertForPreTraining")
    assert export_refusal(BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=V))) is None


@dataclass
class _PairConfig:
    d_model: int = 4
    max_seq_len: int = 8


class _PairMapping(HFMapping):
    """A made-up HF architecture whose one fused weight is two HF tensors."""

    architecture = "PairModel"
    model_type = "pair"
    special_tokens: Mapping[str, tuple[str, ...]] = {"unk_token": ("<unk>",)}

    def config_from_hf(self, hf_config):
        return _PairConfig(d_model=hf_config["hidden_size"])

    def hf_config(self, config):
        return {"architectures": [self.architecture], "model_type": "pair", "hidden_size": 4}

    def spec(self, config):
        return [("proj.weight", ["up.weight", "gate.weight"])]


class _PairModel(torch.nn.Module):
    hf_mapping = _PairMapping()

    def __init__(self, config: _PairConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(config.d_model, 2 * config.d_model, bias=False)


def test_a_model_class_with_its_own_mapping_exports_and_loads_with_no_edit_here(tmp_path):
    """`models.hf` asks the model's `hf_mapping` for everything that differs by family."""
    ours = _PairModel(_PairConfig())
    export_hf(ours, tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    assert torch.equal(written["up.weight"], ours.proj.weight[:4])
    assert torch.equal(written["gate.weight"], ours.proj.weight[4:])
    again = load_hf(tmp_path, model_classes=(_PairModel, GPT))
    assert type(again) is _PairModel and torch.equal(again.proj.weight, ours.proj.weight)
    with pytest.raises(UnsupportedCheckpointError, match=r"\['PairModel'\]"):
        load_hf(tmp_path)  # not among the default classes


def _files(folder) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mode & 0o777) for p in folder.iterdir()}


def test_an_export_replaces_the_folder_whole_and_keeps_what_it_does_not_write(
    tmp_path, monkeypatch
):
    """A failure (or a kill) mid-export leaves the previous export as it was, never old files
    beside new ones; the next export clears what the interrupted one left, keeps a file the
    user put in the folder, and every file it writes has a normal file's mode."""
    previous_umask = os.umask(0o022)
    try:
        tok = _wordpiece_tokenizer()
        folder = tmp_path / "hf"
        first = load_hf_bert(hf_bert("tiny", vocab_size=tok.get_vocab_size(), seed=1))
        export_hf(first, folder, tokenizer=tok)
        (folder / "README.md").write_text("notes of mine")
        before = _files(folder)
        assert {mode for _, mode in before.values()} == {0o644}

        def cut_short(tensors, filename, metadata=None):
            Path(filename).write_bytes(b"\0" * 100)
            raise OSError(28, "No space left on device")

        second = load_hf_bert(hf_bert("tiny", vocab_size=tok.get_vocab_size(), seed=2))
        with monkeypatch.context() as patched:
            patched.setattr("models.hf.save_file", cut_short)
            with pytest.raises(OSError, match="No space left"):
                export_hf(second, folder, tokenizer=tok)
        assert _files(folder) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

        killed = tmp_path / ".hf.staged-0badf00d"  # what a SIGKILL mid-export leaves
        killed.mkdir()
        (killed / "tokenizer.json").write_text("{}")
        export_hf(second, folder, tokenizer=tok)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
        after = _files(folder)
        assert after["README.md"] == before["README.md"]
        assert after.keys() == before.keys()
        assert after["model.safetensors"] != before["model.safetensors"]
        assert {mode for _, mode in after.values()} == {0o644}
        reloaded = load_hf_bert(folder).state_dict()
        assert all(torch.equal(reloaded[k], v) for k, v in second.state_dict().items())
    finally:
        os.umask(previous_umask)


class Killed(BaseException):
    """A kill at this point: nothing after it runs (no `except Exception`, no cleanup)."""


def test_a_kill_between_the_two_renames_loses_neither_export(tmp_path, monkeypatch):
    """Where the file system refuses the atomic exchange (NFS), the export is swapped in with
    two renames; a kill between them leaves no hf/, the old export and the complete new one
    beside it. The next export (or check) puts the complete one back before it removes
    anything, a file the user put in hf/ included; a leftover of the old two names (no
    mark of a complete new copy) gets the old export back."""
    monkeypatch.setattr("models.atomic_folder._exchange", lambda first, second: False)
    tok = _wordpiece_tokenizer()
    folder = tmp_path / "hf"
    first, second, third = (
        load_hf_bert(hf_bert("tiny", vocab_size=tok.get_vocab_size(), seed=seed))
        for seed in (1, 2, 3)
    )
    export_hf(first, folder, tokenizer=tok)
    (folder / "README.md").write_text("notes of mine")
    readme = _files(folder)["README.md"]
    rename = Path.rename

    def killed_putting_it_in_place(self, target):
        if Path(target) == folder:
            raise Killed
        return rename(self, target)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "rename", killed_putting_it_in_place)
        with pytest.raises(Killed):
            export_hf(second, folder, tokenizer=tok)
    assert not folder.exists()
    assert len(list(tmp_path.glob(".hf.staged-*"))) >= 1

    # the same model again: the complete copy is put back, and found to hold it already
    assert write_hf_export(second, folder, tokenizer=tok) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert _files(folder)["README.md"] == readme
    reloaded = load_hf_bert(folder).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in second.state_dict().items())

    # what a kill between the two renames of an earlier version left: the old export at
    # `-old`, beside a staging folder that is not known to be complete
    folder.rename(tmp_path / ".hf.staged-0badf00d-old")
    (tmp_path / ".hf.staged-0badf00d").mkdir()
    (tmp_path / ".hf.staged-0badf00d" / "config.json").write_text("{")
    assert write_hf_export(third, folder, tokenizer=tok) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert _files(folder)["README.md"] == readme
    reloaded = load_hf_bert(folder).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in third.state_dict().items())

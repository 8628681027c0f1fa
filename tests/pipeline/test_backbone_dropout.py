"""Fine-tuning's `backbone.*` dropout settings (`pipeline.finetune.task_module.with_dropout`): a model
pretrained without dropout can fine-tune with it, weights unchanged; the suite's record of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.bert import BertModel
from models.config import BertConfig, GPTConfig
from models.gpt import GPTModel
from pipeline.finetune.task_module import with_dropout
from pipeline.run.errors import ConfigError
from pipeline.suites.glue import suite_record
from tests.pipeline.test_finetune import compose_config


def dropout_rates(model: nn.Module) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, nn.Dropout)}


def bert(**rates: float) -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig.from_preset("tiny", vocab_size=64, **rates))


def test_a_bert_pretrained_without_dropout_fine_tunes_with_it_and_keeps_its_weights():
    plain = bert(dropout=0.0, attn_dropout=0.0)
    changed = with_dropout(plain, dropout=0.2, attn_dropout=0.3)
    assert (changed.config.dropout, changed.config.attn_dropout) == (0.2, 0.3)
    assert dropout_rates(changed) == {0.2} and dropout_rates(plain) == {0.0}
    assert {layer.attn_dropout for layer in changed.layers} == {0.3}
    before, after = plain.state_dict(), changed.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in changed.parameters())
    ids = torch.randint(5, 64, (2, 9))
    with torch.no_grad():  # evaluation draws no dropout: the same function of the input
        torch.testing.assert_close(
            changed.eval()(ids).hidden_states, plain.eval()(ids).hidden_states
        )
        changed.train()
        torch.manual_seed(1)
        noisy = changed(ids).hidden_states
    assert not torch.allclose(noisy, plain(ids).hidden_states)  # training: dropout is on


def test_the_weights_keep_their_dtype():
    half = bert(dropout=0.0, attn_dropout=0.0).to(torch.bfloat16)
    assert {p.dtype for p in with_dropout(half, dropout=0.1).parameters()} == {torch.bfloat16}


def test_rates_left_null_keep_the_checkpoints_own():
    plain = bert(dropout=0.0, attn_dropout=0.0)
    assert with_dropout(plain, dropout=None, attn_dropout=None) is plain
    half = with_dropout(plain, dropout=0.1, attn_dropout=None)
    assert (half.config.dropout, half.config.attn_dropout) == (0.1, 0.0)


def test_gpt_takes_one_rate_and_bad_rates_are_named():
    gpt = GPTModel(GPTConfig.from_preset("tiny", vocab_size=64))
    changed = with_dropout(gpt, dropout=0.1)
    assert dropout_rates(changed) == {0.1}
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(changed.eval()(ids), gpt.eval()(ids))
    with pytest.raises(
        ConfigError,
        match=r"backbone.attn_dropout is not a setting of a GPTConfig \(its rates: dropout\)",
    ):
        with_dropout(gpt, attn_dropout=0.1)
    with pytest.raises(
        ConfigError, match=r"backbone.dropout must be a number in \[0, 1\), got 1.5"
    ):
        with_dropout(bert(), dropout=1.5)
    with pytest.raises(ConfigError, match=r"backbone.dropout must be a number .* got 'abc'"):
        with_dropout(bert(), dropout="abc")


def test_the_suite_records_the_backbone_rates_only_when_set():
    """A suite started before the setting existed has no `backbone` in its record; the same
    command still matches it, so it resumes."""
    default = suite_record(compose_config("glue", "ckpt=x"), "x", [], [1])
    assert "backbone" not in default.finetune
    given = suite_record(compose_config("glue", "ckpt=x", "backbone.dropout=0.1"), "x", [], [1])
    assert given.finetune["backbone"] == {"dropout": 0.1, "attn_dropout": None}


def test_a_null_backbone_group_is_the_checkpoints_own_rates():
    """`backbone=null` on the command line: nothing set, nothing recorded."""
    cfg = compose_config("glue", "ckpt=x", "backbone=null")
    assert "backbone" not in suite_record(cfg, str(cfg.ckpt), [], [1]).finetune
    plain = bert()
    assert with_dropout(plain, **(cfg.get("backbone") or {})) is plain


def test_a_suite_refuses_a_bad_rate_before_it_writes_its_record(tmp_path):
    """A rate the checkpoint's family lacks fails before the suite's folder holds a record, so
    the corrected command can reuse the same run_name."""
    from pipeline.run.folder import SUITE_RECORD
    from pipeline.suites.glue import run_suite
    from tests.pipeline.test_glue import load_task
    from tests.pipeline.tiny_models import write_run

    write_run(tmp_path / "gpt", "gpt")
    folder = tmp_path / "suite"
    cfg = compose_config(
        "glue",
        f"ckpt={tmp_path / 'gpt'}",
        "tasks=[rte]",
        "backbone.attn_dropout=0.1",
        run_dir=folder,
    )
    with pytest.raises(ConfigError, match="backbone.attn_dropout is not a setting"):
        run_suite(cfg, load_task)
    assert not (folder / SUITE_RECORD).exists()

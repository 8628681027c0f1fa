"""Bad config values fail before any work starts, with a message naming the field."""

import pytest
from hydra.errors import ConfigCompositionException

from pipeline.config import ConfigError, check_config
from tests.conftest import compose_pretrain


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr=-0.001"], r"optim\.lr must be > 0"),
        (["model=gpt", "optim.lr=0"], r"optim\.lr must be > 0"),
        (["model.n_heads=5"], r"model\.n_heads=5 does not divide model\.d_model=256"),
        (
            ["model=gpt", "model.n_kv_heads=3"],
            r"model\.n_kv_heads=3 does not divide model\.n_heads=8",
        ),
        (
            ["model=gpt", "model.d_model=250"],
            r"model\.n_heads=8 does not divide model\.d_model=250",
        ),
        (["model.n_layers=0"], r"model\.n_layers must be a positive integer"),
        (["model.dropout=1.5"], r"model\.dropout must be a number in \[0, 1\)"),
        (["+model.n_layer=2"], r"model: .*n_layer.*check the field names"),
        (["tokenizer=bpe"], r"tokenizer\.kind='bpe' does not fit a bert model"),
        (["model=gpt", "objective=mlm_nsp"], r"does not fit a gpt model"),
        (["objective.mlm_probability=0"], r"objective\.mlm_probability must be in \(0, 1\]"),
        (["objective.mask_replace_prob=0.95"], r"mask_replace_prob \+ objective\.random"),
        (["objective.seq_len=1024"], r"objective\.seq_len=1024 exceeds model\.max_seq_len=512"),
        (
            ["objective.phases=[{share:0.9},{share:0.1,seq_len:1024}]"],
            r"objective\.phases\[1\]\.seq_len=1024 exceeds model\.max_seq_len=512",
        ),
        (["objective.phases=[{share:0.5}]"], r"shares of objective\.phases add up to 0\.5"),
        (
            ["objective.phases=[{share:0.999},{share:0.001}]"],
            r"objective\.phases\[1\] gets no step of trainer\.max_steps=300",
        ),
        (
            ["objective.phases=[{share:0.9},{share:0.1,seq_len:512}]", "trainer.budget=10m"],
            r"objective\.phases split trainer\.max_steps, but trainer\.budget=10m",
        ),
        (["tokenizer.vocab_size=3"], r"tokenizer\.vocab_size=3 is too small"),
        (["trainer.max_steps=-1"], r"trainer\.max_steps must be a positive integer"),
        (["trainer.precision=fp8"], r"trainer\.precision='fp8'"),
        (["schedule.warmup_steps=10"], r"exactly one of schedule\.warmup_steps"),
        (["optim.betas=[0.9,1.5]"], r"optim\.betas\[1\]"),
        (["data=text_files"], r"required config value\(s\) not set: data\.paths"),
        (["data=text_files", "data.paths=/nonexistent/*.txt"], r"matches no file"),
        (["trainer.val_check_interval=0.5"], r"val_check_interval must be a whole number"),
        (["checkpoint.keep_last=0"], r"checkpoint\.keep_last must be an integer >= 1, got 0"),
        (["module.max_nonfinite_steps=0"], r"module\.max_nonfinite_steps must be an integer"),
        (["trainer=fsdp", "trainer.strategy.sharding_strategy=zero3"], r"zero3.*FULL_SHARD"),
        (["probe=glue", "trainer=fsdp"], r"probe=\.\.\. is not supported with trainer=fsdp"),
        (["probe=glue", "probe.every_n_steps=0"], r"probe\.every_n_steps=0: use a positive"),
        (["probe=glue", "~probe.tasks"], r"probe\.tasks is empty"),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    cfg = compose_pretrain(*overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_unknown_model_name_lists_the_choices():
    with pytest.raises(ConfigCompositionException, match=r"model/berty(.|\n)*bert-base"):
        compose_pretrain("model=berty")


def test_misspelled_field_is_caught_at_composition():
    with pytest.raises(ConfigCompositionException, match=r"model\.n_layer"):
        compose_pretrain("model.n_layer=2")

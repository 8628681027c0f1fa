"""Bad config values fail before any work starts, with a message naming the field."""

import shlex

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from pipeline.finetune.settings import check_finetune_keys, task_from
from pipeline.pretrain.checks import _check_setting_keys, check_config
from pipeline.run.config_keys import check_keys
from pipeline.run.errors import ConfigError
from pipeline.run.launcher import register_resolvers
from tests.composed_configs import composed_pretrain
from tests.conftest import CONF, compose_pretrain


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr=-0.001"], r"optim\.lr=-0\.001: give a learning rate > 0"),
        (["model=gpt", "optim.lr=0"], r"optim\.lr=0: give a learning rate > 0"),
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
        (
            ["+model.n_layer=2"],
            r"model\.n_layer is not a setting of models\.config\.BertConfig; did you mean: "
            r"model\.n_layers=2$",  # too many keys to list them all
        ),
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
        (["optim.lr=null"], r"optim\.lr=None: give a learning rate > 0, e\.g\. optim\.lr=1e-4$"),
        (["optim.weight_decay=-0.1"], r"optim\.weight_decay=-0\.1: give a number >= 0"),
        (["optim=muon_gpt", "optim.adamw_lr=0"], r"optim\.adamw_lr=0: give a rate > 0"),
        (["data=text_files"], r"required config value\(s\) not set: data\.paths"),
        (["data=text_files", "data.paths=/nonexistent/*.txt"], r"matches no file"),
        (["trainer.val_check_interval=0.5"], r"val_check_interval must be a whole number"),
        (["checkpoint.keep_last=0"], r"checkpoint\.keep_last must be an integer >= 1, got 0"),
        (["module.max_nonfinite_steps=0"], r"module\.max_nonfinite_steps must be an integer"),
        (["trainer=fsdp"], r"with FSDP the AdamW recipe \(recipe=bert-reference\)$"),
        (
            ["experiment=bert-mini-budget", "trainer=fsdp"],  # Muon on the reference recipe
            r"with FSDP an AdamW optimizer \(optim=adamw_bert\)$",
        ),
        (
            ["recipe=bert-reference", "trainer=fsdp", "trainer.strategy.sharding_strategy=zero3"],
            r"zero3.*FULL_SHARD",
        ),
        (
            ["recipe=bert-reference", "probe=glue", "trainer=fsdp"],
            r"probe=\.\.\. is not supported with trainer=fsdp",
        ),
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


# (override, the fix the error suggests as a shell word, or None when it lists the accepted keys)
UNKNOWN_KEYS = [
    ("+optim.lrr=1", "optim.lr=1"),
    ("+optim.amsgrd=true", "+optim.amsgrad=true"),  # a setting the config file leaves out
    ("+schedule.warmup_ration=0.2", "schedule.warmup_ratio=0.2"),
    ("+objective.seqlen=64", "objective.seq_len=64"),
    ("+tokenizer.vocab=3000", "tokenizer.vocab_size=3000"),
    ("+trainer.max_step=7", "trainer.max_steps=7"),
    ("+datamodule.num_worker=1", "datamodule.num_workers=1"),
    ("+checkpoint.keep=3", "checkpoint.keep_last=3"),
    ("+module.compiles=true", "module.compile=true"),
    ("+logger.csv.nme=x", "logger.csv.name=x"),
    ("+optim.betaz=[0.8,0.9]", "'optim.betas=[0.8,0.9]'"),  # quoted for the shell
    ("+optim.foo=1", None),
]


@pytest.mark.parametrize(("override", "fix"), UNKNOWN_KEYS)
def test_unknown_keys_name_the_setting_that_works_when_pasted(override, fix):
    """A key that the constructor of its node does not take (added with `+`, as Hydra suggests
    for a typo) is a ConfigError before anything is built; the suggested override, given
    instead, passes the check."""
    key = override.lstrip("+").split("=")[0]
    adamw = "recipe=bert-reference"  # the optim keys above are AdamW's
    with pytest.raises(ConfigError) as refused:
        check_config(compose_pretrain(adamw, override))
    message = str(refused.value)
    assert message.startswith(f"{key} is not a setting")
    if fix is None:
        assert "which takes lr, betas, eps, weight_decay" in message
        assert f"remove {key} from the command line" in message
        return
    assert f"did you mean: {fix}" in message
    [pasted] = shlex.split(fix)
    check_config(compose_pretrain(adamw, pasted))


def test_unknown_keys_of_other_presets_and_nested_targets():
    with pytest.raises(ConfigError, match=r"did you mean: model\.n_kv_heads=1$"):
        check_config(compose_pretrain("model=gpt-tiny", "+model.n_kv_head=1"))
    with pytest.raises(
        ConfigError, match=r"of pipeline\.training\.muon\.MuonWithAdamW; .*optim\.ns_steps"
    ):
        check_config(compose_pretrain("model=gpt-tiny", "optim=muon", "+optim.ns_step=3"))
    with pytest.raises(ConfigError, match=r"trainer\.strategy\.cpu_ofload is not a setting of"):
        check_config(compose_pretrain("trainer=fsdp", "+trainer.strategy.cpu_ofload=true"))
    with pytest.raises(ConfigError, match=r"data\.parts\.wikitext2\.doc_splt is not a setting"):
        check_config(
            compose_pretrain("data=wikitext2_glue_texts", "+data.parts.wikitext2.doc_splt=x")
        )
    with pytest.raises(ConfigError, match=r"the run passes total_steps to .*warmup_linear_decay"):
        check_config(compose_pretrain("+schedule.total_steps=10"))


def test_targets_that_take_any_keyword_are_not_checked():
    check_keys(
        "logger.wandb", {"_target_": "pipeline.training.loggers.wandb_logger", "entity": "me"}
    )
    with pytest.raises(ConfigError, match=r"cannot be imported"):
        check_keys("optim", {"_target_": "torch.optim.Adamm", "lr": 1})


def test_every_config_of_the_pretraining_groups_passes_the_key_check():
    """No preset, experiment or group option sets a key its constructor does not take."""
    for group in ("model", "experiment", "data", "optim", "recipe", "trainer", "logger"):
        for option in sorted((CONF / group).glob("*.yaml")):
            overrides = [f"{group}={option.stem}"]
            if group == "optim" and option.stem == "muon":
                overrides.append("model=gpt")
            if group == "recipe":  # bert-fast, gpt-reference, ...: with its family's model
                overrides.insert(0, f"model={option.stem.split('-')[0]}")
            _check_setting_keys(composed_pretrain(*overrides))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=abc", r"optim\.lr='abc' is not a number: torch\.optim\.AdamW takes a number"),
        ("trainer.max_steps=abc", r"trainer\.max_steps='abc' is not a whole number"),
        ("objective.batch_size=3.5", r"objective\.batch_size=3\.5 is not a whole number"),
        (
            "tokenizer.vocab_size=1e4",
            r"is not a whole number: .*; e\.g\. tokenizer\.vocab_size=10000$",
        ),
        ("schedule.warmup_ratio=abc", r"takes a number \(or null\) there"),
        ("seed=abc", r"seed='abc' is not a whole number; e\.g\. seed=1234"),
    ],
)
def test_text_where_a_number_goes_is_named_before_the_run(override, message):
    """A value that the constructor's annotation says is a number, given as text (or a
    fraction for a whole number), would fail deep inside the run with a TypeError."""
    with pytest.raises(ConfigError, match=message):
        check_config(compose_pretrain("recipe=bert-reference", override))


def compose_finetune(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("finetune", overrides=list(overrides))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "+optim.lrr=1",
            r"optim\.lrr is not a setting of torch\.optim\.AdamW; did you mean: optim\.lr=1 ",
        ),
        ("+schedule.warmup_step=5", r"did you mean: schedule\.warmup_steps=5 "),
        ("+trainer.max_epoch=2", r"did you mean: trainer\.max_epochs=2$"),
        ("+datamodule.batchsize=8", r"did you mean: datamodule\.batch_size=8 "),
        ("+datamodule.task=x", r"the run passes task to datamodules\.finetune\.FinetuneDataModule"),
        ("+head.poolin=mean", r"did you mean: head\.pooling=mean \(head takes dropout, pooling"),
        ("trainer.max_epochs=abc", r"trainer\.max_epochs='abc' is not a whole number"),
        ("datamodule.max_examples=abc", r"datamodule\.max_examples='abc' is not a whole number"),
        ("head.dropout=abc", r"head\.dropout='abc': use a number in \[0, 1\)"),
        ("seed=abc", r"seed='abc' is not a whole number"),
    ],
)
def test_finetuning_settings_are_checked_before_anything_is_loaded(override, message):
    with pytest.raises(ConfigError, match=message):
        check_finetune_keys(compose_finetune(override))


def test_a_task_with_unset_values_names_them_all():
    with pytest.raises(
        ConfigError,
        match=r"task custom: required value\(s\) not set: "
        r"task\.data_dir, task\.files\.dev, task\.files\.train, task\.label_column, "
        r"task\.text_columns; give them on the command line \(conf/task/custom",
    ):
        task_from(compose_finetune("task=custom").task)
    with pytest.raises(
        ConfigError,
        match=r"task\.label_col is not a setting of .*TaskSpec; "
        r"did you mean: task\.label_column=x",
    ):
        task_from(compose_finetune("+task.label_col=x").task)

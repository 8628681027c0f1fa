"""Every file under conf/ composes, and every component in it instantiates (no training)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from datamodules.corpora.corpus import EmbeddedCorpus, TextFilesCorpus
from models.config import BertConfig, GPTConfig
from models.gpt import GPT
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.run import trainer_arguments
from pipeline.run.errors import ConfigError
from pipeline.run.recipes import (
    ADAMW,
    MUON,
    optimizer_class,
    optimizer_option,
    recipe_optimizer,
    recipe_with,
    recipes_of,
)
from pipeline.training.optim import build_optimizer
from tests.composed_configs import composed_pretrain
from tests.conftest import CONF, compose_pretrain
from tests.pipeline.task_data import point_shipped_corpora_at

# conf/task/ belongs to fine-tuning, not to pretrain.yaml; tests/datamodules/tasks/test_tasks.py
# instantiates every task config. conf/suite/ belongs to glue.yaml (tests/pipeline/test_glue.py).
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("task", "suite"))
FILE_DATA = {
    "text_files",
    "jsonl",
    "parquet",
    "wikitext2",
    "wikitext2_test",
    "gutenberg",
    "gutenberg_valid",
}
# options that read task files from $GLUE_DIR (and WikiText-2 from $WIKITEXT2_DIR)
GLUE_TEXTS_DATA = {"glue_texts", "wikitext2_glue_texts", "mixture"}


@functools.cache
def reads_glue_texts(group: str, option: str) -> bool:
    """Whether the option's corpus is, or contains, the suite's task texts (an experiment: found
    by composing it, once, so a new experiment on those texts needs no entry here)."""
    if group == "data":
        return option in GLUE_TEXTS_DATA
    if group != "experiment":
        return False
    data = composed_pretrain(f"experiment={option}").data
    corpora = [data, *data.get("parts", {}).values()]
    return any(c._target_ == "datamodules.tasks.texts.TaskTextsCorpus" for c in corpora)


GPT_ONLY_OPTIONS = {"bpe", "causal_lm", "adamw_gpt", "warmup_cosine", "gpt-reference", "gpt-fast"}
# adamw_finetune leaves lr to pipeline/finetune/run.py (by model width); tests/pipeline/test_finetune.py
FINETUNE_ONLY = {("optim", "adamw_finetune")}
OPTIONS = [
    (g, p.stem)
    for g in GROUPS
    for p in sorted((CONF / g).glob("*.yaml"))
    if (g, p.stem) not in FINETUNE_ONLY
]


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("A first paragraph.\n\nA second one.\n")
    return path


def overrides_for(group: str, option: str, tmp_path: Path, text_file: Path) -> list[str]:
    overrides = [f"{group}={option}", f"paths.cache_dir={tmp_path}"]
    if option in GPT_ONLY_OPTIONS:
        overrides.append("model=gpt")
    if (group, option) == ("trainer", "fsdp"):  # the default fast recipe's Muon is refused there
        overrides.append("recipe=bert-reference")
    reads_local_files = (group == "data" and option in FILE_DATA) or group == "experiment"
    if reads_glue_texts(group, option):  # test_option_composes_and_instantiates writes them
        reads_local_files = False
    if reads_local_files:  # experiments read local files too; tests never need ../shared
        data_file = {"jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet"}.get(
            option, text_file
        )
        overrides.append(f"data.paths=[{data_file}]")
    return overrides


def test_every_group_has_options():
    assert {
        "model",
        "data",
        "tokenizer",
        "objective",
        "optim",
        "schedule",
        "trainer",
        "logger",
        "paths",
        "recipe",
        "experiment",
        "debug",
    } <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group, option, tmp_path, text_file, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if reads_glue_texts(group, option):
        point_shipped_corpora_at(tmp_path, monkeypatch)

    (tmp_path / "d.jsonl").write_text('{"text": "one doc"}\n')
    pq.write_table(pa.table({"text": ["one doc"]}), tmp_path / "d.parquet")
    cfg = compose_pretrain(*overrides_for(group, option, tmp_path, text_file))
    OmegaConf.resolve(cfg)
    plan = check_config(cfg)  # model, tokenizer, objective, data, optim and trainer checks

    # bound as the LightningModule binds it, to a (tiny) model of a registered family
    tiny = GPT(GPTConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1))
    optimizer = build_optimizer(tiny, instantiate(cfg.optim))
    assert optimizer.param_groups[0]["lr"] == cfg.optim.lr
    scheduler = instantiate(cfg.schedule)(optimizer, total_steps=cfg.trainer.max_steps)
    assert scheduler.get_last_lr()[0] > 0

    for name, logger_cfg in cfg.logger.items():
        logger_cfg.save_dir = str(tmp_path)
        assert instantiate(logger_cfg) is not None, name
    trainer_cfg = trainer_arguments(cfg.trainer)
    trainer_cfg.update(default_root_dir=str(tmp_path), logger=False, enable_progress_bar=False)
    if trainer_cfg.get("accelerator") == "gpu" and not torch.cuda.is_available():
        trainer_cfg.update(accelerator="cpu", devices=1, strategy="auto")
    assert isinstance(instantiate(trainer_cfg), pl.Trainer)
    assert plan.family in ("bert", "gpt")


# The recipe (conf/recipe/) each model preset trains with unless recipe= says otherwise: the
# CPU-sized presets the fast one (the recipe study's winner), the paper-sized ones the published.
RECIPE_OF_MODEL = {
    "bert": "bert-fast",
    "bert-tiny": "bert-fast",
    "bert-base": "bert-reference",
    "bert-large": "bert-reference",
    "gpt": "gpt-fast",
    "gpt-tiny": "gpt-fast",
    "gpt-124m": "gpt-reference",
    "gpt-1b": "gpt-reference",
}


@pytest.mark.parametrize(
    ("model", "family", "config_type", "tokenizer", "schedule"),
    [
        ("bert", "bert", BertConfig, "wordpiece", "warmup_linear_decay"),
        ("bert-tiny", "bert", BertConfig, "wordpiece", "warmup_linear_decay"),
        ("bert-base", "bert", BertConfig, "wordpiece", "warmup_linear_decay"),
        ("bert-large", "bert", BertConfig, "wordpiece", "warmup_linear_decay"),
        ("gpt", "gpt", GPTConfig, "bpe", "warmup_cosine"),
        ("gpt-tiny", "gpt", GPTConfig, "bpe", "warmup_cosine"),
        ("gpt-124m", "gpt", GPTConfig, "bpe", "warmup_cosine"),
        ("gpt-1b", "gpt", GPTConfig, "bpe", "warmup_cosine"),
    ],
)
def test_model_choice_pulls_in_a_consistent_recipe(model, family, config_type, tokenizer, schedule):
    cfg = composed_pretrain(f"model={model}")
    assert cfg.recipe == {"name": RECIPE_OF_MODEL[model], "family": family}
    plan = check_config(cfg)
    assert plan.family == family
    assert isinstance(plan.model, config_type)
    assert plan.tokenizer.kind == tokenizer
    assert cfg.schedule._target_.endswith(schedule)


def test_recipes_set_what_they_name():
    """reference: the published AdamW recipe; fast: Muon at a higher rate with a 2% warmup,
    and for BERT no dropout and the unigram output bias. Sizes set in a preset (bert-base's
    rate and warmup) stay the preset's whichever recipe is chosen."""
    bert = composed_pretrain("model=bert", "recipe=bert-reference")
    assert bert.optim._target_ == "torch.optim.AdamW" and list(bert.optim.betas) == [0.9, 0.999]
    assert (bert.optim.lr, bert.schedule.warmup_ratio, bert.output_bias) == (5e-4, 0.1, "zeros")
    assert (bert.model.dropout, bert.model.attn_dropout) == (0.1, 0.1)
    fast = composed_pretrain("model=bert", "recipe=bert-fast")
    assert fast.optim._target_.endswith("MuonWithAdamW")
    assert (fast.optim.lr, fast.schedule.warmup_ratio, fast.output_bias) == (2e-3, 0.02, "unigram")
    assert (fast.model.dropout, fast.model.attn_dropout) == (0.0, 0.0)
    assert fast.schedule._target_ == bert.schedule._target_
    gpt = composed_pretrain("model=gpt", "recipe=gpt-reference")
    assert gpt.optim._target_ == "torch.optim.AdamW" and list(gpt.optim.betas) == [0.9, 0.95]
    assert (gpt.optim.lr, gpt.schedule.warmup_ratio) == (1e-3, 0.05)
    fast = composed_pretrain("model=gpt", "recipe=gpt-fast")
    assert fast.optim._target_.endswith("MuonWithAdamW")
    assert (fast.optim.lr, fast.schedule.warmup_ratio, fast.model.dropout) == (3e-3, 0.02, 0.0)
    base = composed_pretrain("model=bert-base", "recipe=bert-fast")
    assert (base.optim.lr, base.schedule.warmup_steps) == (1e-4, 10000)


def test_an_optimizer_chosen_after_a_recipe_trains_at_its_own_rate():
    """A rate belongs to its optimizer's file (conf/optim/muon_gpt.yaml holds the fast recipe's
    3e-3): AdamW chosen on a preset whose recipe is the fast one trains at AdamW's 1e-3, not
    at Muon's, while the recipe's schedule and regularization stay."""
    gpt = composed_pretrain("model=gpt", "optim=adamw_gpt")
    assert (gpt.optim._target_, gpt.optim.lr) == ("torch.optim.AdamW", 1e-3)
    assert (gpt.recipe.name, gpt.schedule.warmup_ratio) == ("gpt-fast", 0.02)
    bert = composed_pretrain("model=bert", "optim=adamw_bert")
    assert (bert.optim.lr, bert.output_bias, bert.model.dropout) == (5e-4, "unigram", 0.0)
    assert bert.schedule.warmup_ratio == 0.02


def test_the_recipe_files_say_which_optimizer_each_trains_with():
    """The fixes that errors name (a resume with the checkpoint's optimizer, FSDP's AdamW) are
    read from the recipe and optimizer files (pipeline/run/recipes.py); muon_gpt extends muon."""
    assert recipes_of("gpt") == ["gpt-fast", "gpt-reference"]
    assert [recipe_optimizer(name) for name in recipes_of("bert")] == ["muon_bert", "adamw_bert"]
    assert optimizer_class("muon_gpt") == optimizer_class("muon") == MUON
    assert (recipe_with(ADAMW, "gpt"), recipe_with(MUON, "bert")) == ("gpt-reference", "bert-fast")
    assert (optimizer_option(MUON, "gpt"), optimizer_option(ADAMW, "bert")) == (
        "muon_gpt",
        "adamw_bert",
    )
    assert optimizer_option(MUON, "toy") == "muon" and recipe_with(ADAMW, "toy") is None
    assert optimizer_class("no_such_optimizer") is None
    plain = composed_pretrain("model=gpt", "optim=muon")  # Muon's own file, at 1e-3
    assert plain.optim._target_.endswith("MuonWithAdamW") and plain.optim.lr == 1e-3
    assert composed_pretrain("model=gpt").optim.lr == 3e-3


def test_a_recipe_of_the_other_family_is_refused_by_name():
    for overrides, message in [
        (("model=gpt", "recipe=bert-fast"), r"recipe=bert-fast is a recipe for bert models, not "),
        (("model=bert", "recipe=gpt-fast"), r"its family's \(recipe=bert-fast or recipe=bert-ref"),
        (("model=gpt-124m", "recipe=bert-reference"), r"not for a gpt model"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_config(composed_pretrain(*overrides))
    assert check_config(composed_pretrain("model=gpt", "recipe=gpt-fast")).family == "gpt"


def test_size_presets_have_published_shapes():
    base = check_config(composed_pretrain("model=bert-base")).model
    assert (base.n_layers, base.d_model, base.n_heads, base.d_ff) == (12, 768, 12, 3072)
    gpt = check_config(composed_pretrain("model=gpt-124m")).model
    assert (gpt.n_layers, gpt.d_model, gpt.n_heads, gpt.max_seq_len) == (12, 768, 12, 1024)
    small = check_config(composed_pretrain("model=bert")).model
    assert small.n_layers * small.d_model <= 4 * 256  # the CPU default stays small


# Each model config group's option and the named shape (models/config.py PRESETS) it spells out
# field by field, so that Hydra shows and overrides every field.
PRESET_OF_OPTION = {
    "bert": "mini",
    "bert-tiny": "tiny",
    "bert-base": "base",
    "bert-large": "large",
    "gpt": "mini",
    "gpt-tiny": "tiny",
    "gpt-124m": "124m",
    "gpt-1b": "1b",
}


def test_every_model_option_is_its_named_preset_and_every_option_is_listed():
    assert sorted(PRESET_OF_OPTION) == sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
    for option, preset in PRESET_OF_OPTION.items():
        built = check_config(composed_pretrain(f"model={option}")).model
        named = type(built).from_preset(preset, vocab_size=built.vocab_size)
        for field in (*type(built).PRESETS[preset], "d_ff"):
            assert getattr(built, field) == getattr(named, field), (option, field)


def test_default_is_bert_on_the_embedded_corpus():
    plan = check_config(composed_pretrain())
    assert plan.family == "bert" and isinstance(plan.corpus, EmbeddedCorpus)


def test_command_line_overrides_pass_through(text_file):
    cfg = compose_pretrain(
        "model=gpt",
        "trainer.max_steps=50",
        "model.n_layers=2",
        "data=text_files",
        f"data.paths={text_file}",
    )
    plan = check_config(cfg)
    assert plan.model.n_layers == 2 and cfg.trainer.max_steps == 50
    assert isinstance(plan.corpus, TextFilesCorpus)


def test_experiment_selects_model_and_data(shared_data):
    cfg = compose_pretrain(
        "experiment=gpt-mini-wikitext2",
        f"data.paths=[{shared_data}/wikitext/wikitext-2-tokenized/train.txt.gz]",
    )
    plan = check_config(cfg)
    assert plan.family == "gpt" and plan.corpus.doc_split == "wikitext"


def test_run_dir_is_one_folder_per_model_and_time():
    cfg = compose_pretrain("model=gpt", hydra_node=True)
    HydraConfig.instance().set_config(cfg)
    run_dir = cfg.hydra.run.dir
    assert re.fullmatch(r"outputs/gpt/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir), run_dir

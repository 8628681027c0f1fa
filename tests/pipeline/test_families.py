"""The family registry: a third family, defined here and registered, runs the generic paths
(config check, pretraining with checkpoints, loading, from-scratch twin) with no change to any
pipeline module."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torch.nn import functional as F

from datamodules.objectives.objective import CausalLMObjective
from models.config import BertConfig, GPTConfig
from pipeline.checkpoint.load import load_backbone, load_finetuned, load_pretrained
from pipeline.finetune.evaluation import evaluate
from pipeline.finetune.run import finetune
from pipeline.finetune.task_module import reinitialize
from pipeline.pretrain.checks import check_config
from pipeline.pretrain.modules import PretrainModule
from pipeline.pretrain.run import assemble, train
from pipeline.run import families as registry
from pipeline.run.errors import ConfigError, UnknownFamilyError
from pipeline.run.families import (
    Family,
    families,
    family_named,
    family_of_config,
    family_of_target,
    register,
    unregister,
)
from tests.conftest import compose_pretrain
from tests.pipeline.task_data import pair_task, write_pairs
from tests.pipeline.test_finetune import compose_config
from tokenizer import get_tokenizer, tokenizer_kind


@dataclass
class ToyConfig:
    """A bigram model: each token's embedding predicts the next token. Takes the GPT preset's
    keys (a `model=gpt-tiny` config with another `_target_`), using two of them."""

    vocab_size: int = 256
    d_model: int = 16
    max_seq_len: int = 128
    n_layers: int = 1
    n_heads: int = 1
    n_kv_heads: int = 1
    d_ff: int = 16
    ffn_multiple_of: int = 64
    rope_theta: float = 1e4
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(input_ids))

    # The backbone interface (models.heads.Backbone) that task heads use for any family.
    def backbone(self) -> ToyModel:
        return self

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.embed

    def token_states(self, input_ids, attention_mask=None, token_type_ids=None) -> torch.Tensor:
        return self.embed(input_ids)

    def sequence_features(self, input_ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask_BT1 = attention_mask.unsqueeze(-1).float()
        return (self.embed(input_ids) * mask_BT1).sum(1) / mask_BT1.sum(1).clamp_min(1.0)

    def train_own_features(self, trained: bool) -> None:
        pass


class ToyPretraining(PretrainModule):
    loss_terms = {"loss": "targets"}  # noqa: RUF012 (as the pipeline's modules declare it)

    def build_model(self, config: ToyConfig) -> ToyModel:
        return ToyModel(config)

    def metric_names(self) -> list[str]:
        return ["loss"]

    @property
    def flops_per_token(self) -> float:
        return 6.0 * sum(p.numel() for p in self.model.parameters())

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        return {"loss": (loss, batch["targets"].numel())}


TOY = Family(
    name="toy",
    config_class=ToyConfig,
    model_class=ToyModel,
    backbone_class=ToyModel,
    block_class=nn.Linear,
    tokenizer_kind="bpe",
    objective_class=CausalLMObjective,
    module_class=ToyPretraining,
    vocab_multiple=8,
    try_command=("finetune", "task=sst2"),
    hf_auto_class=None,  # no HF mapping: a run exports no hf/ folder
)
TOY_RUN = (
    "model=gpt-tiny",
    "model._target_=tests.pipeline.test_families.ToyConfig",
    "tokenizer.vocab_size=400",
    "debug=smoke",
    "logger=csv",
    "trainer.max_steps=3",
    "checkpoint.every_n_steps=3",
)


@pytest.fixture
def toy_family():
    register(TOY)
    yield TOY
    unregister(TOY.name)


def test_the_two_families_are_registered_once_each():
    assert [f.name for f in families()] == ["bert", "gpt"]
    assert family_of_config(BertConfig(vocab_size=100)).name == "bert"
    assert family_of_config(GPTConfig(vocab_size=128)).model_vocab_size(1000) == 1024
    with pytest.raises(UnknownFamilyError, match="'t5' is not one of bert, gpt"):
        family_named("t5")
    # a model node's `_target_`, before it is built (the recipe check reads it)
    assert family_of_target("models.config.GPTConfig").name == "gpt"
    assert family_of_target(f"{__name__}.ToyConfig") is None  # no such family registered


def test_a_registered_family_is_found_by_its_config_target(toy_family):
    assert family_of_target("tests.pipeline.test_families.ToyConfig") is toy_family
    assert family_of_target("models.config.BertConfig").name == "bert"


def test_a_third_family_trains_checkpoints_and_loads_through_the_generic_paths(
    toy_family, tmp_path
):
    cfg = compose_pretrain(*TOY_RUN, f"paths.cache_dir={tmp_path / 'cache'}")
    plan = check_config(cfg)
    assert plan.family == "toy"
    tokenizer = get_tokenizer(plan.tokenizer, plan.corpus, cfg.paths.cache_dir)
    run_dir = tmp_path / "run"
    cfg.paths.output_dir = str(run_dir)  # where the loggers write
    module, datamodule, trainer = assemble(cfg, plan, tokenizer, run_dir)
    assert isinstance(module, ToyPretraining)
    assert module.model.config.vocab_size == toy_family.model_vocab_size(tokenizer.get_vocab_size())
    trainer.fit(module, datamodule=datamodule)

    loaded = load_pretrained(run_dir)  # a run folder: its checkpoints/last.ckpt
    assert (loaded.family, tokenizer_kind(loaded.tokenizer)) == ("toy", "bpe")
    assert isinstance(loaded.model, ToyModel) and loaded.trained_seq_len == 128
    trained = module.model.state_dict()
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in trained.items())
    backbone = load_backbone(run_dir).model
    fresh = reinitialize(backbone)  # the from-scratch twin: same architecture, new weights
    assert type(fresh) is ToyModel and fresh.config == backbone.config
    assert not torch.equal(fresh.embed.weight, backbone.embed.weight)


def test_a_family_decides_which_tokenizer_and_objective_fit(toy_family):
    cfg = compose_pretrain(*TOY_RUN, "tokenizer=wordpiece")
    with pytest.raises(ConfigError, match="does not fit a toy model, which needs 'bpe'"):
        check_config(cfg)
    assert instantiate(compose_pretrain(*TOY_RUN).model).d_model == 64


def test_a_model_of_no_registered_family_is_named():
    with pytest.raises(ConfigError, match="no model family has the config type ToyConfig"):
        check_config(compose_pretrain(*TOY_RUN))


def test_a_third_family_pretrains_resumes_fine_tunes_and_evaluates_with_no_pipeline_edit(
    toy_family, tmp_path
):
    """The commands' library paths, end to end, for a family the pipeline has never heard of:
    pretrain (3 steps), resume to 5, fine-tune on a pair task (texts read apart, as the widths
    of mini models are by default), evaluate the fine-tuned run."""
    pretrain_cfg = compose_pretrain(
        *TOY_RUN, "checkpoint.every_n_steps=1", f"paths.cache_dir={tmp_path / 'cache'}"
    )
    run_dir = tmp_path / "toy"
    pretrain_cfg.paths.output_dir = str(run_dir)
    run_dir.mkdir()  # Hydra makes it for the command
    train(pretrain_cfg, check_config(pretrain_cfg))
    assert not (run_dir / "hf").exists()  # the family has no HF mapping
    pretrain_cfg.trainer.max_steps = 5
    pretrain_cfg.resume = "auto"
    train(pretrain_cfg, check_config(pretrain_cfg))
    resumed = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 5

    write_pairs(tmp_path / "pairs", n_train=40, n_dev=16)
    tuned_dir = tmp_path / "tuned"
    finetune_cfg = compose_config(
        "finetune",
        f"ckpt={run_dir}",
        *pair_task(tmp_path / "pairs"),
        "datamodule.batch_size=8",
        "trainer.max_epochs=1",
        run_dir=tuned_dir,
    )
    results = finetune(finetune_cfg, announce=False)
    assert set(results.final.metrics["dev"]) >= {"pearson", "spearman"}
    tuned = load_finetuned(tuned_dir)
    assert tuned.family == "toy" and type(tuned.model.backbone) is ToyModel
    assert tuned.head.siamese  # a pair read apart: ToyModel.sequence_features per text

    scores = evaluate(compose_config("evaluate", f"ckpt={tuned_dir}", run_dir=tuned_dir))
    assert scores["dev"]["pearson"] == pytest.approx(results.final.metrics["dev"]["pearson"])


def test_an_empty_registry_says_which_module_fills_it(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    with pytest.raises(UnknownFamilyError, match=r"import pipeline\.pretrain\.families"):
        family_named("bert")


REPO = Path(__file__).resolve().parents[2]


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


@functools.cache  # each command's walk meets the same modules: each file is parsed once
def _imports_of(module: str) -> frozenset[str]:
    """Our modules that importing `module` runs (its imports and their parent packages)."""
    names = set()
    for node in ast.walk(ast.parse(_module_file(module).read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    parts = [name.split(".") for name in names]
    return frozenset({".".join(p[:i]) for p in parts for i in range(1, len(p) + 1)} - {module})


def _imported_with(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        here = todo.pop()
        if here not in seen and _module_file(here) is not None:
            seen.add(here)
            todo.extend(_imports_of(here))
    return seen


def test_every_command_that_asks_the_registry_fills_it_first():
    """The records of BERT and GPT are registered by pipeline/pretrain/families.py, above the
    registry; a command reaching the registry through a lower module (loading a checkpoint,
    say) must import that module too, or it finds no family."""
    asking, unfilled = [], []
    for path in sorted((REPO / "pipeline" / "commands").glob("[!_]*.py")):
        imported = _imported_with(f"pipeline.commands.{path.stem}")
        if "pipeline.run.families" in imported:
            asking.append(path.stem)
            if "pipeline.pretrain.families" not in imported:
                unfilled.append(path.stem)
    assert {"pretrain", "finetune", "generate"} <= set(asking)  # the check sees the imports
    assert unfilled == []

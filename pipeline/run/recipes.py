"""What the recipes (conf/recipe/) and optimizer files (conf/optim/) select, read from the files
themselves, for the fixes that errors name: which recipe or `optim=` option trains a family with a
given optimizer class (a resume that needs the checkpoint's optimizer, FSDP that needs AdamW)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
RECIPES_DIR = CONF_DIR / "recipe"
OPTIM_DIR = CONF_DIR / "optim"
ADAMW = "torch.optim.AdamW"
MUON = "pipeline.training.muon.MuonWithAdamW"


def recipes_of(family: str) -> list[str]:
    """The recipes written for `family` (conf/recipe/<family>-*.yaml), sorted."""
    return sorted(path.stem for path in RECIPES_DIR.glob(f"{family}-*.yaml"))


def recipe_optimizer(recipe: str) -> str | None:
    """The `optim=` option a recipe selects (its defaults list's `override /optim`), or None."""
    return _default_of(RECIPES_DIR / f"{recipe}.yaml", "override /optim")


def optimizer_class(option: str | None) -> str | None:
    """The `_target_` that an `optim=` option builds, following the file's defaults list to the
    file it extends (muon_gpt.yaml extends muon.yaml); None for no such option."""
    path = OPTIM_DIR / f"{option}.yaml"
    if option is None or not path.is_file():
        return None
    node = OmegaConf.load(path)
    if node.get("_target_"):
        return str(node._target_)
    bases = [entry for entry in node.get("defaults", []) if isinstance(entry, str)]
    return optimizer_class(next((base for base in bases if base != "_self_"), None))


def recipe_with(optimizer: str, family: str) -> str | None:
    """The first of `family`'s recipes whose optimizer is the class `optimizer`, or None."""
    return next(
        (
            name
            for name in recipes_of(family)
            if optimizer_class(recipe_optimizer(name)) == optimizer
        ),
        None,
    )


def optimizer_option(optimizer: str, family: str | None) -> str | None:
    """The `optim=` option that builds the class `optimizer` for `family`: the family's own
    (adamw_gpt, muon_bert) where there is one, else the first by name; None if none does."""
    options = sorted(
        path.stem for path in OPTIM_DIR.glob("*.yaml") if optimizer_class(path.stem) == optimizer
    )
    own = [name for name in options if family and name.endswith(f"_{family}")]
    return (own or options or [None])[0]


def _default_of(path: Path, key: str) -> str | None:
    if not path.is_file():
        return None
    for entry in OmegaConf.load(path).get("defaults", []):
        if isinstance(entry, DictConfig) and key in entry:
            return str(entry[key])
    return None

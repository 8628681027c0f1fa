"""Config keys that nothing takes, values of the wrong kind, and values written back as overrides.

Hydra adds any key given with `+` (`+optim.lrr=1`, which it suggests after the typo
`optim.lrr=1`), and a constructor refuses it only when called, long after the run folder was made.
`check_keys` compares each key of a config node with what the callable it is built with takes,
before anything is built; its errors name the closest accepted key as an override to paste, which
`override_word` / `hydra_value` / `hydra_quote` write in Hydra's override grammar.
"""

from __future__ import annotations

import difflib
import inspect
import re
import shlex
import types
import typing
from collections.abc import Callable, Collection
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.run.errors import ConfigError

# Keys of a config node that Hydra's `instantiate` reads itself: never arguments of the target.
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


# What a run passes to the optimizer and schedule of `conf/optim/`, `conf/schedule/` itself: never
# config keys (the pretraining and fine-tuning checks share these).
OPTIMIZER_ARGUMENTS = ("params",)
SCHEDULE_ARGUMENTS = ("optimizer", "total_steps", "pace")
# What pretraining and fine-tuning pass to Lightning's Trainer besides `trainer.*`.
TRAINER_ARGUMENTS = ("logger", "callbacks", "plugins")


def check_keys(
    key: str,
    node: Any,
    target: Callable[..., Any] | None = None,
    *,
    accepted: Collection[str] | None = None,
    supplied: Collection[str] = (),
    extra: Collection[str] = (),
) -> None:
    """Refuse a key of config node `key` that the callable it is built with does not take.

    Hydra adds any key given with `+` (`+optim.lrr=1`, as it suggests for a typo), and the
    constructor would only refuse it when called, with a TypeError, long after the run folder
    was made. The callable is `target`, else the node's `_target_`; `accepted` lists the keys
    of a node whose settings are read one by one instead. `supplied`: arguments that the code
    passes itself (an optimizer's `params`); `extra`: keys the code takes out of the node before
    the call (`trainer.budget`). A target that takes `**kwargs` accepts any key and is not
    checked. Nested `_target_` nodes (`trainer.strategy`, `data.parts.<name>`) are checked
    too, as `instantiate` builds them.

    Raises:
        ConfigError: naming the unknown key and the closest accepted one as an override to paste
            (`optim.lr=1`), or else every accepted key.
    """
    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=False)
    _check_plain_keys(key, node, target, accepted, supplied, extra)


def _check_plain_keys(
    key: str,
    node: Any,
    target: Callable[..., Any] | None,
    accepted: Collection[str] | None,
    supplied: Collection[str],
    extra: Collection[str],
) -> None:
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_plain_keys(f"{key}[{i}]", item, None, None, (), ())
        return
    if not isinstance(node, dict):
        return
    if target is None and accepted is None and "_target_" in node:
        path = str(node["_target_"])
        try:
            target = get_object(path)
        except Exception as err:  # Hydra raises ImportError or its own error
            raise ConfigError(f"{key}._target_={path} cannot be imported: {err}") from None
    name = node.get("_target_")
    parameters = {}
    if accepted is None and target is not None:
        parameters = _keyword_parameters(target)
        accepted = None if parameters is None else list(parameters)
        name = name or f"{target.__module__}.{target.__qualname__}"
    if accepted is not None:
        takes = [k for k in accepted if k not in supplied] + list(extra)
        for field in node:
            if field not in HYDRA_KEYS and field not in takes:
                raise ConfigError(_unknown_key(key, str(field), node, name, takes, supplied))
    for field, parameter in (parameters or {}).items():
        if field in node:
            _check_number(f"{key}.{field}", node[field], parameter.annotation, name)
    for field, value in node.items():
        if field not in HYDRA_KEYS:
            _check_plain_keys(f"{key}.{field}", value, None, None, (), ())


def _keyword_parameters(target: Callable[..., Any]) -> dict[str, inspect.Parameter] | None:
    """The arguments `target` takes by name, with their annotations where they can be read;
    None when it takes any (`**kwargs`) or its signature cannot be read."""
    try:
        try:
            signature = inspect.signature(target, eval_str=True)
        except Exception:  # an annotation that names what only type checkers import
            signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _check_number(where: str, value: Any, annotation: Any, target: str | None) -> None:
    """A value for an argument annotated as a number (`int`, `float | None`, ...; not one that
    also takes text) must be one: `trainer.max_epochs=abc` would fail deep inside the run."""
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    if any(
        m is str or isinstance(m, str) or typing.get_origin(m) is typing.Literal for m in members
    ):
        return  # text is allowed (or the annotation could not be read)
    numbers = [m for m in members if m in (int, float)]
    if not numbers or isinstance(value, bool) or value is None:
        return
    whole = float not in numbers
    text = isinstance(value, str) and "${" not in value and value != "???"
    if text or (whole and isinstance(value, float)):
        kind = "a whole number" if whole else "a number"
        null = " (or null)" if type(None) in members else ""
        fix = (
            f"; e.g. {where}={int(value)}"
            if isinstance(value, float) and value.is_integer()
            else ""
        )
        raise ConfigError(
            f"{where}={value!r} is not {kind}: {target or where.rsplit('.', 1)[0]} takes "
            f"{kind}{null} there{fix}"
        )


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


# An unknown key's error lists the accepted ones beside the closest when they are this few.
LISTED_KEYS = 12


def _unknown_key(
    key: str,
    field: str,
    node: dict,
    target: str | None,
    takes: list[str],
    supplied: Collection[str],
) -> str:
    where = f"{key}.{field}"
    of = f" of {target}" if target else ""
    remove = f"remove {where} from the command line (or the config file that sets it)"
    if field in supplied:
        to = f" to {target}" if target else ""
        return f"{where} is not a setting: the run passes {field}{to} itself; {remove}"
    close = difflib.get_close_matches(field, takes, n=1, cutoff=0.6)
    if not close:
        return f"{where} is not a setting{of}, which takes {', '.join(takes)}; {remove}"
    fix = override_word(f"{key}.{close[0]}", node[field], add=close[0] not in node)
    listed = f" ({key} takes {', '.join(takes)})" if len(takes) <= LISTED_KEYS else ""
    return f"{where} is not a setting{of}; did you mean: {fix}{listed}"


def override_word(key: str, value: Any, *, add: bool = False) -> str:
    """`key=value` as a Hydra override (`+key=value` with `add`, for a key the config does not
    have), quoted for a shell when it needs it: a fix that works when pasted."""
    return shlex.quote(f"{'+' if add else ''}{key}={hydra_value(value)}")


def hydra_value(value: Any) -> str:
    """A plain config value (scalars, lists, dicts; strings may hold `${...}` interpolations)
    written as Hydra's override grammar reads it back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return f"[{','.join(hydra_value(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return text if _reads_back(text, text) else hydra_quote(text)


def hydra_quote(text: str, quote: str = '"') -> str:
    """`text` as one quoted Hydra string (`"..."` or `'...'`) that reads back as `text` (a
    `${...}` in it stays an interpolation). Inside, a quote is escaped with a backslash, and
    the backslashes before a quote or at the end are doubled; others stay as they are."""
    escaped = re.sub(
        rf"(\\*)({re.escape(quote)}|$)",
        lambda m: m[1] * 2 + ("\\" + quote if m[2] else ""),
        text,
    )
    return f"{quote}{escaped}{quote}"


def _reads_back(value_text: str, expected: Any) -> bool:
    """Whether Hydra reads the override value `value_text` as exactly `expected`."""
    try:
        [parsed] = OverridesParser.create().parse_overrides([f"k={value_text}"])
    except OverrideParseException:
        return False
    return not parsed.is_sweep_override() and parsed.value() == expected


def check_seed(seed: object) -> None:
    """`seed` seeds every random number generator: a whole number."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r} is not a whole number; e.g. seed=1234")


def check_run_name(name: object) -> None:
    """`run_name` must name one folder inside the outputs folder."""
    text = str(name)
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise ConfigError(
            f"run_name={text!r} is not a folder name: it must be one name without '/' (and not "
            "'.' or '..'), as runs are kept under outputs/<model>/<run_name>; e.g. "
            "run_name=wiki-bert (paths.output_root=DIR moves all runs elsewhere)"
        )

"""Command-line plumbing shared by the `@hydra.main` entry points.

- Make overrides: `make pretrain model=gpt trainer.max_steps=50` hands `key=value` words to make as
  variables; make records them, escaped, in MAKEFLAGS, and `entry_point` turns them back into
  Hydra overrides exactly (spaces, globs and quotes intact, no shell in between).
- Free text (`make generate prompt="..."`, `make fill-mask text="..."`): `literal_text_overrides`
  quotes it for Hydra, whose override grammar would read `[`, `,`, `'` and `${` as syntax.
- Sweeps: `make finetune seed=1,2,3` runs as a Hydra multirun (make itself swallows `-m`).
- `override_error`: an override that Hydra's grammar cannot read (a path with `(`, `'` or `é`)
  or a config choice that `conf/` does not have (`model=berty`) ends the command with one line,
  the fix to paste included, before Hydra runs.
- `user_errors`: bad input ends the run with one clear line and exit status 2, not a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import OverrideParseException
from omegaconf.errors import MissingMandatoryValue

from datamodules.corpora.corpus import CorpusError, DataSetupError
from datamodules.tasks.long_text import LongTextError
from datamodules.tasks.spec import TaskDataError
from pipeline.run.config_keys import hydra_quote
from pipeline.run.errors import CheckpointLoadError, ConfigError, NonFiniteLossError
from pipeline.run.folder import remove_unused_run_folder
from pipeline.run.launcher import register_resolvers
from tokenizer import (
    EmptyCorpusError,
    MissingSpecialTokensError,
    TokenizerLoadError,
    UnsupportedTokenizerError,
)

log = logging.getLogger(__name__)

FROM_MAKE_ENV = "LMPIPE_FROM_MAKE"
# Make variables of the Makefile itself, never Hydra overrides.
MAKE_ONLY_VARIABLES = {"ALLOCATOR", "ARGS", "PYTHON", "QUICK", "VENV"}


def parse_makeflags(makeflags: str) -> list[str]:
    """The command-line variable assignments recorded in MAKEFLAGS, in command-line order.

    Make writes them after ` -- `, newest first, escaping spaces and backslashes with a backslash
    and `$` as `$$`.
    """
    head, sep, assignments = makeflags.partition("-- ")
    if not sep or (head and not head.endswith(" ")):
        return []
    words: list[str] = []
    current: list[str] = []
    chars = iter(assignments)
    for char in chars:
        if char == "\\":
            current.append(next(chars, ""))
        elif char == "$":
            next(chars, "")  # make doubles every $
            current.append("$")
        elif char == " ":
            if current:
                words.append("".join(current))
            current = []
        else:
            current.append(char)
    if current:
        words.append("".join(current))
    return list(reversed(words))


def overrides_from_make(makeflags: str) -> list[str]:
    """Hydra overrides from `make <target> key=value ... ARGS="..."`: the variables in command-line
    order (less the Makefile's own), then the words of ARGS."""
    overrides, extra = [], []
    for word in parse_makeflags(makeflags):
        name, _, value = word.partition("=")
        if name == "ARGS":
            try:
                extra = shlex.split(value)
            except ValueError as err:  # an unbalanced quote
                raise ConfigError(
                    f"ARGS={value!r}: {err}; ARGS is split into overrides as a shell splits "
                    "words, so quotes in it come in pairs, e.g. ARGS=\"~logger.csv +x='a b'\""
                ) from None
        elif name not in MAKE_ONLY_VARIABLES:
            overrides.append(word)
    return overrides + extra


def entry_point(
    main: Callable[[], None], literal_keys: tuple[str, ...] = (), amends: tuple[str, ...] = ()
) -> None:
    """Run a `@hydra.main` function, first adding the overrides given to make (when launched by
    the Makefile; the flag is consumed so that re-launched child processes do not add them
    twice), quoting the values of `literal_keys` (free text such as a prompt), and letting
    `<group>.key=value` amend a saved value for each group of `amends` (`amending_overrides`)."""
    register_resolvers()
    if os.environ.pop(FROM_MAKE_ENV, None):
        try:
            sys.argv.extend(overrides_from_make(os.environ.get("MAKEFLAGS", "")))
        except ConfigError as err:
            _refuse(str(err))
    if literal_keys:
        sys.argv[1:] = literal_text_overrides(sys.argv[1:], literal_keys)
    for group in amends:
        sys.argv[1:] = amending_overrides(sys.argv[1:], group)
    error = override_error(sys.argv[1:], command_name())
    if error:
        _refuse(error)
    if is_sweep(sys.argv[1:]) and not {"-m", "--multirun"} & set(sys.argv[1:]):
        # make swallows `-m` (`make finetune -m seed=1,2,3`): a sweep value implies it.
        sys.argv.insert(1, "--multirun")
    main()


def _refuse(error: str) -> None:
    """End a command line that Hydra would refuse (before it makes a run folder): one line."""
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


def command_name() -> str | None:
    """The module run as `python -m` (`pipeline.commands.pretrain`), if any."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None)


def override_error(args: list[str], command: str | None = None) -> str | None:
    """The one-line error for the first override among `args` (a command line) that Hydra's
    grammar cannot read (`data.paths=run (2)/a.txt`) or that chooses a config that is not in
    `conf/` (`model=berty`), else None. Hydra itself would end with several lines (a
    traceback for some): here the line names the override, Hydra's reason, and a quoted form
    that works when pasted, when quoting fixes it. `command`: the module of the command
    (`pipeline.commands.pretrain`), named in the hint."""
    try:
        options, _ = get_args_parser().parse_known_args(args)
    except SystemExit:  # an option Hydra refuses: it says so itself
        return None
    overrides = options.overrides or []
    # configs found elsewhere as well (--config-dir, hydra.searchpath) may hold more choices
    own_configs = not (
        options.config_dir or options.config_path or any("searchpath" in o for o in overrides)
    )
    parser = OverridesParser.create()
    for override in overrides:
        try:
            [parsed] = parser.parse_overrides([override])
        except OverrideParseException as err:
            return unreadable_override(override, err.message, command)
        if own_configs and not parsed.is_delete() and parsed.package is None:
            error = _unknown_choices(override, parsed.key_or_group, parsed.value())
            if error:
                return f"{override}: {error}"
    return None


def unreadable_override(override: str, message: str, command: str | None = None) -> str:
    """The error for an override that Hydra's grammar refused with `message`."""
    lines = [
        line
        for line in message.splitlines()
        if line.strip() and not line.startswith(("See https:", "Error parsing override"))
    ]
    reason = "; ".join(lines)
    lexer = "LexerNoViableAltException: "
    if lines and lines[0].startswith(lexer) and len(lines) > 1 and "^" in lines[1]:
        column = lines[1].index("^") - len(lexer)
        if 0 <= column < len(override):
            reason = f"it cannot read {override[column]!r} at character {column + 1}"
    text = f"Hydra cannot read the override {override!r} ({reason})"
    fix = quoted_override(override)
    if fix is not None:
        where = ""
        if command and command.startswith(COMMANDS_PACKAGE):
            name = command.removeprefix(COMMANDS_PACKAGE)
            where = f" (the same after make {name.replace('_', '-')} or python -m {command})"
        return f"{text}; quote the value: {fix}{where}"
    if "=" not in override and not override.startswith("~"):
        return f"{text}; an override is key=value (or ~key, which removes a key)"
    if override.partition("=")[2].lstrip()[:1] in ("'", '"', "[", "{"):
        return f"{text}; check that its quotes and brackets are balanced"
    return f"{text}; see {OVERRIDE_GRAMMAR}"


COMMANDS_PACKAGE = "pipeline.commands."
OVERRIDE_GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def quoted_override(override: str) -> str | None:
    """`key=value` with the value (each item of a `[...]` list) in Hydra's quotes, as one
    shell word that reads back as the text typed (`'data.paths="run (2)/a.txt"'`); None when
    quoting does not make it readable, or when the value is quoted or bracketed already
    (an unbalanced quote or bracket is no text to quote)."""
    key, sep, value = override.partition("=")
    if not sep or not value.strip() or value.lstrip()[:1] in ("'", '"', "{"):
        return None
    listed = value.startswith("[") and value.endswith("]")
    if value.startswith("[") and not listed:
        return None
    items = [v.strip() for v in value[1:-1].split(",")] if listed else [value.strip()]
    # in Hydra's single quotes (escaped within), the shell's double quotes can hold the word
    quote = "'" if any("'" in v for v in items) else '"'
    quoted = [hydra_quote(v, quote) for v in items]
    word = f"{key}=[{','.join(quoted)}]" if listed else f"{key}={quoted[0]}"
    shell = _shell_word(word)
    try:
        [parsed] = OverridesParser.create().parse_overrides([word])
    except OverrideParseException:
        return None
    expected = items if listed else items[0]
    if shlex.split(shell) != [word] or parsed.value() != expected:
        return None
    return shell


def _shell_word(word: str) -> str:
    """`word` quoted for a POSIX shell: in single quotes where it has none, in double quotes
    where nothing in it is special there (a backslash is, only before `$`, `` ` ``, `"`, `\\`),
    else as `shlex.quote` writes it."""
    if "'" not in word:
        return f"'{word}'"
    if not re.search(r'["$`!]|\\[$`"\\\n]', word):
        return f'"{word}"'
    return shlex.quote(word)


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def config_choices(group: str) -> list[str]:
    """The configs of a config group: the names of `conf/<group>/*.yaml` ([] when `group` is
    not a folder of `conf/`)."""
    folder = CONF_DIR / group
    if not group or not folder.is_dir() or folder.parent != CONF_DIR:
        return []
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def unknown_choice(group: str, name: str, key: str | None = None) -> str | None:
    """The error for `name`, not a config of `group` (`conf/<group>/<name>.yaml`): the
    choices, and the closest (as `key=<closest>` with `key`, the override's key); None when
    `name` is one, or `group` is not a config group."""
    choices = config_choices(group)
    if not choices or name in choices:
        return None
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"; did you mean {f'{key}={close[0]}' if key else close[0]}?" if close else ""
    return (
        f"there is no {group} config {name!r} (conf/{group}/{name}.yaml); the choices are "
        f"{', '.join(choices)}{hint}"
    )


def _unknown_choices(override: str, group: str, value: Any) -> str | None:
    """`unknown_choice` for each config a group override chooses (one, a list, or a sweep)."""
    if isinstance(value, str):
        return unknown_choice(group, value, override.partition("=")[0])
    names = value.list if isinstance(value, ChoiceSweep) else value
    for name in names if isinstance(names, list) else []:
        error = unknown_choice(group, name) if isinstance(name, str) else None
        if error:
            return error
    return None


def make_command(target: str, overrides: list[str]) -> str:
    """`make <target> ...` that a shell runs as these overrides: `key=value` words as make
    variables, the rest (`~key` removals) in ARGS; quoted for pasting."""
    variables = [o for o in overrides if "=" in o and not o.startswith("~")]
    rest = [o for o in overrides if o not in variables]
    # ARGS is split by `shlex.split` (overrides_from_make): quote only the words it would cut
    args = " ".join(w if w.split() == [w] and "'" not in w else shlex.quote(w) for w in rest)
    words = ["make", target, *variables, *([f"ARGS={args}"] if rest else [])]
    return shlex.join(words)


def amending_overrides(args: list[str], group: str) -> list[str]:
    """`group.key=value` overrides as `+group.key=value` when no `group=<name>` is chosen.

    `make predict ckpt=RUN task.data_dir=DIR` amends the task the model was fine-tuned on (read
    from its checkpoint), but that config has no `task` node for Hydra to override, and Hydra
    refuses the key unless it is added with `+`: the same override then works in `make
    finetune task=sst2 task.data_dir=DIR` and here, as error hints print it.
    """
    if any(a.partition("=")[0].lstrip("+") == group for a in args):
        return args
    prefix = f"{group}."
    return [f"+{a}" if a.startswith(prefix) and "=" in a else a for a in args]


def is_sweep(args: list[str]) -> bool:
    """Whether any Hydra override in `args` sweeps over values (`seed=1,2,3`, `range(3)`)."""
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # let Hydra itself report a malformed override
        return False
    return any(o.is_sweep_override() for o in parsed)


def literal_text_overrides(args: list[str], keys: tuple[str, ...]) -> list[str]:
    """Command-line overrides with the values of `keys` turned into quoted Hydra strings.

    `make fill-mask text="The capital of France is [MASK]."` reaches Hydra as
    `text=The capital of France is [MASK].`, which its override grammar rejects (`[` opens a
    list; `,` makes a sweep, `'` a quote, `${` an interpolation). A prompt is text, never Hydra
    syntax, so it is quoted here, exactly; a value the user already quoted is left alone.
    """
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in keys and not _is_quoted(arg):
            arg = f"{key}={_hydra_quote(value)}"
        out.append(arg)
    return out


def _is_quoted(override: str) -> bool:
    value = override.partition("=")[2]
    if len(value) < 2 or value[0] != value[-1] or value[0] not in "'\"":
        return False
    try:
        return isinstance(OverridesParser.create().parse_override(override).value(), str)
    except Exception:  # not one quoted string after all, e.g. 'a' and 'b'
        return False


def _hydra_quote(text: str) -> str:
    """A single-quoted Hydra override value that reads back as exactly `text`.

    Two layers: OmegaConf reads `${` as an interpolation unless escaped (`\\${`, with the
    backslashes before it doubled); then Hydra's quoted string needs `\\'` for a quote and
    doubled backslashes where they precede a quote or end the string.
    """
    text = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)
    return hydra_quote(text, "'")


USER_ERRORS = (
    CheckpointLoadError,
    DataSetupError,
    ConfigError,
    CorpusError,
    EmptyCorpusError,
    LongTextError,
    MissingSpecialTokensError,
    TokenizerLoadError,
    UnsupportedTokenizerError,
    MissingMandatoryValue,
    NonFiniteLossError,
    TaskDataError,
)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn errors caused by the user's input into one line on stderr and exit status 2."""
    try:
        yield
    except USER_ERRORS as err:
        if os.environ.get("LMPIPE_DEBUG"):
            raise
        message = str(err)
        if isinstance(err, MissingMandatoryValue):  # OmegaConf's message spans lines
            message = f"{err.full_key} is not set; give it on the command line: {err.full_key}=..."
        print(f"error: {message}", file=sys.stderr)
        print("(set LMPIPE_DEBUG=1 to see the traceback)", file=sys.stderr)
        remove_unused_run_folder()
        sys.exit(2)

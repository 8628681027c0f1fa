"""Every `make <target> ...` command written in README.md and docs/, composed as the target
would compose it (no training), so that a renamed key, a removed option or a stale preset in the
documentation fails the tests with the file and line of the command.

The rules follow the Makefile and the CLI (pipeline/run/cli.py):

- a target that runs `$(RUN) pipeline.commands.<name>` composes the Hydra config named by
  `config_name=` in pipeline/commands/<name>.py; any other target (`make test`, `make bench`,
  `make docs`, `make report`) is only checked to exist in the Makefile;
- `NAME=value` words go to Hydra except the Makefile's own variables (ARGS, QUICK, ...); the
  words of `ARGS="..."` are split as a shell splits them and added after the others;
- `-m` is dropped (make swallows it; a comma-separated value makes the sweep), and a sweep is
  composed for its first value;
- the values of the command's `literal_keys` (`prompt=`, `text=`) are free text, quoted for
  Hydra as the CLI quotes them; for the command's `amends` groups (`task`), `task.key=value`
  amends the saved task when no `task=` is given, i.e. `+task.key=value`;
- `<name>` in a value is a placeholder (`ckpt=outputs/finetune/sst2/<run>`): composed as `name`.

`python -m pipeline.commands.<name> ...` lines in code blocks (torchrun, srun) are checked the
same way.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from pipeline.run.cli import MAKE_ONLY_VARIABLES  # the Makefile's own variables, never overrides

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
COMMANDS = REPO / "pipeline" / "commands"
MAKEFILE = REPO / "Makefile"
# Where a shell command ends.
SHELL_ENDS = {";", "&&", "||", "|", ">", ">>", "&"}


@dataclass(frozen=True)
class Command:
    """One documented command: where it is written and its text (continuations joined)."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        try:
            name = self.path.relative_to(REPO)
        except ValueError:
            name = self.path
        return f"{name}:{self.line}"


def documentation_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


FENCE = re.compile(r"^\s*(```|~~~)")
# `make` as a command word: at the start of a shell line or after a separator (`;`, `&&`, `|`,
# `$(`), after any environment assignments (`WANDB_MODE=disabled make pretrain`).
MAKE = re.compile(r"(?:^|[;&|]|\$\()\s*(?:[A-Za-z_]\w*=\S*\s+)*(make\s+[A-Za-z])")
PYTHON_MODULE = re.compile(r"-m\s+pipeline\.commands\.[a-z_]+")
# A shell comment: `#` at the start of a word.
COMMENT = re.compile(r"(?:^|\s)#.*$")
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n(?!\s*\n)[^`\n]+)*)`(?!`)")


def extract_commands(path: Path) -> list[Command]:
    """The `make ...` commands of a Markdown file: each line of a fenced code block (joined
    over trailing backslashes) that runs make or `-m pipeline.commands.<name>`, and each inline
    code span that starts with `make `."""
    lines = path.read_text(encoding="utf-8").splitlines()
    commands: list[Command] = []
    prose = list(lines)  # code blocks blanked, so that inline spans keep their line numbers
    in_block = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, start=1):
        if FENCE.match(line):
            in_block = not in_block
            prose[number - 1] = ""
            continue
        if not in_block:
            continue
        prose[number - 1] = ""
        start, text = pending if pending else (number, "")
        text += line.rstrip()
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        pending = None
        for found in _commands_in_shell_line(text):
            commands.append(Command(path, start, found))
    text = "\n".join(prose)
    for match in INLINE.finditer(text):
        span = " ".join(match.group(1).split())
        if span.startswith("make ") and len(span.split()) > 1:
            commands.append(Command(path, text.count("\n", 0, match.start()) + 1, span))
    return commands


def _commands_in_shell_line(text: str) -> list[str]:
    text = COMMENT.sub("", text)
    found = [text[m.start(1) :] for m in MAKE.finditer(text)]
    found += [text[m.start() :] for m in PYTHON_MODULE.finditer(text)]
    return found


def documented_commands() -> list[Command]:
    return [c for path in documentation_files() for c in extract_commands(path)]


def make_targets() -> dict[str, str | None]:
    """Each Makefile target and the `pipeline.commands.<name>` module its recipe runs (None
    when it runs none through $(RUN))."""
    targets: dict[str, str | None] = {}
    current = None
    for line in MAKEFILE.read_text().splitlines():
        rule = re.match(r"^([A-Za-z][\w-]*)\s*:(?!=)", line)
        if rule:
            current = rule.group(1)
            targets.setdefault(current, None)
            continue
        run = re.search(r"\$\(RUN\)\s+(pipeline\.commands\.\w+)", line)
        if run and current and line.startswith("\t"):
            targets[current] = run.group(1)
    return targets


@dataclass(frozen=True)
class EntryPoint:
    config_name: str
    literal_keys: tuple[str, ...]
    amends: tuple[str, ...]


def entry_point(module: str) -> EntryPoint:
    """What `pipeline/commands/<name>.py` composes: its `config_name=` and the `literal_keys=`
    and `amends=` it hands to `entry_point`."""
    source = (COMMANDS / f"{module.rsplit('.', 1)[-1]}.py").read_text()
    config = re.search(r"config_name=\"([\w-]+)\"", source.split("@hydra.main", 1)[-1])
    if config is None:
        raise AssertionError(f"{module}: no @hydra.main(config_name=...) found")

    def names(keyword: str) -> tuple[str, ...]:
        found = re.search(rf"{keyword}=\(([^)]*)\)", source)
        return tuple(re.findall(r"[\"']([\w.]+)[\"']", found.group(1))) if found else ()

    return EntryPoint(config.group(1), names("literal_keys"), names("amends"))


def _hydra_quote(text: str) -> str:
    """A single-quoted Hydra string that reads back as `text` (pipeline/run/cli.py's quoting)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_quoted(value: str) -> bool:
    return len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""


def _first_of_sweep(override: str) -> str:
    parser = OverridesParser.create()
    parsed = parser.parse_override(override)
    if not parsed.is_sweep_override():
        return override
    key = override.split("=", 1)[0]
    return f"{key}={next(iter(parsed.sweep_string_iterator()))}"


def hydra_overrides(words: list[str], entry: EntryPoint) -> list[str]:
    """The Hydra overrides that `words` (after the target, shell-split) become."""
    overrides: list[str] = []
    extra: list[str] = []
    for word in words:
        if word in ("-m", "--multirun"):
            continue
        name, sep, value = word.partition("=")
        if sep and name == "ARGS":
            extra = shlex.split(value)
        elif sep and name in MAKE_ONLY_VARIABLES:
            continue
        else:
            overrides.append(word)
    result = []
    given = {o.partition("=")[0].lstrip("+~") for o in overrides + extra}
    for override in overrides + extra:
        override = re.sub(r"<([^<>\s]+)>", r"\1", override)
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+") in entry.literal_keys and not _is_quoted(value):
            override = f"{key}={_hydra_quote(value)}"
        for group in entry.amends:
            if key.startswith(f"{group}.") and sep and group not in given:
                override = f"+{override}"
        result.append(_first_of_sweep(override))
    return result


def split_command(text: str) -> list[str]:
    """The words of a shell command line up to where the command ends (comments dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = []
    for word in lexer:
        if word in SHELL_ENDS or set(word) <= set(";&|"):
            break
        words.append(word)
    return words


def check_command(command: Command) -> str | None:
    """None when the command's target exists and its overrides compose; else the error, with
    the file, line and command."""
    try:
        words = split_command(command.text)
    except ValueError as err:  # unbalanced quotes
        return f"{command.where()}: {command.text}\n  cannot split it as a shell would: {err}"
    targets = make_targets()
    if words[0] == "make":
        rest = words[1:]
        target = rest.pop(0)
        plain = [w for w in rest if re.fullmatch(r"[A-Za-z][\w-]*", w)]  # more targets
        for name in [target, *plain]:
            if name not in targets:
                return f"{command.where()}: {command.text}\n  there is no make target {name!r}"
        module = targets[target]
        if module is None:
            return None  # not a Hydra command: only its existence is checked
        rest = [w for w in rest if w not in plain]
    else:  # `-m pipeline.commands.<name> ...`
        module, rest = words[1], words[2:]
        if not (COMMANDS / f"{module.rsplit('.', 1)[-1]}.py").is_file():
            return f"{command.where()}: {command.text}\n  there is no module {module}"
        if "@hydra.main" not in (COMMANDS / f"{module.rsplit('.', 1)[-1]}.py").read_text():
            return None
    entry = entry_point(module)
    try:
        overrides = hydra_overrides(rest, entry)
    except Exception as err:  # the override grammar (a sweep's first value)
        reason = " ".join(str(err).split())
        return (
            f"{command.where()}: {command.text}\n  composing {entry.config_name} with "
            f"{rest} fails: {reason}"
        )
    reason = composition_error(entry.config_name, tuple(overrides))
    if reason is not None:
        return (
            f"{command.where()}: {command.text}\n  composing {entry.config_name} with "
            f"{overrides} fails: {reason}"
        )
    return None


@functools.cache
def composition_error(config_name: str, overrides: tuple[str, ...]) -> str | None:
    """Hydra's refusal to compose `config_name` with `overrides` (None: it composes). Composed
    once per distinct command: many pages write the same one (`make glue ckpt=<run>`), and
    conf/ does not change while the tests run."""
    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            compose(config_name=config_name, overrides=list(overrides))
    except Exception as err:  # any refusal by Hydra: the key, the option, the grammar
        return " ".join(str(err).split())
    return None

"""Every `make <target> key=value ...` written in README.md and docs/ composes its config the
way the target would (tests/docs/commands.py says how), so a renamed key, a removed option or a
stale preset name in the documentation fails here with the file and line of the command."""

from __future__ import annotations

import shutil

import pytest

from tests.docs.commands import (
    REPO,
    Command,
    check_command,
    documentation_files,
    documented_commands,
    extract_commands,
    make_targets,
)

COMMANDS = documented_commands()


def test_commands_are_found():
    """The extraction finds the commands of every kind of page (a broken regex would make the
    parametrized test below pass vacuously)."""
    files = {c.path.relative_to(REPO).as_posix() for c in COMMANDS}
    assert {"README.md", "docs/index.md", "docs/finetuning.md", "docs/quality.md"} <= files
    assert len(COMMANDS) > 50
    targets = {c.text.split()[1] for c in COMMANDS if c.text.startswith("make ")}
    assert {"pretrain", "finetune", "glue", "generate", "fill-mask", "predict"} <= targets


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where()}" for c in COMMANDS])
def test_documented_command_composes(command: Command):
    error = check_command(command)
    assert error is None, error


def test_every_doc_file_is_read():
    names = {p.relative_to(REPO).as_posix() for p in documentation_files()}
    assert "README.md" in names and "docs/configuration.md" in names


def test_make_targets_map_to_commands():
    targets = make_targets()
    assert targets["pretrain"] == "pipeline.commands.pretrain"
    assert targets["fill-mask"] == "pipeline.commands.fill_mask"
    assert targets["test"] is None and targets["docs"] is None


def _page_with(tmp_path, text: str):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return extract_commands(page)


def test_planted_bad_key_fails_naming_file_line_and_key(tmp_path):
    """A copy of a real page with one documented key renamed fails, naming where and what."""
    source = REPO / "docs" / "pretraining.md"
    copy = tmp_path / "pretraining.md"
    shutil.copy(source, copy)
    text = copy.read_text(encoding="utf-8")
    good = "make pretrain model=gpt trainer.budget=10m trainer.max_steps=100000"
    assert good in text
    copy.write_text(
        text.replace(good, "make pretrain model=gpt trainer.budgett=10m trainer.max_steps=100000")
    )
    line = next(n for n, t in enumerate(copy.read_text().splitlines(), start=1) if "budgett" in t)
    errors = [e for e in map(check_command, extract_commands(copy)) if e]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{copy}:{line}: make pretrain model=gpt trainer.budgett=10m")
    assert "budgett" in errors[0]
    # the untouched copy passes
    shutil.copy(source, copy)
    assert not [e for e in map(check_command, extract_commands(copy)) if e]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("```bash\nmake pretrain model=berty\n```\n", "model/berty"),
        ("Run `make finetune task=sst2 head.poolin=mean` then.\n", "head.poolin"),
        ("```bash\nmake glue ckpt=x \\\n  suite=fast\n```\n", "suite/fast"),
        ("```bash\nmake pretrian model=gpt\n```\n", "no make target 'pretrian'"),
        ('```bash\nmake pretrain ARGS="~logger.cvs"\n```\n', "logger.cvs"),
        ('```bash\nmake finetune task=custom ARGS="~task.files.dev"\n```\n', "task.files.dev"),
    ],
)
def test_bad_commands_fail(tmp_path, text, needle):
    [command] = _page_with(tmp_path, text)
    error = check_command(command)
    assert error is not None and needle in error, error


@pytest.mark.parametrize(
    "text",
    [
        # make swallows -m; a sweep composes for its first value
        "```bash\nmake finetune task=rte ckpt=x -m optim.lr=2e-5,3e-5 seed=1,2,3\n```\n",
        # free text with brackets and quotes, as the CLI quotes it
        "```bash\nmake fill-mask ckpt=x text=\"It's [MASK], isn't it?\"\n```\n",
        # a task key amends the saved task (pipeline/run/cli.py amending_overrides)
        "```bash\nmake predict ckpt=<run> task.data_dir=DIR\n```\n",
        # an environment prefix, a comment, a shell pipe after the command
        "```bash\nWANDB_MODE=disabled make pretrain logger=csv  # no wandb\n```\n",
        # targets without a Hydra config only need to exist
        "```bash\nmake bench QUICK=1\nmake docs\nmake lint format\n```\n",
        # torchrun and srun lines run the module directly
        "```bash\nsrun .venv/bin/python -m pipeline.commands.pretrain trainer=ddp resume=auto\n```\n",
    ],
)
def test_valid_forms_pass(tmp_path, text):
    commands = _page_with(tmp_path, text)
    assert commands
    assert [check_command(c) for c in commands] == [None] * len(commands)


def test_error_output_in_a_code_block_is_not_a_command(tmp_path):
    text = "```\nerror: outputs/gpt/wiki is in use by pid 1 on n (make pretrain, since t)\n```\n"
    assert _page_with(tmp_path, text) == []

"""The command line as users meet it: make overrides, error messages, run folders."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from tokenizers import Tokenizer

from pipeline.run.cli import make_command, override_error, overrides_from_make, parse_makeflags
from pipeline.run.errors import ConfigError
from tests.conftest import REPO, compose_pretrain, run_command

TRICKY_ARGS = [
    "model=gpt",
    "trainer.max_steps=50",
    "data.paths=corpus/*.txt",
    "prompt=The capital of  France",
    'quote=it\'s "so"',
    "money=$HOME\\n",
    "+extra=[1,2]",
    "QUICK=1",
    "ALLOCATOR=system",
    "ARGS=~logger.csv +x='a b'",
]


def run_python(module: str, *args: str, env: dict | None = None, cwd: Path = REPO):
    """`python -m module *args` with this environment and `env` added (`run_command`)."""
    return run_command(module, *args, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def test_overrides_survive_real_make(tmp_path):
    (tmp_path / "Makefile").write_text("show:\n\t@printf '%s' \"$$MAKEFLAGS\" > flags.txt\n")
    subprocess.run(["make", "-s", "show", *TRICKY_ARGS], cwd=tmp_path, check=True)
    makeflags = (tmp_path / "flags.txt").read_text()
    assert parse_makeflags(makeflags) == TRICKY_ARGS
    assert overrides_from_make(makeflags) == [*TRICKY_ARGS[:7], "~logger.csv", "+x=a b"]


def make_repo(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`make` in the repository (or `cwd`), free of the make settings this test run may have
    inherited (e.g. `make test ALLOCATOR=system`)."""
    inherited = ("ALLOCATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    clean = {k: v for k, v in os.environ.items() if k not in inherited}
    return subprocess.run(
        ["make", *args], cwd=cwd, capture_output=True, text=True, env={**clean, **(env or {})}
    )


def test_setup_reinstalls_when_the_install_inputs_change_by_content_not_mtime(tmp_path):
    """A fresh clone (git sets every mtime) or a `touch` keeps .venv; an edit to the lock file
    or to pyproject.toml (read by `pip install -e .`) reinstalls."""
    (tmp_path / "Makefile").write_text((REPO / "Makefile").read_text())
    lock, pyproject = tmp_path / "requirements.lock", tmp_path / "pyproject.toml"
    lock.write_text("numpy==2.0.0\n")
    pyproject.write_text('[project]\nname = "x"\n')

    def installs() -> bool:
        result = make_repo("-n", "setup", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        return "pip install" in result.stdout

    def settle() -> None:  # what a finished install leaves: the stamp of the current inputs
        stamp = make_repo("-s", "--eval=show-stamp: ; @echo $(STAMP)", "show-stamp", cwd=tmp_path)
        (tmp_path / stamp.stdout.strip()).parent.mkdir(exist_ok=True)
        (tmp_path / stamp.stdout.strip()).touch()

    assert installs()
    settle()
    assert not installs()
    later = time.time() + 3600
    for path in (lock, pyproject):
        os.utime(path, (later, later))  # newer than the stamp, content unchanged
    assert not installs()
    lock.write_text("numpy==2.0.1\n")
    assert installs()
    settle()
    pyproject.write_text('[project]\nname = "x"\nversion = "2"\n')
    assert installs()


def test_runs_preload_tcmalloc_when_installed_unless_allocator_system(tmp_path):
    """`make pretrain` (and the benchmarks) run under tcmalloc when the library is installed;
    ALLOCATOR=system runs glibc's malloc and is not handed to Hydra."""

    def make(*args: str) -> str:
        result = make_repo(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout

    found = make("-s", "--eval=show-tcmalloc: ; @echo $(TCMALLOC)", "show-tcmalloc").strip()
    assert not found or (Path(found).is_file() and "libtcmalloc" in found)
    for target in ("pretrain", "finetune", "prepare", "bench", "bench-models"):
        assert ("LD_PRELOAD=" in make("-n", target)) == bool(found)
        assert not found or f"LD_PRELOAD={found} " in make("-n", target)
        assert "LD_PRELOAD" not in make("-n", target, "ALLOCATOR=system")


def test_an_unknown_or_missing_allocator_stops_make_with_the_fix():
    make = make_repo
    unknown = make("-n", "pretrain", "ALLOCATOR=jemalloc")
    assert unknown.returncode != 0
    assert "ALLOCATOR=jemalloc is not known" in unknown.stderr
    assert "ALLOCATOR=system" in unknown.stderr
    # tcmalloc named on the command line or in the environment, but not installed (TCMALLOC=
    # stands for a machine without it): an error naming the package; by default, glibc's malloc.
    for named in (
        make("-n", "pretrain", "ALLOCATOR=tcmalloc", "TCMALLOC="),
        make("-n", "pretrain", "TCMALLOC=", env={"ALLOCATOR": "tcmalloc"}),
    ):
        assert named.returncode != 0
        assert "libtcmalloc-minimal4" in named.stderr and "ALLOCATOR=system" in named.stderr
    default = make("-n", "pretrain", "TCMALLOC=")
    assert default.returncode == 0 and "LD_PRELOAD" not in default.stdout
    # Only the jobs that run under the allocator stop; help, setup and test do not.
    assert make("help", "ALLOCATOR=jemalloc").returncode == 0
    assert make("-n", "test", "ALLOCATOR=tcmalloc", "TCMALLOC=").returncode == 0
    several = make("-n", "pretrain", "ALLOCATOR=tcmalloc system")
    assert several.returncode != 0 and "is not known" in several.stderr


def test_makeflags_without_variables():
    assert parse_makeflags("") == []
    assert parse_makeflags("s -j2") == []


def test_make_help_lists_every_target():
    out = subprocess.run(["make", "help"], cwd=REPO, capture_output=True, text=True).stdout
    for target in (
        "help",
        "setup",
        "pretrain",
        "prepare",
        "generate",
        "fill-mask",
        "tokenizer",
        "test",
        "test-all",
        "lint",
        "format",
        "clean",
    ):
        assert f"  {target} " in out


def test_tokenizer_command_with_make_overrides(tmp_path):
    env = {
        "LMPIPE_FROM_MAKE": "1",
        "MAKEFLAGS": (
            f" -- tokenizer.vocab_size=3000 paths.cache_dir={tmp_path}/cache "
            f"paths.output_root={tmp_path}/out model=gpt"
        ),
    }
    result = run_python("pipeline.commands.tokenizer", env=env)
    assert result.returncode == 0, result.stderr
    assert "tokenizer   bpe, vocabulary" in result.stdout
    assert "round trip  exact" in result.stdout
    assert "MB/s" in result.stdout
    file = result.stdout.split("file        ")[1].splitlines()[0]
    assert Tokenizer.from_file(file).get_vocab_size() == 3000
    assert not (tmp_path / "out").exists()  # the cache only: no run folder
    again = run_python("pipeline.commands.tokenizer", env=env)
    assert "reused from cache" in again.stdout


@pytest.mark.parametrize("module", ["pipeline.commands.prepare", "pipeline.commands.tokenizer"])
def test_cache_commands_leave_no_run_folder(tmp_path, module):
    result = run_python(
        module,
        "tokenizer.vocab_size=1000",
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_prepare_for_a_streamed_run_caches_the_tokenizer_and_builds_no_store(tmp_path):
    result = run_python(
        "pipeline.commands.prepare",
        "tokenizer.vocab_size=1000",
        "datamodule.streaming=true",
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "token store  none: datamodule.streaming=true" in result.stdout
    tokenizer = result.stdout.split("tokenizer    ")[1].splitlines()[0]
    assert Tokenizer.from_file(tokenizer).get_vocab_size() == 1000
    assert not (tmp_path / "cache" / "token_stores").exists()


def test_bad_value_fails_fast_with_one_line(tmp_path):
    result = run_python(
        "pipeline.commands.pretrain",
        "optim.lr=-0.001",
        f"paths.cache_dir={tmp_path}/c",
        f"paths.output_root={tmp_path}/out",
    )
    assert result.returncode == 2
    assert "error: optim.lr=-0.001: give a learning rate > 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "c").exists()  # nothing was trained or cached


def test_unknown_model_fails_with_the_choices(tmp_path):
    result = run_python(
        "pipeline.commands.pretrain", "model=berty", f"paths.output_root={tmp_path}"
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: model=berty: there is no model config 'berty' (conf/model/berty.yaml); the "
        "choices are bert, bert-base, bert-large, bert-tiny, gpt, gpt-124m, gpt-1b, gpt-tiny; "
        "did you mean model=bert?"
    ]
    assert not any(tmp_path.iterdir())


# A typo that Hydra accepts when added with `+`, as its own message suggests, given to each
# command whose optimizer is built from conf/optim/ (finetune and glue fail before reading ckpt).
TYPO_COMMANDS = {
    "pretrain": ["model=bert-tiny", "recipe=bert-reference"],  # AdamW, as fine-tuning's
    "finetune": ["ckpt=never-read"],
    "glue": ["ckpt=never-read"],
}


@pytest.mark.parametrize("command", sorted(TYPO_COMMANDS))
def test_an_unknown_key_is_one_line_and_leaves_no_run_folder(tmp_path, command):
    result = run_python(
        f"pipeline.commands.{command}",
        *TYPO_COMMANDS[command],
        "+optim.lrr=1",
        "logger=csv",
        "run_name=typo",
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        env={"WANDB_MODE": "disabled"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: optim.lrr is not a setting of torch.optim.AdamW; did you mean: optim.lr=1 "
        "(optim takes lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, "
        "differentiable, fused)"
    ]
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("typo")), "the run folder was left behind"
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert not (tmp_path / "out").exists(), "the folders made for the run were left behind"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "data.paths=corpus (2)/*.txt",
            "Hydra cannot read the override 'data.paths=corpus (2)/*.txt' (mismatched input '/' "
            "expecting <EOF>); quote the value: 'data.paths=\"corpus (2)/*.txt\"' (the same "
            "after make pretrain or python -m pipeline.commands.pretrain)",
        ),
        (
            "data.paths=[a (1).txt,b.txt]",
            'quote the value: \'data.paths=["a (1).txt","b.txt"]\'',
        ),
        (
            "data.paths=l'été/a.txt",
            '(it cannot read "\'" at character 13); quote the value: '
            "\"data.paths='l\\'été/a.txt'\"",
        ),
        ("data.paths=[a.txt", "check that its quotes and brackets are balanced"),
        ("data.paths='a b.txt", "check that its quotes and brackets are balanced"),
        ("data.paths", "an override is key=value"),
        ("logger=[csv,wanb]", "there is no logger config 'wanb' (conf/logger/wanb.yaml); the "),
        ("+experiment=bert-mini-budgt", "did you mean +experiment=bert-mini-budget?"),
    ],
)
def test_overrides_hydra_would_refuse_are_one_line_with_the_fix(override, expected):
    error = override_error(["--multirun", override], "pipeline.commands.pretrain")
    assert error is not None and expected in error and "\n" not in error
    assert override_error(["model=gpt", "data.paths=my corpus/*.txt", "seed=1,2"]) is None


def test_an_unbalanced_quote_in_args_is_one_line_from_make(tmp_path):
    result = make_repo(
        "-s", "tokenizer", "ALLOCATOR=system", "ARGS=+x='a b", f"paths.output_root={tmp_path}"
    )
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == (
        'error: ARGS="+x=\'a b": No closing quotation; ARGS is split into overrides as a '
        "shell splits words, so quotes in it come in pairs, e.g. ARGS=\"~logger.csv +x='a b'\""
    )
    with pytest.raises(ConfigError, match="No closing quotation"):
        overrides_from_make(" -- ARGS=+x='a\\ b")


def test_a_quoted_path_from_the_error_works_after_make_and_python(tmp_path, small_docs):
    """A data path with characters Hydra reads as syntax: the one-line error's quoted form,
    pasted into a shell after `make tokenizer` and after `python -m ...`, reads the file."""
    corpus = tmp_path / "my corpus (2)" / "a.txt"
    corpus.parent.mkdir()
    corpus.write_text("\n\n".join(small_docs))
    settings = [
        "tokenizer.vocab_size=1000",
        f"paths.cache_dir={tmp_path}/cache",
        f"paths.output_root={tmp_path}/out",
        "data=text_files",
    ]
    refused = run_python("pipeline.commands.tokenizer", *settings, f"data.paths={corpus}")
    assert refused.returncode == 2
    [error] = refused.stderr.splitlines()
    hint = re.search(
        r"quote the value: (.+) \(the same after make tokenizer or python -m "
        r"pipeline\.commands\.tokenizer\)$",
        error,
    )
    assert error.startswith("error: Hydra cannot read the override") and hint, error
    words = " ".join(shlex.quote(s) for s in settings)
    inherited = ("ALLOCATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    for command in (
        f"{sys.executable} -m pipeline.commands.tokenizer {words} {hint[1]}",
        f"make -s tokenizer ALLOCATOR=system {words} {hint[1]}",
    ):
        pasted = subprocess.run(
            ["sh", "-c", command],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert pasted.returncode == 0, (command, pasted.stderr[-3000:])
        assert "corpus      1 text file(s)" in pasted.stdout


def run_dir_of_process(monkeypatch, env: dict[str, str]) -> str:
    """The run folder a process of `make pretrain` started with `env` would write to, as Hydra
    resolves it there (the run stamp is read from the environment alone)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose_pretrain(hydra_node=True)
    HydraConfig.instance().set_config(cfg)
    try:
        return cfg.hydra.run.dir
    finally:
        HydraConfig.instance().cfg = None  # as a process that has not started a run


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_ranks_of_one_run_share_one_folder(monkeypatch, launcher):
    env = {"LMPIPE_RUN_STAMP": "", "TORCHELASTIC_RUN_ID": "none"}
    env.update(
        {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc123"}
        if launcher == "torchrun"
        else {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}
    )
    folders = [run_dir_of_process(monkeypatch, {**env, "RANK": str(rank)}) for rank in range(2)]
    name = "torchrun-abc123" if launcher == "torchrun" else "slurm-77.3"
    assert folders == [f"outputs/bert/{name}"] * 2


def test_single_process_runs_get_a_time_stamped_folder(monkeypatch):
    folder = Path(run_dir_of_process(monkeypatch, {"LMPIPE_RUN_STAMP": ""}))
    assert folder.parent == Path("outputs/bert")
    assert folder.name[:2] == "20" and len(folder.name) == len("2026-01-01_12-00-00")


def test_make_passes_sigterm_on_to_the_run(tmp_path):
    """`kill <make>` (SLURM, Kubernetes) must reach the training process, which then saves a
    checkpoint; make forwards SIGTERM to its job, so the job must be the run itself (`exec`),
    not a shell around it. A stand-in for Python records the signal it gets."""
    (tmp_path / "Makefile").write_text((REPO / "Makefile").read_text())
    fake = tmp_path / "py"
    fake.write_text(
        "#!/bin/sh\ntrap 'echo TERM > got; exit 143' TERM\ntouch started\n"
        "while true; do sleep 0.05; done\n"
    )
    fake.chmod(0o755)
    inherited = ("ALLOCATOR", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    make = subprocess.Popen(
        ["make", "-s", "pretrain", "PY=./py", "STAMP=", "ALLOCATOR=system"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in inherited},
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "started").exists():
        assert make.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    make.terminate()
    assert make.wait(timeout=30) != 0
    deadline = time.monotonic() + 10
    while not (tmp_path / "got").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "got").read_text().strip() == "TERM"


def test_printed_make_commands_paste_back_as_the_same_overrides(tmp_path):
    """`~key` removals go in ARGS (make would take them for targets); values are quoted."""
    overrides = ["model=gpt", "~logger.csv", "prompt=a b", "run_name=x"]
    command = make_command("pretrain", overrides)
    assert command == "make pretrain model=gpt 'prompt=a b' run_name=x 'ARGS=~logger.csv'"
    (tmp_path / "Makefile").write_text("pretrain:\n\t@printf '%s' \"$$MAKEFLAGS\" > flags.txt\n")
    inherited = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    subprocess.run(
        ["sh", "-c", command.replace("make ", "make -s ", 1)], cwd=tmp_path, env=env, check=True
    )
    pasted = overrides_from_make((tmp_path / "flags.txt").read_text())
    assert sorted(pasted) == sorted(overrides)

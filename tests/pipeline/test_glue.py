"""`make glue` (pipeline/suites/glue.py, pipeline/suites/summary.py): a tiny pretrained model and its
from-scratch twin fine-tuned on slices of real GLUE tasks over two seeds, the summary table,
resuming a suite that was cut short, and the report of a suite folder."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from models.hf import export_hf
from pipeline.finetune import run as finetuning
from pipeline.finetune.results import FinetuneResults
from pipeline.report import write_report
from pipeline.run.errors import ConfigError, FineTuneCrashError
from pipeline.suites import runners
from pipeline.suites.glue import Job, SuiteTask, job_config, plan, run_suite, seeds_of, suite_tasks
from pipeline.suites.runners import check_jobs
from pipeline.suites.summary import BASELINES, summarize_suite, task_score
from tests.conftest import CLI_ENV, CONF, SHARED_DATA
from tests.pipeline.test_finetune import compose_config
from tests.pipeline.test_generate import run_cli
from tests.pipeline.tiny_models import write_run

GLUE = SHARED_DATA / "glue"
needs_glue = pytest.mark.skipif(not GLUE.is_dir(), reason=f"GLUE data not found at {GLUE}")
SMALL = ("datamodule.max_examples=48", "datamodule.batch_size=16", "trainer.max_epochs=1")


def load_task(name: str):
    """conf/task/<name>.yaml as the command composes it."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("glue", overrides=[f"task={name}"]).task


# --- the plan (no training) ---------------------------------------------------------------


def test_seeds_are_a_count_or_a_list():
    assert seeds_of(3) == [1, 2, 3]
    assert seeds_of(OmegaConf.create([7, 2])) == [7, 2]
    for bad in (0, [1, 1], "3", [1.5], True):
        with pytest.raises(ConfigError, match="seeds="):
            seeds_of(bad)


def test_tasks_come_from_the_suite_or_the_command_line():
    cfg = compose_config("glue")
    quick = suite_tasks(cfg)
    assert [t.name for t in quick] == ["sst2", "mrpc", "stsb", "cola", "rte"]
    assert quick[0].settings == {"datamodule.train_examples": 2000}
    cfg.tasks = ["rte", "sst2", "wnli"]
    chosen = suite_tasks(cfg)
    assert [(t.name, t.settings) for t in chosen] == [
        ("rte", {"datamodule.train_examples": 2000}),
        ("sst2", {"datamodule.train_examples": 2000}),  # the suite's settings for a task it has
        ("wnli", {}),
    ]
    cfg.tasks = "wnli"  # tasks=wnli: one task, not the letters of its name
    assert [t.name for t in suite_tasks(cfg)] == ["wnli"]
    cfg.tasks = []
    with pytest.raises(ConfigError, match="no task to run"):
        suite_tasks(cfg)


def test_an_unknown_task_is_one_line_with_the_choices_and_leaves_no_folder(tmp_path):
    """`make glue tasks=[nonexistent]`: refused before the checkpoint is read, naming the task
    and every task config; the suite folder Hydra made (its .hydra/ and empty log) is gone."""
    result = run_cli(
        "pipeline.commands.glue",
        "ckpt=never-read",
        "tasks=[sst2,nonexistent]",
        "run_name=suite",
        f"paths.output_root={tmp_path / 'out'}",
        tmp_path=tmp_path,
        env={"WANDB_MODE": "disabled"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    choices = ", ".join(sorted(p.stem for p in (CONF / "task").glob("*.yaml")))
    assert result.stderr.splitlines()[0] == (
        "error: there is no task config 'nonexistent' (conf/task/nonexistent.yaml); the "
        f"choices are {choices}; name the tasks to run with tasks=[sst2,rte]"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "glue" / "suite").exists()
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


GLUE_SUITES = sorted(
    p.stem for p in (CONF / "suite").glob("*.yaml") if "tasks" in OmegaConf.load(p)
)


def test_the_suites_of_make_glue_are_found():
    assert {"quick", "full"} <= set(GLUE_SUITES) and "blimp" not in GLUE_SUITES


def test_a_suite_of_another_command_is_refused():
    with pytest.raises(ConfigError, match="suite=blimp is not a suite of fine-tuning tasks"):
        suite_tasks(compose_config("glue", "suite=blimp"))


@pytest.mark.parametrize("suite_name", GLUE_SUITES)
def test_every_suite_lists_task_configs_and_settings_that_exist(suite_name):
    cfg = compose_config("glue", f"suite={suite_name}")
    tasks = suite_tasks(cfg)
    assert tasks
    for task in tasks:
        assert load_task(task.name).name == task.name
        for key in task.settings:
            assert OmegaConf.select(cfg, key, default="missing") != "missing", key


def test_plan_runs_whole_tasks_pretrained_before_scratch():
    jobs = plan([SuiteTask("a", {}), SuiteTask("b", {})], [1, 2])
    assert [j.folder for j in jobs[:4]] == [
        "a/pretrained-seed1",
        "a/scratch-seed1",
        "a/pretrained-seed2",
        "a/scratch-seed2",
    ]
    assert {j.task for j in jobs[4:]} == {"b"}


def test_a_job_gets_the_suite_settings_unless_the_command_line_set_them(tmp_path):
    cfg = compose_config("glue", "ckpt=x", "trainer.max_epochs=1")
    task = SuiteTask("sst2", {"datamodule.train_examples": 100, "trainer.max_epochs": 5})
    job = Job("sst2", "scratch", 4)
    job_cfg = job_config(cfg, load_task("sst2"), task, job, tmp_path / "j", {"trainer.max_epochs"})
    assert job_cfg.datamodule.train_examples == 100
    assert job_cfg.trainer.max_epochs == 1  # given on the command line: it wins
    assert (job_cfg.seed, job_cfg.from_scratch, job_cfg.task.name) == (4, True, "sst2")
    assert job_cfg.paths.output_dir == str(tmp_path / "j")
    assert "suite" not in job_cfg and "seeds" not in job_cfg


# --- a real suite ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """`python -m pipeline.commands.glue` on a tiny BERT on the CPU: SST-2 and STS-B, seeds 1
    and 2. Run in this process, with the word embeddings of each backbone its fine-tunes load
    recorded (the fifth item; see test_every_fine_tune_of_a_suite_starts_from_the_checkpoint)."""
    if not GLUE.is_dir():
        pytest.skip(f"GLUE data not found at {GLUE}")
    root = tmp_path_factory.mktemp("glue")
    write_run(root / "bert", "bert")
    args = [
        f"ckpt={root / 'bert'}",
        "tasks=[sst2,stsb]",
        "seeds=2",
        *SMALL,
        "trainer.accelerator=cpu",  # where training changes the weights in place
        "logger=csv",
        f"paths.output_root={root / 'out'}",
        "run_name=suite",
        "+trainer.enable_progress_bar=false",
    ]
    loaded_words = []
    load_backbone = finetuning.load_backbone

    def recording(source):
        pretrained = load_backbone(source)
        loaded_words.append(pretrained.model.bert.embeddings.word.weight.detach().clone())
        return pretrained

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(finetuning, "load_backbone", recording)
        result = run_cli(
            "pipeline.commands.glue", *args, tmp_path=root, env={"GLUE_DIR": str(GLUE)}
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return root, root / "out" / "glue" / "suite", args, result.stdout, loaded_words


def results_of(folder: Path, task: str, init: str) -> dict[int, FinetuneResults]:
    return {
        seed: FinetuneResults.read(folder / task / f"{init}-seed{seed}" / "results.json")
        for seed in (1, 2)
    }


@needs_glue
def test_suite_table_pairs_the_seeds_of_both_inits(suite):
    _, folder, _, stdout, _ = suite
    summary = json.loads((folder / "glue_summary.json").read_text())
    rows = {row["task"]: row for row in summary["rows"]}
    assert list(rows) == ["sst2", "stsb", "average"]
    names = {"sst2": ["accuracy"], "stsb": ["spearman", "pearson"]}
    per_seed_mean = {}
    for task, metrics in names.items():
        row = rows[task]
        assert row["metrics"] == metrics
        scores = {
            init: {
                seed: task_score(r.best.metrics["dev"], metrics)
                for seed, r in results_of(folder, task, init).items()
            }
            for init in ("pretrained", "scratch")
        }
        for init, values in scores.items():
            assert {int(k): v for k, v in row[init]["scores"].items()} == pytest.approx(values)
        diffs = [scores["pretrained"][s] - scores["scratch"][s] for s in (1, 2)]
        assert row["difference"]["n"] == 2
        assert row["difference"]["mean"] == pytest.approx(sum(diffs) / 2)
        assert row["difference"]["low"] <= row["difference"]["mean"] <= row["difference"]["high"]
        baselines = json.loads((folder / task / BASELINES).read_text())
        best = max(task_score(m, metrics) for m in baselines.values())
        assert row["baseline_score"] == pytest.approx(best)
        per_seed_mean[task] = scores["pretrained"]
    average = rows["average"]["pretrained"]["scores"]
    for seed in (1, 2):
        expected = (per_seed_mean["sst2"][seed] + per_seed_mean["stsb"][seed]) / 2
        assert average[str(seed)] == pytest.approx(expected)
    table = (folder / "glue_summary.md").read_text()
    assert table.count("\n| ") == 4 and "| stsb | spearman/pearson |" in table
    for row in summary["rows"]:  # flagged exactly when the mean does not beat the baseline
        below = row["pretrained"]["summary"]["mean"] <= row["baseline_score"]
        line = next(line for line in table.splitlines() if line.startswith(f"| {row['task']} |"))
        assert ("BELOW BASELINE" in line.split("|")[4]) == below
    assert "| average | GLUE score |" in stdout
    # one line per run with its score, not each fine-tune's own summary and next commands
    sst2 = results_of(folder, "sst2", "pretrained")[1]
    line = f"  dev accuracy {sst2.main_score():.4f} (best at epoch {sst2.best.epoch}); "
    assert f"{line}{folder / 'sst2' / 'pretrained-seed1'}\n" in stdout
    assert "next: make evaluate" not in stdout and "fine-tuning bert" not in stdout


@needs_glue
def test_the_twin_has_random_weights_and_the_same_tokenizer(suite):
    root, folder, _, _, _ = suite
    original = torch.load(root / "bert" / "checkpoints" / "last.ckpt", weights_only=False)
    start = original["state_dict"]["model.bert.embeddings.word.weight"]
    for init in ("pretrained", "scratch"):
        run = folder / "sst2" / f"{init}-seed1"
        results = FinetuneResults.read(run / "results.json")
        assert results.backbone == str(root / "bert")
        assert results.init == ("random" if init == "scratch" else str(root / "bert"))
        tuned = torch.load(run / "checkpoints" / "best.ckpt", weights_only=False)
        assert tuned["tokenizer"] == original["tokenizer"]
        assert_started_from(tuned, start, init)


def assert_started_from(tuned: dict, start: torch.Tensor, init: str) -> None:
    """The fine-tuned checkpoint's word embeddings are a few small steps from `start` (the
    pretrained init) or unrelated to it (the twin's random init)."""
    weights = tuned["state_dict"]["model.backbone.embeddings.word.weight"]
    correlation = torch.corrcoef(torch.stack([weights.flatten(), start.flatten()]))[0, 1]
    if init == "pretrained":
        assert correlation > 0.99
    else:
        assert abs(correlation) < 0.1


@needs_glue
def test_every_fine_tune_of_a_suite_starts_from_the_checkpoint(suite):
    """The suite reads its checkpoint once for all its fine-tunes. Each must start from the
    checkpoint's weights, not from what the fine-tune before it trained (as happened on a CPU,
    when the model held the read checkpoint's tensors and trained them in place). The suite
    of the fixture (two tasks, two seeds, on the CPU) records what each fine-tune loaded."""
    root, folder, _, _, loaded_words = suite
    original = torch.load(root / "bert" / "checkpoints" / "last.ckpt", weights_only=False)
    start = original["state_dict"]["model.bert.embeddings.word.weight"]
    assert len(loaded_words) == 8  # the twin's runs load it too, for its architecture
    for number, words in enumerate(loaded_words, start=1):
        assert torch.equal(words, start), f"fine-tune {number} of 8"
    tuned = torch.load(
        folder / "stsb" / "pretrained-seed2" / "checkpoints" / "best.ckpt",
        weights_only=False,
    )["state_dict"]["model.backbone.embeddings.word.weight"]
    assert not torch.equal(tuned, start)  # the fine-tunes did train the weights


@needs_glue
def test_a_suite_cut_short_resumes_and_refuses_other_settings(suite, monkeypatch):
    _, folder, args, _, _ = suite
    cfg = compose_config("glue", *[a for a in args if not a.startswith("+")], run_dir=folder)
    cfg.datamodule.max_examples = 48
    monkeypatch.setenv("GLUE_DIR", str(GLUE))
    done = {p: p.stat().st_mtime_ns for p in folder.glob("*/*/results.json")}
    assert len(done) == 8
    cut = folder / "stsb" / "scratch-seed2"
    (cut / "results.json").unlink()  # as if the suite was stopped during this run
    run_suite(cfg, load_task, overrides=args)
    assert (folder / "stsb" / "scratch-seed2.interrupted" / "checkpoints").is_dir()
    assert (cut / "results.json").is_file()
    for path, mtime in done.items():
        if path.parent != cut:
            assert path.stat().st_mtime_ns == mtime  # the finished runs were not run again
    assert summarize_suite(folder).rows[1].difference.n == 2
    cfg.seeds = 3
    with pytest.raises(ConfigError, match="started with other seeds"):
        run_suite(cfg, load_task, overrides=args)


@needs_glue
def test_report_of_a_suite_folder(suite, tmp_path):
    _, folder, _, _, _ = suite
    report = write_report([folder], out=tmp_path / "report")
    assert [p.name for p in report.plots] == ["suite_1.png"]
    page = report.html.read_text()
    assert "Downstream suite (make glue)" in page and "pretrained - scratch (95% CI)" in page


# One step on 16 examples: the suites below check what runs from another kind of checkpoint
# (its row, each init's tokenizer and starting weights), which more steps would not change.
ONE_STEP = ("datamodule.max_examples=16", "datamodule.batch_size=16", "trainer.max_epochs=1")


def one_task_suite(ckpt: Path, task: str, run_dir: Path, monkeypatch):
    """The single row of a one-seed, one-task one-step suite of `ckpt` run into `run_dir`."""
    cfg = compose_config(
        "glue", f"ckpt={ckpt}", f"tasks=[{task}]", "seeds=1", *ONE_STEP, run_dir=run_dir
    )
    cfg.task = None
    monkeypatch.setenv("GLUE_DIR", str(GLUE))
    (row,) = run_suite(cfg, load_task).rows
    return row


@needs_glue
def test_a_gpt_checkpoint_runs_the_suite(tmp_path, monkeypatch):
    write_run(tmp_path / "gpt", "gpt")
    row = one_task_suite(tmp_path / "gpt", "rte", tmp_path / "s", monkeypatch)
    assert row.task == "rte" and row.baseline in ("majority", "word overlap")
    assert set(row.pretrained.scores) == set(row.scratch.scores) == {1}


@needs_glue
def test_a_hugging_face_folder_runs_the_suite_with_its_own_tokenizer(tmp_path, monkeypatch):
    """ckpt= an HF folder (our export; a BERT saved from the Hub looks the same): both inits
    fine-tune with the folder's tokenizer, the twin from random weights."""
    model, tokenizer, _ = write_run(tmp_path / "bert", "bert")
    export_hf(model, tmp_path / "hf", tokenizer=tokenizer)
    row = one_task_suite(tmp_path / "hf", "mrpc", tmp_path / "s", monkeypatch)
    assert row.task == "mrpc" and set(row.pretrained.scores) == set(row.scratch.scores) == {1}
    start = model.state_dict()["bert.embeddings.word.weight"]
    for init in ("pretrained", "scratch"):
        tuned = torch.load(
            tmp_path / "s" / "mrpc" / f"{init}-seed1" / "checkpoints" / "best.ckpt",
            weights_only=False,
        )
        assert Tokenizer.from_str(tuned["tokenizer"]["json"]).get_vocab() == tokenizer.get_vocab()
        assert_started_from(tuned, start, init)


@needs_glue
def test_a_suite_on_two_processes_runs_each_fine_tune_with_ddp_and_resumes(tmp_path):
    """`trainer.devices=2 trainer.strategy=ddp`: Lightning starts the second process once, at
    the first fine-tune; both run every job together, the first alone writes and prints. The
    same command again finds every job done and prints the same table."""
    write_run(tmp_path / "bert", "bert")
    command = (
        "pipeline.commands.glue",
        f"ckpt={tmp_path / 'bert'}",
        "tasks=[stsb]",
        "seeds=1",
        "run_name=ddp",
        f"paths.output_root={tmp_path / 'out'}",
        "logger=csv",
        "datamodule.max_examples=25",
        "datamodule.batch_size=8",
        "trainer.max_epochs=1",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
    )
    env = {**CLI_ENV, "OMP_NUM_THREADS": "1", "GLUE_DIR": str(GLUE)}
    first = run_cli(*command, tmp_path=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("[1/2] stsb, pretrained, seed 1") == 1
    assert first.stdout.count("| stsb |") == 1
    folder = tmp_path / "out" / "glue" / "ddp"
    for init in ("pretrained", "scratch"):
        results = FinetuneResults.read(folder / "stsb" / f"{init}-seed1" / "results.json")
        assert results.final.step == 2  # 25 examples: 13 a rank, batches of 8
    again = run_cli(*command, tmp_path=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[1/2]" not in again.stdout
    table = [line for line in first.stdout.splitlines() if line.startswith("| stsb |")]
    assert table[0] in again.stdout


# --- fine-tunes side by side (jobs=N) ---------------------------------------------------------


def test_jobs_is_a_count_and_each_job_one_device():
    cfg = OmegaConf.create({"trainer": {"devices": 1, "num_nodes": 1}})
    assert check_jobs(1, cfg) == 1 and check_jobs(3, cfg) == 3
    for bad in (0, -1, "2", True, 1.5):
        with pytest.raises(ConfigError, match="give how many fine-tunes run at once"):
            check_jobs(bad, cfg)
    several = OmegaConf.create({"trainer": {"devices": 2, "num_nodes": 1}})
    assert check_jobs(1, several) == 1  # one DDP fine-tune at a time
    with pytest.raises(ConfigError, match="use jobs=1 with several devices"):
        check_jobs(2, several)


@needs_glue
def test_a_suite_side_by_side_gives_the_results_of_one_at_a_time(tmp_path, monkeypatch):
    """jobs=2: both fine-tunes of a one-seed RTE suite run at once, each in a process of its own
    with half of this process's threads; their results equal those of jobs=1 at that thread
    count, to the bit. A fine-tune that fails in its process stops the suite with its error."""
    write_run(tmp_path / "bert", "bert")
    monkeypatch.setenv("GLUE_DIR", str(GLUE))

    def run(name: str, *overrides: str):
        cfg = compose_config(
            "glue", f"ckpt={tmp_path / 'bert'}", "tasks=[rte]", "seeds=1", *ONE_STEP, *overrides
        )
        cfg.task, cfg.paths.output_dir = None, str(tmp_path / name)
        return run_suite(cfg, load_task)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run("alone")
        torch.set_num_threads(2)  # each of the two processes: 1
        with monkeypatch.context() as here:  # not in this process: in processes of their own
            here.setattr(runners, "finetune", lambda *a, **k: pytest.fail("ran in this process"))
            (row,) = run("side", "jobs=2").rows
    finally:
        torch.set_num_threads(threads)
    assert set(row.pretrained.scores) == set(row.scratch.scores) == {1}
    for init in ("pretrained", "scratch"):
        ours, theirs = (
            json.loads((tmp_path / name / "rte" / f"{init}-seed1" / "results.json").read_text())
            for name in ("side", "alone")
        )
        assert ours["best"]["metrics"] == theirs["best"]["metrics"]
        assert ours["final"] == theirs["final"]
    assert alone.rows[0].pretrained.scores == row.pretrained.scores
    with pytest.raises(ConfigError, match="datamodule.max_seq_len=4096 exceeds"):
        run("failed", "jobs=2", "datamodule.max_seq_len=4096")
    assert not [p for p in multiprocessing.active_children() if "Spawn" in p.name]  # none left


def test_an_unexpected_error_in_a_fine_tunes_process_is_one_line_naming_it(monkeypatch, capfd):
    """Not a user error: the fine-tune's process prints the traceback, where it happened, and
    sends its first line; the suite names the fine-tune in one line (no second traceback)."""

    def crash(*args, **kwargs):
        raise RuntimeError("the first line\nthe second")

    monkeypatch.setattr(runners, "finetune", crash)
    receive, send = multiprocessing.Pipe(duplex=False)
    with pytest.raises(SystemExit):
        runners._fine_tune({}, None, None, 1, send)
    sent = receive.recv()
    assert isinstance(sent, FineTuneCrashError)
    assert str(sent) == "RuntimeError: the first line"
    assert "Traceback (most recent call last)" in capfd.readouterr().err

    runner, said = runners.SideBySide(source=None, jobs=2), []
    for job, what in (("rte/pretrained-seed1", sent), ("rte/scratch-seed1", None)):
        receive, send = runner.context.Pipe(duplex=False)
        # a process that sends what a fine-tune's process would, or ends without a word
        target, args = (send.send, (what,)) if what else (os._exit, (3,))
        process = runner.context.Process(target=target, args=args)
        process.start()
        send.close()
        runner.running = [runners.Running(process, receive, Path(job))]
        with pytest.raises(FineTuneCrashError) as crashed:
            runner.drain()
        said.append(str(crashed.value))
    assert said == [
        "the fine-tune of rte/pretrained-seed1 failed: RuntimeError: the first line (its "
        "traceback is above)",
        "the fine-tune of rte/scratch-seed1 ended without results (exit code 3); its log is above",
    ]
    assert not [p for p in multiprocessing.active_children() if "Spawn" in p.name]

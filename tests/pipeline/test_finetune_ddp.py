"""Fine-tuning on several processes: the samplers share every epoch and every evaluation split
out among the ranks (each evaluation example scored exactly once, whatever the split's size), and
a real 2-process DDP fine-tune on CPU (gloo), launched by Lightning from the command line as
`make finetune trainer.devices=2 trainer.strategy=ddp` runs, scores its dev split exactly as a
single process scores the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from datamodules.tasks.batches import EpochShuffleSampler, EvalShardSampler, Repeat, with_scored
from pipeline.run.folder import RESULTS
from tests.conftest import CLI_ENV, run_command
from tests.pipeline.task_data import pair_task, write_pairs
from tests.pipeline.test_generate import run_cli
from tests.pipeline.tiny_models import write_run

# --- sharding (no processes) ----------------------------------------------------------------


@pytest.mark.parametrize(("n", "world"), [(10, 2), (11, 2), (7, 3), (1, 2), (2, 4)])
def test_evaluation_shares_score_every_example_exactly_once(n, world):
    shares = [list(EvalShardSampler(n, rank=rank, world=world)) for rank in range(world)]
    assert {len(share) for share in shares} == {-(-n // world)}  # equal batch counts per rank
    assert len(EvalShardSampler(n, rank=0, world=world)) == len(shares[0])
    scored = sorted(i for share in shares for i in share if not isinstance(i, Repeat))
    assert scored == list(range(n))
    repeats = [i for share in shares for i in share if isinstance(i, Repeat)]
    assert len(repeats) == world * -(-n // world) - n


def test_one_process_evaluates_in_order_with_nothing_repeated():
    assert list(EvalShardSampler(5)) == [0, 1, 2, 3, 4]
    assert not any(isinstance(i, Repeat) for i in EvalShardSampler(5))


@pytest.mark.parametrize("n", [9, 10])
def test_training_shares_one_permutation_out_among_the_ranks(n):
    """Every rank deals from the same per-epoch order; an odd count is padded with the order's
    first example, so both ranks run as many steps."""
    samplers = [EpochShuffleSampler(n, seed=3, rank=rank, world=2) for rank in range(2)]
    single = EpochShuffleSampler(n, seed=3)
    orders = []
    for _ in range(2):
        order = list(single)
        padded = order + order[: n % 2]
        assert [list(s) for s in samplers] == [padded[0::2], padded[1::2]]
        assert len(samplers[0]) == len(samplers[1]) == -(-n // 2)
        orders.append(order)
    assert orders[0] != orders[1]  # a new order each epoch


def test_a_batch_marks_the_examples_it_repeats_as_unscored():
    batch = with_scored({"labels": torch.zeros(3)}, [4, Repeat(0), 5])
    assert batch["scored"].tolist() == [True, False, True]
    assert "scored" not in with_scored({"labels": torch.zeros(2)}, [4, 5])


# --- a real 2-process run -------------------------------------------------------------------


def test_two_process_fine_tune_scores_every_dev_example_once(tmp_path):
    """23 dev examples on 2 ranks: one rank repeats an example to keep the batch counts equal,
    and does not score it. The best checkpoint's dev scores in results.json (Spearman: any
    missing or doubled example changes it) equal those of `make evaluate` on one process; each
    rank trains on half of every epoch (20 examples, batches of 8: 2 steps an epoch, not 3)."""
    ckpt = tmp_path / "bert"
    write_run(ckpt, "bert")
    data = tmp_path / "pairs"
    write_pairs(data, n_train=20, n_dev=23)
    task = pair_task(data)
    env = {**CLI_ENV, "OMP_NUM_THREADS": "1"}
    # fp32 in both commands: a null precision is chosen by timing a matrix product in each
    # process (bf16 where it measures faster), and bf16 scores would differ by more than this
    # test's tolerance, whatever the sharding
    common = (
        "logger=csv",
        f"paths.output_root={tmp_path / 'out'}",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
    )
    # DDP: rank 0 in a process of its own too (Lightning starts rank 1 by running the command
    # again), not in this one, whose torch.distributed state the run would change
    tuned = run_command(
        "pipeline.commands.finetune",
        f"ckpt={ckpt}",
        *task,
        *common,
        "run_name=ddp",
        "datamodule.batch_size=8",
        "datamodule.eval_batch_size=5",
        "trainer.max_epochs=2",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        env={**env, "TMPDIR": str(tmp_path)},
        timeout=300,
        process=True,
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert tuned.stdout.count("best at epoch") == 1  # the first process alone prints
    run_dir = tmp_path / "out" / "finetune" / "custom" / "ddp"
    results = json.loads((run_dir / RESULTS).read_text())
    assert results["final"]["step"] == 4
    again = run_cli(
        "pipeline.commands.evaluate", f"ckpt={run_dir}", *common, tmp_path=tmp_path, env=env
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(23 examples)" in again.stdout
    evaluated = json.loads((run_dir / "eval_custom.json").read_text())["metrics"]["dev"]
    best = results["best"]["metrics"]["dev"]
    assert best.keys() == evaluated.keys() == {"loss", "spearman", "pearson"}
    for name, value in evaluated.items():
        # Pearson merges per-rank running moments in float32: equal to ~1e-5 (a missing or
        # doubled example moves it by ~1e-2)
        assert best[name] == pytest.approx(value, rel=1e-5, abs=1e-4), name

"""Two real processes (torch.distributed, gloo): only rank 0 builds the store, rank 1 waits, then
both read it and take disjoint shares of every epoch; ranks with different tokenizers fail fast."""

import multiprocessing as mp
from collections import Counter

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from datamodules.corpora.corpus import EmbeddedCorpus
from datamodules.objectives.objective import MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from tokenizer import batched, train_tokenizer


def rank_main(rank: int, tokenizers: dict[str, str], folder: str, results) -> None:
    """Rank `rank` of 2 sets up a run's data for each case of `tokenizers` in turn (the case's
    tokenizer of this rank, a cache of the case's own); puts (case, rank, outcome)."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2
    )
    try:
        for case, tokenizer_json in tokenizers.items():
            results.put((case, rank, set_up(tokenizer_json, f"{folder}/{case}")))
    finally:
        torch.distributed.destroy_process_group()


def set_up(tokenizer_json: str, cache_dir: str) -> tuple:
    """(whether this rank built the store, its path, the rank's items of epoch 1, the epoch's
    order), or (the error,) where the setup is refused."""
    # Every rank loads the same trained tokenizer, as a run does from the tokenizer cache
    # (WordPiece training is not reproducible across processes: ties break differently).
    tokenizer = Tokenizer.from_str(tokenizer_json)
    objective = MaskedLMObjective(seq_len=64, batch_size=8)
    dm = PretrainDataModule(
        EmbeddedCorpus(), tokenizer, objective, cache_dir, seed=3, wait_timeout_s=60
    )
    try:
        dm.setup("fit")
    except RuntimeError as err:
        return (str(err),)
    items = np.concatenate([dm.train_set.batch_items(1, i) for i in range(len(dm.train_set))])
    order = dm.train_set.order(1)
    return (dm.stats[0].built, str(dm.store.path), items.tolist(), order.tolist())


def run_ranks(tokenizers: dict[str, list[str]], folder) -> dict[str, dict[int, tuple]]:
    """Each case of `tokenizers` (the tokenizer of rank 0 and of rank 1) set up by the same two
    processes, one case after the other (a spawned process takes seconds to import torch);
    the outcome of each case on each rank."""
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=rank_main,
            args=(
                rank,
                {case: pair[rank] for case, pair in tokenizers.items()},
                str(folder),
                results,
            ),
            daemon=True,
        )
        for rank in (1, 0)  # rank 1 starts first: it must wait for rank 0's store
    ]
    for process in processes:
        process.start()
    outcome = {case: {} for case in tokenizers}
    for _ in range(len(processes) * len(tokenizers)):
        case, rank, rest = results.get(timeout=120)
        outcome[case][rank] = rest
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return outcome


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, wordpiece, embedded) -> dict[str, dict[int, tuple]]:
    """`same`: both ranks load one tokenizer; then `different`: rank 1 loads another."""
    other = train_tokenizer("wordpiece", batched(embedded.documents()), 1500)
    tokenizers = {
        "same": [wordpiece.to_str()] * 2,
        "different": [wordpiece.to_str(), other.to_str()],
    }
    return run_ranks(tokenizers, tmp_path_factory.mktemp("ranks"))


def test_only_rank_0_builds_and_ranks_share_the_epoch(outcomes):
    outcome = outcomes["same"]
    assert outcome[0][0] and not outcome[1][0]  # built by rank 0 only
    assert outcome[0][1] == outcome[1][1]  # the same store
    assert outcome[0][3] == outcome[1][3]  # the same epoch order on both ranks
    # Together the ranks read the epoch exactly once, but for a tail shorter than the world
    # size, left out so that every rank gets as many batches (datamodules.objectives.sharding.ShardPlan).
    # (An NSP epoch may hold an instance twice: its length is fixed, and an epoch with fewer
    # instances wraps around, so compare counts.)
    read = len(outcome[0][2]) + len(outcome[1][2])
    assert len(outcome[0][3]) - 1 <= read <= len(outcome[0][3])
    assert Counter(outcome[0][2]) + Counter(outcome[1][2]) == Counter(outcome[0][3][:read])
    assert abs(len(outcome[0][2]) - len(outcome[1][2])) <= 1  # the last batch is split evenly


def test_ranks_with_different_tokenizers_fail_fast(outcomes):
    outcome = outcomes["different"]
    for rank in (0, 1):
        assert "ranks would read different token stores" in outcome[rank][0]

"""Two real processes (torch.distributed, gloo): only rank 0 builds the store, rank 1 waits, then
both read it and take disjoint shares of every epoch; ranks with different tokenizers fail fast."""

import multiprocessing as mp
from collections import Counter

import numpy as np
import torch
from tokenizers import Tokenizer

from datamodules.corpora.corpus import EmbeddedCorpus
from datamodules.objectives.objective import MaskedLMObjective
from datamodules.pretrain import PretrainDataModule
from tokenizer import batched, train_tokenizer


def rank_main(rank: int, tokenizer_json: str, cache_dir: str, results) -> None:
    # Every rank loads the same trained tokenizer, as a run does from the tokenizer cache
    # (WordPiece training is not reproducible across processes: ties break differently).
    tokenizer = Tokenizer.from_str(tokenizer_json)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{cache_dir}/rendezvous", rank=rank, world_size=2
    )
    objective = MaskedLMObjective(seq_len=64, batch_size=8)
    dm = PretrainDataModule(
        EmbeddedCorpus(), tokenizer, objective, cache_dir, seed=3, wait_timeout_s=60
    )
    try:
        dm.setup("fit")
    except RuntimeError as err:
        results.put((rank, str(err)))
        return
    finally:
        torch.distributed.destroy_process_group()
    items = np.concatenate([dm.train_set.batch_items(1, i) for i in range(len(dm.train_set))])
    order = dm.train_set.order(1)
    results.put((rank, dm.stats[0].built, str(dm.store.path), items.tolist(), order.tolist()))


def run_ranks(tokenizers: list[str], cache_dir) -> dict[int, tuple]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(
            target=rank_main, args=(rank, tokenizers[rank], str(cache_dir), results), daemon=True
        )
        for rank in (1, 0)  # rank 1 starts first: it must wait for rank 0's store
    ]
    for process in processes:
        process.start()
    outcome = {}
    for _ in processes:
        rank, *rest = results.get(timeout=120)
        outcome[rank] = tuple(rest)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return outcome


def test_only_rank_0_builds_and_ranks_share_the_epoch(tmp_path, wordpiece):
    outcome = run_ranks([wordpiece.to_str()] * 2, tmp_path)
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


def test_ranks_with_different_tokenizers_fail_fast(tmp_path, wordpiece, embedded):
    other = train_tokenizer("wordpiece", batched(embedded.documents()), 1500)
    outcome = run_ranks([wordpiece.to_str(), other.to_str()], tmp_path)
    for rank in (0, 1):
        assert "ranks would read different token stores" in outcome[rank][0]

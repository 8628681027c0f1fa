"""Distributed training strategies built from config (`conf/trainer/ddp.yaml`, `fsdp.yaml`).

Both take `timeout_s`: how long a process waits in a collective (an all-reduce, a barrier) for
the others. A peer that is killed closes its connections and the others stop at once; a node
that loses power or its network closes nothing, and the others notice only when the timeout
runs out. `PeerDirectory`, a callback, records which process runs where when training starts,
so that either failure becomes a `PeerLostError` (`peers_lost_as_error`) that names the process
lost instead of a socket, for the command to report in one line.

`fsdp_strategy` builds Lightning's `FSDPStrategy` for the registered model families: each
transformer block (`Family.block_class`: `BertLayer`, `GPTBlock`) is its own FSDP unit, so only
the block being computed (and the next, prefetched) is ever whole in memory; embeddings, final
norms and heads stay in the root unit.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import lightning as L
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from pipeline.run.errors import PeerLostError
from pipeline.run.families import families

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
# "sharded" (one file per rank, for models too big to gather on one host) is not offered yet:
# resume and the Hugging Face export read single-file checkpoints.
STATE_DICT_TYPES = ("full",)
# torch's and Lightning's default; it must outlast the longest wait of one process for another
# (rank 0 writing a checkpoint, counting word vectors), since a slow peer looks like a lost one.
DEFAULT_TIMEOUT_S = 1800.0


def collective_timeout(timeout_s: float) -> timedelta:
    """`timeout_s` as the timedelta Lightning's strategies take, or a ValueError naming the knob."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(
            f"trainer.strategy.timeout_s={timeout_s!r} is not a positive number of seconds; "
            f"e.g. trainer.strategy.timeout_s={DEFAULT_TIMEOUT_S:.0f}"
        )
    return timedelta(seconds=timeout_s)


def ddp_strategy(*, timeout_s: float = DEFAULT_TIMEOUT_S) -> DDPStrategy:
    """Lightning's DDP (gloo on CPUs, NCCL on GPUs) whose collectives give up on a silent peer
    after `timeout_s` seconds."""
    return DDPStrategy(timeout=collective_timeout(timeout_s))


def _choice(
    knob: str, value: str, allowed: tuple[str, ...], normalize: Callable[[str], str]
) -> str:
    """`value` normalized (case-insensitive match), or a ValueError naming the knob."""
    if isinstance(value, str) and normalize(value) in allowed:
        return normalize(value)
    raise ValueError(
        f"trainer.strategy.{knob}={value!r} is not one of {', '.join(allowed)}; "
        f"e.g. trainer.strategy.{knob}={allowed[0]}"
    )


def fsdp_strategy(
    *,
    sharding_strategy: str = "FULL_SHARD",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    state_dict_type: str = "full",
    limit_all_gathers: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> FSDPStrategy:
    """Fully Sharded Data Parallel over the transformer blocks of BERT and GPT.

    Args:
        sharding_strategy: FULL_SHARD (parameters, gradients and optimizer states sharded; least
            memory), SHARD_GRAD_OP (parameters kept whole between forward and backward: fewer
            all-gathers, more memory), HYBRID_SHARD (FULL_SHARD within a node, replicated across
            nodes: all-gathers stay on the fast intra-node links) or NO_SHARD (plain DDP).
            Case-insensitive.
        activation_checkpointing: recompute each block's activations in the backward pass instead
            of storing them (about a third more compute for much less activation memory).
        cpu_offload: keep the sharded parameters and their gradients in CPU memory and run the
            optimizer step there; for models that do not fit otherwise, at a large cost in speed.
        state_dict_type: "full" gathers the whole model and optimizer state on rank 0 into one
            checkpoint file (what resume and the Hugging Face export read); the only choice for
            now (see STATE_DICT_TYPES).
        limit_all_gathers: rate-limit the all-gathers FSDP issues ahead of compute, so a CPU
            thread running ahead cannot pile up unsharded blocks in GPU memory.
        timeout_s: how long a collective waits for a silent peer (`ddp_strategy`).

    Returns:
        An `FSDPStrategy` with the blocks as auto-wrap policy (and activation-checkpointing policy
        when enabled) and `use_orig_params=True`: parameters keep their names and shapes, so the
        weight-decay groups of `pipeline.training.optim` (which tell matrices from vectors) and
        `torch.compile` see the real parameters rather than FSDP's flattened 1-D buffers.

    Precision is not set here but by `trainer.precision`, which Lightning (2.6) turns into an
    `FSDPPrecision` plugin mapped onto FSDP's own `MixedPrecision`:

    - "bf16-mixed" / "16-mixed": parameters are all-gathered and used in bf16 / fp16, gradients
      are reduce-scattered in bf16 / fp16 and buffers cast too, while the sharded master weights
      and optimizer states stay fp32; the forward also runs under CUDA autocast. Unlike DDP, the
      gradient reduction itself is in half precision. "16-mixed" adds a `ShardedGradScaler`.
    - "bf16-true" / "16-true": the module is converted to that dtype before wrapping; weights
      and optimizer states are half precision throughout.
    - "32-true": fp32 throughout.

    Lightning's FSDP precision plugin cannot clip gradients by norm (it raises), so
    `pipeline.pretrain.modules.PretrainModule.configure_gradient_clipping` calls FSDP's own
    `clip_grad_norm_`, which takes the norm over all shards.

    Raises:
        ValueError: `sharding_strategy` or `state_dict_type` is not one of the allowed values,
            or `timeout_s` is not a positive number.
    """
    sharding = _choice("sharding_strategy", sharding_strategy, SHARDING_STRATEGIES, str.upper)
    state_dict = _choice("state_dict_type", state_dict_type, STATE_DICT_TYPES, str.lower)
    # Lightning turns a `set` (not a frozenset) of classes into a ModuleWrapPolicy.
    # each family's repeated block: the unit of sharding and of activation checkpointing (task
    # heads reuse the backbones, so fine-tuning is covered too)
    blocks = {family.block_class for family in families()}
    return FSDPStrategy(
        sharding_strategy=sharding,
        auto_wrap_policy=blocks,
        activation_checkpointing_policy=set(blocks) if activation_checkpointing else None,
        cpu_offload=cpu_offload,
        state_dict_type=state_dict,
        use_orig_params=True,
        limit_all_gathers=limit_all_gathers,
        timeout=collective_timeout(timeout_s),
    )


# What gloo (CPU) and the c10d store say when a peer's connection breaks, and when no peer
# answered in time; `[address]:port` names the other end of a broken connection.
_BROKEN = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|Connection refused|"
    r"Connection was likely closed|Socket closed"
)
_TIMED_OUT = re.compile(r"Timed out waiting|timed out|Watchdog caught collective", re.IGNORECASE)
_ADDRESS = re.compile(r"\[(?:::ffff:)?([0-9A-Fa-f.:]+)\]:\d+")


@dataclass(frozen=True)
class Peer:
    """One process of a run, as it said at the start of training."""

    rank: int
    host: str
    address: str
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid} on {self.host})"


def name_peers(peers: list[Peer]) -> str:
    """`rank 1 (pid 42 on node2)` for one process; for several, their ranks and hosts."""
    if len(peers) == 1:
        return peers[0].describe()
    hosts = ", ".join(dict.fromkeys(peer.host for peer in peers))
    return f"ranks {', '.join(str(peer.rank) for peer in peers)} (on {hosts})"


def _own_address() -> str:
    """The address the other processes see this one at (gloo's: the host name's)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


class PeerDirectory(L.Callback):
    """Gathers every process's rank, host and pid once the processes are connected, so that a
    lost connection can be reported as the rank it went to (gloo names an address only).

    Args:
        timeout_s: the run's `trainer.strategy.timeout_s` (None: a strategy given by name,
            which has Lightning's default), named when no peer answered in time.
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
        self.peers: list[Peer] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or not dist.is_initialized() or self.peers:
            return
        me = Peer(trainer.global_rank, socket.gethostname(), _own_address(), os.getpid())
        gathered: list[Peer | None] = [None] * trainer.world_size
        dist.all_gather_object(gathered, me)
        self.peers = [peer for peer in gathered if peer is not None]


def lost_peer_seen(err: BaseException) -> tuple[str, str | None] | None:
    """("broken", address) when `err` (or an error it came from) is a connection to another
    process that broke, ("timeout", None) when none answered in time; None for other errors."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (RuntimeError, dist.DistError)):
            text = str(err)
            if _BROKEN.search(text):
                address = _ADDRESS.search(text)
                return "broken", address[1] if address else None
            collective = isinstance(err, dist.DistError) or "gloo" in text or "NCCL" in text
            if collective and _TIMED_OUT.search(text):
                return "timeout", None
        err = err.__cause__ or err.__context__
    return None


def describe_lost(
    kind: str,
    address: str | None,
    me: Peer,
    peers: list[Peer],
    world_size: int,
    timeout_s: float,
) -> str:
    """The sentence of a `PeerLostError`: which process lost which, and what was seen."""
    others = [peer for peer in peers if peer.rank != me.rank]
    suspects = [peer for peer in others if address and peer.address == address] or others
    if kind == "broken":
        who = name_peers(suspects) if suspects else "another rank"
        who = f"one of {who}" if len(suspects) > 1 else who
        where = f" at {address}" if address else ""
        what = (
            f"lost its connection to {who}{where}: that process was killed or crashed, or its "
            "node went down"
        )
    else:
        what = (
            f"had no answer from the other processes within {timeout_s:g} s "
            "(trainer.strategy.timeout_s): a node lost power or its network, or a process hangs"
        )
        if others:
            what += f" (the others: {name_peers(others)})"
    return f"rank {me.rank} of {world_size} (pid {me.pid} on {me.host}) {what}"


@contextlib.contextmanager
def peers_lost_as_error(trainer: L.Trainer) -> Iterator[None]:
    """Run training (`trainer.fit`), turning a lost peer into a `PeerLostError`."""
    try:
        yield
    except Exception as err:
        seen = lost_peer_seen(err) if trainer.world_size > 1 else None
        if seen is None:
            raise
        directory = next(
            (c for c in trainer.callbacks if isinstance(c, PeerDirectory)), PeerDirectory()
        )
        me = next(
            (peer for peer in directory.peers if peer.rank == trainer.global_rank),
            Peer(trainer.global_rank, socket.gethostname(), _own_address(), os.getpid()),
        )
        said = describe_lost(*seen, me, directory.peers, trainer.world_size, directory.timeout_s)
        raise PeerLostError(f"{said}; training stopped at step {trainer.global_step}") from err

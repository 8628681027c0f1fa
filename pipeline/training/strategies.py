"""Distributed training strategies built from config (`conf/trainer/fsdp.yaml`).

`fsdp_strategy` builds Lightning's `FSDPStrategy` for the registered model families: each
transformer block (`Family.block_class`: `BertLayer`, `GPTBlock`) is its own FSDP unit, so only
the block being computed (and the next, prefetched) is ever whole in memory; embeddings, final
norms and heads stay in the root unit.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch.strategies import FSDPStrategy

from pipeline.run.families import families

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
# "sharded" (one file per rank, for models too big to gather on one host) is not offered yet:
# resume and the Hugging Face export read single-file checkpoints.
STATE_DICT_TYPES = ("full",)


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
        ValueError: `sharding_strategy` or `state_dict_type` is not one of the allowed values.
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
    )

"""Muon for the transformer blocks' weight matrices, AdamW for everything else, as one optimizer
(`optim=muon`, conf/optim/muon.yaml).

Muon (momentum, then the update orthogonalized by Newton-Schulz iterations) suits the 2-D
matrices of the hidden layers. Its step is written here rather than taken from `torch.optim.Muon`,
which orthogonalizes in bf16 always: on a CPU without native bf16 that made a step ten times
slower; here the orthogonalization runs in bf16 only where the hardware has it (`fast_dtype`).
Embeddings, the output layer and task heads, norm gains and biases are not hidden matrices (a row of an embedding is a lookup, not a linear map)
and keep AdamW, as Muon's authors prescribe. Both sit in one `torch.optim.Optimizer`: Lightning,
the learning-rate schedule (which scales every group's peak), gradient clipping, DDP and
checkpoints see a single optimizer with one state and one step. With
`adjust_lr_fn="match_rms_adamw"` (the default here) Muon's update has AdamW's RMS, so both parts
can share one learning rate and weight decay.

A fused projection (BERT's and GPT's QKV, SwiGLU's gate and up, `models.layers.fused_linear`)
is several matrices in one weight. With `split_fused=True` each is orthogonalized on its own,
with its own shape's learning-rate scale, as if the projections were separate layers, which is
how Muon's reference implementations treat query, key and value; the default orthogonalizes the
stack as one matrix, the setting every measurement in docs/results/ used.

Muon needs whole matrices: FSDP, which hands the optimizer flat shards, is refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.run.families import family_of_model
from pipeline.training.optim import weight_decay_groups
from pipeline.training.precision import native_bf16_flags

# Newton-Schulz quintic coefficients of Muon's reference implementation (Jordan et al., 2024),
# also torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7):
    """`matrix` (A, B) pushed towards the nearest semi-orthogonal matrix (singular values near
    1) by `steps` Newton-Schulz iterations computed in `dtype`; returned in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    wide = matrix.size(0) <= matrix.size(1)
    x = (matrix if wide else matrix.T).to(dtype)
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def lr_scale(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    """The factor on Muon's learning rate for a matrix of `shape` (A, B): 0.2 sqrt(max(A, B))
    gives the update AdamW's RMS (`match_rms_adamw`); `original` (or None): sqrt(max(1, A / B))."""
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


@functools.cache
def fast_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device multiplies it natively (a GPU with bf16, a CPU with avx512_bf16 or
    amx_bf16), else fp32: torch.optim.Muon always orthogonalizes in bf16, which a CPU without
    native bf16 emulates about 10x slower than the rest of a step (measured: BERT mini on a
    2-core AVX2 CPU went from ~1 s to ~10 s per step)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if native_bf16_flags() else torch.float32


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others, in one step.

    Muon, per matrix W (A, B) with gradient G: the momentum buffer M <- mu M + (1 - mu) G; the
    update U = (1 - mu) G + mu M with Nesterov (else M), orthogonalized (`orthogonalize`); then
    W <- W (1 - lr wd) - lr' U, with lr' = lr * 0.2 sqrt(max(A, B)) for `match_rms_adamw`
    (AdamW's update RMS) or lr * sqrt(max(1, A / B)) for `original`.

    Args:
        params: param groups, each with `muon: True` or `muon: False` (`group_parameters`); a
            Muon group may hold `row_blocks`, per parameter the row counts of the matrices
            stacked in it (None: one matrix).
        lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn: Muon's.
        adamw_lr: AdamW's peak learning rate (None: `lr`).
        betas, eps: AdamW's.
        adamw_weight_decay: AdamW's for the matrices it updates (None: `weight_decay`).
        ns_dtype: the orthogonalization's dtype: "auto" (`fast_dtype`), "bfloat16" or "float32".
        split_fused: read by `group_parameters` (which sets the groups' `row_blocks`).
    """

    def __init__(
        self,
        params: list[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        adamw_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        ns_dtype: str = "auto",
        split_fused: bool = False,
    ) -> None:
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: use match_rms_adamw or original")
        if ns_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"ns_dtype={ns_dtype!r}: use auto, bfloat16 or float32")
        groups = [dict(g) for g in params]
        for group in groups:
            if "muon" not in group:
                raise ValueError("every param group needs `muon`: True or False")
            if group["muon"]:
                # in the group, as torch optimizers keep them: saved with the state, and a
                # resumed run's config applies (pipeline.training.optim.HYPERPARAMETERS)
                for key, value in (
                    ("lr", lr),
                    ("weight_decay", weight_decay),
                    ("momentum", momentum),
                    ("nesterov", nesterov),
                    ("ns_steps", ns_steps),
                    ("adjust_lr_fn", adjust_lr_fn),
                    ("ns_dtype", ns_dtype),
                ):
                    group.setdefault(key, value)
                if any(p.ndim != 2 for p in group["params"]):
                    raise ValueError(
                        "Muon needs whole 2-D weight matrices, but some are not (FSDP "
                        "flattens them); use trainer=ddp, or optim=adamw_gpt with FSDP"
                    )
                blocks = group.setdefault("row_blocks", [None] * len(group["params"]))
                if len(blocks) != len(group["params"]) or any(
                    b is not None and sum(b) != p.shape[0]
                    for b, p in zip(blocks, group["params"], strict=False)
                ):
                    raise ValueError(
                        "row_blocks must give, per parameter, row counts summing to its rows"
                    )
            else:
                group.setdefault("lr", adamw_lr or lr)
        muon = [g for g in groups if g["muon"] and g["params"]]
        adamw = [g for g in groups if not g["muon"] and g["params"]]
        # AdamW fills its defaults into its group dicts; it steps them, sharing this state.
        self._adamw = (
            torch.optim.AdamW(adamw, lr=adamw_lr or lr, betas=betas, eps=eps) if adamw else None
        )
        super().__init__(muon + adamw, {})
        self._link()

    def _link(self) -> None:
        """Let the AdamW part step this optimizer's groups and state (after a load too)."""
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # how the weights split is the model's structure, not a setting: keep the current
        # (a checkpoint from before fused splits has none)
        blocks = [group.get("row_blocks") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, row_blocks in zip(self.param_groups, blocks, strict=True):
            if group["muon"]:
                group["row_blocks"] = row_blocks
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        mu, lr = group["momentum"], group["lr"]
        for param, blocks in zip(group["params"], group["row_blocks"], strict=True):
            if param.grad is None:
                continue
            grad = param.grad
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - mu)
            update = grad.lerp(buffer, mu) if group["nesterov"] else buffer
            dtype = (
                fast_dtype(param.device)
                if group["ns_dtype"] == "auto"
                else getattr(torch, group["ns_dtype"])
            )
            param.mul_(1 - lr * group["weight_decay"])
            sizes = list(blocks) if blocks else [len(param)]
            for rows, part in zip(param.split(sizes), update.split(sizes), strict=True):
                step = orthogonalize(part, group["ns_steps"], dtype).to(param.dtype)
                rows.add_(step, alpha=-lr * lr_scale(part.shape, group["adjust_lr_fn"]))

    @staticmethod
    def group_parameters(
        model: nn.Module, weight_decay: float = 0.1, split_fused: bool = False, **settings: Any
    ) -> list[dict]:
        """Muon: the weight matrices of the model's transformer blocks (its family's
        `block_class`), fused ones split into their matrices with `split_fused`; AdamW: the
        rest, with decay on linear weights only (`pipeline.training.optim`).

        """
        adamw_decay = settings.get("adamw_weight_decay")
        block = family_of_model(model).block_class
        hidden = {
            id(m.weight)
            for b in model.modules()
            if isinstance(b, block)
            for m in b.modules()
            if isinstance(m, nn.Linear)
        }
        matrices = [p for p in model.parameters() if id(p) in hidden and p.requires_grad]
        fused = {
            id(m.weight): m.fused_rows
            for m in model.modules()
            if split_fused and hasattr(m, "fused_rows")
        }
        decay = weight_decay if adamw_decay is None else adamw_decay
        others = [
            {**g, "params": [p for p in g["params"] if id(p) not in hidden], "muon": False}
            for g in weight_decay_groups(model, decay)
        ]
        muon = {
            "params": matrices,
            "muon": True,
            "weight_decay": weight_decay,
            "row_blocks": [fused.get(id(p)) for p in matrices],
        }
        return [muon, *others]

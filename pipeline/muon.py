"""Muon for the transformer blocks' weight matrices, AdamW for everything else, as one optimizer
(`optim=muon`, conf/optim/muon.yaml).

Muon (momentum, then the update orthogonalized by Newton-Schulz iterations; `torch.optim.Muon`)
suits the 2-D matrices of the hidden layers. Embeddings, the output layer and task heads, norm
gains and biases are not hidden matrices (a row of an embedding is a lookup, not a linear map)
and keep AdamW, as Muon's authors prescribe. Both sit in one `torch.optim.Optimizer`: Lightning,
the learning-rate schedule (which scales every group's peak), gradient clipping, DDP and
checkpoints see a single optimizer with one state and one step. With
`adjust_lr_fn="match_rms_adamw"` (the default here) Muon's update has AdamW's RMS, so both parts
can share one learning rate and weight decay.

Muon needs whole matrices: FSDP, which hands the optimizer flat shards, is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.optim import weight_decay_groups


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others, in one step.

    Args:
        params: param groups, each with `muon: True` or `muon: False` (`group_parameters`).
        lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn: Muon's.
        adamw_lr: AdamW's peak learning rate (None: `lr`).
        betas, eps: AdamW's.
        adamw_weight_decay: AdamW's for the matrices it updates (None: `weight_decay`).
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
    ) -> None:
        groups = [dict(g) for g in params]
        for group in groups:
            if "muon" not in group:
                raise ValueError("every param group needs `muon`: True or False")
            group.setdefault("lr", lr if group["muon"] else adamw_lr or lr)
        muon = [g for g in groups if g["muon"] and g["params"]]
        adamw = [g for g in groups if not g["muon"] and g["params"]]
        # Each part fills its own defaults into the shared group dicts and steps them.
        self._muon = None
        if muon:
            self._muon = torch.optim.Muon(
                muon,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            )
        self._adamw = None
        if adamw:
            self._adamw = torch.optim.AdamW(adamw, lr=adamw_lr or lr, betas=betas, eps=eps)
        super().__init__(muon + adamw, {})
        self._link()

    def _link(self) -> None:
        """Let both parts step this optimizer's groups and state (after a load too)."""
        for part, is_muon in ((self._muon, True), (self._adamw, False)):
            if part is not None:
                part.param_groups = [g for g in self.param_groups if g["muon"] == is_muon]
                part.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in (self._muon, self._adamw):
            if part is not None:
                part.step()
        return loss

    @staticmethod
    def group_parameters(
        model: nn.Module, weight_decay: float = 0.1, **settings: Any
    ) -> list[dict]:
        """Muon: the weight matrices of the model's transformer blocks (its family's
        `block_class`); AdamW: the rest, with decay on linear weights only (`pipeline.optim`).

        Raises:
            ValueError: the matrices are not 2-D (FSDP's flat shards).
        """
        from pipeline.families import family_of_model  # the registry imports the modules

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
        if any(p.ndim != 2 for p in matrices):
            raise ValueError(
                "optim=muon needs whole 2-D weight matrices, but the model's are flattened "
                "(FSDP shards them); use trainer=ddp, or optim=adamw_gpt with FSDP"
            )
        decay = weight_decay if adamw_decay is None else adamw_decay
        others = [
            {**g, "params": [p for p in g["params"] if id(p) not in hidden], "muon": False}
            for g in weight_decay_groups(model, decay)
        ]
        return [{"params": matrices, "muon": True, "weight_decay": weight_decay}, *others]

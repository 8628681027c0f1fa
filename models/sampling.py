"""The pieces of GPT.generate that are not the model: left-aligning prompts of different lengths,
and drawing the next token with temperature, top-k and top-p."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _left_align(
    prompt_ids: torch.Tensor | Sequence[Sequence[int]],
    attention_mask: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a left-padded (B, T) tensor and its (B, T) mask of real tokens."""
    if not isinstance(prompt_ids, torch.Tensor):
        rows = [torch.as_tensor(list(p), dtype=torch.long) for p in prompt_ids]
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("every prompt needs at least one token")
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, T - len(r) :], mask[i, T - len(r) :] = r, 1
        return ids.to(device), mask.to(device)
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be (batch, tokens), got shape {tuple(prompt_ids.shape)}")
    ids = prompt_ids.to(device)
    if attention_mask is None:
        return ids, torch.ones_like(ids)
    mask = attention_mask.to(device).long()
    if bool((mask.sum(dim=1) == 0).any()):
        raise ValueError(
            "every prompt needs at least one real token (a row of attention_mask is 0)"
        )
    # A stable sort on the mask moves pads first and keeps real tokens in order: any padding
    # side becomes left padding.
    order = torch.sort(mask, dim=1, stable=True).indices
    return ids.gather(1, order), mask.gather(1, order)


def _sample(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next token per row from float32 logits (B, V) -> (B,)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        cum_BV = sorted_BV.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the ones before it already reach p; the top token always stays.
        drop_BV = (cum_BV - sorted_BV.softmax(dim=-1)) >= top_p
        logits_BV = logits_BV.scatter(1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)

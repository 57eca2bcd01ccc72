"""Dense reference of the fused filtered log-probs: the float64 logits, then the filter's reference."""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx.reference._filtering import filtered_token_logprobs
from lossfx.reference._linear import linear_logits

__all__ = ["linear_filtered_token_logprobs"]


def linear_filtered_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    top_k: int | None = None,
    top_p: float | None = None,
    ties: str = "together",
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> Tensor:
    """`[..., H]`, full `[V, H]`, `[...]` -> `[...]` float64: ``filtered_token_logprobs(z, token_ids,
    top_k, top_p, ties)`` of `z = linear_logits(hidden, weight, temperature, bias, logit_scale,
    softcap)`; 0 (no gradient) where `token_ids == ignore_index`."""
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)
    valid = token_ids != ignore_index
    k = top_k if top_k is not None and top_k > 0 else None
    out = filtered_token_logprobs(z, torch.where(valid, token_ids, 0), k, 1.0 if top_p is None else top_p, ties)
    return torch.where(valid, out, torch.zeros_like(out))

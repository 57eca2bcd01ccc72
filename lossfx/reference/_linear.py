"""Dense references of the fused LM-head path: form the float64 logits, then the logits references."""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx.reference._distillation import gather_logprobs
from lossfx.reference._logprobs import log_softmax

__all__ = [
    "linear_gather_logprobs",
    "linear_logits",
    "linear_logprob_objective",
    "linear_next_token_logprobs",
    "linear_token_logprobs",
]

_F64 = torch.float64


def linear_logits(hidden: Tensor, weight: Tensor, temperature: float = 1.0) -> Tensor:
    """`hidden [..., H]`, full `weight [V, H]` -> `hidden @ weight.T / temperature` `[..., V]` in float64."""
    return hidden.to(_F64) @ weight.to(_F64).T / temperature


def linear_token_logprobs(
    hidden: Tensor, weight: Tensor, target: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[...]` -> (`log_softmax(z)[target]` `[...]`, `Σ p log p` `[...]`), float64."""
    logprobs, neg_entropy = gather_logprobs(linear_logits(hidden, weight, temperature), target.unsqueeze(-1))
    return logprobs.squeeze(-1), neg_entropy


def linear_gather_logprobs(
    hidden: Tensor, weight: Tensor, ids: Tensor, zero_outside_topk: bool = True, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[..., K]` -> (log-probs at the ids `[..., K]`, `Σ p log p` `[...]`), float64.

    `zero_outside_topk=False` renormalises over the K ids: `log_softmax(z[ids])`.
    """
    z = linear_logits(hidden, weight, temperature)
    logprobs, neg_entropy = gather_logprobs(z, ids)
    if not zero_outside_topk:
        logprobs = log_softmax(z.gather(-1, ids))
    return logprobs, neg_entropy


def linear_next_token_logprobs(
    hidden: Tensor, weight: Tensor, input_ids: Tensor, temperature: float = 1.0, position_ids: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Canonical `[B, S, H]`, `[V, H]`, `[B, S]` -> (`[B, S−1]` next-token log-probs, `[B, S−1]` `Σ p log p`).

    With padding-free `position_ids [B, S]`, both are 0 at each sequence's last position
    (`position_ids[:, t+1] == 0`)."""
    logprobs, neg_entropy = linear_token_logprobs(hidden[:, :-1], weight, input_ids[:, 1:], temperature)
    if position_ids is None:
        return logprobs, neg_entropy
    ends = position_ids[:, 1:] == 0
    return torch.where(ends, 0.0, logprobs), torch.where(ends, 0.0, neg_entropy)


def linear_logprob_objective(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    logprob_weight: Tensor,
    entropy_weight: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[...]`, `[...]` -> (`Σ a·log p(target) + Σ b·Σ p log p` scalar, log-probs
    `[...]`, `Σ p log p` `[...]`), float64, all differentiable; no entropy term when `b` is `None`."""
    logprobs, neg_entropy = linear_token_logprobs(hidden, weight, target, temperature)
    objective = (logprob_weight.to(_F64) * logprobs).sum()
    if entropy_weight is not None:
        objective = objective + (entropy_weight.to(_F64) * neg_entropy).sum()
    return objective, logprobs, neg_entropy

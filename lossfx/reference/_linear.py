"""Dense references of the fused LM-head path: form the float64 logits, then the logits references.

Options shared by every function: `bias [V]`, `logit_scale` `s`, `softcap` `c` (None: no cap) and
`temperature` `T` give the logits `z = c · tanh(s · (h Wᵀ + b) / c) / T` (`z = s · (h Wᵀ + b) / T`
without a cap); ids equal to `ignore_index` have log-prob 0 and no gradient, and a row whose ids
are all ignored has `Σ p log p = 0`.
"""

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


def linear_logits(
    hidden: Tensor,
    weight: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """`hidden [..., H]`, full `weight [V, H]`, `bias [V]` -> `c·tanh(s·(hidden @ weight.T + bias)/c)/T`
    `[..., V]` in float64 (no tanh when `softcap` is None)."""
    raw = hidden.to(_F64) @ weight.to(_F64).T
    if bias is not None:
        raw = raw + bias.to(_F64)
    scaled = logit_scale * raw
    if softcap is not None:
        scaled = softcap * torch.tanh(scaled / softcap)
    return scaled / temperature


def _masked_gather(z: Tensor, ids: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log-probs at the ids, 0 where ignored; `Σ p log p`, 0 where every id is ignored; valid `[..., K]`)."""
    valid = ids != ignore_index
    logprobs, neg_entropy = gather_logprobs(z, torch.where(valid, ids, torch.zeros_like(ids)))
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    neg_entropy = torch.where(valid.any(dim=-1), neg_entropy, torch.zeros_like(neg_entropy))
    return logprobs, neg_entropy, valid


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[...]` -> (`log_softmax(z)[target]` `[...]`, `Σ p log p` `[...]`), float64."""
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)
    logprobs, neg_entropy, _ = _masked_gather(z, target.unsqueeze(-1), ignore_index)
    return logprobs.squeeze(-1), neg_entropy


def linear_gather_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    zero_outside_topk: bool = True,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> tuple[Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[..., K]` -> (log-probs at the ids `[..., K]`, `Σ p log p` `[...]`), float64.

    `zero_outside_topk=False` renormalises over the K ids that are not ignored: `log_softmax(z[ids])`.
    """
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)
    logprobs, neg_entropy, valid = _masked_gather(z, ids, ignore_index)
    if not zero_outside_topk:
        picked = z.gather(-1, torch.where(valid, ids, torch.zeros_like(ids)))
        fill = torch.where(valid.any(dim=-1, keepdim=True), float("-inf"), 0.0)
        renormed = log_softmax(torch.where(valid, picked, fill))
        logprobs = torch.where(valid, renormed, torch.zeros_like(renormed))
    return logprobs, neg_entropy


def linear_next_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    position_ids: Tensor | None = None,
    **options: object,
) -> tuple[Tensor, Tensor]:
    """Canonical `[B, S, H]`, `[V, H]`, `[B, S]` -> (`[B, S−1]` next-token log-probs, `[B, S−1]` `Σ p log p`);
    `options` as in `linear_token_logprobs`.

    With padding-free `position_ids [B, S]`, both are 0 at each sequence's last position
    (`position_ids[:, t+1] == 0`)."""
    logprobs, neg_entropy = linear_token_logprobs(hidden[:, :-1], weight, input_ids[:, 1:], temperature, **options)  # type: ignore[arg-type]
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
    **options: object,
) -> tuple[Tensor, Tensor, Tensor]:
    """`[..., H]`, `[V, H]`, `[...]`, `[...]` -> (`Σ a·log p(target) + Σ b·Σ p log p` scalar, log-probs
    `[...]`, `Σ p log p` `[...]`), float64, all differentiable; no entropy term when `b` is `None`;
    `options` as in `linear_token_logprobs` (ignored targets contribute 0)."""
    logprobs, neg_entropy = linear_token_logprobs(hidden, weight, target, temperature, **options)  # type: ignore[arg-type]
    objective = (logprob_weight.to(_F64) * logprobs).sum()
    if entropy_weight is not None:
        objective = objective + (entropy_weight.to(_F64) * neg_entropy).sum()
    return objective, logprobs, neg_entropy

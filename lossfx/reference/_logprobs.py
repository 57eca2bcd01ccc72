"""Dense references of token log-probabilities and of the LOGIT/LOGPROB loss inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "log_softmax",
    "next_token_logprobs",
    "prepare_loss_input",
    "token_logprobs",
]

_F64 = torch.float64


def log_softmax(logits: Tensor) -> Tensor:
    """`log_softmax` over the last dim in float64; all `-inf` rows give `-inf`, gradient 0."""
    z = logits.to(_F64)
    row_ok = ~torch.isneginf(z).all(dim=-1, keepdim=True)
    z_safe = torch.where(row_ok, z, torch.zeros_like(z))
    return torch.where(row_ok, z_safe.log_softmax(dim=-1), torch.full_like(z, float("-inf")))


def token_logprobs(logits: Tensor, target: Tensor, ignore_index: int | None = None) -> Tensor:
    """`[..., V]`, `[...]` -> `[...]`: `log_softmax(logits)[..., target]` in float64; 0 where
    `target == ignore_index` (when given)."""
    ignored = torch.zeros_like(target, dtype=torch.bool) if ignore_index is None else target == ignore_index
    logprobs = log_softmax(logits).gather(-1, target.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(ignored, 0.0, logprobs)


def next_token_logprobs(
    logits: Tensor, input_ids: Tensor, position_ids: Tensor | None = None, ignore_index: int | None = None
) -> Tensor:
    """`[B, S, V]`, `[B, S]` -> `[B, S-1]`: position `t` scores token `input_ids[:, t+1]`.

    With padding-free `position_ids [B, S]` (positions restarting at 0 where a sequence starts),
    0 at each sequence's last position (`position_ids[:, t+1] == 0`); 0 where
    `input_ids[:, t+1] == ignore_index` (when given)."""
    logprobs = token_logprobs(logits[:, :-1], input_ids[:, 1:], ignore_index)
    if position_ids is None:
        return logprobs
    return torch.where(position_ids[:, 1:] == 0, 0.0, logprobs)


def prepare_loss_input(logits: Tensor, data: dict[str, Any], loss_fn: Any) -> dict[str, Any]:
    """The loss-input dict of `lossfx.prepare_loss_input` from dense, canonical logits `[B, S, V]`."""
    input_type = getattr(loss_fn.input_type, "value", loss_fn.input_type)
    if input_type == "logit":
        return {"logits": logits}
    if input_type == "logprob":
        if getattr(loss_fn, "use_fused_linear_logprobs", False):
            return {"next_token_logprobs": logits.to(_F64)[:, : data["input_ids"].shape[1] - 1]}
        return {"next_token_logprobs": next_token_logprobs(logits, data["input_ids"])}
    raise NotImplementedError(f"reference.prepare_loss_input has no branch for {input_type!r} yet")

"""Dense references of top-k gathers, top-k distillation inputs and draft-model targets."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lossfx.reference._logprobs import log_softmax

_F64 = torch.float64


def gather_logprobs(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """`[..., V]`, `[..., K]` -> (`log_softmax(logits)[ids]` `[..., K]`, `Σ p log p` `[...]`)."""
    lp = log_softmax(logits)
    absent = torch.isneginf(lp)
    lp_safe = torch.where(absent, torch.zeros_like(lp), lp)  # no 0·(−∞) in the backward either
    plogp = torch.where(absent, torch.zeros_like(lp), lp_safe.exp() * lp_safe)
    return lp.gather(-1, ids.to(torch.int64)), plogp.sum(-1)


def vocab_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The `min(k, V)` largest entries per row, ties ordered by the smaller id (float64)."""
    z = logits.to(_F64)
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., : min(k, z.shape[-1])]
    return z.gather(-1, order), order


def distillation_topk_logprobs(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Canonical `[B, S, V]` student and `[B, S, K]` teacher -> the three `[B, S-1, ...]` outputs."""
    ids = teacher_topk_indices.to(torch.int64)
    if zero_outside_topk:
        student_lp, neg_entropy = gather_logprobs(student_logits, ids)
    else:
        student_lp = log_softmax(student_logits.to(_F64).gather(-1, ids))
        neg_entropy = None
    teacher_lp = log_softmax(teacher_topk_logits)
    entropy_out = neg_entropy[:, :-1] if (calculate_entropy and neg_entropy is not None) else None
    return student_lp[:, :-1], teacher_lp[:, :-1], entropy_out


def draft_targets(logits: Tensor, token_mask: Tensor, d2t: Tensor | None) -> tuple[Tensor, Tensor]:
    """Canonical `[B, S, V]` -> (shifted teacher logits in draft vocab `[B, S, D]`, shifted mask)."""
    shifted = torch.cat([logits.detach()[:, 1:], torch.zeros_like(logits[:, :1])], dim=1)
    if d2t is not None:
        shifted = shifted[..., torch.arange(d2t.shape[0], device=d2t.device) + d2t]
    mask = torch.cat([token_mask[:, 1:], torch.zeros_like(token_mask[:, :1])], dim=1)
    return shifted, mask


def prepare_distillation_input(logits: Tensor, data: dict[str, Any], loss_fn: Any) -> dict[str, Any]:
    """The `DISTILLATION` branch of `prepare_loss_input` on canonical, full-vocabulary logits."""
    zero_outside = bool(getattr(loss_fn, "zero_outside_topk", False))
    calculate_entropy = zero_outside and getattr(loss_fn, "kl_type", "mixed") != "forward"
    student, teacher, neg_entropy = distillation_topk_logprobs(
        logits, data["teacher_topk_logits"], data["teacher_topk_indices"], zero_outside, calculate_entropy
    )
    return {"student_topk_logprobs": student, "teacher_topk_logprobs": teacher, "H_all": neg_entropy}


def prepare_draft_input(logits: Tensor, data: dict[str, Any], d2t: Tensor | None) -> dict[str, Any]:
    """The `DRAFT` branch of `prepare_loss_input` on canonical, full-vocabulary logits."""
    teacher, mask = draft_targets(logits, data["token_mask"], d2t)
    return {"teacher_logits": teacher, "student_logits": data["student_logits"], "token_mask": mask}

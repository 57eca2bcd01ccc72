"""Dense reference of `lossfx.linear_divergence_to_teacher`: form the float64 logits of both sides,
then the logits references (`reverse_kl_to_fixed`, `cross_entropy_to_fixed`, `neg_entropy`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lossfx.reference._divergence import cross_entropy_to_fixed, neg_entropy, reverse_kl_to_fixed
from lossfx.reference._linear import linear_logits

__all__ = ["linear_divergence_to_teacher"]

_F64 = torch.float64


def linear_divergence_to_teacher(
    hidden: Tensor,
    weight: Tensor,
    *,
    teacher_logits: Tensor | None = None,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | Sequence[Tensor] | None = None,
    teacher_head: Tensor | None = None,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`hidden [..., H]`, full `weight [V, H]`, and `teacher_logits [..., V]` or `teacher_hidden
    [..., H_t]` with the full `teacher_weight [V, H_t]` (or a list of heads and `teacher_head [...]`,
    each row's position in it) -> `(reverse_kl, cross_entropy, neg_entropy)` `[...]` in float64,
    differentiable in hidden, weight and bias (the teacher detached).

    Student logits: `linear_logits` (the fused head options). Teacher: the logits, or row `n`'s
    `teacher_hidden[n].to(W_t.dtype).to(f64) @ W_t.to(f64).T` (as `opd_full_teacher_logits`)."""
    z = linear_logits(hidden, weight, temperature, bias, logit_scale, softcap)
    if teacher_logits is not None:
        t = teacher_logits.detach().to(_F64)
    else:
        assert teacher_hidden is not None and teacher_weight is not None
        heads = [teacher_weight] if isinstance(teacher_weight, Tensor) else list(teacher_weight)
        projected = [teacher_hidden.detach().to(w.dtype).to(_F64) @ w.detach().to(_F64).T for w in heads]
        t = projected[0]
        for k, p in enumerate(projected[1:], start=1):
            assert teacher_head is not None
            t = torch.where((teacher_head == k)[..., None], p, t)
    return reverse_kl_to_fixed(z, t), cross_entropy_to_fixed(z, t), neg_entropy(z)

"""Pure: top-k distillation inputs from hidden states, the student's logits never held.

    student[b, t, k] = log p_s(ids[b, t, k] | t),   p_s = softmax(head(hidden[b, t] @ W.T))
    teacher[b, t, k] = log_softmax_k(teacher_topk_logits[b, t])
    H_all[b, t]     = Σ_v p_s log p_s

`lossfx._layouts.distillation` with the logits gather replaced by the fused kernel
(`lossfx._kernels.fused_linear.linear_gather_logprobs`: one `[C, Cv]` tile of logits at a time,
`Σ p log p` from the same pass). Plain tensors in, validated by the public boundary
(`lossfx.linear_loss_input`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.numerics import compute_dtype, log_softmax_rows
from lossfx._core.tiles import HeadOptions, matmul_dtype
from lossfx._core.vocab import VocabRange
from lossfx._kernels import fused_linear as _kernel
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = ["defer_active_rows", "linear_distillation_topk_logprobs"]

_PAD = -1  # the id of layout padding: never a real id (the ids are range-checked), so never computed


def linear_distillation_topk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    vocab: VocabRange,
    layout: SequenceLayout,
    *,
    head: HeadOptions,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    chunk_rows: int = 0,
    count: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """hidden `[B, S_l, H]` (this rank's positions of `layout`), weight `[Vl, H]` (rows
    `vocab.start + [0, Vl)`), teacher `[B, S, K]` canonical -> `(student [B, S-1, K], teacher
    [B, S-1, K], H_all [B, S-1] or None)` in the compute dtype.

    Dense equivalent: ``lossfx.reference.prepare_distillation_input(z, ...)`` with
    ``z = head(hidden @ W_full.T + b_full)``. `count`: the `into` of `defer_active_rows` (the
    kernel's count of active rows, deferred ahead of the call's first read), or None.
    """
    seq = teacher_topk_indices.shape[1]
    ids = _local_ids(hidden, teacher_topk_indices, layout)
    student_lp, neg_entropy = _kernel.linear_gather_logprobs(
        hidden,
        weight,
        ids,
        vocab,
        head=head._replace(ignore_index=_PAD),
        with_neg_entropy=zero_outside_topk and calculate_entropy,
        zero_outside_topk=zero_outside_topk,
        chunk_rows=chunk_rows,
        count=count,
    )
    width = max(seq - 1, 0)  # position t predicts token t+1: the last position is dropped
    student_lp = layout.to_canonical(student_lp, width)
    if neg_entropy is not None:
        neg_entropy = layout.to_canonical(neg_entropy, width)
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    teacher_lp = log_softmax_rows(teacher_topk_logits.to(device=student_lp.device, dtype=cdtype))
    return student_lp, teacher_lp[:, :width], neg_entropy


def _local_ids(hidden: Tensor, teacher_topk_indices: Tensor, layout: SequenceLayout) -> Tensor:
    """The teacher's ids in `hidden`'s layout, `_PAD` in the layout's padding."""
    return layout.to_local(teacher_topk_indices.to(device=hidden.device, dtype=torch.int64), hidden.shape[1], fill=_PAD)


def defer_active_rows(hidden: Tensor, teacher_topk_indices: Tensor, layout: SequenceLayout, into: list[int]) -> None:
    """Defer the kernel's count of active rows (`fused_linear.defer_active_rows`) of
    `linear_distillation_topk_logprobs(hidden, ..., teacher_topk_indices, ..., layout)`, into `into`."""
    _kernel.defer_active_rows(_local_ids(hidden, teacher_topk_indices, layout), _PAD, into)

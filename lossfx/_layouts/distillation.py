"""Pure: top-k distillation log-probs over a sequence layout, on plain tensors and a `VocabRange`.

    student[b, t, k] = log p_s(ids[b, t, k] | t)        (over the full vocabulary, or the K ids)
    teacher[b, t, k] = log_softmax_k(teacher_topk_logits[b, t])

The public boundary (`lossfx.distillation`) unwraps DTensors, validates the arguments, range-checks
the ids once and builds the layout and the `VocabRange`; the function here only computes, calling
the pure gather kernels (`lossfx._kernels.gather`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.numerics import compute_dtype, log_softmax_rows
from lossfx._core.vocab import VocabRange
from lossfx._kernels import gather as _gather
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = ["distillation_topk_logprobs"]


def distillation_topk_logprobs(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    vocab: VocabRange,
    layout: SequenceLayout,
    *,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(student [B, S-1, K], teacher [B, S-1, K], H_all [B, S-1] or None)` in the compute dtype.

    `student_logits [B, S_l, Vl]` are this rank's part (columns `vocab.start + [0, Vl)`, positions
    of `layout`); `teacher_topk_logits`, `teacher_topk_indices [B, S, K]` canonical (ids in
    `[0, vocab.size)`, any int dtype). `H_all = Σ p log p` only with both `zero_outside_topk` and
    `calculate_entropy`. Dense equivalent (`lossfx.reference.distillation_topk_logprobs`)::

        lp = full_logits.log_softmax(-1)
        s = lp.gather(-1, ids) if zero_outside_topk else full_logits.gather(-1, ids).log_softmax(-1)
        (s[:, :-1], teacher_topk_logits.log_softmax(-1)[:, :-1], (lp.exp() * lp).sum(-1)[:, :-1])
    """
    seq, local_len = teacher_topk_indices.shape[1], student_logits.shape[1]
    ids = layout.to_local(teacher_topk_indices.to(torch.int64), local_len)  # [B, S_l, K]
    neg_entropy = None
    if zero_outside_topk:
        student_lp, neg_entropy = _gather.gather_logprobs(
            student_logits, ids, vocab, with_neg_entropy=calculate_entropy, chunk_rows=chunk_rows
        )
    else:
        student_lp = log_softmax_rows(_gather.gather_logits(student_logits, ids, vocab))  # [B, S_l, K]
    width = max(seq - 1, 0)  # position t predicts token t+1: the last position is dropped
    student_lp = layout.to_canonical(student_lp, width)
    if neg_entropy is not None:
        neg_entropy = layout.to_canonical(neg_entropy, width)
    cdtype = compute_dtype(student_logits.dtype)
    teacher_lp = log_softmax_rows(teacher_topk_logits.to(device=student_lp.device, dtype=cdtype))
    return student_lp, teacher_lp[:, :width], neg_entropy

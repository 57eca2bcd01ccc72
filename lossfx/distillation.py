"""Top-k distillation inputs: student and teacher log-probs at the teacher's top-k ids.

Pipeline (`distillation_topk_logprobs`), every step on this rank's `[B, S_l, Vl]` student shard:

1. the canonical ids `[B, S, K]` in the logits' sequence layout (`lossfx.sequence_layout`: with
   load-balanced context parallelism padded to `C·S_l` and cut to this rank's positions; or an
   external `cp_sharder`'s layout);
2. student log-probs at the ids, either normalised over the full vocabulary (`zero_outside_topk`,
   with `Σ p log p` from the same streaming pass when asked: `gather.gather_logprobs`), or
   renormalised over the K ids (`gather.gather_logits`, then a K-way `log_softmax`);
3. the per-token results back to canonical order (`SequenceLayout.to_canonical`: under lossfx's
   CP layout gradients are summed over CP ranks, so divide the loss by `C`) and unpadded;
4. the teacher's log-probs, renormalised over its K logits; all outputs drop the last position
   (position `t` predicts token `t+1`; student and teacher are already aligned).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import replicated, vocab_shard
from lossfx._boundary.validation import check_floating, check_ids_in_range, check_integer_ids, check_positive_int
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._core.numerics import compute_dtype, log_softmax_rows
from lossfx.gather import gather_logits, gather_logprobs
from lossfx.sequence_layout import ContextParallelSharder, sequence_layout

__all__ = ["distillation_topk_logprobs"]


@boundary(
    roles=Roles(
        tp="vocab_parallel_group",
        cp="context_parallel_group",
        cp_from="cp_sharder",
        shards=("student_logits",),
    ),
    vocab="equal",
)
def distillation_topk_logprobs(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    *,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    cp_sharder: ContextParallelSharder | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Student and teacher log-probs at the teacher's top-k ids, next-token aligned.

    Equivalent (no parallelism) to::

        lp = student_logits.log_softmax(-1)
        slp = lp.gather(-1, ids) if zero_outside_topk else student_logits.gather(-1, ids).log_softmax(-1)
        tlp = teacher_topk_logits.log_softmax(-1)
        H = (lp.exp() * lp).sum(-1)
        return slp[:, :-1], tlp[:, :-1], H[:, :-1] if calculate_entropy else None

    Args:
        student_logits: `[B, S_l, Vl]` this rank's shard (TP over the vocabulary, CP over the
            sequence in the load-balanced layout; `S_l = S` without CP).
        teacher_topk_logits: `[B, S, K]` canonical teacher logits at its top-k ids.
        teacher_topk_indices: `[B, S, K]` canonical global ids in `[0, V)`, any integer dtype;
            duplicates allowed.
        zero_outside_topk: normalise the student over the full vocabulary (True) or over the K
            ids (False; a duplicated id then counts twice in the normaliser, as in the reference).
        calculate_entropy: also return `H_all = Σ_v p log p` (the negative entropy); only
            meaningful with `zero_outside_topk`.
        vocab_parallel_group: TP group over the vocabulary, or `None`.
        context_parallel_group: CP group, or `None`; gradients follow the summed convention.
        chunk_size: sequence positions per eager chunk (memory bound only).
        cp_sharder: an external context-parallel layout (`shard_token_tensor` /
            `gather_token_tensor`) or a `lossfx.sequence_layout.SequenceLayout`; takes precedence
            over `context_parallel_group`.

    Returns:
        `(student_topk_logprobs [B, S-1, K], teacher_topk_logprobs [B, S-1, K], H_all [B, S-1] or
        None)` in the compute dtype, replicated over TP and CP ranks.

    Raises:
        ValueError: `K <= 0`, ids outside `[0, V)`, shape mismatches. TypeError: bad dtypes.
    """
    student_logits, vocab_parallel_group, *_ = vocab_shard(
        student_logits, name="student_logits", group=vocab_parallel_group, even=True, group_arg="vocab_parallel_group"
    )
    teacher_topk_logits, teacher_topk_indices = (
        replicated(teacher_topk_logits, "teacher_topk_logits"),
        replicated(teacher_topk_indices, "teacher_topk_indices"),
    )
    check_floating("student_logits", student_logits)
    check_floating("teacher_topk_logits", teacher_topk_logits)
    check_integer_ids("teacher_topk_indices", teacher_topk_indices)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if teacher_topk_indices.dim() != 3 or teacher_topk_indices.shape[-1] < 1:
        raise ValueError(
            f"topk must be positive: teacher_topk_indices must be [B, S, K] with K >= 1, got shape "
            f"{tuple(teacher_topk_indices.shape)} (topk=0 is not supported)"
        )
    if tuple(teacher_topk_logits.shape) != tuple(teacher_topk_indices.shape):
        raise ValueError(
            f"teacher_topk_logits and teacher_topk_indices must share one [B, S, K] shape; got "
            f"{tuple(teacher_topk_logits.shape)} and {tuple(teacher_topk_indices.shape)}"
        )
    if student_logits.dim() != 3 or student_logits.shape[0] != teacher_topk_indices.shape[0]:
        raise ValueError(
            f"student_logits must be [B, S_local, V_local] with the teacher's B; got "
            f"{tuple(student_logits.shape)} and teacher shape {tuple(teacher_topk_indices.shape)}"
        )
    batch, seq, _ = teacher_topk_indices.shape
    layout = sequence_layout(context_parallel_group, cp_sharder)
    local_len = student_logits.shape[1]
    layout.check_covers(
        "student_logits",
        local_len,
        seq,
        f"student_logits.shape={tuple(student_logits.shape)} and teacher shape {tuple(teacher_topk_indices.shape)}",
        canonical="teacher_topk_indices",
    )
    vocab = group_size(vocab_parallel_group) * student_logits.shape[-1]
    check_ids_in_range("teacher_topk_indices", teacher_topk_indices, vocab)
    # any integer dtype: int64 for gather (uint8 ids would also wrap in `ids - vocab_start`)
    ids = layout.to_local(teacher_topk_indices.to(torch.int64), local_len)  # [B, S_l, K]
    rows = None if chunk_size is None else chunk_size * batch
    neg_entropy = None
    if zero_outside_topk:
        student_lp, neg_entropy = gather_logprobs(
            student_logits, ids, with_neg_entropy=calculate_entropy, group=vocab_parallel_group, chunk_rows=rows
        )
    else:
        picked = gather_logits(student_logits, ids, group=vocab_parallel_group)  # [B, S_l, K]
        student_lp = log_softmax_rows(picked)
    width = max(seq - 1, 0)  # position t predicts token t+1: the last position is dropped
    student_lp = layout.to_canonical(student_lp, width)
    if neg_entropy is not None:
        neg_entropy = layout.to_canonical(neg_entropy, width)
    cdtype = compute_dtype(student_logits.dtype)
    teacher_lp = log_softmax_rows(teacher_topk_logits.to(device=student_lp.device, dtype=cdtype))
    return student_lp, teacher_lp[:, :width], neg_entropy

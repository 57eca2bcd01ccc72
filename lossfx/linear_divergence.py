"""OPD_FULL's divergences from hidden states: the student's logits (and the teacher's) never materialised.

    z_s = c · tanh(s · (hidden @ weight.T + bias) / c) / T        (the fused head, `LogitHead`)
    z_t = teacher_logits, or teacher_hidden @ teacher_weight.T     (fixed: no gradient)
    reverse_kl = Σ p_s (log p_s − log p_t),  cross_entropy = −Σ p_s log p_t,  neg_entropy = Σ p_s log p_s

One tile loop computes all three (`lossfx._kernels.linear_divergence`): at most one `[C, Cv]` tile
of each side's logits is alive, forward and backward, eager and compiled. Under tensor parallelism
`weight`, `bias`, `teacher_logits` and `teacher_weight` are this rank's vocabulary shard (the same
rows; uneven widths allowed) and one all-gather of `7N` per-row statistics merges the ranks.

The boundary: `linear_divergence_to_teacher` does its boundary work once (the cross-rank check of
`@boundary`, the head and its options through `lossfx.fused_linear.resolved_call`, the teacher's
arguments), then calls the pure kernel once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Unpack

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import local_view
from lossfx._core.distributed import ProcessGroup
from lossfx._kernels import linear_divergence as _kernel
from lossfx._kernels.linear_divergence import LinearDivergence
from lossfx.divergence import fixed_teacher, projected_teacher
from lossfx.fused_linear import HeadKeywords, head_keywords, resolved_call

__all__ = ["LinearDivergence", "linear_divergence_to_teacher"]

# `weight`'s rows are this rank's width; `teacher_logits` and `bias` are shards of it; the teacher
# head is per rank (its rows, like weight's, are not compared across ranks)
_ROLES = Roles(tp="group", head="weight", shards=("teacher_logits", "bias"), heads="teacher_weight")


def _check_teacher(
    hidden: Tensor,
    weight: Tensor,
    teacher_logits: Tensor | None,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | Sequence[Tensor] | None,
    teacher_head: Tensor | None,
    teacher_logits_dtype: torch.dtype | None,
) -> tuple[list[Tensor], torch.dtype]:
    """Check the teacher's arguments against `hidden [..., H]` and `weight [Vl, H]` (a projected
    teacher: `lossfx.divergence.projected_teacher`); returns the teacher heads (a list, empty for
    `teacher_logits`) and the teacher logits' dtype."""
    lead, local_vocab = tuple(hidden.shape[:-1]), weight.shape[0]
    if (teacher_logits is None) == (teacher_hidden is None and teacher_weight is None):
        raise ValueError(
            "pass the teacher either as teacher_logits or as teacher_hidden with teacher_weight (exactly one form)"
        )
    if teacher_logits is not None:
        # the student's logits are hidden × weight: [..., Vl] on hidden's device
        fixed_teacher(teacher_logits, "teacher_logits", (*lead, local_vocab), hidden.device)
        if teacher_logits_dtype is not None or teacher_head is not None:
            raise ValueError("teacher_logits_dtype and teacher_head apply to a projected teacher only (teacher_hidden)")
        return [], teacher_logits.dtype
    if teacher_hidden is None or teacher_weight is None:
        raise ValueError("teacher_hidden and teacher_weight go together: pass both")
    student = (lead, local_vocab, hidden.device)
    return projected_teacher(teacher_hidden, teacher_weight, teacher_head, teacher_logits_dtype, student, _NAMES)


_NAMES = ("teacher_hidden", "teacher_weight", "teacher_head", "teacher_logits_dtype")  # `projected_teacher`'s


# the one unwrap (`local_view`): a `Shard(0)` DTensor `weight` as this rank's rows with the group of its
# placement (uneven rows included); `bias` and each `teacher_weight` `Shard(0)`, `teacher_logits` `Shard(-1)`
# on the same mesh as their local rows/columns; `hidden`, `teacher_hidden`, `teacher_head` `Replicate()`
@boundary(roles=_ROLES, vocab="free", local=local_view(_ROLES))
@head_keywords
def linear_divergence_to_teacher(
    hidden: Tensor,
    weight: Tensor,
    *,
    teacher_logits: Tensor | None = None,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | Sequence[Tensor] | None = None,
    teacher_head: Tensor | None = None,
    teacher_logits_dtype: torch.dtype | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    **head: Unpack[HeadKeywords],
) -> LinearDivergence:
    """Reverse KL, cross-entropy and `Σ p log p` of the student `hidden × weight` against a fixed
    teacher, per token, in one tile loop: neither side's `[N, V]` logits ever exist.

    Equivalent, on the full vocabulary (all ranks' shards concatenated in rank order), to::

        z_s = hidden @ weight.T / temperature          # with bias, logit_scale, softcap as the fused functions
        z_t = teacher_logits  # or lossfx.divergence.project_onto_lm_head(teacher_hidden, teacher_weight, dtype)
        LinearDivergence(lossfx.reverse_kl_to_fixed(z_s, z_t), lossfx.cross_entropy_to_fixed(z_s, z_t),
                         lossfx.neg_entropy(z_s))

    the three quantities OPD_FULL returns (`opd_full_divergence`, `opd_full_cross_entropy`,
    `opd_full_entropy`), with the logits path's conventions: `0 · log 0 = 0`, a teacher `-inf`
    where the student has mass gives `+inf` (KL and CE) and no gradient on that row, an all `-inf`
    teacher row has `log p_t = -inf` everywhere.

    Args:
        hidden: `[..., H]` the student's last hidden states (replicated over the TP group; every
            rank's `hidden.grad` is the full gradient: one all-reduce of `[N, H]` backward).
        weight: `[Vl, H]` this rank's rows of the student's LM head (the whole head without a group),
            or a `Shard(0)` DTensor (uneven rows included: the group is its placement's; then `bias`,
            `teacher_weight` may be `Shard(0)` and `teacher_logits` `Shard(-1)` DTensors on the same
            mesh, and `hidden`, `teacher_hidden`, `teacher_head` `Replicate()` ones; outputs are plain).
        teacher_logits: `[..., Vl]` the teacher's logits, the same columns as `weight`'s rows; or
        teacher_hidden: `[..., H_t]` the teacher's hidden states (replicated), with
        teacher_weight: `[Vl, H_t]` this rank's rows of the teacher's LM head (the same vocabulary
            rows as `weight`), or a list of such heads (one shape and dtype) with
        teacher_head: `[...]` integer position in `teacher_weight` of each row's head (required
            with several heads; OPD_FULL's `opd_full_teacher_index`, mapped to positions). The
            teacher is fixed: it never receives a gradient.
        teacher_logits_dtype: dtype of the projected teacher logits (`None`: `teacher_weight`'s), as
            `prepare_loss_input`'s: the hidden states are rounded to the head's dtype, each product to this.
        group: tensor-parallel group over the vocabulary, or `None`.
        bias, temperature, logit_scale, softcap: the student's head (`HeadKeywords`), as
            `lossfx.linear_token_logprobs`.
        ignore_index: accepted with the head options (`HeadKeywords`) and unused: this function
            reads no ids.
        chunk_size: rows per `[C, Cv]` tile (a memory bound; results do not depend on it);
            default from the device's `lossfx.ChunkPolicy`.

    Returns:
        `LinearDivergence(reverse_kl, cross_entropy, neg_entropy)`, each `[...]` in
        `promote_types(hidden @ weight.T, teacher logits, float32)` (the logits path's dtype),
        replicated over the group. Gradients reach `hidden`, `weight` and `bias` from each one
        that reaches a loss (an output used as a metric costs no backward work).

    Raises:
        TypeError: non-float tensors, a non-float `teacher_logits_dtype`.
        ValueError: both or neither teacher form, shape or device mismatches, bad head options,
            `teacher_head` outside `[0, len(teacher_weight))` (compiled: an in-graph check).

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> lossfx.linear_divergence_to_teacher(h, w, teacher_logits=h @ w.T).reverse_kl
        tensor([0.])

    See also: docs/fused_linear.md, proofs/linear_divergence.md,
    lossfx.reference.linear_divergence_to_teacher.
    """
    # hidden, weight, the teacher: local tensors (the boundary's one unwrap, `local_view`)
    call = resolved_call(hidden, weight, {**head, "group": group, "chunk_size": chunk_size})
    heads, dtype = _check_teacher(
        hidden, weight, teacher_logits, teacher_hidden, teacher_weight, teacher_head, teacher_logits_dtype
    )
    return _kernel.linear_divergence_to_teacher(
        hidden,
        weight,
        group,
        teacher_logits=teacher_logits,
        teacher_hidden=teacher_hidden,
        teacher_weights=heads,
        teacher_head=teacher_head,
        logits_dtype=dtype,
        head=call.head,
        chunk_rows=call.chunk_rows,
    )

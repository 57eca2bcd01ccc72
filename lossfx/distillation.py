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

The boundary: `distillation_topk_logprobs` (and `lossfx.prepare_loss_input`'s `DISTILLATION`
branch, through the same private `_distillation`) unwraps DTensors, validates the arguments,
range-checks the ids once, builds the layout and the `VocabRange`, then calls the pure
`lossfx._layouts.distillation.distillation_topk_logprobs` once.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import local_view, resolved_shard
from lossfx._boundary.validation import check_floating, check_ids_in_range, check_integer_ids, check_positive_int
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._layouts import distillation as _pure
from lossfx.next_token import resolved_vocab
from lossfx.sequence_layout import ContextParallelSharder, SequenceLayout, check_covers, sequence_layout

__all__ = ["distillation_topk_logprobs"]


_ROLES = Roles(  # the parameters' parts (`Roles`)
    tp="vocab_parallel_group", cp="context_parallel_group", cp_from="cp_sharder", shards=("student_logits",)
)


@boundary(roles=_ROLES, vocab="equal", local=local_view(_ROLES, even=True))
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
    _view: dict[str, Any] | None = None,
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
    return _distillation(
        student_logits,
        teacher_topk_logits,
        teacher_topk_indices,
        zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy,
        vocab_parallel_group=vocab_parallel_group,
        layout=sequence_layout(context_parallel_group, cp_sharder),
        chunk_size=chunk_size,
        vocab_size=resolved_shard(_view).vocab_size,
    )


def _distillation(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    *,
    vocab_parallel_group: ProcessGroup | None,
    layout: SequenceLayout,
    chunk_size: int | None,
    vocab_size: int | None = None,
    **flags: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The boundary work of `distillation_topk_logprobs` (`validated_distillation`), then the
    pure call: shared with `prepare_loss_input`'s `DISTILLATION` branch (`vocab_size`: a padded
    DTensor shard's real `V`; `flags`: the pure call's `zero_outside_topk` and `calculate_entropy`)."""
    student, values, ids, vocab, chunk_rows = validated_distillation(
        student_logits,
        teacher_topk_logits,
        teacher_topk_indices,
        vocab_parallel_group,
        layout,
        chunk_size,
        real_size=vocab_size,
    )
    return _pure.distillation_topk_logprobs(student, values, ids, vocab, layout, chunk_rows=chunk_rows, **flags)


def validated_distillation(
    student_logits: Tensor,
    teacher_topk_logits: Tensor,
    teacher_topk_indices: Tensor,
    vocab_parallel_group: ProcessGroup | None,
    layout: SequenceLayout,
    chunk_size: int | None,
    names: tuple[str, str, str] = ("student_logits", "teacher_topk_logits", "teacher_topk_indices"),
    real_size: int | None = None,
    **vocab: Any,
) -> tuple[Tensor, Tensor, Tensor, VocabRange, int | None]:
    """The boundary work of a distillation call, once: `(student_logits, teacher_topk_logits,
    teacher_topk_indices, vocab, chunk_rows)` as the pure layouts take them (the fused front door's
    too: `names`, how its arguments are called there; `vocab`: its head's `vocab_start`,
    `vocab_size`, `widths`, as `lossfx.next_token.resolved_vocab` takes them; `real_size`: a
    padded DTensor shard's real `V`, the range of its ids). Local tensors (the boundary's one unwrap)."""
    logits_name, values_name, ids_name = names
    check_floating(logits_name, student_logits)
    check_floating(values_name, teacher_topk_logits)
    check_integer_ids(ids_name, teacher_topk_indices)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if teacher_topk_indices.dim() != 3 or teacher_topk_indices.shape[-1] < 1:
        raise ValueError(
            f"topk must be positive: {ids_name} must be [B, S, K] with K >= 1, got shape "
            f"{tuple(teacher_topk_indices.shape)} (topk=0 is not supported)"
        )
    if tuple(teacher_topk_logits.shape) != tuple(teacher_topk_indices.shape):
        raise ValueError(
            f"{values_name} and {ids_name} must share one [B, S, K] shape; got "
            f"{tuple(teacher_topk_logits.shape)} and {tuple(teacher_topk_indices.shape)}"
        )
    if student_logits.dim() != 3 or student_logits.shape[0] != teacher_topk_indices.shape[0]:
        raise ValueError(
            f"{logits_name} must be [B, S_local, V_local] with the teacher's B; got "
            f"{tuple(student_logits.shape)} and teacher shape {tuple(teacher_topk_indices.shape)}"
        )
    batch, seq, _ = teacher_topk_indices.shape
    got = f"{logits_name}.shape={tuple(student_logits.shape)} and teacher shape {tuple(teacher_topk_indices.shape)}"
    check_covers(layout, logits_name, student_logits.shape[1], seq, got, canonical=ids_name)
    check = functools.partial(check_ids_in_range, ids_name, teacher_topk_indices)
    # the ids' range: a padded DTensor shard's real V (its padding columns are no ids), else the call's V
    resolved = resolved_vocab(vocab_parallel_group, student_logits.shape[-1], lambda v: check(real_size or v), **vocab)
    chunk_rows = None if chunk_size is None else chunk_size * batch
    return student_logits, teacher_topk_logits, teacher_topk_indices, resolved, chunk_rows

"""Student/teacher reductions over a vocabulary that may be sharded across tensor-parallel ranks.

All three functions return, per token, `R = Σ_v p_s(v) · w(v)` with `p_s = softmax(student)`,
`log p_t = log_softmax(teacher)` (the teacher is fixed: it receives no gradient) and

    neg_entropy             w = log p_s                 R = Σ p_s log p_s      (≤ 0: the NEGATIVE entropy)
    cross_entropy_to_fixed  w = −log p_t                R = −Σ p_s log p_t
    reverse_kl_to_fixed     w = log p_s − log p_t       R = KL(p_s ‖ p_t)

The boundary: each public function does its boundary work once, at the top (the cross-rank check
of `@boundary`, DTensor unwrapping, argument validation, the `chunk_size` deprecation), then calls
its pure kernel in `lossfx._kernels.divergence` exactly once (the pipeline, one all-gather of `5N`
per-row statistics forward and no collective backward, is documented there). No public function
here calls another one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.deprecation import warn_renamed
from lossfx._boundary.dtensor import local_view
from lossfx._boundary.validation import check_floating, check_ids_in_range, check_integer_ids, check_positive_int
from lossfx._core.chunking import resolve_chunk_rows
from lossfx._core.distributed import ProcessGroup
from lossfx._kernels import divergence as _kernel
from lossfx._kernels.divergence import project_onto_lm_head as project_onto_lm_head  # (re-exported)

__all__ = ["cross_entropy_to_fixed", "entropy", "neg_entropy", "reverse_kl_to_fixed"]


def _validated(student: Tensor, teacher: Tensor | None, chunk_rows: int | None) -> int | None:
    """Check the plain (already unwrapped) arguments of the three functions; returns `chunk_rows`."""
    check_floating("student", student)
    chunk_rows = check_positive_int("chunk_rows", chunk_rows)
    if student.dim() < 1 or student.shape[-1] < 1:
        raise ValueError(
            f"student logits must be [..., V_local] with at least one vocabulary column; got shape "
            f"{tuple(student.shape)}"
        )
    if teacher is not None:
        fixed_teacher(teacher, "teacher", tuple(student.shape), student.device)
    return chunk_rows


def fixed_teacher(teacher: object, name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Fixed teacher logits `[..., Vl]` (named `name`), checked against the student's logits' `shape`
    and `device`: the one check of a teacher given as logits (these functions' `teacher`,
    `lossfx.linear_divergence_to_teacher`'s `teacher_logits`, whose student is its hidden × head)."""
    teacher = check_floating(name, teacher)
    if tuple(teacher.shape) != shape:
        raise ValueError(
            f"{name} must be [..., V_local] = {shape}: the student and teacher logits must share the same "
            f"[..., V_local] shape (the student's leading dims and vocabulary columns); got {tuple(teacher.shape)}"
        )
    if teacher.device != device:
        raise ValueError(f"{name} must be on the student's device {device}, got {teacher.device}")
    return teacher


_COMMON_DOC = """
    Args:
        student: `[..., Vl]` this rank's vocabulary shard of the student logits (the full
            vocabulary without a group). Any float dtype; never modified.{teacher_arg}
        group: tensor-parallel process group over the vocabulary, or `None`. The output is the
            same on every rank; the gradient each rank receives is for its own shard only.
        chunk_rows: rows of the flattened `[N, Vl]` logits processed at once in eager mode (a
            memory bound; results do not depend on it). Default: the device's
            `lossfx.ChunkPolicy` (CPU: about 2 MiB per temporary). Under `torch.compile` the
            whole tensor is one fused pass.
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `[...]` per-token values in `promote_types(student, teacher, float32)` (fp32 for
        bf16/fp16/fp32, float64 for float64). The gradient flows back to `student` in its own
        dtype{teacher_grad}. Under `torch.no_grad()`, or when `student` does not require grad,
        nothing is saved for backward.

    Raises:
        TypeError: non-float inputs, non-int `chunk_rows`.
        ValueError: shape mismatch, an empty vocabulary, `chunk_rows <= 0`.

    Note:
        Computation is in the compute dtype, one all-gather of `5N` per-row statistics over the
        group in the forward and no collective in the backward. `0 · log 0 = 0`: columns where
        `p_s = 0` contribute nothing; a student row that is `-inf` everywhere gives 0 with a
        zero gradient.{inf_note} Double backward is not supported (`once_differentiable`).
"""


_ROLES_STUDENT = Roles(tp="group", shards=("student",))  # the parameters' parts (`Roles`)
_ROLES_PAIR = Roles(tp="group", shards=("student", "teacher"))


@boundary(roles=_ROLES_STUDENT, vocab="free", local=local_view(_ROLES_STUDENT))
def neg_entropy(
    student: Tensor,
    *,
    group: ProcessGroup | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Negative entropy `Σ_v p log p` (≤ 0) of the student distribution, per token.

    Equivalent to ``(p * p.log()).sum(-1)`` with ``p = student.softmax(-1)`` on the
    full-vocabulary logits (with `0 · log 0 = 0`), without materialising a `[N, V]` tensor.

    .. math::
        \\mathrm{out}_n = \\sum_v p_{n,v} \\log p_{n,v} \\le 0
    """
    chunk_rows = _validated(student, None, resolve_chunk_rows(chunk_rows, chunk_size))
    return _kernel.neg_entropy(student, group, chunk_rows=chunk_rows)


@boundary(roles=_ROLES_STUDENT, vocab="free", local=local_view(_ROLES_STUDENT))
def entropy(
    student: Tensor,
    *,
    group: ProcessGroup | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Deprecated name of `neg_entropy`: the same value `Σ_v p log p` (≤ 0, the NEGATIVE entropy),
    with a FutureWarning in eager mode (none under `torch.compile`: no graph break).

    Equivalent to ``lossfx.neg_entropy(student, group=group, chunk_rows=chunk_rows)``; the entropy
    `−Σ p log p` is its negation.
    """
    warn_renamed("lossfx.entropy", "lossfx.neg_entropy", stacklevel=4)  # past the boundary's wrapper
    chunk_rows = _validated(student, None, resolve_chunk_rows(chunk_rows, chunk_size))
    return _kernel.neg_entropy(student, group, chunk_rows=chunk_rows)


@boundary(roles=_ROLES_PAIR, vocab="free", local=local_view(_ROLES_PAIR))
def cross_entropy_to_fixed(
    student: Tensor,
    teacher: Tensor,
    *,
    group: ProcessGroup | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Cross-entropy `−Σ_v p_s log p_t` from the student to fixed teacher logits, per token.

    Equivalent to ``-(student.softmax(-1) * teacher.log_softmax(-1)).sum(-1)`` on the
    full-vocabulary logits (with `0 · log 0 = 0`), without materialising a `[N, V]` tensor.

    .. math::
        \\mathrm{out}_n = -\\sum_v p_s(v) \\log p_t(v)
    """
    chunk_rows = _validated(student, teacher, resolve_chunk_rows(chunk_rows, chunk_size))
    return _kernel.cross_entropy_to_fixed(student, teacher, group, chunk_rows=chunk_rows)


@boundary(roles=_ROLES_PAIR, vocab="free", local=local_view(_ROLES_PAIR))
def reverse_kl_to_fixed(
    student: Tensor,
    teacher: Tensor,
    *,
    group: ProcessGroup | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Reverse KL `KL(p_s ‖ p_t) = Σ_v p_s (log p_s − log p_t)` to fixed teacher logits, per token.

    Equivalent to ``(p_s * (student.log_softmax(-1) - teacher.log_softmax(-1))).sum(-1)`` with
    ``p_s = student.softmax(-1)`` on the full-vocabulary logits (with `0 · log 0 = 0`), without
    materialising a `[N, V]` tensor. `entropy + cross_entropy_to_fixed == reverse_kl_to_fixed`
    to rounding; identical student and teacher give exactly 0 with a zero gradient.

    .. math::
        \\mathrm{out}_n = \\sum_v p_s(v) \\left(\\log p_s(v) - \\log p_t(v)\\right)

    Example:
        >>> import torch, lossfx
        >>> s = torch.tensor([[0.0, 1.0, 2.0]])
        >>> lossfx.reverse_kl_to_fixed(s, s)
        tensor([0.])
    """
    chunk_rows = _validated(student, teacher, resolve_chunk_rows(chunk_rows, chunk_size))
    return _kernel.reverse_kl_to_fixed(student, teacher, group, chunk_rows=chunk_rows)


_TEACHER_ARG = """
        teacher: `[..., Vl]` the teacher logits, same shape as `student` (any float dtype, e.g.
            an fp32 teacher beside a bf16 student). Fixed: it never receives a gradient."""
_INF_NOTE = """ A teacher `-inf` where the student has mass makes the value
        `+inf` (mathematically right) and that row's gradient 0; a teacher row that is `-inf`
        everywhere counts as `log p_t = -inf` everywhere."""
neg_entropy.__doc__ = (
    (neg_entropy.__doc__ or "")
    + _COMMON_DOC.format(teacher_arg="", teacher_grad="", inf_note="")
    + ("\n    See also: proofs/divergence.md, lossfx.reference.neg_entropy.\n")
)
for _fn, _ref in (
    (cross_entropy_to_fixed, "cross_entropy_to_fixed"),
    (reverse_kl_to_fixed, "reverse_kl_to_fixed"),
):
    _doc = _fn.__doc__ or ""
    _head, _sep, _example = _doc.partition("    Example:")
    _fn.__doc__ = (
        _head.rstrip()
        + "\n"
        + _COMMON_DOC.format(teacher_arg=_TEACHER_ARG, teacher_grad="; the teacher gets none", inf_note=_INF_NOTE)
        + ("\n" + _sep + _example.rstrip() + "\n" if _sep else "")
        + f"\n    See also: proofs/divergence.md, lossfx.reference.{_ref}.\n"
    )


# ---------------------------------------------------------------------------------------------
# A teacher given as hidden states and LM-head shards (lossfx.opd_full's teacher)
# ---------------------------------------------------------------------------------------------


def projected_teacher(
    hidden: Tensor,
    weights: Tensor | Sequence[Tensor],
    head: Tensor | None,
    logits_dtype: torch.dtype | None,
    student: tuple[tuple[int, ...], int, torch.device],
    names: tuple[str, str, str, str],
) -> tuple[list[Tensor], torch.dtype]:
    """The checks of a teacher given as hidden states `[..., H_t]` through LM-head shards `[Vl, H_t]`
    against the `student`'s leading dims `[...]`, `Vl` and device, once for
    `divergence_to_projected_teacher` and `lossfx.linear_divergence_to_teacher` (`names`: their
    spellings of `hidden`, `weights`, `head` and `logits_dtype`). Returns the heads (a list: a
    single tensor is one head) and the projected logits' dtype (default: the heads'). `head`
    (required with several heads) is range-checked: compiled, in the graph."""
    hidden_name, weights_name, head_name, dtype_name = names
    lead, local_vocab, device = student
    check_floating(hidden_name, hidden)
    heads = [weights] if isinstance(weights, Tensor) else list(weights)
    if not heads:
        raise ValueError(f"{weights_name} must hold at least one [V_local, H_t] LM-head shard")
    if tuple(hidden.shape[:-1]) != lead or hidden.dim() < 1:
        raise ValueError(
            f"{hidden_name} must be [..., H_t] with the student's leading dims {lead}; got shape {tuple(hidden.shape)}"
        )
    for i, weight in enumerate(heads):
        check_floating(f"{weights_name}[{i}]", weight)
        if tuple(weight.shape) != (local_vocab, hidden.shape[-1]) or weight.dtype != heads[0].dtype:
            raise ValueError(
                f"{weights_name} must be [V_local, H_t] = [{local_vocab}, {hidden.shape[-1]}] LM-head shards (the "
                f"student's vocabulary rows, {hidden_name}'s width) of one dtype; {weights_name}[{i}] has shape "
                f"{tuple(weight.shape)} and dtype {weight.dtype} ({weights_name}[0]: {heads[0].dtype})"
            )
    for name, t in ((hidden_name, hidden), *((weights_name, w) for w in heads)):
        if t.device != device:
            raise ValueError(f"{name} must be on the student's device {device}, got {t.device}")
    if head is None and len(heads) > 1:
        raise ValueError(f"{head_name} (each row's head) is required with {len(heads)} teacher heads")
    if head is not None:
        if tuple(check_integer_ids(head_name, head).shape) != lead:
            raise ValueError(
                f"{head_name} must be [...] = {lead} (the student's leading dims); got shape {tuple(head.shape)}"
            )
        check_ids_in_range(head_name, head, len(heads))
    if logits_dtype is None:
        return heads, heads[0].dtype
    if not isinstance(logits_dtype, torch.dtype) or not logits_dtype.is_floating_point:
        raise TypeError(f"{dtype_name} must be a floating torch.dtype or None, got {logits_dtype!r}")
    return heads, logits_dtype


_PROJECTED = ("hidden", "weights", "head", "logits_dtype")  # divergence_to_projected_teacher's names


def divergence_to_projected_teacher(
    kind: str,
    student: Tensor,
    hidden: Tensor,
    weights: list[Tensor],
    head: Tensor | None = None,
    *,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    logits_dtype: torch.dtype | None = None,
) -> Tensor:
    """`entropy`/`cross_entropy_to_fixed`/`reverse_kl_to_fixed` with the teacher logits given as
    hidden states through LM-head shards, projected one row chunk at a time (never `[N, Vl]`).

    Equivalent to ``reverse_kl_to_fixed(student, teacher)`` (for `kind="reverse_kl"`) with
    ``teacher[n] = project_onto_lm_head(hidden[n], weights[head[n]], logits_dtype)``.

    Args:
        kind: `"cross_entropy"` or `"reverse_kl"`.
        student: `[..., Vl]` this rank's student logits shard.
        hidden: `[..., H]` the teacher's hidden states (same leading dims); fixed (no gradient).
        weights: `[Vl, H]` LM-head shards (one dtype, one shape); fixed (no gradient).
        head: `[...]` integer position in `weights` of each row's head; `None` with one head.
        group, chunk_size: as for `reverse_kl_to_fixed` (eager and compiled alike, the teacher
            is projected `chunk_size` rows at a time; default: the fused paths' rows-outside
            chunk, `min(N / 16, a [C, Vl] compute-dtype chunk near the device policy's
            chunk_bytes)`, at least 64 rows, so that the GEMM stays efficient: each chunk reads
            the LM-head shard once).
        logits_dtype: dtype of the projected teacher logits (`None`: the heads' dtype).

    Returns:
        `[...]` in `promote_types(student, logits_dtype, float32)`; the gradient flows to `student`.

    Note:
        Under `torch.compile` the chunk loops are two `torch.library` custom ops (forward
        statistics; backward gradient, recomputing each teacher chunk) around a traced functional
        all-gather: the graph size does not depend on the chunk count, and no `[N, Vl]` teacher
        tensor exists in eager or compiled mode. Peak extra memory of forward + backward: the
        student gradient plus O(chunk).
    """
    if kind not in ("cross_entropy", "reverse_kl"):
        raise ValueError(f"kind must be 'cross_entropy' or 'reverse_kl', got {kind!r}")
    check_floating("student", student)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    like = (tuple(student.shape[:-1]), student.shape[-1], student.device)  # [..., Vl]
    heads, logits_dtype = projected_teacher(hidden, weights, head, logits_dtype, like, _PROJECTED)
    return _kernel.divergence_to_projected_teacher(
        kind, student, hidden, heads, head, group, chunk_rows=chunk_size, logits_dtype=logits_dtype
    )

"""Student/teacher reductions over a vocabulary that may be sharded across tensor-parallel ranks.

All three kernels return, per token, `R = Σ_v p_s(v) · w(v)` with `p_s = softmax(student)`,
`log p_t = log_softmax(teacher)` (the teacher is fixed: it receives no gradient) and

    entropy                 w = log p_s                 R = Σ p_s log p_s      (≤ 0: the NEGATIVE entropy)
    cross_entropy_to_fixed  w = −log p_t                R = −Σ p_s log p_t
    reverse_kl_to_fixed     w = log p_s − log p_t       R = KL(p_s ‖ p_t)

written `w = α·log p_s − β·log p_t` with `(α, β)` = (1, 0), (0, 1), (1, 1).

Pipeline of the forward (one streaming read of student and teacher, one collective):

1. per row chunk and per rank, the local statistics of this rank's columns `[5, N]`: the student's
   `(m_s, s_s)` (max, `Σ exp(z_s − m_s)`), the teacher's `(m_t, s_t)`, and
   `u = Σ exp(z_s − m_s) · (α (z_s − m_s) − β (z_t − m_t))` (each logit shifted by its own local
   max, so `u` is bounded by the spread of the logits, not their level);
2. one all-gather of the stacked statistics over the tensor-parallel group and an exact merge
   (proofs/divergence.md §3) into `R` and the row statistics `(M_s, log S, M_t, log T)`, with
   `lse_s = M_s + log S`: the shift and the log-sum are kept apart, never added, so `log S`
   survives at any logit magnitude (proofs/divergence.md §8).

Saved for backward: the student and teacher logits themselves (no copy), the row statistics and
`R` (`5N` floats). The backward needs **no** collective: with the global statistics known,

    dstudent = dout[:, None] · p_s ⊙ (w − R[:, None])

is local to each rank's columns, streamed chunk by chunk into one buffer of the student's dtype.
Under `torch.no_grad()` (or for a student that does not require grad) nothing is saved.

`-inf` conventions (proofs/divergence.md §4): `0 · log 0 = 0`, so columns with `p_s = 0` contribute
nothing whatever the teacher says there; a teacher `-inf` where the student has mass gives
`R = +inf` (CE and KL; mathematically right) and a zero gradient for that row; a student row that
is `-inf` everywhere gives `R = 0` with a zero gradient; a teacher row that is `-inf` everywhere
has `log p_t = -inf` everywhere. Reference: lossfx.reference.reverse_kl_to_fixed and siblings.

Pure: plain tensors and the tensor-parallel group in (ids are never mapped here, so no
`VocabRange`), no argument validation, no DTensor, no cross-rank check, no host read. The public
functions of `lossfx.divergence` validate once and call these kernels once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._core.chunking import cat_chunks, policy_for, row_chunks
from lossfx._core.distributed import ProcessGroup, all_gather_stack
from lossfx._core.numerics import (
    compiled_row_sum,
    finite_or_nan,
    finite_or_nan_,
    finite_or_zero,
    log_s_for_softmax,
    merge,
    merge_moment,
    tracing,
)
from lossfx._core.tiles import LogitHead, Tiles, chunk_rows_for

__all__ = [
    "PROJECTED_MIN_ROWS",
    "cross_entropy_to_fixed",
    "divergence_to_projected_teacher",
    "neg_entropy",
    "project_onto_lm_head",
    "reverse_kl_to_fixed",
]

_WEIGHTS = {"entropy": (1, 0), "cross_entropy": (0, 1), "reverse_kl": (1, 1)}


def _compute_dtype(student: Tensor, teacher: Tensor | None) -> torch.dtype:
    """`promote_types(student, teacher, float32)`: fp32 for low precision, float64 stays float64."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    return dtype if teacher is None else torch.promote_types(dtype, teacher.dtype)


def _sub_rows(z: Tensor, shift: Tensor, out: Tensor | None = None) -> Tensor:
    """`z [C, Vl] − shift [C, None]` in `shift`'s dtype, as one fresh buffer (or into `out`).

    A mixed-dtype `torch.sub` (bf16 logits, fp32 shift) would first cast `z` into a hidden
    temporary; casting into the result buffer and subtracting in place avoids it.
    """
    if z.dtype == shift.dtype:
        return torch.sub(z, shift[:, None], out=out)
    buf = z.to(shift.dtype) if out is None else out.copy_(z)
    return buf.sub_(shift[:, None])


def _local_stats(zs: Tensor, zt: Tensor | None, alpha: int, beta: int) -> Tensor:
    """Local statistics `[5, C]` of one chunk `zs, zt [C, Vl]` (compute dtype), as one expression
    (the compiled path: Inductor fuses it into row-reduction loops with no `[C, Vl]` buffer)."""
    m_s = zs.amax(dim=-1)  # [C]
    xs = zs - finite_or_zero(m_s).unsqueeze(-1)  # [C, Vl], ≤ 0 or -inf
    e = torch.exp(xs)  # [C, Vl]
    s_s = compiled_row_sum(e)  # [C]
    if zt is None:
        m_t, s_t = torch.zeros_like(m_s), torch.ones_like(s_s)
        weight = xs  # [C, Vl]
    else:
        m_t = zt.amax(dim=-1)  # [C]
        xt = zt - finite_or_zero(m_t).unsqueeze(-1)  # [C, Vl]
        s_t = compiled_row_sum(torch.exp(xt))  # [C]
        weight = xs - xt if alpha else -xt  # [C, Vl]
    # 0·log 0 = 0: a NaN product can only come from e = 0 (0·±inf, or e·(−inf − (−inf))), so
    # exactly those terms are dropped; e > 0 under a teacher −inf gives +inf, kept. (A NaN in
    # the inputs still propagates: through the maxes.)
    u = compiled_row_sum(torch.where(e > 0, e * weight, 0.0))  # [C]
    return torch.stack([m_s, s_s, m_t, s_t, u])  # [5, C]


def _local_stats_eager(
    zs: Tensor, zt: Tensor | None, alpha: int, beta: int, cdtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """`_local_stats` of one chunk `zs, zt [C, Vl]` (any float dtypes) with at most three `[C, Vl]`
    compute-dtype temporaries (two for entropy and cross-entropy), updated in place; no converted
    copy of the inputs (`z − m` promotes elementwise). Returns `(m_s, s_s, m_t, s_t, u)`, each `[C]`
    (`m_t, s_t` None without a teacher: the constants 0 and 1)."""
    m_s = zs.amax(dim=-1).to(cdtype)  # [C]
    xs = _sub_rows(zs, finite_or_zero(m_s))  # [C, Vl] temporary 1
    if zt is None:
        e = torch.exp(xs)  # [C, Vl] temporary 2
        s_s = e.sum(dim=-1)  # [C]
        # e·x; 0·(−inf) = NaN only where e = 0: nansum drops exactly those terms (0·log 0 = 0)
        u = e.mul_(xs).nansum(dim=-1)  # [C]
        return m_s, s_s, None, None, u
    m_t = zt.amax(dim=-1).to(cdtype)  # [C]
    xt = _sub_rows(zt, finite_or_zero(m_t))  # [C, Vl] temporary 2
    if alpha:  # reverse KL: w = x_s − x_t
        e = torch.exp(xs)  # [C, Vl] temporary 3
        s_s = e.sum(dim=-1)
        u = e.mul_(xs.sub_(xt)).nansum(dim=-1)  # NaN only where e = 0; +inf (teacher −inf) kept
    else:  # cross-entropy: w = −x_t; x_s is only needed through e, so exponentiate it in place
        e = xs.exp_()
        s_s = e.sum(dim=-1)
        u = e.mul_(xt).nansum(dim=-1).neg_()
    s_t = xt.exp_().sum(dim=-1)  # [C]
    return m_s, s_s, m_t, s_t, u


def _merge(stats: Tensor, alpha: int, beta: int) -> tuple[Tensor, Tensor]:
    """`[R, 5, N]` per-rank statistics -> `(row_stats [4, N], R [N])` (proofs/divergence.md §3).

    `row_stats` = `(M_s, log S, M_t, log T)`: `lse(z) = M_s + log S`, `lse(y) = M_t + log T`.
    """
    m_s, s_s, m_t, s_t, u = stats.unbind(1)  # each [R, N]
    # The one merge (`lossfx._core.numerics.merge`), for the student and the teacher. An all -inf
    # shard has weight exactly 0 and adds nothing; a row with a NaN or +inf logit has a NaN shift,
    # so everything merged from it is NaN (proofs/divergence.md §4).
    student, teacher = merge(m_s, s_s), merge(m_t, s_t)
    log_s = torch.log(student.total)  # [N], −inf for an all −inf student row
    log_t = torch.log(teacher.total)  # [N], −inf for an all −inf teacher row
    # Each rank's `u` is about its local shifts; moved to the global ones: Σ_r w_r (u_r + s_r (α Δs_r − β Δt_r)).
    # (a side whose coefficient is 0 is left out, not multiplied by 0: an all -inf row's offset may be
    # NaN, and 0·NaN would reach merge_moment's nansum, which drops the whole term)
    if alpha and beta:
        offset = alpha * student.offset - beta * teacher.offset
    else:
        offset = alpha * student.offset if alpha else -beta * teacher.offset
    moment = merge_moment(student, s_s, u, offset)  # [N]
    r = moment / student.total - alpha * log_s  # [N]
    if beta:
        # An all -inf teacher row has log p_t = -inf everywhere: R = +inf wherever p_s has mass.
        r = torch.where(torch.isneginf(log_t), torch.full_like(r, float("inf")), r + beta * log_t)
    # A student row that is -inf everywhere has p_s = 0: R = Σ 0·w = 0.
    r = torch.where(torch.isneginf(log_s), torch.zeros_like(r), r)
    # The shifts and log-sums stay apart (lse = shift + log_sum would round log_sum away at large
    # |shift|: proofs/divergence.md §8); stacked `[4, N]` for the backward.
    return torch.stack([student.shift, log_s, teacher.shift, log_t]), r


# The teacher's rows `[start, end)` as a `[C, Vl]` tensor: a slice of given logits, or a projection
# of hidden states through an LM-head shard computed on demand (the teacher logits never exist whole).
TeacherRows = Callable[[int, int], Tensor]


def _row_slicer(teacher: Tensor | None) -> TeacherRows | None:
    return None if teacher is None else (lambda start, end: teacher[start:end])


def _stats_eager(
    student: Tensor,
    teacher_rows: TeacherRows | None,
    alpha: int,
    beta: int,
    chunk_rows: int | None,
    cdtype: torch.dtype,
) -> Tensor:
    """Local statistics `[5, N]` (`_local_stats` rows), one chunk of rows at a time."""
    n_rows, local_vocab = student.shape
    columns: list[list[Tensor]] = [[], [], [], [], []]
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, student.device):
        zt = None if teacher_rows is None else teacher_rows(start, end)  # [C, Vl]
        for column, stat in zip(columns, _local_stats_eager(student[start:end], zt, alpha, beta, cdtype)):
            if stat is not None:
                column.append(stat)
    # one stack (and a cat per statistic when there are several chunks): few ops per call
    rows = [cat_chunks(col) for col in columns if col]  # [N] each
    if teacher_rows is None:  # no teacher: m_t = 0, s_t = 1
        rows[2:2] = [torch.zeros_like(rows[0]), torch.ones_like(rows[0])]
    return torch.stack(rows)


def _divergence_fwd(
    student: Tensor, teacher: Tensor | None, kind: str, chunk_rows: int | None, group: ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """student, teacher `[N, Vl]` -> `(R [N], row_stats [4, N])` in the compute dtype (`_merge`)."""
    alpha, beta = _WEIGHTS[kind]
    cdtype = _compute_dtype(student, teacher)
    # 1. local statistics, one chunk of rows at a time
    if tracing():  # one fused pass over the whole tensor
        zt = None if teacher is None else teacher.to(cdtype)
        local = _local_stats(student.to(cdtype), zt, alpha, beta)  # [5, N]
    else:
        local = _stats_eager(student, _row_slicer(teacher), alpha, beta, chunk_rows, cdtype)  # [5, N]
    # 2. merge across ranks: one all-gather of per-row scalars
    stats = all_gather_stack(local, group)  # [R, 5, N]
    row_stats, r = _merge(stats, alpha, beta)
    return r, row_stats


def _divergence_bwd(
    student: Tensor,
    teacher: Tensor | None,
    row_stats: Tensor,
    r: Tensor,
    dout: Tensor,
    kind: str,
    chunk_rows: int | None,
) -> Tensor:
    """-> dstudent `[N, Vl]` in the student's dtype; no collective."""
    alpha, beta = _WEIGHTS[kind]
    cdtype = _compute_dtype(student, teacher)
    terms = _backward_terms(row_stats, r, dout, cdtype, join=bool(alpha and beta) and not tracing())
    shift_s, log_s_safe, shift_t, log_t_safe, grad, r_safe = terms
    if tracing():
        # One expression over the whole tensor: Inductor fuses it into a single loop that reads the
        # logits once and writes dstudent once, in the student's dtype, with no [N, Vl] temporary.
        # (z − M) − log S: the large shift leaves first, exactly (proofs/divergence.md §8).
        logp_s = (student.to(cdtype) - shift_s[:, None]) - log_s_safe[:, None]  # [N, Vl]
        # Each factor finite (`finite_or_nan`: ±inf -> ±max, NaN kept), so 0 · factor is 0 where
        # p_s = 0 or on a zeroed row, and a NaN row stays NaN (proofs/divergence.md §4).
        w = finite_or_nan(logp_s)
        if beta and teacher is not None:
            logp_t = finite_or_nan((teacher.to(cdtype) - shift_t[:, None]) - log_t_safe[:, None])  # [N, Vl]
            w = w - logp_t if alpha else -logp_t  # [N, Vl]
        dchunk = torch.exp(logp_s) * (w - r_safe[:, None]) * grad[:, None]
        return dchunk.to(student.dtype)
    return _grad_eager(student, _row_slicer(teacher), terms, alpha, beta, chunk_rows, cdtype)


def _backward_terms(
    row_stats: Tensor, r: Tensor, dout: Tensor, cdtype: torch.dtype, join: bool = False
) -> tuple[Tensor, ...]:
    """Per-row constants of the backward, each `[N]`: `(M_s, log S, M_t, log T, g, R)` made safe.

    `join` (the eager reverse KL): `R + log S − log T` in place of `R`, the constant of
    `w − R = ((z_s − M_s) − (z_t − M_t)) − (R + log S − log T)`: all three of moderate size, and
    identical student and teacher give exactly 0 (the columns' differences and the constant both)."""
    shift_s, log_s, shift_t, log_t = row_stats.unbind(0)  # each [N]
    log_s_safe = log_s_for_softmax(log_s)  # +inf for an empty row: p_s = 0
    # A row with R = ±inf (teacher -inf under student mass) or an empty student row: gradient 0.
    # A row with a NaN or +inf logit (NaN shift, log-sums and R) keeps its NaN: its gradient is NaN.
    dead = torch.isinf(r) | torch.isneginf(log_s)
    grad = torch.where(dead, 0.0, dout.to(cdtype))
    r_safe = torch.where(dead, 0.0, r + (log_s - log_t) if join else r)
    log_t_safe = finite_or_zero(log_t)  # only read on rows whose gradient is nonzero
    return shift_s, log_s_safe, shift_t, log_t_safe, grad, r_safe


def _grad_eager(
    student: Tensor,
    teacher_rows: TeacherRows | None,
    terms: tuple[Tensor, ...],
    alpha: int,
    beta: int,
    chunk_rows: int | None,
    cdtype: torch.dtype,
) -> Tensor:
    """dstudent `[N, Vl]`, per chunk at most two `[C, Vl]` temporaries (besides the teacher's rows),
    updated in place; the rows are written directly into dstudent when the student is in the
    compute dtype (else rounded once)."""
    shift_s, log_s_safe, shift_t, log_t_safe, grad, r_safe = terms
    n_rows, local_vocab = student.shape
    direct = student.dtype == cdtype
    dstudent = torch.empty_like(student)
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, student.device):
        rows = slice(start, end)
        out = dstudent[rows] if direct else None
        # g · p · (w − R) with every factor finite where the inputs are (`finite_or_nan_`: ±inf ->
        # ±max, NaN kept): 0 · factor is 0 where p_s = 0 or on a zeroed row, and a NaN stays NaN
        # (proofs/divergence.md §4)
        if teacher_rows is None:  # entropy: d := log p_s (in the output rows when direct), p := exp(d)
            d = _sub_rows(student[rows], shift_s[rows], out).sub_(log_s_safe[rows, None])
            p = torch.exp(d)  # [C, Vl]
            finite_or_nan_(d).sub_(r_safe[rows, None])
        elif alpha:  # reverse KL: d := z_s − M_s, p := exp(d − log S), then d − (z_t − M_t)
            d = _sub_rows(student[rows], shift_s[rows], out)
            p = torch.sub(d, log_s_safe[rows, None]).exp_()  # [C, Vl]
            x_t = finite_or_nan_(_sub_rows(teacher_rows(start, end), shift_t[rows]))  # [C, Vl]
            finite_or_nan_(d).sub_(x_t).sub_(r_safe[rows, None])
            del x_t
        else:  # cross-entropy: p := exp(log p_s), d := −log p_t
            p = _sub_rows(student[rows], shift_s[rows]).sub_(log_s_safe[rows, None]).exp_()
            d = _sub_rows(teacher_rows(start, end), shift_t[rows], out).sub_(log_t_safe[rows, None]).neg_()
            finite_or_nan_(d).sub_(r_safe[rows, None])
        d.mul_(p.mul_(grad[rows, None]))
        if not direct:
            dstudent[rows] = d  # rounds once to the student's dtype
    return dstudent


class _DivergenceFn(torch.autograd.Function):
    @staticmethod
    def forward(student, teacher, kind, chunk_rows, group):
        return _divergence_fwd(student, teacher, kind, chunk_rows, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        student, teacher, kind, chunk_rows, _group = inputs
        r, row_stats = output
        ctx.save_for_backward(student, teacher, row_stats, r)
        ctx.kind, ctx.chunk_rows = kind, chunk_rows
        ctx.mark_non_differentiable(row_stats)

    @staticmethod
    @once_differentiable  # the saved statistics are constants of the backward: proofs/divergence.md §5
    def backward(ctx, dout, _drow_stats):
        student, teacher, row_stats, r = ctx.saved_tensors
        dstudent = _divergence_bwd(student, teacher, row_stats, r, dout, ctx.kind, ctx.chunk_rows)
        return dstudent, None, None, None, None  # one entry per forward input


def _divergence(
    kind: str, student: Tensor, teacher: Tensor | None, group: ProcessGroup | None, chunk_rows: int | None
) -> Tensor:
    """student, teacher `[..., Vl]` -> `[...]` (autograd to `student` only)."""
    local_vocab = student.shape[-1]
    flat_teacher = None if teacher is None else teacher.detach().reshape(-1, local_vocab)  # [N, Vl]: fixed
    flat_student = student.reshape(-1, local_vocab)  # [N, Vl]
    if torch.is_grad_enabled() and student.requires_grad:
        r, _ = _DivergenceFn.apply(flat_student, flat_teacher, kind, chunk_rows, group)
    else:  # metric-only: no autograd node, nothing saved for backward
        r, _ = _divergence_fwd(flat_student.detach(), flat_teacher, kind, chunk_rows, group)
    return r.view(student.shape[:-1])


def neg_entropy(student: Tensor, group: ProcessGroup | None, *, chunk_rows: int | None = None) -> Tensor:
    """`student [..., Vl]` (this rank's columns) -> `Σ_v p log p` `[...]` in the compute dtype.

    Dense equivalent: ``(p * p.log()).sum(-1)``, ``p = full_student.softmax(-1)`` (`0 · log 0 = 0`).
    """
    return _divergence("entropy", student, None, group, chunk_rows)


def cross_entropy_to_fixed(
    student: Tensor, teacher: Tensor, group: ProcessGroup | None, *, chunk_rows: int | None = None
) -> Tensor:
    """`student, teacher [..., Vl]` (the same columns) -> `−Σ_v p_s log p_t` `[...]`.

    Dense equivalent: ``-(full_student.softmax(-1) * full_teacher.log_softmax(-1)).sum(-1)``.
    """
    return _divergence("cross_entropy", student, teacher, group, chunk_rows)


def reverse_kl_to_fixed(
    student: Tensor, teacher: Tensor, group: ProcessGroup | None, *, chunk_rows: int | None = None
) -> Tensor:
    """`student, teacher [..., Vl]` (the same columns) -> `KL(p_s ‖ p_t)` `[...]`.

    Dense equivalent: ``(p_s * (full_student.log_softmax(-1) - full_teacher.log_softmax(-1))).sum(-1)``.
    """
    return _divergence("reverse_kl", student, teacher, group, chunk_rows)


# ---------------------------------------------------------------------------------------------
# A teacher given as hidden states and LM-head shards: its logits projected chunk by chunk
# ---------------------------------------------------------------------------------------------


def project_onto_lm_head(h: Tensor, weight: Tensor, logits_dtype: torch.dtype | None) -> Tensor:
    """`h [..., H] @ weight [Vl, H]ᵀ` with operands in `weight.dtype` and the result in `logits_dtype`.

    The hidden states are first rounded to `weight.dtype`. With another `logits_dtype` the product
    is computed in `promote_types(weight.dtype, logits_dtype)` (an exact upcast of the operands, so
    an unrounded product) and returned in `logits_dtype`.
    """
    h = h.to(weight.dtype)
    if logits_dtype is None or logits_dtype == weight.dtype:
        return h @ weight.T  # [..., Vl]
    gemm_dtype = torch.promote_types(weight.dtype, logits_dtype)
    return (h.to(gemm_dtype) @ weight.to(gemm_dtype).T).to(logits_dtype)  # [..., Vl]


# Rows per projected-teacher chunk, at least: each chunk streams every LM-head shard once, and the
# [C, Vl] chunks stay O(chunk) beside the student's [N, Vl] logits.
PROJECTED_MIN_ROWS = 64


def _projected_rows(
    hidden: Tensor, weights: list[Tensor], head: Tensor, chunk_rows: int, logits_dtype: torch.dtype
) -> tuple[TeacherRows, int]:
    """Teacher rows `[start, end)`: row `n` of `hidden [N, H]` through `weights[head[n]]` -> `[C, Vl]`,
    and the rows per chunk (`chunk_rows`, or the engine's rows-outside default when negative).

    Projected by the tile engine (`lossfx._core.tiles.Tiles`) into one reused `[C, Vl]` buffer: the
    operands are cast once per call (the hidden states to the heads' dtype; both to the GEMM dtype
    when `logits_dtype` differs), each product rounded to `logits_dtype`. Each chunk reads every
    head once, so a chunk of a few rows would make the projection a memory-bound pass over the head
    per chunk (measured ~20x slower at V = 151936, H = 512): the default keeps C >= 64."""
    n_rows, local_vocab = hidden.shape[0], weights[0].shape[0]
    gemm_dtype = torch.promote_types(weights[0].dtype, logits_dtype)
    h = hidden.to(weights[0].dtype).to(gemm_dtype)  # [N, H]; rounded to the heads' dtype first
    if chunk_rows < 0:
        chunk_rows = chunk_rows_for(n_rows, local_vocab, gemm_dtype, policy_for(hidden.device), PROJECTED_MIN_ROWS)
    tiles = Tiles(
        h,
        [w.to(gemm_dtype) for w in weights],  # no copy when already gemm_dtype
        None,
        LogitHead(),
        active=None,
        rows=chunk_rows,
        block=local_vocab,
        chunk_width=local_vocab,
        head_of_row=head if len(weights) > 1 else None,
        round_to=logits_dtype,
    )
    return (lambda start, end: tiles.chunk_logits(slice(start, end))), tiles.rows


# The chunk loops run inside custom ops: under torch.compile they are one opaque node each (the
# graph does not grow with the chunk count, and Inductor never sees, hence never materialises, the
# [N, Vl] matmul output); the collective stays outside, in the traced graph, as a functional one.
@torch.library.custom_op(
    "lossfx::projected_teacher_stats",
    mutates_args=(),
    schema="(Tensor student, Tensor hidden, Tensor[] weights, Tensor head, str kind, int chunk_rows, "
    "ScalarType logits_dtype) -> Tensor",
)
def _projected_teacher_stats(
    student: Tensor,
    hidden: Tensor,
    weights: list[Tensor],
    head: Tensor,
    kind: str,
    chunk_rows: int,
    logits_dtype: torch.dtype,
) -> Tensor:
    """Local statistics `[5, N]` of `student [N, Vl]` against the projected teacher (chunked)."""
    alpha, beta = _WEIGHTS[kind]
    cdtype = _compute_dtype(student, torch.empty((), dtype=logits_dtype))
    teacher_rows, rows = _projected_rows(hidden, weights, head, chunk_rows, logits_dtype)
    return _stats_eager(student, teacher_rows, alpha, beta, rows, cdtype)


@_projected_teacher_stats.register_fake
def _(student, hidden, weights, head, kind, chunk_rows, logits_dtype):
    cdtype = _compute_dtype(student, torch.empty((), dtype=logits_dtype))
    return student.new_empty((5, student.shape[0]), dtype=cdtype)


@torch.library.custom_op(
    "lossfx::projected_teacher_grad",
    mutates_args=(),
    schema="(Tensor student, Tensor hidden, Tensor[] weights, Tensor head, Tensor row_stats, Tensor r, "
    "Tensor dout, str kind, int chunk_rows, ScalarType logits_dtype) -> Tensor",
)
def _projected_teacher_grad(
    student: Tensor,
    hidden: Tensor,
    weights: list[Tensor],
    head: Tensor,
    row_stats: Tensor,
    r: Tensor,
    dout: Tensor,
    kind: str,
    chunk_rows: int,
    logits_dtype: torch.dtype,
) -> Tensor:
    """dstudent `[N, Vl]`, each teacher chunk projected again (nothing `[N, Vl]` was saved)."""
    alpha, beta = _WEIGHTS[kind]
    cdtype = r.dtype
    terms = _backward_terms(row_stats, r, dout, cdtype, join=bool(alpha and beta))
    teacher_rows, rows = _projected_rows(hidden, weights, head, chunk_rows, logits_dtype)
    return _grad_eager(student, teacher_rows, terms, alpha, beta, rows, cdtype)


@_projected_teacher_grad.register_fake
def _(student, hidden, weights, head, row_stats, r, dout, kind, chunk_rows, logits_dtype):
    return torch.empty_like(student)


def _projected_fwd(student, hidden, head, kind, chunk_rows, group, logits_dtype, weights):
    local = _projected_teacher_stats(student, hidden, list(weights), head, kind, chunk_rows, logits_dtype)
    stats = all_gather_stack(local, group)  # [R, 5, N]
    row_stats, r = _merge(stats, *_WEIGHTS[kind])
    return r, row_stats


class _ProjectedDivergenceFn(torch.autograd.Function):
    @staticmethod
    def forward(student, hidden, head, kind, chunk_rows, group, logits_dtype, *weights):
        return _projected_fwd(student, hidden, head, kind, chunk_rows, group, logits_dtype, weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        student, hidden, head, kind, chunk_rows, _group, logits_dtype, *weights = inputs
        r, row_stats = output
        ctx.save_for_backward(student, hidden, head, row_stats, r, *weights)
        ctx.kind, ctx.chunk_rows, ctx.logits_dtype = kind, chunk_rows, logits_dtype
        ctx.mark_non_differentiable(row_stats)

    @staticmethod
    @once_differentiable  # the saved statistics are constants of the backward: proofs/divergence.md §5
    def backward(ctx, dout, _drow_stats):
        student, hidden, head, row_stats, r, *weights = ctx.saved_tensors
        dstudent = _projected_teacher_grad(
            student, hidden, weights, head, row_stats, r, dout.contiguous(), ctx.kind, ctx.chunk_rows, ctx.logits_dtype
        )
        return (dstudent, None, None, None, None, None, None, *([None] * len(weights)))


def divergence_to_projected_teacher(
    kind: str,
    student: Tensor,
    hidden: Tensor,
    weights: list[Tensor],
    head: Tensor | None,
    group: ProcessGroup | None,
    *,
    chunk_rows: int | None,
    logits_dtype: torch.dtype,
) -> Tensor:
    """`kind` (`"cross_entropy"` / `"reverse_kl"`) of `student [..., Vl]` to the teacher
    ``teacher[n] = project_onto_lm_head(hidden[n], weights[head[n]], logits_dtype)``, `[...]`.

    `hidden [..., H]`, `weights` `[Vl, H]` shards of one dtype and shape, `head [...]` integer
    positions in `weights` (`None`: the single head). `chunk_rows`: rows per projected chunk
    (`None`: the rows-outside default, at least `PROJECTED_MIN_ROWS`).
    """
    lead = student.shape[:-1]
    flat_student = student.reshape(-1, student.shape[-1])  # [N, Vl]
    flat_hidden = hidden.detach().reshape(-1, hidden.shape[-1]).contiguous()  # [N, H]
    if head is None:
        flat_head = torch.zeros(flat_student.shape[0], dtype=torch.int64, device=student.device)
    else:
        flat_head = head.reshape(-1).to(device=student.device, dtype=torch.int64)  # [N]
    heads = tuple(w.detach() for w in weights)
    chunk_arg = -1 if chunk_rows is None else chunk_rows
    if torch.is_grad_enabled() and student.requires_grad:
        r, _ = _ProjectedDivergenceFn.apply(
            flat_student, flat_hidden, flat_head, kind, chunk_arg, group, logits_dtype, *heads
        )
    else:  # metric-only: no autograd node, nothing saved for backward
        r, _ = _projected_fwd(
            flat_student.detach(), flat_hidden, flat_head, kind, chunk_arg, group, logits_dtype, heads
        )
    return r.view(lead)

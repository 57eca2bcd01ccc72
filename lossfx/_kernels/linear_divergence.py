"""OPD_FULL from hidden states on both sides, pure: reverse KL, cross-entropy and `Σ p log p` in one tile loop.

    z_s = head(hidden @ weight.T + bias)                     (student logits; one [C, Cv] tile alive)
    z_t = teacher_logits, or teacher_hidden @ teacher_weight.T   (teacher; one [C, Cv] tile alive)
    neg_entropy = Σ p_s log p_s,   cross_entropy = −Σ p_s log p_t,   reverse_kl = Σ p_s (log p_s − log p_t)

Forward (`lossfx::linear_divergence_stats`, one opaque custom op): vocabulary blocks of `Cv` columns
outside, row chunks of `C` rows inside; per tile the per-row part `(m_s, s_s, m_t, s_t, A, B, U)`
of this block — the two maxes, `s = Σ exp(z − m)` of each side, and the moments
`A = Σ e_s x_s`, `B = Σ e_s x_t`, `U = Σ e_s (x_s − x_t)` with `e_s = exp(x_s)`, `x = z − m` —
merged exactly over the blocks (`merge_parts`), then one all-gather of `[7, N]` per rank over the
tensor-parallel group and the logits path's own merge (`lossfx._kernels.divergence._merge`: the
same `-inf` rules, proofs/divergence.md §3-4) into the three outputs and the row statistics
`(M_s, log S, M_t, log T)`.

Backward (`lossfx::linear_divergence_grads`): the tiles are recomputed (the teacher's too, when it
is projected) and, with upstream gradients `g_kl, g_ce, g_ent` (each 0 on rows whose value is not
finite, as the logits path),

    dz_s = p_s ⊙ (a·log p_s − b·log p_t − c),  a = g_kl + g_ent,  b = g_kl + g_ce,
    c = g_kl·KL + g_ce·CE + g_ent·NE,           dhidden = dr W,  dweight = drᵀ hidden,  dbias = Σ dr

with `dr = dz_s ⊙ dz/dr` (`LogitHead`), then one all-reduce of `dhidden` (proofs/linear_divergence.md).
The teacher is fixed: no gradient. Nothing `[N, Vl]` exists in either pass, eager or compiled.

Pure: plain tensors, the group and resolved options in; validation lives in `lossfx.linear_divergence`.
Dense equivalent: `lossfx.reference.linear_divergence_to_teacher`.
"""

from __future__ import annotations

import typing

import torch
from torch import Tensor

from lossfx._core.distributed import ProcessGroup, all_gather_stack, all_reduce
from lossfx._core.numerics import EXP_ZERO_BELOW, finite_or_zero, log_s_for_softmax
from lossfx._core.tiles import HeadOptions, LogitHead, Tiles, compute_dtype, matmul_dtype
from lossfx._kernels.divergence import _merge
from lossfx._kernels.linear_chunks import tile_sizes

__all__ = ["LinearDivergence", "linear_divergence_grads", "linear_divergence_stats", "linear_divergence_to_teacher"]


class LinearDivergence(typing.NamedTuple):
    """The three per-token quantities, each `[...]`."""

    reverse_kl: Tensor  # Σ p_s (log p_s − log p_t)
    cross_entropy: Tensor  # −Σ p_s log p_t
    neg_entropy: Tensor  # Σ p_s log p_s (≤ 0)


def out_dtype(mm_dtype: torch.dtype, teacher_dtype: torch.dtype) -> torch.dtype:
    """`promote_types(student logits, teacher logits, float32)`: the logits path's compute dtype."""
    return torch.promote_types(compute_dtype(mm_dtype), teacher_dtype)


class _Loop:
    """The two tile walks side by side: the student's `Tiles` and the teacher (a slice of its
    logits, or its own `Tiles` over the teacher head), plus the loop's scratch buffers."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        head: LogitHead,
        teacher_logits: Tensor | None,
        teacher_hidden: Tensor | None,
        teacher_weights: list[Tensor],
        teacher_head: Tensor | None,
        logits_dtype: torch.dtype,
        chunk_rows: int,
        scratch: int,
    ) -> None:
        self.cdtype = out_dtype(matmul_dtype(hidden, weight), logits_dtype)
        self.teacher_head = teacher_head if len(teacher_weights) > 1 else None
        # the loop's [C, Cv] tiles: the student's, `scratch + 1` buffers, the projected teacher's
        # and the tile of several teacher heads; sized as every fused loop's (`tile_sizes`)
        n_buffers = scratch + 1 + int(self.teacher_head is not None)
        block, rows = tile_sizes(hidden, weight, n_buffers + int(teacher_logits is None))
        rows = max(1, min(chunk_rows or rows, hidden.shape[0]))
        self.student = Tiles(hidden, weight, bias, head, active=None, rows=rows, block=block)
        self.teacher_logits = teacher_logits
        self.teacher: Tiles | None = None
        if teacher_logits is None:
            assert teacher_hidden is not None and teacher_weights
            # `project_onto_lm_head`: hidden rounded to the heads' dtype, products in
            # promote(head, logits_dtype), each rounded to logits_dtype
            head_dtype = teacher_weights[0].dtype
            gemm = torch.promote_types(head_dtype, logits_dtype)
            self.teacher = Tiles(
                teacher_hidden.to(head_dtype).to(gemm),
                [w.to(gemm) for w in teacher_weights],
                None,
                LogitHead(),
                active=None,
                rows=rows,
                block=block,
                round_to=logits_dtype,
            )
            self.teacher_weights = self.teacher.mm_weights()
        size, device = self.student.rows * self.student.block, hidden.device
        self._buffers = [torch.empty(size, dtype=self.cdtype, device=device) for _ in range(n_buffers)]

    def buffer(self, i: int, like: Tensor) -> Tensor:
        return Tiles.view(self._buffers[i], like.shape[0], like.shape[1])

    def walk(self) -> typing.Iterator[tuple[int, slice, slice, Tensor, Tensor, Tensor, Tensor]]:
        """`(block index, cols, rows, hidden rows, w block, x_s, z_t)`: the student logits `z_s`
        in the compute dtype (a tile buffer: may be overwritten) and the teacher's `[C, Cv]`
        (a view of the given logits, or the teacher's tile buffer: read-only here)."""
        tiles = self.student
        for b, (cols, w_block, b_block) in enumerate(tiles.blocks()):
            for rows in typing.cast(list[slice], tiles.chunks):
                h = tiles.hidden_rows(rows)
                z = tiles.logits(h, w_block, b_block)  # [C, Cv]
                if self.teacher is None:
                    assert self.teacher_logits is not None
                    zt = self.teacher_logits[rows, cols]
                else:
                    zt = self._teacher_tile(rows, cols, z)
                yield b, cols, rows, h, w_block, z, zt

    def _teacher_tile(self, rows: slice, cols: slice, like: Tensor) -> Tensor:
        """The projected teacher's `[C, Cv]` tile: each row through its own head (`teacher_head`;
        value-dependent row picks, eager only: inside the opaque op)."""
        teacher = self.teacher
        assert teacher is not None
        h = teacher.hidden_rows(rows)
        if self.teacher_head is None:
            return teacher.logits(h, self.teacher_weights[0][cols], None)
        out = self.buffer(len(self._buffers) - 1, like)
        chosen = self.teacher_head[rows]
        for k, weight in enumerate(self.teacher_weights):
            picked = (chosen == k).nonzero()[:, 0]
            if picked.numel():
                part = teacher.logits(h.index_select(0, picked), weight[cols], None)
                out.index_copy_(0, picked, part.to(out.dtype))
        return out

    def teacher_shifted(self, zt: Tensor, shift: Tensor) -> Tensor:
        """`z_t − shift[:, None]` in the compute dtype, in the teacher buffer (never in the given logits)."""
        out = self.buffer(0, zt)
        return out.copy_(zt).sub_(shift[:, None])


def merge_parts(parts: Tensor) -> Tensor:
    """Parts over disjoint columns `[P, 7, N]` of `(m_s, s_s, m_t, s_t, A, B, U)` -> one `[7, N]`.

    Each part's sums are about its own shift `finite_or_zero(m)`; the merged one's about the merged
    max's (the raw max kept, so an all `-inf` part stays `(-inf, 0, …)` and merges again exactly):

        S = Σ_p w_p s_p,  A = Σ_p w_p (A_p + Δs_p s_p),  B = Σ_p w_p (B_p + Δt_p s_p),
        U = Σ_p w_p (U_p + (Δs_p − Δt_p) s_p),   w_p = exp(m_s,p − M_s),  Δ = shift_p − shift.
    """
    m_s, s_s, m_t, s_t, a, b, u = parts.unbind(1)  # each [P, N]
    big_s, big_t = m_s.amax(dim=0), m_t.amax(dim=0)  # [N], raw: -inf for an all -inf row, NaN kept
    d_s = finite_or_zero(m_s) - finite_or_zero(big_s)  # [P, N]
    d_t = finite_or_zero(m_t) - finite_or_zero(big_t)
    w_s = torch.exp(m_s - finite_or_zero(big_s))  # 0 for an all -inf part
    w_t = torch.exp(m_t - finite_or_zero(big_t))

    def weighted(x: Tensor) -> Tensor:  # Σ_p w_p x_p with 0·anything = 0 (a dead part adds nothing)
        return torch.where(w_s > 0, w_s * x, torch.zeros_like(x)).sum(dim=0)

    return torch.stack(
        [
            big_s,
            (w_s * s_s).sum(dim=0),
            big_t,
            (w_t * s_t).sum(dim=0),
            weighted(a + d_s * s_s),
            weighted(b + d_t * s_s),
            weighted(u + (d_s - d_t) * s_s),
        ]
    )


def _tile_part(loop: _Loop, z: Tensor, zt: Tensor, out: Tensor) -> None:
    """The part `(m_s, s_s, m_t, s_t, A, B, U)` of one tile into `out [7, C]`, in place in the
    loop's buffers (`z` is overwritten)."""
    m_s = z.amax(dim=1)
    xs = z.sub_(finite_or_zero(m_s)[:, None])  # ≤ 0 or -inf
    m_t = zt.amax(dim=1).to(z.dtype)
    xt = loop.teacher_shifted(zt, finite_or_zero(m_t))
    e = torch.exp(xs, out=loop.buffer(1, z))
    prod = loop.buffer(2, z)
    out[0], out[1], out[2] = m_s, e.sum(dim=1), m_t
    # 0·(−inf) = NaN only where e = 0: nansum drops exactly those terms (0·log 0 = 0); a teacher
    # −inf under student mass gives −inf, kept; an input NaN propagates through the maxes
    torch.nansum(torch.mul(e, xs, out=prod), dim=1, out=out[4])
    torch.nansum(torch.mul(e, xt, out=prod), dim=1, out=out[5])
    torch.nansum(xs.sub_(xt).mul_(e), dim=1, out=out[6])
    torch.sum(xt.exp_(), dim=1, out=out[3])


def _loop(hidden, weight, bias, teacher, head, logits_dtype, chunk_rows, scratch):
    return _Loop(hidden, weight, bias, head, *teacher, logits_dtype, chunk_rows, scratch)


@torch.library.custom_op("lossfx::linear_divergence_stats", mutates_args=())
def linear_divergence_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher_logits: Tensor | None,
    teacher_hidden: Tensor | None,
    teacher_weights: list[Tensor],
    teacher_head: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    logits_dtype: torch.dtype,
    chunk_rows: int,
) -> Tensor:
    """-> this rank's part `[7, N]` (`merge_parts`' rows) in the compute dtype.

    hidden `[N, H]`, weight `[Vl, H]`, bias `[Vl]` or None; the teacher as `teacher_logits [N, Vl]`
    (`teacher_weights` empty), or `teacher_hidden [N, H']` through `teacher_weights` `[Vl, H']`
    (row `n` through `teacher_weights[teacher_head[n]]`; `teacher_head` None with one head;
    products rounded to `logits_dtype`); `chunk_rows = 0`: the default tile rows."""
    head = LogitHead(temperature, logit_scale, softcap)
    teacher = (teacher_logits, teacher_hidden, teacher_weights, teacher_head)
    loop = _loop(hidden, weight, bias, teacher, head, logits_dtype, chunk_rows, 2)
    n_blocks = len(loop.student.block_slices)
    parts = torch.empty(n_blocks, 7, hidden.shape[0], dtype=loop.cdtype, device=hidden.device)
    for b, _cols, rows, _h, _w, z, zt in loop.walk():
        if z.dtype != loop.cdtype:
            z = z.to(loop.cdtype)
        _tile_part(loop, z, zt, parts[b, :, rows])
    return parts[0] if n_blocks == 1 else merge_parts(parts)


@linear_divergence_stats.register_fake
def _(
    hidden,
    weight,
    bias,
    teacher_logits,
    teacher_hidden,
    teacher_weights,
    teacher_head,
    temperature,
    logit_scale,
    softcap,
    logits_dtype,
    chunk_rows,
):
    cdtype = out_dtype(matmul_dtype(hidden, weight), logits_dtype)
    return hidden.new_empty((7, hidden.shape[0]), dtype=cdtype)


@torch.library.custom_op("lossfx::linear_divergence_grads", mutates_args=())
def linear_divergence_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teacher_logits: Tensor | None,
    teacher_hidden: Tensor | None,
    teacher_weights: list[Tensor],
    teacher_head: Tensor | None,
    row_stats: Tensor,
    factors: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    logits_dtype: torch.dtype,
    chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dhidden `[N, H]` in the student's compute dtype, dweight `[Vl, H]` in weight's dtype,
    dbias `[Vl]` in the student's compute dtype, or `[0]` without a bias); no collective.

    `row_stats [4, N]` = `(M_s, log S, M_t, log T)`; `factors [3, N]` = `(a, b, c)/S` of
    `dz_s = exp(z_s − M_s) ⊙ (a·(z_s − M_s) − b·(z_t − M_t) − c)` (`linear_divergence_to_teacher`
    forms them). The tiles are recomputed: vocabulary blocks outside, row chunks inside."""
    n_rows, hidden_size = hidden.shape
    head = LogitHead(temperature, logit_scale, softcap)
    teacher = (teacher_logits, teacher_hidden, teacher_weights, teacher_head)
    loop = _loop(hidden, weight, bias, teacher, head, logits_dtype, chunk_rows, 2)
    tiles = loop.student
    sdtype, exact = tiles.cdtype, tiles.exact  # the student's compute dtype: its gradients' sums
    dhidden = torch.zeros(n_rows, hidden_size, dtype=sdtype, device=hidden.device)
    dweight = torch.empty_like(weight)
    dbias = torch.zeros(0 if bias is None else weight.shape[0], dtype=sdtype, device=hidden.device)
    shift_s, _, shift_t, _ = row_stats.unbind(0)
    a, b, c = factors.unbind(0)
    scale = head.scale  # dz/dr = s/T (· (1 − tanh²)), folded into the matmuls
    in_place = exact and weight.dtype == sdtype
    # each vocabulary block's dweight, summed over the row chunks in the compute dtype (in place when
    # that is weight's dtype, else in one [Cv, H] accumulator rounded once at the block's end)
    acc: Tensor | None = None
    acc_cols = slice(0, 0)

    def flush() -> None:
        if acc is not None and not in_place:
            dweight[acc_cols] = acc

    for _b, cols, rows, h, w_block, z, zt in loop.walk():
        if rows.start == 0:  # a new vocabulary block
            flush()
            acc = dweight[cols].zero_() if in_place else torch.zeros(w_block.shape, dtype=sdtype, device=weight.device)
            acc_cols = cols
        cap = head.cap_derivative(z, loop.buffer(2, z)) if softcap is not None else None
        x = z if z.dtype == loop.cdtype else z.to(loop.cdtype)
        xs = x.sub_(shift_s[rows, None])
        e = torch.exp(xs, out=loop.buffer(1, x))
        # clamped where z_s = −inf (e = 0): a finite bracket there, so the term is 0, not 0·inf
        xs.clamp_(min=EXP_ZERO_BELOW).mul_(a[rows, None])
        # the teacher term: a −inf teacher entry is clamped (its row has b = 0, or e = 0 there), and a
        # NaN one (its row's values are NaN: b = 0) adds 0
        xt = loop.teacher_shifted(zt, shift_t[rows]).nan_to_num_(nan=0.0, neginf=EXP_ZERO_BELOW)
        dz = xs.sub_(xt.mul_(b[rows, None])).sub_(c[rows, None]).mul_(e)
        dz.nan_to_num_(nan=0.0)  # a NaN/+inf student row (zero factors): 0, as the logits path
        if cap is not None:
            dz.mul_(cap)
        if dz.dtype != sdtype:
            dz = dz.to(sdtype)
        if bias is not None:
            dbias[cols].add_(dz.sum(dim=0), alpha=scale)
        if exact:
            dhidden[rows].addmm_(dz, w_block, alpha=scale)
            acc.addmm_(dz.T, h, alpha=scale)  # type: ignore[union-attr]
        else:  # input-dtype matmuls, each tile's product rounded once, summed in the compute dtype
            dz_low = tiles.low(dz).copy_(dz)
            dhidden[rows].add_(dz_low @ w_block, alpha=scale)
            acc.add_(dz_low.T @ h, alpha=scale)  # type: ignore[union-attr]
    flush()
    return dhidden, dweight, dbias


@linear_divergence_grads.register_fake
def _(hidden, weight, bias, *args):
    sdtype = compute_dtype(matmul_dtype(hidden, weight))
    n_bias = 0 if bias is None else weight.shape[0]
    return (
        hidden.new_empty(hidden.shape, dtype=sdtype),
        weight.new_empty(weight.shape),
        hidden.new_empty((n_bias,), dtype=sdtype),
    )


def _finalize(merged: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every rank's `[R, 7, N]` -> `(reverse_kl, cross_entropy, neg_entropy, row_stats [4, N])`
    by the logits path's merge (its `-inf` rules), once per quantity."""
    m_s, s_s, m_t, s_t, a, b, u = merged.unbind(1)  # each [R, N]
    row_stats, kl = _merge(torch.stack([m_s, s_s, m_t, s_t, u], dim=1), 1, 1)
    _, ce = _merge(torch.stack([m_s, s_s, m_t, s_t, -b], dim=1), 0, 1)
    _, ne = _merge(torch.stack([m_s, s_s, m_t, s_t, a], dim=1), 1, 0)
    return kl, ce, ne, row_stats


class _LinearDivergenceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, t_logits, t_hidden, t_head, head, logits_dtype, chunk_rows, group, *t_weights
    ):
        teacher = (t_logits, t_hidden, list(t_weights), t_head)
        local = linear_divergence_stats(hidden, weight, bias, *teacher, *head, logits_dtype, chunk_rows)
        outputs = _finalize(all_gather_stack(local, group))  # kl, ce, ne, row_stats
        ctx.save_for_backward(hidden, weight, bias, t_logits, t_hidden, t_head, *outputs, *t_weights)
        ctx.head, ctx.logits_dtype, ctx.chunk_rows, ctx.group = head, logits_dtype, chunk_rows, group
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)  # an output that reaches no loss: None, its terms skipped
        ctx.mark_non_differentiable(outputs[3])
        return outputs

    @staticmethod
    def backward(ctx, dkl, dce, dne, _drow_stats):
        hidden, weight, bias, t_logits, t_hidden, t_head, kl, ce, ne, row_stats, *t_weights = ctx.saved_tensors
        factors = _factors(row_stats, (kl, ce, ne), (dkl, dce, dne))
        teacher = (t_logits, t_hidden, t_weights, t_head)
        dhidden, dweight, dbias = linear_divergence_grads(
            hidden, weight, bias, *teacher, row_stats, factors, *ctx.head, ctx.logits_dtype, ctx.chunk_rows
        )
        dbias = None if bias is None else dbias.to(bias.dtype)
        nones = (None,) * (7 + len(t_weights))
        if not ctx.needs_input_grad[0]:  # the same on every rank, so the collective is skipped by all
            return None, dweight, dbias, *nones
        dhidden = all_reduce(dhidden, "sum", ctx.group)  # [N, H]: the full gradient on every rank
        return dhidden.to(ctx.hidden_dtype), dweight, dbias, *nones


def _factors(row_stats: Tensor, values: tuple[Tensor, ...], grads: tuple[Tensor | None, ...]) -> Tensor:
    """`(a, b, c)/S` `[3, N]` of the backward (module docstring), in the compute dtype. A quantity
    whose value is not finite on a row (a teacher `-inf` under student mass, a NaN), or a row whose
    student logits are all `-inf`, sends no gradient there (the logits path's rule)."""
    _, log_s, _, log_t = row_stats.unbind(0)
    zero = torch.zeros_like(log_s)
    live = []
    for value, grad in zip(values, grads, strict=True):
        if grad is None:
            live.append((zero, zero))
            continue
        ok = torch.isfinite(value) & torch.isfinite(log_s)
        live.append((torch.where(ok, grad.to(log_s.dtype), zero), torch.where(ok, value, zero)))
    (g_kl, r_kl), (g_ce, r_ce), (g_ne, r_ne) = live
    a, b = g_kl + g_ne, g_kl + g_ce
    # log p_s = x_s − log S, log p_t = x_t − log T: their constants join c (finite where a, b ≠ 0)
    c = g_kl * r_kl + g_ce * r_ce + g_ne * r_ne + a * finite_or_zero(log_s) - b * finite_or_zero(log_t)
    inv_s = torch.exp(-log_s_for_softmax(log_s))  # 1/S, 0 for an all -inf student row
    return torch.stack([a, b, c]) * inv_s


def linear_divergence_to_teacher(
    hidden: Tensor,
    weight: Tensor,
    group: ProcessGroup | None,
    *,
    teacher_logits: Tensor | None = None,
    teacher_hidden: Tensor | None = None,
    teacher_weights: typing.Sequence[Tensor] = (),
    teacher_head: Tensor | None = None,
    logits_dtype: torch.dtype,
    head: HeadOptions,
    chunk_rows: int = 0,
) -> LinearDivergence:
    """hidden `[..., H]`, this rank's head rows `weight [Vl, H]`, and the teacher `teacher_logits
    [..., Vl]` or `teacher_hidden [..., H']` through `teacher_weights` `[Vl, H']` (row `n` through
    `teacher_weights[teacher_head[n]]`, `teacher_head [...]`; None with one head) ->
    `LinearDivergence`, each `[...]` in `out_dtype`. Autograd reaches hidden, weight, bias; the
    teacher is detached.

    Dense equivalent: with `z_s = head(hidden @ W.T + b)` (`HeadOptions`; its `ignore_index` is
    unused: no ids), `z_t = teacher_logits` or
    ``project_onto_lm_head(teacher_hidden[n], teacher_weights[teacher_head[n]], logits_dtype)``,
    ``(reverse_kl_to_fixed(z_s, z_t), cross_entropy_to_fixed(z_s, z_t), neg_entropy(z_s))``.
    """
    lead = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    local_vocab = weight.shape[0]
    tl = None if teacher_logits is None else teacher_logits.detach().reshape(-1, local_vocab)
    th = None if teacher_hidden is None else teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    tk = None if teacher_head is None or len(teacher_weights) < 2 else teacher_head.reshape(-1).to(torch.int64)
    tw = [w.detach() for w in teacher_weights]
    kl, ce, ne, _ = _LinearDivergenceFn.apply(
        flat_hidden, weight, head.bias, tl, th, tk, tuple(head.logits), logits_dtype, chunk_rows, group, *tw
    )
    return LinearDivergence(kl.view(lead), ce.view(lead), ne.view(lead))

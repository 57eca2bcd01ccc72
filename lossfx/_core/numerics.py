"""Numerics shared by every kernel: the compute dtype and the one max-shifted log-sum-exp merge.

A row's softmax statistics over a set of columns (a vocabulary block, a rank's shard) are a part
`(m, s)`: `m` the max and `s = Σ exp(z − m)`, with optionally the moment `u = Σ exp(z − m)(z − m)`.
Parts over disjoint column sets merge exactly (proofs/logprobs.md §3, proofs/gather.md §4):

    M = max_r m_r,  w_r = exp(m_r − shift),  S = Σ_r w_r s_r,  U = Σ_r w_r (u_r + (m_r − shift) s_r),

with `lse = shift + log S`. `merge` is that merge, written once; every kernel uses it (the
fused tile engine through `merge_stats`, the logits kernels through `merge_max_logsum`, the
divergences with their own moment offsets).

Non-finite conventions (proofs/logprobs.md §3.1, checked by tests/test_nonfinite_merge.py):
* a part whose columns are all `-inf` is `m = -inf, s = u = 0`: its weight is exactly 0 and it
  adds nothing, whatever the other parts; a row that is `-inf` everywhere has shift 0 (no
  `-inf − -inf` is formed), `S = 0` (`log S = -inf`) and `U = 0`;
* a row with a NaN or `+inf` logit has `M` NaN or `+inf`, so its shift is NaN and every merged
  quantity of the row is NaN, as `torch.log_softmax` and the float64 reference make that row.
"""

from __future__ import annotations

import math
import typing

import torch
from torch import Tensor

from lossfx._core.host_reads import tracing


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """`promote_types(dtype, float32)`: bf16/fp16/fp32 compute in fp32, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def finite_or_zero(x: Tensor) -> Tensor:
    """`x` where finite, else 0: a safe shift for `exp(z − shift)`. (One op: `isfinite` + `where`
    would be six kernel launches on a GPU, in every chunk of every row loop.)"""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def finite_or_nan(x: Tensor) -> Tensor:
    """`x` with `±inf` made `±max` of its dtype and NaN kept: a factor that multiplies a `p` which
    is 0 where `x` is infinite gives 0 there, never `0 · inf = NaN`, while a NaN input stays NaN.
    One op."""
    return torch.nan_to_num(x, nan=math.nan)


def finite_or_nan_(x: Tensor) -> Tensor:
    """`finite_or_nan` in place."""
    return x.nan_to_num_(nan=math.nan)


# exp(x) is exactly 0 for every x <= this in float64 (below -745.2), float32 and bf16 (below -103.9):
# clamping x up to it changes no exp(x), and keeps a factor x·c finite where exp(x) = 0
EXP_ZERO_BELOW = -1000.0


def shift_or_nan(m: Tensor) -> Tensor:
    """The softmax shift of a row from its max `m`: `m` where finite, 0 where `-inf` (a row whose
    logits are all `-inf`), NaN where `m` is NaN or `+inf`. A row with a NaN or `+inf` logit is NaN
    throughout, as `torch.log_softmax` makes it; a NaN shift carries that into every quantity of the
    row formed from it (log-probs, `Σ p log p`, every entry of its gradient). One op."""
    return torch.nan_to_num(m, nan=math.nan, posinf=math.nan, neginf=0.0)


def compiled_row_sum(x: Tensor) -> Tensor:
    """`x [..., V] -> [...]`: the row sum for traced code, rounded once to `x`'s dtype.

    On CPU, Inductor's fp32 sum adds each block of 4096 values sequentially per vector lane
    (relative error ~5e-6 at V = 32000, 25x eager's cascade sum); a float64 accumulator inside the
    same fused loop leaves only the terms' own rounding, for ~14 % on that pass (docs/opd_full.md,
    "Compiled accuracy"). GPU reductions are trees (error ~log V ulps) and float64 is slow there,
    so other devices sum in `x`'s dtype. The device is a constant of the trace.
    """
    if x.device.type == "cpu" and x.dtype != torch.float64:
        return x.sum(dim=-1, dtype=torch.float64).to(x.dtype)
    return x.sum(dim=-1)


def row_max_sumexp(z: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Per-row `(m, s)` of `z [N, V]` in `dtype` (default `z`'s): `m = max_v z`, `s = Σ_v exp(z − m)`.

    `z` may be narrower than `dtype` (bf16 logits, fp32 compute): the max is exact in any dtype, and
    `z − m` promotes to `dtype` elementwise, so no converted copy of `z` is made. The difference is a
    fresh `[N, V]` temporary, exponentiated in place: one temporary per call in eager mode.
    """
    dtype = z.dtype if dtype is None else dtype
    if tracing():
        # Inductor fuses the cast into its loads; a bf16 max reduction measured 2x slower on CPU.
        z = z.to(dtype)
    m = z.amax(dim=-1).to(dtype)  # [N]
    e = z - finite_or_zero(m).unsqueeze(-1)  # [N, V] in dtype (type promotion; exact upcast)
    if tracing():
        return m, compiled_row_sum(torch.exp(e))
    s = e.exp_().sum(dim=-1)  # [N]
    return m, s


class Merged(typing.NamedTuple):
    """The merge of parts `[R, N]` over disjoint columns (`merge`), each field over the whole row."""

    big: Tensor  # [N] M = max_r m_r as is: -inf for a row that is -inf everywhere, NaN / +inf through a NaN row
    shift: Tensor  # [N] shift_or_nan(M): 0 for an all -inf row, NaN for a row with a NaN or +inf logit
    offset: Tensor  # [R, N] m_r − shift: ≤ 0, -inf for an all -inf part, NaN through a NaN row
    weight: Tensor  # [R, N] exp(offset): exactly 0 for an all -inf part
    total: Tensor  # [N] S = Σ_r w_r s_r = Σ_v exp(z_v − shift)


def merge(m: Tensor, s: Tensor) -> Merged:
    """Merge per-part `m, s [R, N]` over dim 0 (parts: vocabulary blocks or ranks) into `Merged`."""
    big = m.amax(dim=0)  # [N]
    shift = shift_or_nan(big)  # [N]: no -inf − -inf; NaN carries a NaN / +inf row
    offset = m - shift.unsqueeze(0)  # [R, N]
    weight = torch.exp(offset)  # [R, N]
    return Merged(big, shift, offset, weight, (weight * s).sum(dim=0))


def merge_moment(merged: Merged, s: Tensor, u: Tensor, moment_offset: Tensor | None = None) -> Tensor:
    """`U = Σ_r w_r (u_r + δ_r s_r)` `[N]`: per-part moments `u [R, N]`, each about its part's own
    shift, moved to the merged shift; `δ = moment_offset [R, N]` (default `merged.offset`, the
    moment of `z`; the divergences pass their weighted student/teacher offsets).

    A part of weight 0 adds exactly 0: its term can only be NaN as `0 · (±inf)` (an all `-inf`
    part's `δ = -inf`, or a divergence's `u = +inf` on a part whose mass underflows), and NaN terms
    are dropped (`nansum`, one op). On a row whose merged `S` is not NaN that is the only NaN term;
    a NaN row (NaN shift) may get a finite `U` this way, but its `S` is NaN, and `U` is only ever
    read as `U / S`: NaN (proofs/logprobs.md §3.1)."""
    delta = merged.offset if moment_offset is None else moment_offset
    return (merged.weight * (u + delta * s)).nansum(dim=0)


def merge_stats(m: Tensor, s: Tensor, u: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """`merge` of parts `m, s, u [R, N]` -> `(M, S, U)` `[N]`, `S`, `U` about `shift_or_nan(M)`.

    `M` is returned as is, so an all `-inf` row stays the part `(-inf, 0, 0)` and merges again
    exactly (the fused tile engine merges vocabulary blocks, then ranks: proofs/fused_linear.md §5, §10)."""
    merged = merge(m, s)
    return merged.big, merged.total, (None if u is None else merge_moment(merged, s, u))


def merge_max_logsum(m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Merge per-shard `m, s [R, N]` into `(shift, log_s)`, each `[N]`, with `lse = shift + log_s`.

    The two parts are kept apart on purpose: once `|m|` dwarfs `log s`, the sum `m + log s` rounds
    `log s` away, so `z − lse` loses it. `(z − shift) − log_s` subtracts the large part exactly
    first, and is as accurate as `torch.log_softmax` at any magnitude (issue 10, item 1).
    `shift` is the finite row max (0 for a row that is `-inf` everywhere, whose `log_s` is `-inf`;
    NaN for a row with a NaN or `+inf` logit, whose `log_s` is NaN).
    """
    merged = merge(m, s)
    return merged.shift, torch.log(merged.total)


def log_s_for_softmax(log_s: Tensor) -> Tensor:
    """`log_s` to use in `exp((z − shift) − log_s)`: `+inf` for an all `-inf` row, so its softmax is 0."""
    return torch.where(torch.isneginf(log_s), torch.full_like(log_s, float("inf")), log_s)


def log_softmax_rows(x: Tensor) -> Tensor:
    """`log_softmax` over the last dim; a row that is all `-inf` gives `-inf` and a zero gradient."""
    row_ok = ~torch.isneginf(x).all(dim=-1, keepdim=True)
    safe = torch.where(row_ok, x, torch.zeros_like(x))
    return torch.where(row_ok, safe.log_softmax(dim=-1), torch.full_like(x, float("-inf")))

"""Numerics shared by every kernel: the compute dtype and the max-shifted log-sum-exp merge.

A row's softmax statistics are a pair `(m, s)`: `m` the row max and `s = Σ exp(z − m)`. Two pairs
over disjoint column sets merge exactly (proofs/logprobs.md §3):

    m = max(m_a, m_b),   s = s_a·exp(m_a − m) + s_b·exp(m_b − m),   lse = m + log s.

`-inf` conventions: a set of columns that are all `-inf` has `m = -inf, s = 0`; its weight
`exp(m_r − m)` is then 0, and a row that is `-inf` everywhere has `lse = -inf`. A shift of 0 is
used where the max is not finite, so no `inf − inf` is ever formed.
"""

from __future__ import annotations

import math

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


def merge_max_logsum(m: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """Merge per-shard `m, s [R, N]` into `(shift, log_s)`, each `[N]`, with `lse = shift + log_s`.

    The two parts are kept apart on purpose: once `|m|` dwarfs `log s`, the sum `m + log s` rounds
    `log s` away, so `z − lse` loses it. `(z − shift) − log_s` subtracts the large part exactly
    first, and is as accurate as `torch.log_softmax` at any magnitude (issue 10, item 1).
    `shift` is the finite row max (0 for a row that is `-inf` everywhere, whose `log_s` is `-inf`).
    """
    shift = finite_or_zero(m.amax(dim=0))  # [N]
    log_s = torch.log((s * torch.exp(m - shift.unsqueeze(0))).sum(dim=0))  # [N]
    return shift, log_s


def log_s_for_softmax(log_s: Tensor) -> Tensor:
    """`log_s` to use in `exp((z − shift) − log_s)`: `+inf` for an all `-inf` row, so its softmax is 0."""
    return torch.where(torch.isneginf(log_s), torch.full_like(log_s, float("inf")), log_s)


def log_softmax_rows(x: Tensor) -> Tensor:
    """`log_softmax` over the last dim; a row that is all `-inf` gives `-inf` and a zero gradient."""
    row_ok = ~torch.isneginf(x).all(dim=-1, keepdim=True)
    safe = torch.where(row_ok, x, torch.zeros_like(x))
    return torch.where(row_ok, safe.log_softmax(dim=-1), torch.full_like(x, float("-inf")))

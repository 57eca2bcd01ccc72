"""Pure kernel of the top-k / top-p filter: thresholds, filtered log-probs, their backward.

Pure: plain tensors, a `VocabRange` (this rank's slice of the vocabulary) and resolved options in
(`top_k` an int > 0 or None, `top_p` a float in `(0, 1]`, `strategy` and `ties` known names); no
argument validation, no DTensor, no cross-rank check: `lossfx.filtering` does those once, at its
boundary. No host read, eager or compiled: every loop count and collective is fixed by the shapes.

The filter keeps, per row, the tokens whose logit is at least a threshold `τ`; the whole design is
to find `τ` exactly while communicating only per-row scalars (the rules: `lossfx.filtering`).

Pipeline of the forward (`N` rows, `Vl` local columns, `R` ranks):

1. thresholds (`_thresholds`), one of two exact strategies:
   * **candidates** (top-k enabled, `k ≤ CANDIDATE_TOP_K_MAX`): each rank's `min(k, Vl)`
     largest values (a two-level top-k: one max-reduction over groups of 64 columns, then a
     `topk` over the best groups only); one all-gather of `[N, k]`; the top-k of the union is the
     global top-k multiset, so `τ_k` is its last entry; the global count of ties at `τ_k`
     (one counting pass, all-reduced; all-gathered per rank under `ties="sorted"`)
     completes the survivors, and the top-p masses `M`, `τ` and the filtered log-sum-exp follow
     from the `k` sorted candidates in float64, with no further pass over the logits;
   * **bisection** (top-p alone, or a large k): a search over the float bit pattern (an
     order-preserving integer key). Top-k: 32 bisection steps (64 for float64), each one counting
     pass and one all-reduce of `[N]` counts. Top-p over fp32 keys: 4 passes of a 256-ary search,
     each one histogram of the float64 masses between 256 cut points and one all-reduce of
     `[N, 257]` (float64 keys: 64 bisection steps of one masked mass sum each).
   Under `ties="sorted"` (top-p) the ties at `τ` are cut by id (`_id_cut`): every rank's count of
   its ties and its first id ride on an all-gather the counts need anyway; each rank then keeps
   its share, the largest of its tied ids, found by one local pass (a cumulative count); the
   threshold function's replicated cut is one all-reduce (min) of `[N]`.
2. the target logit on its owner rank (and, for the bisection strategy, one pass for the filtered
   log-sum-exp), merged with one all-gather of per-row statistics.

Saved for backward: the logits (no copy), `τ [N]`, the filtered `lse [N]` and, under
`ties="sorted"`, this rank's id cut `[N]`. The keep mask is a
constant (no derivative through the thresholds), so the backward is one local read/write pass:

    dlogits = keep ⊙ (onehot(target) − exp(logits − lse)) · dout,     keep = logits ≥ τ.

Temperature is never applied here: divide the logits by it before calling.
Proof of exactness: proofs/filtering.md. Reference: lossfx.reference.filtered_token_logprobs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._core.chunking import cat_chunks, row_chunks
from lossfx._core.distributed import ProcessGroup, all_gather_stack, all_reduce, group_rank, group_size, local_columns
from lossfx._core.numerics import (
    compute_dtype,
    log_s_for_softmax,
    merge_max_logsum,
    row_max_sumexp,
    shift_or_nan,
)
from lossfx._core.vocab import VocabRange

__all__ = [
    "CANDIDATE_TOP_K_MAX",
    "EXACT_TIES_MAX",
    "RADIX",
    "apply_top_k_top_p",
    "filtered_token_logprobs",
    "top_k_top_p_threshold",
]

# Largest top-k served by the candidate strategy (an all-gather of `[N, k]` values per row).
CANDIDATE_TOP_K_MAX = 1024
_F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# Order-preserving integer keys of floats (the bisection's search space)
# ---------------------------------------------------------------------------------------------


def _key_bits(dtype: torch.dtype) -> int:
    return 64 if dtype == _F64 else 32


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == _F64 else torch.int32


def _float_to_key(x: Tensor) -> Tensor:
    """int64 key of the floats `x`, monotone: `x < y ⟺ key(x) < key(y)` (non-NaN, `-0` as `+0`)."""
    bits = (x + 0.0).view(_int_dtype(x.dtype)).to(torch.int64)  # `+ 0.0` turns -0 into +0
    low = (1 << (_key_bits(x.dtype) - 1)) - 1  # every bit but the sign
    return torch.where(bits < 0, bits ^ low, bits)


def _key_to_float(key: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of `_float_to_key` (an involution on the bits)."""
    low = (1 << (_key_bits(dtype) - 1)) - 1
    bits = torch.where(key < 0, key ^ low, key)
    return bits.to(_int_dtype(dtype)).view(dtype)


def _key_limits(n_rows: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """`(key(-inf), key(+inf))` broadcast to `[N]`."""
    inf = torch.full((n_rows,), float("inf"), dtype=dtype, device=device)
    return _float_to_key(-inf), _float_to_key(inf)


def _floor_avg(lo: Tensor, hi: Tensor, bits: int = 64) -> Tensor:
    """`⌊(lo + hi) / 2⌋` of `bits`-bit keys held in int64, without overflow."""
    if bits < 64:  # the sum of two 32-bit keys fits in int64: two ops instead of six
        return (lo + hi) >> 1
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


# ---------------------------------------------------------------------------------------------
# Row passes (eager: chunked rows; compiled: one fused pass)
# ---------------------------------------------------------------------------------------------
# Each pass compares the logits in their own dtype against compute-dtype thresholds: the comparison
# promotes elementwise (exact: every logit is a compute-dtype value), so no converted copy of a
# chunk is made. A bisection runs one pass per step, so each op per chunk costs a kernel launch per
# step on a GPU (benchmarks/bench_ops.py): the passes are written with as few ops as they need.


def _count_ge(logits: Tensor, x: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` int64: local number of entries `z ≥ x[n]`."""
    return cat_chunks([(logits[s:e] >= x[s:e, None]).sum(dim=-1, dtype=torch.int64) for s, e in chunks])


def _count_eq(logits: Tensor, x: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` int64: local number of entries `z == x[n]`."""
    return cat_chunks([(logits[s:e] == x[s:e, None]).sum(dim=-1, dtype=torch.int64) for s, e in chunks])


def _count_nan(logits: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` int64: local number of NaN entries."""
    return cat_chunks([torch.isnan(logits[s:e]).sum(dim=-1, dtype=torch.int64) for s, e in chunks])


def _below(tau_k: Tensor) -> Tensor:
    """`[N]` the float just below each `τ_k` (its dtype): `z ≥ τ_k ⟺ z > _below(τ_k)` for every
    value `z` of that dtype but `−∞` (never counted by `_mass_above`: its weight is 0)."""
    return torch.nextafter(tau_k, torch.full_like(tau_k, float("-inf")))


def _mass_above(logits: Tensor, bound: Tensor, shift: Tensor, log_s: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` float64: local `Σ exp((z − shift) − log_s)` over the entries `z > bound[n]`.

    With `bound = max(x, _below(τ_k))` that is the entries `z > x` and `z ≥ τ_k`. Seven ops per
    chunk: one fresh float64 `[C, Vl]` buffer (`z − shift` promotes exactly), updated in place, and
    a bool mask.
    """
    parts = []
    for s, e in chunks:
        z = logits[s:e]  # [C, Vl], never written
        outside = (z > bound[s:e, None]).logical_not_()  # a NaN entry is outside
        w = torch.sub(z, shift[s:e, None]).sub_(log_s[s:e, None]).exp_().masked_fill_(outside, 0.0)
        parts.append(w.sum(dim=-1))
    return cat_chunks(parts)


def _count_live_below(logits: Tensor, x: Tensor, tau_k: Tensor, shift: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` float64: local number of survivors `τ_k ≤ z < x` whose weight `exp(z − shift)` is
    nonzero in float64."""
    parts = []
    for s, e in chunks:
        z = logits[s:e]  # [C, Vl]
        live = (z < x[s:e, None]) & (z >= tau_k[s:e, None]) & (torch.exp(z.to(_F64) - shift[s:e, None]) > 0)
        parts.append(live.sum(dim=-1, dtype=torch.float64))
    return cat_chunks(parts)


def _masked_logsum(
    logits: Tensor, keep: Any, chunks: list[tuple[int, int]], dtype: torch.dtype, group: ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """`(shift [N], log_s [N])` in `dtype` over the kept entries, `lse = shift + log_s` (kept apart).

    `keep(z, start, end) -> [C, Vl] bool` selects the kept entries of rows `start:end`; a NaN entry
    always enters the max, so a row holding a kept NaN gets a NaN `log_s`.
    """
    maxes, sums = [], []
    for s, e in chunks:
        z = logits[s:e].to(dtype)  # [C, Vl]
        z = torch.where(keep(z, s, e), z, float("-inf"))
        m, ssum = row_max_sumexp(z)  # [C], [C]
        maxes.append(m)
        sums.append(ssum)
    stats = all_gather_stack(torch.stack([cat_chunks(maxes), cat_chunks(sums)]), group)  # [R, 2, N]
    return merge_max_logsum(stats[:, 0], stats[:, 1])


# ---------------------------------------------------------------------------------------------
# Thresholds
# ---------------------------------------------------------------------------------------------


# Columns per group of the two-level local top-k (`_local_top`).
_GROUP = 64


def _local_top(logits: Tensor, width: int, cdtype: torch.dtype) -> Tensor:
    """`[N, width]` the `width` largest values of each local row, descending, in `cdtype`.

    Two levels, exact (proofs/filtering.md §3.1, Lemma 2'): the columns are partitioned into
    groups of `_GROUP` (group `j < G` = columns `j, j + G, j + 2G, …`, `G = Vl // _GROUP`, plus one
    group for the last `Vl mod _GROUP` columns); the row's `width` largest values all lie in the
    `width` groups with the largest maxima. So one streaming max-reduction, a small `topk` over
    the group maxima, a gather of those groups, and a `topk` over `width·_GROUP` values replace a
    `topk` over the whole row.
    """
    n_rows, local_vocab = logits.shape
    n_main = local_vocab // _GROUP  # G groups of _GROUP strided columns
    n_groups = n_main + (1 if local_vocab % _GROUP else 0)
    if n_groups <= 2 * width:  # small rows: one plain topk
        return torch.topk(logits.to(cdtype), width, dim=-1, sorted=True).values
    main = logits[:, : n_main * _GROUP].reshape(n_rows, _GROUP, n_main)  # [N, _GROUP, G]
    group_max = main.amax(dim=1)  # [N, G]: an elementwise max over _GROUP slices
    if n_groups > n_main:  # the last, partial group
        tail = logits[:, n_main * _GROUP :].amax(dim=-1, keepdim=True)  # [N, 1]
        group_max = torch.cat([group_max, tail], dim=-1)  # [N, G + 1]
    groups = torch.topk(group_max, width, dim=-1, sorted=False).indices  # [N, w]
    offsets = torch.arange(_GROUP, device=logits.device)  # [_GROUP]
    strided = groups.unsqueeze(-1) + offsets * n_main  # [N, w, _GROUP] (main groups)
    packed = n_main * _GROUP + offsets  # [_GROUP] (the tail group)
    cols = torch.where(groups.unsqueeze(-1) < n_main, strided, packed).reshape(n_rows, width * _GROUP)
    inside = cols < local_vocab
    values = logits.gather(-1, torch.where(inside, cols, 0)).to(cdtype)  # [N, w·_GROUP]
    values = torch.where(inside, values, float("-inf"))
    return torch.topk(values, width, dim=-1, sorted=True).values  # [N, w]


def _candidates(
    logits: Tensor, k: int, chunks: list[tuple[int, int]], cdtype: torch.dtype, group: ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """`(cand [N, k], ranks [R, N, k])`: the k largest values of each global row (descending, with
    multiplicity), and every rank's `min(k, Vl)` largest local values (descending, `−∞`-padded).

    A NaN counts as larger than every number (`torch.topk`'s order), so a row holding one has a
    NaN first candidate. Eager: row chunk by row chunk (the strided view of a row whose width is
    not a multiple of `_GROUP` is copied by the reshape: one chunk at a time).
    """
    n_rows, local_vocab = logits.shape
    width = min(k, local_vocab)
    mine = torch.cat([_local_top(logits[s:e], width, cdtype) for s, e in chunks])  # [N, min(k, Vl)]
    if mine.shape[1] < k:  # pad to the same width on every rank: -inf never changes the k largest
        mine = torch.cat([mine, mine.new_full((n_rows, k - mine.shape[1]), float("-inf"))], dim=-1)
    ranks = all_gather_stack(mine, group)  # [R, N, k]
    union = ranks.permute(1, 0, 2).reshape(n_rows, group_size(group) * k)  # [N, R·k]
    return torch.topk(union, k, dim=-1, sorted=True).values, ranks  # [N, k], [R, N, k]


def _tie_count(
    logits: Tensor,
    tau_k: Tensor,
    chunks: list[tuple[int, int]],
    cdtype: torch.dtype,
    group: ProcessGroup | None,
) -> Tensor:
    """`[N]` int64: the global number of entries equal to `τ_k`: one fused counting pass over the
    logits, eager and compiled (no host read: a rank's top-(k+1) values would hold the count on
    most rows, but finding the other rows on the host would cost a device→host read)."""
    return all_reduce(_count_eq(logits, tau_k, chunks), "sum", group)


def _split_top_p(top_p: float) -> tuple[float, float]:
    """`top_p = hi + lo` exactly, `hi` with at most 27 significant bits and `0 ≤ lo < 2^-26 · top_p`
    (`lo` has at most 26), so `hi · t` and `lo · t` are exact float64 products for integers
    `0 ≤ t ≤ 2^26` (proofs/filtering.md §3.3)."""
    mantissa, exponent = math.frexp(top_p)  # top_p = mantissa · 2^exponent, 0.5 ≤ mantissa < 1
    bits = int(mantissa * (1 << 53))  # the 53-bit significand, exact
    high = (bits >> 26) << 26
    return math.ldexp(high, exponent - 53), math.ldexp(bits - high, exponent - 53)


# Largest tie count whose `⌈top_p · t⌉` `_ceil_top_p_times` decides exactly (a vocabulary of 67M).
EXACT_TIES_MAX = 1 << 26


def _ceil_top_p_times(top_p: float, count: Tensor) -> Tensor:
    """`[N]` int64: `⌈top_p · t⌉` in exact arithmetic for integer counts `1 ≤ t ≤ EXACT_TIES_MAX`.

    With `top_p = hi + lo` (`_split_top_p`) both products are exact; `f = ⌈hi·t⌉` and `f − hi·t`
    are exact too (Sterbenz; for `hi·t < 1/2` the answer is 1 either way), and `lo·t < 1`, so
    `⌈top_p·t⌉ = f + [lo·t > f − hi·t]` (proofs/filtering.md §3.3).
    """
    hi, lo = _split_top_p(top_p)
    t = count.to(_F64)
    hi_t = hi * t  # [N] exact
    f = torch.ceil(hi_t)
    return f.to(torch.int64) + (lo * t > f - hi_t).to(torch.int64)


def _keep_at_boundary(mass_above_tau: Tensor, tied: Tensor, q_tau: Tensor, top_p: float, uniform: Tensor) -> Tensor:
    """`[N]` int64: how many of the `tied` entries equal to `τ` the sort-order rule keeps.

    Ranked by id (largest first), the j-th tied entry has the mass `M(τ) + j·q_τ` above it and is
    kept iff that is `< top_p`. Where every survivor with a nonzero float64 weight is tied at `τ`
    (`uniform [N]` bool; the only rows where the mass can equal `top_p` exactly, proofs/filtering.md
    §3.3), the j-th has the mass `j / t` above it: `n = ⌈top_p · t⌉`, decided exactly. Elsewhere
    `n = ⌈(top_p − M(τ)) / q_τ⌉` in float64. Always between 1 and `tied` (`M(τ) < top_p`).
    """
    room = torch.ceil((top_p - mass_above_tau) / q_tau)  # [N] float64
    n = torch.where(q_tau > 0, torch.minimum(room, tied.to(_F64)), tied.to(_F64))
    n = torch.clamp(torch.nan_to_num(n, nan=1.0), min=1.0).to(torch.int64)
    exact = torch.clamp(_ceil_top_p_times(top_p, tied), min=1)
    return torch.where(uniform, torch.minimum(exact, tied), n)


def _from_candidates(
    cand: Tensor, tie_count: Tensor, top_p: float, sort_ties: bool
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """`(τ, n, tied, shift, log_s)`, each `[N]`, of top-k (then top-p) from the sorted candidates.

    `cand [N, k]` holds every survivor with a value above `τ_k = cand[:, -1]` exactly once, and
    `tie_count [N]` is the global number of entries equal to `τ_k`; the float64 masses and
    log-sum-exps over the survivors follow without another pass over the logits. `tied` is the
    number of entries equal to `τ`, `n` how many of them are kept (`None`: all, the
    "together" rule), and the filtered `lse = shift + log_s` (kept apart: issue 10 item 1).
    """
    n_rows, k = cand.shape
    c = cand.to(_F64)  # [N, k]
    tau_k = c[:, -1]  # [N]
    above = c > tau_k[:, None]  # [N, k]
    shift = shift_or_nan(c[:, 0])  # [N]: the row max; 0 if -inf, NaN if +inf (the row is NaN)
    w = torch.where(above, torch.exp(c - shift[:, None]), 0.0)  # [N, k]
    log_s_k = torch.log(w.sum(dim=-1) + tie_count.to(_F64) * torch.exp(tau_k - shift))  # [N]
    if top_p >= 1.0:
        tau, tied, n = tau_k, tie_count, None
    else:
        q = torch.where(above, torch.exp((c - shift[:, None]) - log_s_for_softmax(log_s_k)[:, None]), 0.0)
        # M at each candidate: the mass of strictly larger values = exclusive prefix sum at the
        # start of the candidate's tie group (sorted descending, so a tie group is a contiguous run)
        excl = torch.cat([torch.zeros_like(q[:, :1]), torch.cumsum(q, dim=-1)[:, :-1]], dim=-1)  # [N, k]
        positions = torch.arange(k, device=c.device).expand(n_rows, k)  # [N, k]
        starts = torch.cat([torch.ones_like(above[:, :1]), c[:, 1:] != c[:, :-1]], dim=-1)  # [N, k]
        group_start = torch.cummax(torch.where(starts, positions, 0), dim=-1).values  # [N, k]
        mass = excl.gather(-1, group_start)  # [N, k]
        # M is non-decreasing along the row, so the kept candidates are a prefix; τ is its last value.
        # A value whose float64 weight is 0 has exactly the whole mass above it: never kept (its
        # float sum may round below a top_p just under 1); the first candidate always is.
        weighed = (torch.exp(c - shift[:, None]) > 0) | (positions == 0)  # [N, k]
        kept = (mass < top_p) & weighed  # [N, k]
        tau = torch.where(kept, c, float("inf")).amin(dim=-1)  # [N]
        at_tau = c == tau[:, None]  # [N, k]
        tied = torch.where(tau > tau_k, at_tau.sum(dim=-1), tie_count)  # [N]
        n = None
        if sort_ties:
            mass_tau = torch.where(at_tau, mass, 0.0).amax(dim=-1)  # [N]
            q_tau = torch.exp((tau - shift) - log_s_for_softmax(log_s_k))  # [N]
            # every survivor with a nonzero weight is tied at τ (τ is the max, the rest underflow)
            live_below = (c < tau[:, None]) & (torch.exp(c - shift[:, None]) > 0)  # [N, k]
            uniform = (tau == c[:, 0]) & torch.isfinite(tau) & ~live_below.any(dim=-1)  # [N]
            n = _keep_at_boundary(mass_tau, tied, q_tau, top_p, uniform)
    # the filtered log-sum: candidates above τ, plus the kept entries equal to τ
    kept_at_tau = (tied if n is None else n).to(_F64) * torch.exp(tau - shift)
    log_s = torch.log(torch.where(c > tau[:, None], w, 0.0).sum(dim=-1) + kept_at_tau)  # [N]
    tau = torch.where(torch.isnan(c[:, 0]), c[:, 0], tau)  # a row holding NaN: τ = NaN
    dtype = cand.dtype
    return tau.to(dtype), n, tied, shift.to(dtype), log_s.to(dtype)


def _top_k_by_bisection(
    logits: Tensor, k: int, chunks: list[tuple[int, int]], cdtype: torch.dtype, group: ProcessGroup | None
) -> Tensor:
    """`τ_k [N]`: the greatest key `t` with `#{z ≥ float(t)} ≥ k` (global count), as a float."""
    n_rows = logits.shape[0]
    lo, hi = _key_limits(n_rows, cdtype, logits.device)  # pred(lo) true (count = V ≥ k)
    hi = hi + 1  # pred(hi) false, never evaluated
    bits = _key_bits(cdtype)
    for _ in range(bits):
        mid = _floor_avg(lo, hi, bits)  # in [lo, hi − 1]: a real float
        count = all_reduce(_count_ge(logits, _key_to_float(mid, cdtype), chunks), "sum", group)
        ok = count >= k
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return _key_to_float(lo, cdtype) + 0.0  # `+ 0.0`: a -0 threshold reads as +0


def _top_p_by_bisection(
    logits: Tensor,
    tau_k: Tensor,
    shift: Tensor,
    log_s: Tensor,
    top_p: float,
    chunks: list[tuple[int, int]],
    cdtype: torch.dtype,
    group: ProcessGroup | None,
    masked: bool = True,
    radix: bool = True,
) -> Tensor:
    """`τ_p [N]`: the least key `t` with `M(float(t)) < top_p`, as a float (see module doc).

    `(shift, log_s)`: the float64 log-sum of the top-k survivors, kept apart; `masked`: whether
    top-k may have cut (`τ_k > −∞` possible). fp32 keys (with `radix`): a `RADIX`-ary search,
    4 passes (`_top_p_by_radix`); otherwise one bisection step per key bit (64 for float64).
    """
    if radix and _key_bits(cdtype) < 64:
        return _top_p_by_radix(logits, tau_k, shift, log_s, top_p, chunks, cdtype, group, masked)
    empty = torch.isinf(log_s)  # a row without survivors of nonzero weight (log_s_for_softmax: +inf)
    n_rows = logits.shape[0]
    lo, hi = _key_limits(n_rows, cdtype, logits.device)  # pred(hi) true: nothing is above +inf
    lo = lo - 1  # pred(lo) taken as false, never evaluated
    below_tau_k = _below(tau_k)
    bits = _key_bits(cdtype)
    for _ in range(bits):
        mid = _floor_avg(lo, hi, bits)
        moving = mid != lo  # mid == lo only once converged (hi = lo + 1): keep the state
        x = _key_to_float(torch.where(moving, mid, hi), cdtype)  # [N], never the sentinel
        mass = all_reduce(_mass_above(logits, torch.maximum(x, below_tau_k), shift, log_s, chunks), "sum", group)
        # a value of float64 weight 0 has the whole mass above it exactly (see _from_candidates)
        weighed = (torch.exp(x.to(_F64) - shift) > 0) | empty
        ok = (mass < top_p) & moving & weighed
        # not moving: mid == lo and ok is false, so `lo` keeps its value either way
        lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
    return _key_to_float(hi, cdtype) + 0.0  # `+ 0.0`: a -0 threshold reads as +0


# Sub-intervals per pass of the top-p search over fp32 keys: 4 passes cover the 2^32 keys.
RADIX = 256


def _radix_passes() -> int:
    """Passes of `_top_p_by_radix` that take the fp32 key interval `(key(−∞) − 1, key(+∞)]` to
    width 1: 4 (`key(+∞) = 0x7F800000`, `key(−∞) = −key(+∞) − 1`)."""
    width, passes = 2 * 0x7F800000 + 2, 0
    while width > 1:
        width, passes = -(-width // RADIX), passes + 1
    return passes


def _mass_histogram(
    logits: Tensor, bounds: Tensor, tau_k: Tensor | None, shift: Tensor, log_s: Tensor, chunks: list[tuple[int, int]]
) -> Tensor:
    """`[N, B + 1]` float64: local mass `Σ exp((z − shift) − log_s)` of the entries with exactly
    `j` of the ascending `bounds [N, B]` strictly below them, in column `j` (entries `z < τ_k`
    weigh 0; `tau_k` None: no top-k). So `Σ_{j > d} hist[:, j]` is the mass of the entries
    `z > bounds[:, d]`, `_mass_above`'s set at `x = bounds[:, d]`.
    """
    parts = []
    width = bounds.shape[1] + 1
    for s, e in chunks:
        z = logits[s:e]  # [C, Vl], never written
        # [C, Vl] int64 #{bounds < z}, compared in fp32 (a bf16 chunk's fp32 copy dies here)
        bins = torch.searchsorted(bounds[s:e], z.to(bounds.dtype).contiguous())
        w = torch.sub(z, shift[s:e, None]).sub_(log_s[s:e, None]).exp_()  # [C, Vl] float64
        if tau_k is not None:
            w.masked_fill_(z < tau_k[s:e, None], 0.0)
        parts.append(w.new_zeros(e - s, width).scatter_add_(1, bins, w))
    return cat_chunks(parts)


def _top_p_by_radix(
    logits: Tensor,
    tau_k: Tensor,
    shift: Tensor,
    log_s: Tensor,
    top_p: float,
    chunks: list[tuple[int, int]],
    cdtype: torch.dtype,
    group: ProcessGroup | None,
    masked: bool,
) -> Tensor:
    """`τ_p [N]` of `_top_p_by_bisection` for fp32 keys, `RADIX` points per pass instead of one.

    The key interval `(lo, hi]` (`P(hi)` true, `P(lo)` false) is cut at `RADIX` ascending points
    `e_d = lo + ⌈(d + 1)·(hi − lo) / RADIX⌉` (`e_{RADIX−1} = hi`); one pass over the logits bins
    the masses between them (`_mass_histogram`, one all-reduce of `[N, RADIX + 1]`), suffix sums
    give `M(f(e_d))`, and `(lo, hi]` becomes `(e_{d*−1}, e_{d*}]` with `d*` the first point where
    `P` holds. The width `< 2^32` shrinks to at most `⌈w / RADIX⌉` per pass: 4 passes end at
    width 1, `hi = T*` (proofs/filtering.md §3.2).
    """
    empty = torch.isinf(log_s)  # a row without survivors of nonzero weight (log_s_for_softmax: +inf)
    n_rows = logits.shape[0]
    lo, hi = _key_limits(n_rows, cdtype, logits.device)  # pred(hi) true: nothing is above +inf
    lo = lo - 1  # pred(lo) taken as false, never evaluated
    steps = torch.arange(1, RADIX + 1, device=logits.device)  # [B]
    last = steps == RADIX  # [B]: e_{B−1} = hi, P true without evaluation
    for _ in range(_radix_passes()):
        ends = lo[:, None] + ((hi - lo)[:, None] * steps + (RADIX - 1)) // RADIX  # [N, B] ascending
        bounds = _key_to_float(ends, cdtype)  # [N, B]: real floats (lo + 1 ≤ e_d ≤ hi)
        hist = all_reduce(
            _mass_histogram(logits, bounds, tau_k if masked else None, shift, log_s, chunks), "sum", group
        )  # [N, B + 1]
        mass = hist.flip(-1).cumsum(-1).flip(-1)[:, 1:]  # [N, B]: M(bounds[:, d]) = Σ_{j > d} hist[:, j]
        # a value of float64 weight 0 has the whole mass above it exactly (see _from_candidates)
        weighed = (torch.exp(bounds.to(_F64) - shift[:, None]) > 0) | empty[:, None]
        ok = ((mass < top_p) & weighed) | last  # [N, B], monotone: false … false true … true
        first = RADIX - ok.sum(dim=-1, keepdim=True)  # [N, 1] d*: the number of false points
        lo = torch.where(first > 0, ends.gather(-1, (first - 1).clamp_(min=0)), lo[:, None]).squeeze(-1)
        hi = ends.gather(-1, first).squeeze(-1)
    return _key_to_float(hi, cdtype) + 0.0  # `+ 0.0`: a -0 threshold reads as +0


def _gather_with_start(x: Tensor, vocab_start: int, group: ProcessGroup | None) -> tuple[Tensor, Tensor]:
    """`(xs [R, *x.shape], starts [R])`: every rank's `x` (int64 or float64) and its first global id,
    in one all-gather (explicit vocabulary ranges need not be in rank order)."""
    flat = torch.cat([x.reshape(-1), x.new_full((1,), vocab_start)])  # [numel + 1]
    gathered = all_gather_stack(flat, group)  # [R, numel + 1]
    return gathered[:, :-1].reshape(gathered.shape[0], *x.shape), gathered[:, -1]


def _tied_prefix(logits: Tensor, tau: Tensor, drop: Tensor, chunks: list[tuple[int, int]]) -> Tensor:
    """`[N]` int64: the number of local columns `j` with `#{i ≤ j : z_i == τ} ≤ drop[n]`, i.e. the
    column of the `(drop + 1)`-th smallest local tied entry (`Vl` when there are `≤ drop`).

    One pass: a cumulative count of the tied mask along the row (int32, chunked like `_count_eq`).
    """
    parts = []
    for s, e in chunks:
        cum = (logits[s:e] == tau[s:e, None]).cumsum(dim=-1, dtype=torch.int32)  # [C, Vl]
        parts.append((cum <= drop[s:e, None]).sum(dim=-1, dtype=torch.int64))
    return cat_chunks(parts)


def _id_cut(
    logits: Tensor,
    tau: Tensor,
    n: Tensor,
    counts: Tensor,
    starts: Tensor,
    vocab_start: int,
    vocab_size: int,
    chunks: list[tuple[int, int]],
    group: ProcessGroup | None,
    shared: bool,
) -> Tensor:
    """`[N]` int64: the id cut of the sort-order rule (keep the entries `z == τ` with id `≥ cut`).

    `counts [R, N]` and `starts [R]`: every rank's number of entries equal to `τ` and first global
    id (rank order: `mine = counts[rank]`); `n [N]` how many ties the rule keeps. The kept ties are the
    `n` largest ids, so this rank keeps its `k_r = clamp(n − above_r, 0, mine)` largest, `above_r`
    the ties in the shards of larger ids, and drops its `mine − k_r` smallest: one local pass
    (`_tied_prefix`) finds its own cut. `shared`: the global cut `t*`, the n-th largest tied id,
    the same on every rank (one all-reduce: the least first kept id over the ranks that keep one;
    0 for a row without ties or holding a NaN); else this rank's own cut (`≥ vocab_start + Vl` when
    it keeps none of its ties), which selects the same entries on its columns (proofs/filtering.md,
    Lemma 1s).
    """
    mine = counts[group_rank(group)]  # [N]
    above = torch.where(starts[:, None] > vocab_start, counts, 0).sum(dim=0)  # [N]
    keep_here = torch.minimum((n - above).clamp(min=0), mine)  # [N] k_r
    local_cut = vocab_start + _tied_prefix(logits, tau, mine - keep_here, chunks)  # [N]
    if not shared:
        return local_cut
    first_kept = torch.where(keep_here > 0, local_cut, vocab_size)  # [N]
    cut = all_reduce(first_kept, "min", group)  # [N]
    return torch.where((cut == vocab_size) | torch.isnan(tau), 0, cut)


class _Filter(NamedTuple):
    """A row's filter: keep `z > τ`, and `z == τ` when the id is `≥ cut` (every tie if `cut` is None)."""

    tau: Tensor  # [N] compute dtype; NaN for a row holding a NaN (keeps nothing)
    cut: Tensor | None  # [N] int64 global id (the global cut, or this rank's own: `_id_cut`), or None
    shift: Tensor | None  # [N] filtered row max (finite, or 0), or None when not computed
    log_s: Tensor | None  # [N] filtered log Σ exp(z − shift) over the kept entries


def _keep(z: Tensor, ids: Tensor, tau: Tensor, cut: Tensor | None) -> Tensor:
    """Keep mask of the values `z` with global ids `ids` (broadcasting) under `(τ, cut)`."""
    if cut is None:
        return z >= tau
    return (z > tau) | ((z == tau) & (ids >= cut))


def _thresholds(
    logits: Tensor,
    top_k: int | None,
    top_p: float,
    vocab_start: int,
    vocab_size: int,
    chunk_rows: int | None,
    group: ProcessGroup | None,
    strategy: str,
    ties: str,
    shared_cut: bool = True,
) -> _Filter:
    """The filter of every row (`_Filter`), in the compute dtype.

    The candidate strategy also returns the filtered log-sum (from the candidates); the bisection
    strategy returns `None` for it. Under `ties="sorted"` the entries tied at `τ` are cut by id:
    `shared_cut` returns the global cut (the same on every rank), else this rank's own (`_id_cut`).
    """
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    chunks = row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device)
    k = None if top_k is None else min(top_k, vocab_size)
    use_top_p = top_p < 1.0
    sort_ties = ties == "sorted" and use_top_p
    use_candidates = k is not None and (strategy == "candidates" or (strategy == "auto" and k <= CANDIDATE_TOP_K_MAX))
    shift: Tensor | None = None
    log_s: Tensor | None = None
    n: Tensor | None = None
    if k is not None and use_candidates:
        # 1. the global top-k multiset from per-rank candidates: one all-gather of [N, k]
        cand, ranks = _candidates(logits, k, chunks, cdtype, group)  # [N, k], [R, N, k]
        # 2. the tie group at τ_k completes the survivors; top-p over the sorted candidates
        tau_k = cand[:, -1]  # [N]
        if sort_ties:  # every rank's count at τ_k (and first id), for the id cut
            at_tau_k, starts = _gather_with_start(_count_eq(logits, tau_k, chunks), vocab_start, group)  # [R, N]
            ties_k = at_tau_k.sum(dim=0)  # [N]
        else:
            ties_k = _tie_count(logits, tau_k, chunks, cdtype, group)  # [N]
        tau, n, _tied, shift, log_s = _from_candidates(cand, ties_k, top_p, sort_ties)
        if sort_ties:
            # each rank's count at τ: above τ_k its ties are among its gathered candidates (fewer
            # than k values exceed τ_k), at τ_k the counting pass's; 0 for a NaN τ
            in_cand = (ranks == tau[:, None]).sum(dim=-1)  # [R, N]
            counts = torch.where(tau > tau_k, in_cand, torch.where(tau == tau_k, at_tau_k, 0))  # [R, N]
    else:
        # bisection: top-k by global counts, then top-p by global masses
        if k is None or k >= vocab_size:
            tau_k = torch.full((n_rows,), float("-inf"), dtype=cdtype, device=logits.device)
        else:
            tau_k = _top_k_by_bisection(logits, k, chunks, cdtype, group)
        tau = tau_k
        if use_top_p:
            shift_k, log_s_k = _masked_logsum(logits, lambda z, s, e: z >= tau_k[s:e, None], chunks, _F64, group)
            log_s_k = log_s_for_softmax(log_s_k)
            masked = k is not None and k < vocab_size  # else τ_k = −∞: nothing to mask
            tau_p = _top_p_by_bisection(logits, tau_k, shift_k, log_s_k, top_p, chunks, cdtype, group, masked)
            tau = torch.maximum(tau_k, tau_p)
            if sort_ties:
                above = _mass_above(logits, torch.maximum(tau, _below(tau_k)), shift_k, log_s_k, chunks)
                tied_here = _count_eq(logits, tau, chunks).to(_F64)
                live = _count_live_below(logits, tau, tau_k, shift_k, chunks)
                # every rank's (mass, ties, live) and first id: one all-gather, summed in rank order
                per_rank, starts = _gather_with_start(torch.stack([above, tied_here, live]), vocab_start, group)
                sums = per_rank.sum(dim=0)  # [3, N]
                q_tau = torch.exp((tau.to(_F64) - shift_k) - log_s_k)
                tied = sums[1].to(torch.int64)
                uniform = (tau.to(_F64) == shift_k) & torch.isfinite(tau) & (sums[2] == 0)
                n = _keep_at_boundary(sums[0], tied, q_tau, top_p, uniform)
                counts = per_rank[:, 1].to(torch.int64)  # [R, N]
        nan_rows = all_reduce(_count_nan(logits, chunks), "sum", group) > 0
        tau = torch.where(nan_rows, torch.full_like(tau, float("nan")), tau)
    cut = None
    if n is not None:  # no host read and no search: one gathered count per rank, one local pass
        cut = _id_cut(logits, tau, n, counts, starts, vocab_start, vocab_size, chunks, group, shared_cut)
    return _Filter(tau, cut, shift, log_s)


# ---------------------------------------------------------------------------------------------
# Filtered log-probs: forward, backward, autograd.Function
# ---------------------------------------------------------------------------------------------


def _filtered_logprobs_fwd(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    top_k: int | None,
    top_p: float,
    chunk_rows: int | None,
    group: ProcessGroup | None,
    strategy: str,
    ties: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits `[N, Vl]`, target `[N]` -> (out, shift, log_s, τ, cut), each `[N]` (cut int64, this
    rank's own id cut: `_id_cut`).

    `out = (z_t − shift) − log_s`: the row max and the log-sum are subtracted one after the other,
    never added first (exact at any magnitude, proofs/filtering.md §4).
    """
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    # 1. the filter (keep = z > τ, or z == τ with id ≥ cut; this rank's own cut: its columns are all
    # it is applied to) and, from the candidates, the log-sum
    tau, cut, shift, log_s = _thresholds(
        logits, top_k, top_p, vocab_start, vocab_size, chunk_rows, group, strategy, ties, shared_cut=False
    )
    local_idx, owned = local_columns(target, vocab_start, local_vocab)  # [N], [N]
    picked = logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1).to(cdtype)  # [N]
    kept = owned & _keep(picked, target, tau, cut)  # [N]: the target survives (owner rank only)
    picked = torch.where(kept, picked, torch.zeros_like(picked))
    local_stats = [picked, kept.to(cdtype)]
    if log_s is None:
        # 2. filtered (m, s) per rank, merged with the target's statistics in one all-gather
        columns = torch.arange(local_vocab, device=logits.device) + vocab_start  # [Vl]
        maxes, sums = [], []
        for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device):
            z = logits[start:end]  # [C, Vl]; compared and shifted with promotion (no converted copy)
            keep = _keep(z, columns, tau[start:end, None], None if cut is None else cut[start:end, None])
            m, s = row_max_sumexp(torch.where(keep, z, float("-inf")), cdtype)
            maxes.append(m)
            sums.append(s)
        local_stats += [torch.cat(maxes), torch.cat(sums)]
    stats = all_gather_stack(torch.stack(local_stats), group)  # [R, 2 or 4, N]
    if log_s is None:
        shift, log_s = merge_max_logsum(stats[:, 2], stats[:, 3])  # [N], [N]
    assert shift is not None
    target_logit = stats[:, 0].sum(dim=0)  # [N]: exactly one rank contributes
    target_kept = stats[:, 1].sum(dim=0) > 0  # [N]
    dead = torch.isneginf(log_s) | ~target_kept
    # a dropped target's -inf, but NaN on a row with a +inf logit (NaN shift): log_softmax is NaN there
    out = torch.where(dead, shift - math.inf, (target_logit - shift) - log_s)
    out = torch.where(torch.isnan(tau), tau, out)  # a row holding NaN: NaN (it keeps nothing)
    cut_out = torch.zeros_like(target) if cut is None else cut
    return out, shift, log_s, tau, cut_out


def dropped_gradient(tau: Tensor) -> Tensor:
    """`[N]` thresholds -> `[N, 1]`: the gradient of a dropped column, 0, or NaN on a row holding a
    NaN (`τ` NaN: it keeps nothing, and every column of it gets a NaN gradient)."""
    return torch.where(torch.isnan(tau), tau, 0.0)[:, None]


def _filtered_logprobs_bwd(
    logits: Tensor,
    target: Tensor,
    shift: Tensor,
    log_s: Tensor,
    tau: Tensor,
    cut: Tensor | None,
    dout: Tensor,
    vocab_start: int,
    chunk_rows: int | None,
    dropped: Tensor | None = None,
) -> Tensor:
    """-> dlogits `[N, Vl]` in the logits' dtype; no collective, the mask is a constant.

    `dlogits = keep ⊙ (onehot(target) − exp((z − shift) − log_s)) · dout`; NaN in every column of a
    row holding a NaN (`τ` NaN: it keeps nothing, and its NaN log-prob never comes with a zero
    gradient, as the reference's unfiltered `log_softmax` of that row; proofs/filtering.md §2).
    `dropped` `[N, 1]`: that column value per row (`dropped_gradient(tau)`), when the caller walks
    row chunks and makes it once for all of them.
    """
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(target, vocab_start, local_vocab)  # [N], [N]
    log_s_safe = log_s_for_softmax(log_s)  # [N]
    grad = torch.where(torch.isneginf(log_s), torch.zeros_like(log_s), dout.to(cdtype))  # [N]
    picked = logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1).to(cdtype)  # [N]
    grad_target = torch.where(owned & _keep(picked, target, tau, cut), grad, torch.zeros_like(grad))  # [N]
    dropped = dropped_gradient(tau) if dropped is None else dropped
    columns = torch.arange(local_vocab, device=logits.device)  # [Vl]
    ids = columns + vocab_start  # [Vl] global ids
    chunks = row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device)
    if len(chunks) == 1:  # compiled (or one chunk): one fused expression
        # no `logits.to(cdtype)` here: the mixed-dtype ops promote elementwise, so AOTAutograd saves
        # the logits themselves, never an fp32 copy of bf16 logits (issue 10 item 9)
        onehot = columns == local_idx[:, None]  # [N, Vl]
        probs = torch.exp((logits - shift[:, None]) - log_s_safe[:, None])  # [N, Vl] in cdtype
        dz = torch.where(onehot, grad_target[:, None], 0.0) - probs * grad[:, None]
        keep = _keep(logits, ids, tau[:, None], None if cut is None else cut[:, None])  # compared in cdtype
        return torch.where(keep, dz, dropped).to(logits.dtype)
    # eager: in-place chunk by chunk, written straight into the output when it has the compute
    # dtype (one read, one write), else through one chunk-sized buffer (rounded once)
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    direct = logits.dtype == cdtype
    neg_grad = -grad  # [N]
    for start, end in chunks:
        z = logits[start:end]  # [C, Vl]; the ops below promote it elementwise (no converted copy)
        d = torch.sub(z, shift[start:end, None], out=dlogits[start:end] if direct else None)  # [C, Vl] cdtype
        d.sub_(log_s_safe[start:end, None]).exp_().mul_(neg_grad[start:end, None])  # the softmax term
        keep = _keep(z, ids, tau[start:end, None], None if cut is None else cut[start:end, None])
        torch.where(keep, d, dropped[start:end], out=d)  # 0 where dropped (NaN on a NaN row: it keeps nothing)
        d.scatter_add_(1, local_idx[start:end, None], grad_target[start:end, None])  # one-hot
        if not direct:
            dlogits[start:end] = d
    return dlogits


class _FilteredLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(logits, target, vocab_start, vocab_size, top_k, top_p, chunk_rows, group, strategy, ties):
        return _filtered_logprobs_fwd(
            logits, target, vocab_start, vocab_size, top_k, top_p, chunk_rows, group, strategy, ties
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, target, vocab_start, _v, _k, top_p, chunk_rows, _group, _strategy, ties = inputs
        _out, shift, log_s, tau, cut = output
        ctx.save_for_backward(logits, target, shift, log_s, tau, cut)
        ctx.vocab_start, ctx.chunk_rows = vocab_start, chunk_rows
        ctx.sort_ties = ties == "sorted" and top_p < 1.0
        ctx.mark_non_differentiable(shift, log_s, tau, cut)

    @staticmethod
    @once_differentiable  # keep and the log-sum are constants of the backward: proofs/filtering.md §2
    def backward(ctx, dout, _dshift, _dlog_s, _dtau, _dcut):
        logits, target, shift, log_s, tau, cut = ctx.saved_tensors
        dlogits = _filtered_logprobs_bwd(
            logits, target, shift, log_s, tau, cut if ctx.sort_ties else None, dout, ctx.vocab_start, ctx.chunk_rows
        )
        return dlogits, None, None, None, None, None, None, None, None, None  # one entry per forward input


# ---------------------------------------------------------------------------------------------
# The pure kernels (already-validated arguments)
# ---------------------------------------------------------------------------------------------


def top_k_top_p_threshold(
    logits: Tensor,
    vocab: VocabRange,
    *,
    top_k: int | None,
    top_p: float,
    chunk_rows: int | None = None,
    strategy: str = "auto",
    ties: str = "together",
) -> Tensor | tuple[Tensor, Tensor]:
    """logits `[..., Vl]` (this rank's columns `vocab.start : vocab.start + Vl` of `[..., vocab.size]`)
    -> `τ [...]` in the compute dtype; with `ties="sorted"`, `(τ [...], id_cut [...] int64)`.

    `top_k`: an int > 0 or None (disabled); `top_p` in `(0, 1]`. No gradient flows through `τ`.
    Dense equivalent: ``where(keep, z, inf).amin(-1)`` with
    ``keep = lossfx.reference.apply_top_k_top_p(z, top_k, top_p, ties)[1]``; the filter keeps
    `z > τ`, and `z == τ` where the global id `≥ id_cut` (every tie under "together").
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])  # [N, Vl]
    found = _thresholds(flat, top_k, top_p, vocab.start, vocab.size, chunk_rows, vocab.group, strategy, ties)
    tau = found.tau.view(logits.shape[:-1])
    if ties == "together":
        return tau
    cut = torch.zeros_like(flat[:, 0], dtype=torch.int64) if found.cut is None else found.cut
    return tau, cut.view(logits.shape[:-1])


def apply_top_k_top_p(
    logits: Tensor,
    vocab: VocabRange,
    *,
    top_k: int | None,
    top_p: float,
    chunk_rows: int | None = None,
    ties: str = "together",
) -> tuple[Tensor, Tensor]:
    """logits `[..., Vl]` -> `(filtered [..., Vl] (the logits' dtype), keep [..., Vl] bool)`.

    Dense equivalent: ``lossfx.reference.apply_top_k_top_p(z, top_k, top_p, ties)`` on this
    rank's columns; `filtered = where(keep, logits, -inf)`, its gradient `grad · keep`.
    """
    found = top_k_top_p_threshold(logits, vocab, top_k=top_k, top_p=top_p, chunk_rows=chunk_rows, ties=ties)
    tau, cut = (found, None) if isinstance(found, Tensor) else found
    ids = torch.arange(logits.shape[-1], device=logits.device) + vocab.start  # [Vl] global ids
    keep = _keep(logits.to(tau.dtype), ids, tau.unsqueeze(-1), None if cut is None else cut.unsqueeze(-1))
    return torch.where(keep, logits, torch.full_like(logits, float("-inf"))), keep


def filtered_token_logprobs(
    logits: Tensor,
    target: Tensor,
    vocab: VocabRange,
    *,
    top_k: int | None,
    top_p: float,
    chunk_rows: int | None = None,
    strategy: str = "auto",
    ties: str = "together",
) -> Tensor:
    """logits `[..., Vl]`, target `[...]` (global ids in `[0, vocab.size)`, any int dtype) -> `[...]`
    in the compute dtype: the target's log-probability under the filtered, renormalised softmax.

    Dense equivalent: ``log_softmax(where(keep, z, -inf), -1).gather(-1, target[..., None])[..., 0]``
    with ``keep`` from ``lossfx.reference.apply_top_k_top_p``; `-inf` where the target is
    filtered out, NaN for a row holding a NaN. Differentiable in `logits` (the mask is a constant).
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, Vl]
    out, _shift, _log_s, _tau, _cut = _FilteredLogprobsFn.apply(
        flat, target.reshape(-1), vocab.start, vocab.size, top_k, top_p, chunk_rows, vocab.group, strategy, ties
    )
    return out.view(target.shape)

"""The per-rank chunk loops of the fused LM-head path, as opaque `torch.library` custom ops.

Both loops walk `[C, Cv]` tiles of the logits `z = c · tanh(s · (hidden @ weight.T + bias) / c) / T`
(`z = s · (hidden @ weight.T + bias) / T` without a soft-cap `c`; `LogitHead`) of this rank's
vocabulary shard, visiting only the active rows (ignored targets cost no logits): vocabulary blocks
of `Cv <= Vl` rows of `weight` outside, chunks of `C` rows of `hidden [N, H]` inside. So at most
one tile of logits (and of its gradient) is alive, in eager mode and under `torch.compile` alike:

* `lossfx::linear_local_stats` (forward) returns this rank's per-row statistics `[3 + K, N]`:
  the local max `m`, `s = Σ exp(z − m)`, `u = Σ exp(z − m)·(z − m)` (each block's folded into
  the running ones with the exact max-shifted merge) and the logits at the `K` ids this rank owns
  (0 elsewhere). Only these per-row scalars ever leave the rank.
* `lossfx::linear_local_grads` (backward) returns `(dhidden [N, H], dweight [Vl, H], dbias [Vl])`
  (compute dtype, weight's dtype, compute dtype), given the merged row statistics and the upstream
  gradients: `dz = p ⊙ (h·(log p − H) − Σ_k g_k) + scatter(ids, g)`, `dr = dz ⊙ dz/dr`,
  `dhidden = dr W`, `dweight = drᵀ hidden`, `dbias = Σ_rows dr` (proofs/fused_linear.md).

Why custom ops: `torch.compile` sees each loop as one node (registered fake implementations give
the output shapes, symbolic in `N`), so the compiled graph and its compile time do not grow with
the number of chunks, a new `N` does not force a new graph beyond the usual automatic-dynamic
recompile, and Inductor cannot merge the chunks back into one `[N, Vl]` logits buffer (it cannot
fuse a matmul into the row reduction). The collectives stay outside, in the traced graph
(`lossfx.fused_linear`). See docs/design.md, "The fused LM-head path under the compiler".

Precision: every matmul runs in `promote_types(hidden.dtype, weight.dtype)` (a bf16 hidden with
an fp32 head multiplies in fp32, each `[C, H]` chunk widened as it is read; bf16/fp16 multiply with the BLAS's fp32
accumulation, each product rounded once to the input dtype, as in the unfused `hidden @ weight.T`
and its backward); the softmax arithmetic, `dlogits`, and the sums of the tile products that form
`dweight` and `dhidden` are in the compute dtype `promote_types(dtype, float32)`. float64 stays
float64 throughout.

Memory of the backward: one `[C, Cv]` tile of logits and its gradient; for bf16/fp16 weights also
one `[Cv, H]` fp32 accumulator (so no `[Vl, H]` fp32 buffer is ever allocated), and
`dhidden [N, H]` in fp32.
"""

from __future__ import annotations

import typing

import torch
from torch import Tensor

from lossfx._numerics import compute_dtype, merge_max_logsum

__all__ = [
    "LogitHead",
    "add_rows_",
    "default_linear_chunk_rows",
    "itemsize",
    "linear_local_grads",
    "linear_local_stats",
    "matmul_dtype",
    "merge_row_stats",
    "row_chunks",
    "tile_buffers",
    "tile_view",
]

# Tiles: `[C, Cv]` logits, `C` rows of `hidden` by `Cv` vocabulary rows of `weight`. Both sides are
# kept large enough for an efficient matmul (a skinny `[C, H] @ [H, Vl]` streams the whole `weight`
# from memory for every few rows: measured 2x slower at C = 32 than at C = 256 on one CPU core),
# and the tile near DEFAULT_TILE_BYTES in the compute dtype (a loop keeps two tiles alive).
DEFAULT_TILE_BYTES = 4 << 20
MAX_BLOCK = 2048  # vocabulary rows per tile, at most
MIN_BLOCK = 128  # ... and at least, when dweight needs a compute-dtype accumulator per block
MIN_ROWS = 8


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _vocab_block(local_vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Vocabulary rows `Cv` per tile: up to MAX_BLOCK; for bf16/fp16 weights also small enough that
    the backward's `[Cv, H]` compute-dtype accumulator stays near DEFAULT_TILE_BYTES."""
    cdtype = compute_dtype(dtype)
    block = MAX_BLOCK
    if dtype != cdtype:
        block = min(block, max(MIN_BLOCK, DEFAULT_TILE_BYTES // max(1, hidden_size * itemsize(cdtype))))
    return max(1, min(local_vocab, block))


def default_linear_chunk_rows(block: int, dtype: torch.dtype) -> int:
    """Rows `C` per tile when the caller gives none: a `[C, block]` compute-dtype tile near 4 MiB, C >= 8."""
    return max(MIN_ROWS, DEFAULT_TILE_BYTES // max(1, block * itemsize(compute_dtype(dtype))))


def tile_buffers(
    rows: int, cols: int, dtype: torch.dtype, cdtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """Flat scratch for one `[rows, cols]` tile in `cdtype` and, when `dtype` is lower, one in `dtype`.

    Reused by every tile of a loop (`torch.mm(..., out=)` into a view): a fresh multi-MiB tensor per
    tile costs a page-faulting allocation each time (measured ~6% of a CPU matmul at 4 MiB tiles)."""
    low = None if dtype == cdtype else torch.empty(rows * cols, dtype=dtype, device=device)
    return torch.empty(rows * cols, dtype=cdtype, device=device), low


def tile_view(buffer: Tensor, rows: int, cols: int) -> Tensor:
    """The first `rows * cols` elements of a flat buffer as a contiguous `[rows, cols]` tensor."""
    return buffer[: rows * cols].view(rows, cols)


def _logits_chunk(
    hidden_rows: Tensor, weight: Tensor, bias: Tensor | None, head: LogitHead, out: Tensor, low: Tensor | None
) -> Tensor:
    """`head(hidden_rows [C, H] @ weight.T + bias)` written into the flat buffer `out` -> `[C, Cv]` view
    of it (in `out`'s dtype; the product is taken in the matmul dtype, in `low` when that is lower)."""
    z = tile_view(out, hidden_rows.shape[0], weight.shape[0])
    if low is None:
        torch.mm(hidden_rows, weight.T, out=z)
    else:  # input-dtype matmul (fp32 accumulation inside the BLAS), rounded once, then widened
        z.copy_(torch.mm(hidden_rows, weight.T, out=tile_view(low, hidden_rows.shape[0], weight.shape[0])))
    if bias is not None:
        z.add_(bias)
    return head.apply_(z)


class LogitHead(typing.NamedTuple):
    """The map from raw logits `r = h Wᵀ + b` to the logits `z` the softmax sees:
    `z = c · tanh(s · r / c) / T` with a soft-cap `c`, else `z = s · r / T` (TRL's order)."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float | None = None

    def apply_(self, z: Tensor) -> Tensor:
        """`r -> z` in place."""
        scale, temperature, cap = self.logit_scale, self.temperature, self.softcap
        if cap is not None:
            return z.mul_(scale / cap).tanh_().mul_(cap / temperature)
        if scale != 1.0:
            z.mul_(scale)
        return z.div_(temperature) if temperature != 1.0 else z

    @property
    def scale(self) -> float:
        """`s / T`: the factor of `dz/dr` outside the soft-cap (folded into the gradient matmuls)."""
        return self.logit_scale / self.temperature

    def cap_derivative(self, z: Tensor, out: Tensor) -> Tensor:
        """`(dz/dr) / (s/T) = 1 − tanh² = 1 − (z·T/c)²` of the logits `z`, into `out` (soft-cap only)."""
        assert self.softcap is not None
        return torch.mul(z, self.temperature / self.softcap, out=out).square_().neg_().add_(1.0)


def row_chunks(active: Tensor | None, n_rows: int, chunk_rows: int) -> list[slice] | list[Tensor]:
    """The row chunks a loop visits: slices of `[0, N)`, or chunks of the indices of the active
    rows only (ignored rows are never computed). `active`: None (every row), the ascending int64
    index of the active rows (no host read), or a bool mask `[N]` (compiled callers: read here,
    inside the opaque op, once per forward and once per backward)."""
    if active is not None and active.dtype == torch.bool:
        active = None if bool(active.all()) else active.nonzero()[:, 0]
    if active is None or active.shape[0] == n_rows:
        return [slice(s, min(n_rows, s + chunk_rows)) for s in range(0, n_rows, chunk_rows)]
    return [active[s : s + chunk_rows] for s in range(0, active.shape[0], chunk_rows)]


def add_rows_(out: Tensor, rows: slice | Tensor, value: Tensor, alpha: float = 1.0) -> None:
    """`out[rows] += alpha · value` for a slice or an index tensor of rows (an index is a copy when read)."""
    if isinstance(rows, slice):
        out[rows].add_(value, alpha=alpha)
    else:
        out.index_add_(0, rows, value.to(out.dtype), alpha=alpha)


def matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of every matmul of the fused path: `promote_types(hidden.dtype, weight.dtype)`."""
    return torch.promote_types(hidden.dtype, weight.dtype)


def _fold_block(stats: Tensor, rows: slice | Tensor, m_b: Tensor, s_b: Tensor, u_b: Tensor | None) -> None:
    """Merge one vocabulary block's `(m_b, s_b, u_b)` `[C]` into the running rows of `stats` in place,
    with the same exact max-shifted merge as across ranks (proofs/fused_linear.md §5)."""
    m, s = stats[0, rows], stats[1, rows]
    m_new = torch.maximum(m, m_b)
    w_old, w_b = torch.exp(m - m_new), torch.exp(m_b - m_new)
    if u_b is not None:
        u = stats[2, rows]
        stats[2, rows] = w_old * (u + (m - m_new) * s) + w_b * (u_b + (m_b - m_new) * s_b)
    stats[1, rows] = w_old * s + w_b * s_b
    stats[0, rows] = m_new


def merge_row_stats(stats: Tensor, n_ids: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every rank's `[R, 3 + K, N]` -> (logprobs `[N, K]`, neg_entropy `[N]`, shift `[N]`, log_s `[N]`)."""
    m, s, u = stats[:, 0], stats[:, 1], stats[:, 2]  # [R, N] each
    shift, log_s = merge_max_logsum(m, s)  # lse = shift + log_s
    picked = stats[:, 3 : 3 + n_ids].sum(dim=0)  # [K, N]; exactly one rank owns each id
    logprobs = ((picked - shift) - log_s).T  # [N, K]
    # Σ_v p (z − shift) = Σ_r w_r (u_r + (m_r − shift) s_r) / Σ_r w_r s_r,  w_r = exp(m_r − shift)
    delta = m - shift  # [R, N], <= 0
    weight = torch.exp(delta)
    mean_shifted = (weight * (u + delta * s)).sum(dim=0) / (weight * s).sum(dim=0)
    neg_entropy = mean_shifted - log_s  # Σ p log p = Σ p (z − shift) − log_s
    return logprobs, neg_entropy, shift, log_s


@torch.library.custom_op("lossfx::linear_local_stats", mutates_args=())
def linear_local_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    local_idx: Tensor,
    owned: Tensor,
    active: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    with_entropy: bool,
    chunk_rows: int,
) -> Tensor:
    """hidden `[N, H]`, weight `[Vl, H]`, bias `[Vl]` or None, local_idx/owned `[N, K]`, active `[N]`
    (bool: the rows to compute) or None -> stats `[3 + K, N]` (compute dtype).

    Rows of the result: `m` (row max of this shard's logits `z = LogitHead(...)(h Wᵀ + b)`),
    `s = Σ exp(z − m)`, `u = Σ exp(z − m)·(z − m)` (0 unless `with_entropy`), then
    `z[n, local_idx[n, k]]` where `owned`, else 0; an inactive row keeps `(0, 1, 0, 0…)` and is never
    computed. Tiles: vocabulary blocks outside, row chunks of `chunk_rows` inside (0: the default),
    each block's statistics folded into the running ones exactly.
    """
    n_rows, n_ids = local_idx.shape
    local_vocab, hidden_size = weight.shape
    mm_dtype = matmul_dtype(hidden, weight)
    cdtype = compute_dtype(mm_dtype)
    head = LogitHead(temperature, logit_scale, softcap)
    block = _vocab_block(local_vocab, hidden_size, mm_dtype)
    chunk_rows = chunk_rows or default_linear_chunk_rows(block, mm_dtype)
    stats = torch.zeros(3 + n_ids, n_rows, dtype=cdtype, device=hidden.device)
    stats[1] = 1.0  # an inactive row: s = 1, so its merged log-sum stays finite
    tile, low = tile_buffers(min(chunk_rows, n_rows), block, mm_dtype, cdtype, hidden.device)
    second = torch.empty_like(tile) if with_entropy else None
    chunks = row_chunks(active, n_rows, chunk_rows)
    for col0 in range(0, local_vocab, block):
        cols = slice(col0, min(local_vocab, col0 + block))
        w_block = weight[cols].to(mm_dtype)  # [Cv, H]
        b_block = None if bias is None else bias[cols].to(cdtype)
        in_block = owned & (local_idx >= col0) & (local_idx < cols.stop)  # [N, K]
        block_idx = torch.where(in_block, local_idx - col0, torch.zeros_like(local_idx))
        for rows in chunks:
            z = _logits_chunk(hidden[rows].to(mm_dtype), w_block, b_block, head, tile, low)  # [C, Cv]
            picked = z.gather(1, block_idx[rows])  # [C, K]
            # each owned id lies in exactly one block: adding 0 elsewhere is exact
            stats[3:, rows] += torch.where(in_block[rows], picked, torch.zeros_like(picked)).T
            m_b = z.amax(dim=1)  # [C]
            z.sub_(m_b[:, None])  # z − m_b, in place
            u_b = None
            if with_entropy:
                assert second is not None
                e = torch.exp(z, out=tile_view(second, z.shape[0], z.shape[1]))  # [C, Cv], the second tile
                s_b = e.sum(dim=1)
                u_b = e.mul_(z).sum(dim=1)
                del e
            else:
                s_b = z.exp_().sum(dim=1)
            del z
            if col0 == 0:
                stats[0, rows], stats[1, rows] = m_b, s_b
                if u_b is not None:
                    stats[2, rows] = u_b
            else:
                _fold_block(stats, rows, m_b, s_b, u_b)
    return stats


@linear_local_stats.register_fake
def _(hidden, weight, bias, local_idx, *args):
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    return hidden.new_empty((3 + local_idx.shape[1], local_idx.shape[0]), dtype=cdtype)


@torch.library.custom_op("lossfx::linear_local_grads", mutates_args=())
def linear_local_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    local_idx: Tensor,
    active: Tensor | None,
    grad_ids: Tensor,
    grad_total: Tensor,
    grad_entropy: Tensor,
    shift: Tensor,
    log_s: Tensor,
    neg_entropy: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    with_entropy: bool,
    chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dhidden `[N, H]` in the compute dtype, dweight `[Vl, H]` in weight's dtype, dbias `[Vl]`
    in the compute dtype, or `[0]` without a bias); no collective.

    The logits are recomputed tile by tile: an outer loop over blocks of `Cv` vocabulary rows of
    `weight` and an inner loop over chunks of `C` rows of `hidden` (only the `active` ones). Each
    block's `dweight` is summed over every row chunk in the compute dtype (in place when that is
    weight's dtype, else in one `[Cv, H]` accumulator) and rounded once; `dhidden` is summed over
    the blocks in the compute dtype.

    Args:
        hidden, weight, bias: as in the forward (all `N` rows; with sequence parallelism the gathered ones).
        local_idx: `[N, K]` column of each id inside this shard (0 where not owned).
        active: `[N]` the rows to compute (the others get zero gradient), or None: all.
        grad_ids: `[N, K]` upstream gradient of the log-probs at the ids this rank owns (0 elsewhere).
        grad_total: `[N]` `Σ_k` of the upstream gradient over all `K` ids (owned or not).
        grad_entropy: `[N]` upstream gradient of `Σ p log p` (ignored unless `with_entropy`).
        shift, log_s: `[N]` the merged row statistics, `p = exp(z − shift) / exp(log_s)`.
        neg_entropy: `[N]` the merged `Σ p log p` (used only `with_entropy`).
        temperature, logit_scale, softcap: the `LogitHead`; `dz/dr = (s/T)·(1 − tanh²)` with a
            soft-cap, `s/T` without (proofs/fused_linear.md §9).
        chunk_rows: rows per tile; 0 for the default (a `[C, Cv]` tile near 4 MiB).
    """
    n_rows, hidden_size = hidden.shape
    local_vocab = weight.shape[0]
    mm_dtype = matmul_dtype(hidden, weight)
    cdtype = compute_dtype(mm_dtype)
    exact = mm_dtype == cdtype
    head = LogitHead(temperature, logit_scale, softcap)
    block = _vocab_block(local_vocab, hidden_size, mm_dtype)
    chunk_rows = chunk_rows or default_linear_chunk_rows(block, mm_dtype)
    dhidden = torch.zeros(n_rows, hidden_size, dtype=cdtype, device=hidden.device)
    dweight = torch.empty_like(weight)
    dbias = torch.zeros(0 if bias is None else local_vocab, dtype=cdtype, device=hidden.device)
    # p = exp(z − shift) · exp(−log_s), never exp(z − (shift + log_s)): the rounding of
    # `shift + log_s` (eps·|shift|) would be one relative error common to the whole row of p, so
    # Σ p ≠ 1 by it, and `dz W` multiplies Σ dz ≠ 0 by W's common direction (proofs/fused_linear.md
    # §8). `exp(−log_s)` is a per-row factor, folded into the per-row scalars below (no extra pass).
    inv_s = torch.exp(-log_s)  # [N], 1/S with S >= 1
    centre = log_s + neg_entropy  # [N], Σ p (z − shift): log p − H = (z − shift) − centre
    scale = head.scale  # dz/dr = s/T (· (1 − tanh²)): s/T folded into the two matmuls (alpha)
    tile, low = tile_buffers(min(chunk_rows, n_rows), block, mm_dtype, cdtype, hidden.device)
    second = torch.empty_like(tile) if with_entropy else None
    cap_tile = torch.empty_like(tile) if softcap is not None else None
    chunks = row_chunks(active, n_rows, chunk_rows)
    for col0 in range(0, local_vocab, block):
        cols = slice(col0, min(local_vocab, col0 + block))
        w_block = weight[cols].to(mm_dtype)  # [Cv, H]
        b_block = None if bias is None else bias[cols].to(cdtype)
        in_place = exact and weight.dtype == cdtype
        acc = dweight[cols].zero_() if in_place else torch.zeros(w_block.shape, dtype=cdtype, device=weight.device)
        in_block = (local_idx >= col0) & (local_idx < cols.stop)  # [N, K]
        block_idx = torch.where(in_block, local_idx - col0, torch.zeros_like(local_idx))
        block_grad = torch.where(in_block, grad_ids, torch.zeros_like(grad_ids))
        for rows in chunks:
            h_rows = hidden[rows].to(mm_dtype)
            z = _logits_chunk(h_rows, w_block, b_block, head, tile, low)  # [C, Cv]
            cap = None
            if cap_tile is not None:  # 1 − tanh², from the logits before they are overwritten
                cap = head.cap_derivative(z, tile_view(cap_tile, z.shape[0], z.shape[1]))
            x = z.sub_(shift[rows, None])  # z − shift, in place
            r = inv_s[rows, None]
            if with_entropy:
                # dz = p ⊙ (h·(log p − H) − Σ_k g_k) = exp(x) ⊙ ((x − centre)·h/S − Σ_k g_k/S)
                assert second is not None
                e = torch.exp(x, out=tile_view(second, z.shape[0], z.shape[1]))  # [C, Cv], the second tile
                bracket = x.sub_(centre[rows, None]).mul_(grad_entropy[rows, None] * r)
                dz = e.mul_(bracket.sub_(grad_total[rows, None] * r))
                del e
            else:
                dz = x.exp_().mul_(-grad_total[rows, None] * r)  # −p·Σ_k g_k, in the same buffer
            del x, z
            dz.scatter_add_(1, block_idx[rows], block_grad[rows])  # + g at each id in this block
            if cap is not None:
                dz.mul_(cap)  # dz/dr up to the factor s/T
            if bias is not None:
                dbias[cols].add_(dz.sum(dim=0), alpha=scale)
            if exact:
                if isinstance(rows, slice):
                    dhidden[rows].addmm_(dz, w_block, alpha=scale)  # [C, H], summed over the blocks
                else:
                    dhidden.index_add_(0, rows, dz @ w_block, alpha=scale)
                acc.addmm_(dz.T, h_rows, alpha=scale)  # [Cv, H], summed over the row chunks
            else:
                # input-dtype matmuls (as the unfused path multiplies its bf16 dlogits), each tile's
                # product rounded once, summed across tiles in the compute dtype
                assert low is not None
                dz_low = tile_view(low, dz.shape[0], dz.shape[1]).copy_(dz)
                add_rows_(dhidden, rows, dz_low @ w_block, alpha=scale)
                acc.add_(dz_low.T @ h_rows, alpha=scale)
                del dz_low
            del dz
        if not in_place:
            dweight[cols] = acc  # rounded once to weight's dtype
    return dhidden, dweight, dbias


@linear_local_grads.register_fake
def _(hidden, weight, bias, *args):
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    n_bias = 0 if bias is None else weight.shape[0]
    return (
        hidden.new_empty(hidden.shape, dtype=cdtype),
        weight.new_empty(weight.shape),
        hidden.new_empty((n_bias,), dtype=cdtype),
    )

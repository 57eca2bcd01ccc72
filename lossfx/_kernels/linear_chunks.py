"""The per-rank chunk loops of the fused LM-head path, as opaque `torch.library` custom ops.

Both loops are the tile engine's walk (`lossfx._core.tiles.Tiles`: sizes from the device's policy,
buffers, logits, merge) with this path's per-tile arithmetic plugged in. They walk `[C, Cv]` tiles
of the logits `z = c · tanh(s · (hidden @ weight.T + bias) / c) / T` (`z = s · (hidden @ weight.T +
bias) / T` without a soft-cap `c`; `LogitHead`) of this rank's vocabulary shard, visiting only the
active rows (ignored targets cost no logits): vocabulary blocks of `Cv <= Vl` rows of `weight`
outside, chunks of `C` rows of `hidden [N, H]` inside. So at most one tile of logits (and of its
gradient) is alive, in eager mode and under `torch.compile` alike:

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
(`lossfx._kernels.fused_linear`). See docs/design.md, "The fused LM-head path under the compiler".

Pure: plain tensors and resolved options in; no DTensor, no argument validation, no cross-rank
check (the public `lossfx.fused_linear` and `lossfx.linear_objective` do those, once per call).

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

import math

import torch
from torch import Tensor

from lossfx._core.chunking import policy_for
from lossfx._core.numerics import EXP_ZERO_BELOW, finite_or_zero, log_s_for_softmax, shift_or_nan
from lossfx._core.tiles import (
    MIN_BLOCK,
    MIN_ROWS,
    LogitHead,
    Tiles,
    compute_dtype,
    matmul_dtype,
    merge_stats,
    tile_shape,
)

__all__ = ["clamp_log_", "linear_local_grads", "linear_local_stats", "merge_row_stats", "tile_sizes"]


def clamp_log_(x: Tensor) -> Tensor:
    """`x` (a tile of `z − shift` or `log p`, `-inf` where `p = 0`) clamped up to `EXP_ZERO_BELOW`
    in place: `exp(x)` is unchanged (0 below it), and a factor `(x − c)·h` formed from it stays
    finite where `p = 0`, so `p·(…)` is 0 there instead of `0·inf = NaN`. A NaN stays NaN (a NaN
    or `+inf` row, a NaN upstream gradient): the exact `0·log 0 = 0` guard, which never makes a
    NaN finite. Dense: ``torch.where(p == 0 & finite factors, 0, p·(…))``."""
    return x.clamp_(min=EXP_ZERO_BELOW)


def _part(x: Tensor, rows: slice) -> Tensor:
    """`x[rows]`, or `x` itself when `rows` covers it (one view op fewer per tile)."""
    return x if rows.start == 0 and rows.stop >= x.shape[0] else x[rows]


# `ChunkPolicy.tile_share`: rows per tile at least (a skinny `[C, H] @ [H, Cv]` is slow: measured
# ~15% slower at [200, 10240] than at [256, 8000] on a CPU), and the tile elements no bound goes below
SHARE_ROWS = 256
SHARE_FLOOR = 1 << 19  # 2 MiB of fp32: small shapes keep cache-sized tiles


def _tiles(hidden: Tensor, weight: Tensor, bias: Tensor | None, head: LogitHead, active, chunk_rows: int, scratch: int):
    """The engine's vocabulary-outside walk, sized by the device's policy (`chunk_rows`: 0 = default;
    `tile_sizes`)."""
    block, rows = tile_sizes(hidden, weight, scratch)
    return Tiles(
        hidden,
        weight,
        bias,
        head,
        active=active,
        rows=chunk_rows or rows,
        block=block,
        scratch=scratch,
        compile_tiles=policy_for(hidden.device).compile_tiles,
    )


def tile_sizes(hidden: Tensor, weight: Tensor, scratch: int) -> tuple[int, int]:
    """`(Cv, C)` of the tiles of a loop over hidden `[N, H]` and weight `[Vl, H]` that keeps
    `1 + scratch` `[C, Cv]` tiles: `tile_shape` under the device's policy, then bounded so that
    the tiles hold at most `1/tile_share` of the `[N, Vl]` logits (`ChunkPolicy.tile_share`):
    fewer rows, and below `SHARE_ROWS` rows a narrower block instead."""
    policy = policy_for(hidden.device)
    block, rows = tile_shape(weight.shape[0], weight.shape[1], matmul_dtype(hidden, weight), policy)
    if policy.tile_share > 1:
        budget = hidden.shape[0] * weight.shape[0] // (policy.tile_share * (1 + scratch))  # elements per tile
        budget = max(SHARE_FLOOR, budget)
        exact = compute_dtype(matmul_dtype(hidden, weight)) == matmul_dtype(hidden, weight)
        if not exact:  # beside each tile: its bf16/fp16 copy (half) and the [Cv, H] fp32 dweight accumulator
            budget = max(SHARE_FLOOR, budget * 2 // 5)
            block = max(1, min(block, max(MIN_BLOCK, budget // max(1, weight.shape[1]))))
        if rows * block > budget:
            if budget // block < SHARE_ROWS:
                block = max(1, min(block, max(MIN_BLOCK, budget // SHARE_ROWS)))
            rows = max(MIN_ROWS, min(rows, budget // block))
    return block, rows


# The per-tile arithmetic as functional bodies for Inductor (`ChunkPolicy.compile_tiles`): each
# compiles to one or two fused loops over the tile (a row reduction, an elementwise pass), where
# the eager bodies below make 4-8 passes and as many kernel launches. Same equations.


def _stats_body(z: Tensor, block_idx: Tensor, in_block: Tensor, with_entropy: bool):
    """Tile `z [C, Cv]` -> `(m_b, s_b, u_b or None, picked [C, K])` (see `linear_local_stats`)."""
    picked = torch.where(in_block, z.gather(1, block_idx), 0.0)
    m = z.amax(dim=1)
    x = z - finite_or_zero(m)[:, None]  # -inf where z is: e = 0 there
    e = torch.exp(x)
    # 0·(−inf) = NaN only where e = 0: those terms are 0 (0·log 0 = 0)
    return m, e.sum(dim=1), (torch.where(e > 0, e * x, 0.0).sum(dim=1) if with_entropy else None), picked


def _grad_body(
    z: Tensor,
    shift: Tensor,
    entropy_factor: Tensor,
    centre: Tensor,
    total_factor: Tensor,
    block_idx: Tensor,
    block_grad: Tensor,
    cap_factor: Tensor | None,
    with_entropy: bool,
    with_softmax: bool,
) -> Tensor:
    """Tile `z [C, Cv]` -> `dz/dr / (s/T)` (see `linear_local_grads`); per-row factors `[C]`:
    `h/S`, `Σ p (z − shift)`, `Σ_k g_k / S` (read only `with_softmax`); `cap_factor` `[T/c, c/T]`
    with a soft-cap."""
    if with_entropy:  # where p = 0 (z = −inf) the term is 0, not 0·(±inf); a NaN stays NaN (`clamp_log_`)
        x = z - shift[:, None]
        bracket = (x.clamp(min=EXP_ZERO_BELOW) - centre[:, None]) * entropy_factor[:, None]
        dz = torch.exp(x) * (bracket - total_factor[:, None] if with_softmax else bracket)
    elif with_softmax:
        dz = torch.exp(z - shift[:, None]) * -total_factor[:, None]
    else:  # the logits at the ids alone: no term elsewhere (a NaN there stays out, as in the reference)
        dz = torch.zeros_like(z)
    dz = dz.scatter_add(1, block_idx, block_grad)
    if cap_factor is not None:  # `LogitHead.cap_derivative`: 0 where the cap saturates (|z| = c/T)
        dz = dz * torch.where(z.abs() == cap_factor[1], 0.0, 1 - (z * cap_factor[0]).square())
    return dz


def merge_row_stats(stats: Tensor, n_ids: int, raw: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every rank's `[R, 3 + K, N]` -> (logprobs `[N, K]`, neg_entropy `[N]`, shift `[N]`, log_s `[N]`).

    A row whose logits are all `-inf` has `shift = 0`, `log_s = -inf`, log-probs `-inf` and
    `Σ p log p = 0` (the reference's; its gradient is 0: `linear_local_grads`). A row with a NaN
    or `+inf` logit has `shift`, `log_s`, log-probs and `Σ p log p` NaN (as `torch.log_softmax`
    makes it), and so a NaN gradient; every other row's `shift` and `log_s` are finite.
    `raw`: the logits `z` at the ids in place of the log-probs (no softmax term: a NaN or `+inf`
    logit elsewhere in the row leaves them as they are)."""
    big, total, moment = merge_stats(stats[:, 0], stats[:, 1], stats[:, 2])  # [N] each
    assert moment is not None
    shift = shift_or_nan(big)  # lse = shift + log_s
    log_s = torch.log(total)
    dead = torch.isneginf(log_s)  # [N]: every logit of the row is -inf
    picked = stats[:, 3 : 3 + n_ids].sum(dim=0)  # [K, N]; exactly one rank owns each id (the others add 0)
    logprobs = picked.T if raw else torch.where(dead, float("-inf"), (picked - shift) - log_s).T  # [N, K]
    neg_entropy = torch.where(dead, 0.0, moment / total - log_s)  # Σ p log p = Σ p (z − shift) − log_s
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
    computed; a row whose shard is all `-inf` is `(-inf, 0, 0, …)` (proofs/fused_linear.md §10).
    Tiles: vocabulary blocks outside, row chunks of `chunk_rows` inside (0: the default); each
    block's statistics are kept per row (`[blocks, 3, N_active]`, a few floats per row and block)
    and merged exactly once at the end.
    """
    n_rows, n_ids = local_idx.shape
    head = LogitHead(temperature, logit_scale, softcap)
    tiles = _tiles(hidden, weight, bias, head, active, chunk_rows, scratch=1 if with_entropy else 0)
    cdtype, device, width = tiles.cdtype, hidden.device, tiles.block
    index, slices = tiles.compact()  # the active rows; each chunk's positions among them
    n_active = n_rows if index is None else index.shape[0]
    # each id's vocabulary block (-1 where this shard does not own it) and column inside it: two ops for all blocks
    id_block = torch.where(owned, local_idx.div(width, rounding_mode="floor"), -1)
    id_col = local_idx.remainder(width)
    h_all = tiles.hidden if index is None else tiles.hidden.index_select(0, index)
    if index is not None:
        id_block, id_col = id_block.index_select(0, index), id_col.index_select(0, index)
    h_all = h_all.to(tiles.mm_dtype)
    picked = torch.zeros(n_active, n_ids, dtype=cdtype, device=device)  # the logits at the owned ids
    chunks = [(rows, *(_part(x, rows) for x in (h_all, id_block, id_col, picked))) for rows in slices]
    # per vocabulary block b, each active row's (m, s, u) over the block's columns in parts[k·b : k·b + k],
    # merged once at the end
    k = 3 if with_entropy else 2
    n_blocks = len(tiles.block_slices)
    parts = torch.empty(n_blocks * k, n_active, dtype=cdtype, device=device)
    zero = torch.zeros((), dtype=cdtype, device=device)
    for b, (cols, w_block, b_block) in enumerate(tiles.blocks()):
        last_col = cols.stop - cols.start - 1  # a ragged last block: clamp the other blocks' columns
        for rows, h, blk, col, picked_c in chunks:
            z = tiles.logits(h, w_block, b_block)  # [C, Cv]
            col = col if last_col == width - 1 else col.clamp(max=last_col)
            here = blk == b  # [C, K]
            body = tiles.body(_stats_body, z)
            if body is not None:
                m_b, s_b, u_b, got = body(z, col, here, with_entropy)
                picked_c.add_(got)
                parts[k * b : k * b + k, rows] = torch.stack([m_b, s_b] if u_b is None else [m_b, s_b, u_b])
                continue
            # each owned id lies in exactly one block: adding 0 elsewhere is exact
            picked_c.add_(torch.where(here, z.gather(1, col), zero))
            m_b = torch.amax(z, dim=1, out=_part(parts[k * b], rows))  # [C], -inf for a row whose block is all -inf
            z.sub_(finite_or_zero(m_b)[:, None])  # z − m_b in place (−inf stays −inf: e = 0)
            if with_entropy:
                e = torch.exp(z, out=tiles.scratch(0, z))  # [C, Cv]
                torch.sum(e, dim=1, out=_part(parts[k * b + 1], rows))
                # 0·(−inf) = NaN only where e = 0: dropped (0·log 0 = 0); a NaN row is NaN through m
                torch.nansum(e.mul_(z), dim=1, out=_part(parts[k * b + 2], rows))
            else:
                torch.sum(z.exp_(), dim=1, out=_part(parts[k * b + 1], rows))
    # the blocks merged exactly (the merge across ranks, proofs/fused_linear.md §5)
    parts = parts.view(n_blocks, k, n_active)
    m, s, u = merge_stats(parts[:, 0], parts[:, 1], parts[:, 2] if with_entropy else None)
    computed = torch.cat([torch.stack([m, s, s.new_zeros(()).expand_as(s) if u is None else u]), picked.T])
    if index is None:
        return computed
    stats = torch.zeros(3 + n_ids, n_rows, dtype=cdtype, device=device)
    stats[1] = 1.0  # an inactive row: s = 1, so its merged log-sum stays finite
    return stats.index_copy_(1, index, computed)


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
    grad_total: Tensor | None,
    grad_entropy: Tensor | None,
    shift: Tensor,
    log_s: Tensor,
    neg_entropy: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
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
        grad_total: `[N]` `Σ_k` of the upstream gradient over all `K` ids (owned or not), or None:
            the upstream gradient is that of the logits at the ids (`merge_row_stats(raw=True)`),
            not of their log-probs, so no `−p Σ_k g_k` term (its branch of every tile is skipped,
            and without the entropy and a soft-cap the logits are not recomputed: `dz` is
            `scatter(ids, g)` alone).
        grad_entropy: `[N]` upstream gradient of `Σ p log p`, or None: no entropy term (the
            entropy's branch of every tile is skipped).
        shift, log_s: `[N]` the merged row statistics, `p = exp(z − shift) / exp(log_s)`.
        neg_entropy: `[N]` the merged `Σ p log p` (read only with `grad_entropy`).
        temperature, logit_scale, softcap: the `LogitHead`; `dz/dr = (s/T)·(1 − tanh²)` with a
            soft-cap, `s/T` without (proofs/fused_linear.md §9).
        chunk_rows: rows per tile; 0 for the default (a `[C, Cv]` tile near the policy's `tile_bytes`).
    """
    n_rows, hidden_size = hidden.shape
    head = LogitHead(temperature, logit_scale, softcap)
    with_entropy = grad_entropy is not None
    scratch = int(with_entropy) + int(softcap is not None)
    tiles = _tiles(hidden, weight, bias, head, active, chunk_rows, scratch)
    cdtype, exact = tiles.cdtype, tiles.exact
    dweight = torch.empty_like(weight)
    dbias = torch.zeros(0 if bias is None else weight.shape[0], dtype=cdtype, device=hidden.device)
    # p = exp(z − shift) · exp(−log_s), never exp(z − (shift + log_s)): the rounding of
    # `shift + log_s` (eps·|shift|) would be one relative error common to the whole row of p, so
    # Σ p ≠ 1 by it, and `dz W` multiplies Σ dz ≠ 0 by W's common direction (proofs/fused_linear.md
    # §8). `exp(−log_s)` is a per-row factor, folded into the per-row scalars below (no extra pass).
    # An all -inf row (log_s = -inf) is constant: 1/S := 0 makes its p and its gradient 0 (the
    # caller zeroes its `grad_ids`); its centre is 0, so every per-row factor stays finite.
    inv_s = torch.exp(-log_s_for_softmax(log_s))  # [N], 1/S with S >= 1, 0 for an all -inf row
    scale = head.scale  # dz/dr = s/T (· (1 − tanh²)): s/T folded into the two matmuls (alpha)
    with_softmax = grad_total is not None
    total_factor = inv_s if grad_total is None else grad_total * inv_s  # [N]: Σ_k g_k/S (read only with_softmax)
    # nothing of a tile but the ids: dz = scatter(ids, g), no logits needed (a soft-cap's dz/dr reads them)
    sparse = not with_softmax and not with_entropy and softcap is None
    centre = entropy_factor = total_factor  # (read only with the entropy)
    if grad_entropy is not None:
        # [N], Σ p (z − shift): log p − H = (z − shift) − centre; 0 for an all -inf row, NaN stays NaN
        centre = (log_s + neg_entropy).nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
        entropy_factor = grad_entropy * inv_s  # [N]: h/S
    cap_factor = None
    if softcap is not None and tiles.compile_tiles:  # a tensor: the compiled body does not specialise on it
        cap_factor = torch.tensor([temperature / softcap, softcap / temperature], dtype=cdtype, device=hidden.device)
    in_place = exact and weight.dtype == cdtype
    width = tiles.block
    index, slices = tiles.compact()  # the active rows; each chunk's positions among them
    # every per-row quantity gathered once for the active rows, then sliced per chunk (views)
    per_row = [shift, total_factor, entropy_factor, centre, grad_ids, local_idx.div(width, rounding_mode="floor")]
    per_row += [local_idx.remainder(width), tiles.hidden]
    if index is not None:
        per_row = [x.index_select(0, index) for x in per_row]
    per_row[-1] = per_row[-1].to(tiles.mm_dtype)
    # the hidden gradient of the active rows, summed over the blocks in place; scattered once at the end
    dh = torch.zeros(per_row[0].shape[0], hidden_size, dtype=cdtype, device=hidden.device)
    chunks = [[_part(x, rows) for x in (*per_row, dh)] for rows in slices]
    for c in chunks:  # the per-row factors as [C, 1] columns, made once per chunk
        c[:4] = [c[0][:, None], c[1].neg()[:, None], c[2][:, None], c[3][:, None]]
    zero = torch.zeros((), dtype=cdtype, device=hidden.device)
    for b, (cols, w_block, b_block) in enumerate(tiles.blocks()):
        acc = dweight[cols].zero_() if in_place else torch.zeros(w_block.shape, dtype=cdtype, device=weight.device)
        last_col = cols.stop - cols.start - 1  # a ragged last block: clamp the other blocks' columns
        for shift_c, neg_total_c, entropy_c, centre_c, g, blk, col, h_rows, dh_c in chunks:
            z = tiles.zeros(h_rows, w_block) if sparse else tiles.logits(h_rows, w_block, b_block)  # [C, Cv]
            col = col if last_col == width - 1 else col.clamp(max=last_col)
            g = torch.where(blk == b, g, zero)  # the upstream gradient of the ids in this block
            body = None if sparse else tiles.body(_grad_body, z)
            if sparse:
                dz = z.scatter_add_(1, col, g)  # g at each id in this block, 0 elsewhere
            elif body is not None:
                factors = (shift_c[:, 0], entropy_c[:, 0], centre_c[:, 0], -neg_total_c[:, 0])
                dz = body(z, *factors, col, g, cap_factor, with_entropy, with_softmax)
            else:
                cap = None
                if softcap is not None:  # 1 − tanh², from the logits before they are overwritten
                    cap = head.cap_derivative(z, tiles.scratch(int(with_entropy), z))
                if with_entropy:
                    x = z.sub_(shift_c)  # z − shift, in place
                    # dz = p ⊙ (h·(log p − H) − Σ_k g_k) = exp(x) ⊙ ((x − centre)·h/S − Σ_k g_k/S)
                    e = torch.exp(x, out=tiles.scratch(0, z))  # [C, Cv]
                    # clamped where z = −inf (e = 0): a finite bracket there, so the term is 0, not 0·inf
                    bracket = clamp_log_(x).sub_(centre_c).mul_(entropy_c)
                    dz = e.mul_(bracket.add_(neg_total_c) if with_softmax else bracket)
                elif with_softmax:
                    dz = z.sub_(shift_c).exp_().mul_(neg_total_c)  # −p·Σ_k g_k, in the same buffer
                else:  # the soft-capped logits at the ids alone (`sparse` without the cap)
                    dz = z.zero_()
                dz.scatter_add_(1, col, g)  # + g at each id in this block (0 at the clamped others)
                if cap is not None:
                    dz.mul_(cap)  # dz/dr up to the factor s/T
            if bias is not None:
                dbias[cols].add_(dz.sum(dim=0), alpha=scale)
            if exact:
                dh_c.addmm_(dz, w_block, alpha=scale)  # [C, H], summed over the blocks
                acc.addmm_(dz.T, h_rows, alpha=scale)  # [Cv, H], summed over the row chunks
            else:
                # input-dtype matmuls (as the unfused path multiplies its bf16 dlogits), each tile's
                # product rounded once, summed across tiles in the compute dtype
                dz_low = tiles.low(dz).copy_(dz)
                dh_c.add_(dz_low @ w_block, alpha=scale)
                acc.add_(dz_low.T @ h_rows, alpha=scale)
        if not in_place:
            dweight[cols] = acc  # rounded once to weight's dtype
    if index is None:
        return dh, dweight, dbias
    dhidden = torch.zeros(n_rows, hidden_size, dtype=cdtype, device=hidden.device)
    return dhidden.index_copy_(0, index, dh), dweight, dbias


@linear_local_grads.register_fake
def _(hidden, weight, bias, *args):
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    n_bias = 0 if bias is None else weight.shape[0]
    return (
        hidden.new_empty(hidden.shape, dtype=cdtype),
        weight.new_empty(weight.shape),
        hidden.new_empty((n_bias,), dtype=cdtype),
    )

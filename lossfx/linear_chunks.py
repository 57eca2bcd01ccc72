"""The per-rank chunk loops of the fused LM-head path, as opaque `torch.library` custom ops.

Both loops walk the rows of `hidden [N, H]` in chunks of `C` rows and form one logits chunk
`z = hidden[c] @ weight.T / T` (`[C, Vl]`, this rank's vocabulary shard) at a time, so at most one
chunk of logits (and of its gradient) is alive, in eager mode and under `torch.compile` alike:

* `lossfx::linear_local_stats` (forward) returns this rank's per-row statistics `[3 + K, N]`:
  the local max `m`, `s = Σ exp(z − m)`, `u = Σ exp(z − m)·(z − m)` and the logits at the `K`
  ids this rank owns (0 elsewhere). Only these per-row scalars ever leave the rank.
* `lossfx::linear_local_grads` (backward) returns `(dhidden [N, H], dweight [Vl, H])` (compute
  dtype, weight's dtype), tile by tile (`[C, Cv]`, `Cv <= Vl` vocabulary rows), given the merged
  row statistics and the upstream gradients:
  `dz = p ⊙ (h·(log p − H) − Σ_k g_k) + scatter(ids, g)`, `dhidden = dz W / T`,
  `dweight = dzᵀ hidden / T` (proofs/fused_linear.md).

Why custom ops: `torch.compile` sees each loop as one node (registered fake implementations give
the output shapes, symbolic in `N`), so the compiled graph and its compile time do not grow with
the number of chunks, a new `N` does not force a new graph beyond the usual automatic-dynamic
recompile, and Inductor cannot merge the chunks back into one `[N, Vl]` logits buffer (it cannot
fuse a matmul into the row reduction). The collectives stay outside, in the traced graph
(`lossfx.fused_linear`). See docs/design.md, "The fused LM-head path under the compiler".

Precision: the logits matmul runs in the input dtype (bf16/fp16 multiply with the BLAS's fp32
accumulation, each logit rounded once to the input dtype: the logits the unfused
`hidden @ weight.T` gives); everything after it, including the two gradient matmuls and the
accumulation of `dweight` and `dhidden` across tiles, is in the compute dtype
`promote_types(dtype, float32)`. float64 stays float64 throughout.

Memory of the backward: one `[C, Cv]` tile of logits and its gradient; for bf16/fp16 weights also
one `[Cv, H]` fp32 accumulator and the fp32 copy of that block (so no `[Vl, H]` fp32 buffer is
ever allocated), and `dhidden [N, H]` in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._numerics import compute_dtype

__all__ = ["default_linear_chunk_rows", "linear_local_grads", "linear_local_stats"]

# Rows per chunk when the caller gives none: one `[C, Vl]` compute-dtype temporary near this many
# bytes (a loop keeps two or three alive), and at least MIN_ROWS rows so the matmul stays efficient.
DEFAULT_CHUNK_BYTES = 4 << 20
MIN_ROWS = 8
MIN_BLOCK = 128  # vocabulary rows per backward tile, at least (when dweight needs an accumulator)


def default_linear_chunk_rows(local_vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk: one `[C, local_vocab]` temporary in `compute_dtype(dtype)` near 4 MiB, C >= 8."""
    itemsize = torch.empty((), dtype=compute_dtype(dtype)).element_size()
    return max(MIN_ROWS, DEFAULT_CHUNK_BYTES // max(1, local_vocab * itemsize))


def _logits_chunk(hidden_rows: Tensor, weight: Tensor, temperature: float, cdtype: torch.dtype) -> Tensor:
    """`hidden_rows [C, H] @ weight.T / T` -> a fresh `[C, Vl]` tensor in `cdtype`."""
    z = hidden_rows @ weight.T  # [C, Vl] in the input dtype (fp32 accumulation inside the BLAS)
    if z.dtype != cdtype:
        z = z.to(cdtype)
    if temperature != 1.0:
        z.div_(temperature)
    return z


@torch.library.custom_op("lossfx::linear_local_stats", mutates_args=())
def linear_local_stats(
    hidden: Tensor,
    weight: Tensor,
    local_idx: Tensor,
    owned: Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
) -> Tensor:
    """hidden `[N, H]`, weight `[Vl, H]`, local_idx/owned `[N, K]` -> stats `[3 + K, N]` (compute dtype).

    Rows of the result: `m` (row max of this shard's logits), `s = Σ exp(z − m)`,
    `u = Σ exp(z − m)·(z − m)` (0 unless `with_entropy`), then `z[n, local_idx[n, k]]` where `owned`, else 0.
    """
    n_rows, n_ids = local_idx.shape
    cdtype = compute_dtype(hidden.dtype)
    stats = torch.empty(3 + n_ids, n_rows, dtype=cdtype, device=hidden.device)
    chunk_rows = chunk_rows or default_linear_chunk_rows(weight.shape[0], weight.dtype)
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, min(n_rows, start + chunk_rows))
        z = _logits_chunk(hidden[rows], weight, temperature, cdtype)  # [C, Vl]
        picked = z.gather(1, local_idx[rows])  # [C, K]
        stats[3:, rows] = torch.where(owned[rows], picked, torch.zeros_like(picked)).T
        m = z.amax(dim=1)  # [C]
        z.sub_(m[:, None])  # z − m, in place
        e = torch.exp(z)  # [C, Vl], the second temporary
        stats[0, rows] = m
        stats[1, rows] = e.sum(dim=1)
        stats[2, rows] = e.mul_(z).sum(dim=1) if with_entropy else 0.0
        del z, e
    return stats


@linear_local_stats.register_fake
def _(hidden, weight, local_idx, owned, temperature, with_entropy, chunk_rows):
    return hidden.new_empty((3 + local_idx.shape[1], local_idx.shape[0]), dtype=compute_dtype(hidden.dtype))


def _vocab_block(local_vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Columns per backward tile: all of them when `dweight` can accumulate in place (its dtype is the
    compute dtype); else enough for a `[Cv, H]` compute-dtype accumulator near 4 MiB (at least 128)."""
    cdtype = compute_dtype(dtype)
    if dtype == cdtype:
        return local_vocab
    itemsize = torch.empty((), dtype=cdtype).element_size()
    return min(local_vocab, max(MIN_BLOCK, DEFAULT_CHUNK_BYTES // max(1, hidden_size * itemsize)))


@torch.library.custom_op("lossfx::linear_local_grads", mutates_args=())
def linear_local_grads(
    hidden: Tensor,
    weight: Tensor,
    local_idx: Tensor,
    grad_ids: Tensor,
    grad_total: Tensor,
    grad_entropy: Tensor,
    shift: Tensor,
    log_s: Tensor,
    neg_entropy: Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
) -> tuple[Tensor, Tensor]:
    """-> (dhidden `[N, H]` in the compute dtype, dweight `[Vl, H]` in weight's dtype); no collective.

    The logits are recomputed tile by tile: an outer loop over blocks of `Cv` vocabulary rows of
    `weight` and an inner loop over chunks of `C` rows of `hidden`. Each block's `dweight` is summed
    over every row chunk in the compute dtype (in place when that is weight's dtype, else in one
    `[Cv, H]` accumulator) and rounded once; `dhidden` is summed over the blocks in the compute dtype
    (for bf16/fp16 weights each block is upcast once for that matmul).

    Args:
        hidden, weight: as in the forward (all `N` rows; with sequence parallelism the gathered ones).
        local_idx: `[N, K]` column of each id inside this shard (0 where not owned).
        grad_ids: `[N, K]` upstream gradient of the log-probs at the ids this rank owns (0 elsewhere).
        grad_total: `[N]` `Σ_k` of the upstream gradient over all `K` ids (owned or not).
        grad_entropy: `[N]` upstream gradient of `Σ p log p` (ignored unless `with_entropy`).
        shift, log_s: `[N]` the merged row statistics, `lse = shift + log_s`.
        neg_entropy: `[N]` the merged `Σ p log p` (used only `with_entropy`).
        chunk_rows: rows per tile; 0 for the default (a `[C, Cv]` tile near 4 MiB).
    """
    n_rows, hidden_size = hidden.shape
    local_vocab = weight.shape[0]
    cdtype = compute_dtype(hidden.dtype)
    exact = weight.dtype == cdtype
    block = _vocab_block(local_vocab, hidden_size, weight.dtype)
    chunk_rows = chunk_rows or default_linear_chunk_rows(block, weight.dtype)
    dhidden = torch.zeros(n_rows, hidden_size, dtype=cdtype, device=hidden.device)
    dweight = torch.empty_like(weight)
    for col0 in range(0, local_vocab, block):
        cols = slice(col0, min(local_vocab, col0 + block))
        w_block = weight[cols]  # [Cv, H]
        acc = dweight[cols].zero_() if exact else torch.zeros(w_block.shape, dtype=cdtype, device=weight.device)
        w_compute = w_block if exact else w_block.to(cdtype)  # [Cv, H] for dhidden's compute-dtype matmul
        in_block = (local_idx >= col0) & (local_idx < cols.stop)  # [N, K]
        block_idx = torch.where(in_block, local_idx - col0, torch.zeros_like(local_idx))
        block_grad = torch.where(in_block, grad_ids, torch.zeros_like(grad_ids))
        for start in range(0, n_rows, chunk_rows):
            rows = slice(start, min(n_rows, start + chunk_rows))
            z = _logits_chunk(hidden[rows], w_block, temperature, cdtype)  # [C, Cv]
            logp = z.sub_(shift[rows, None]).sub_(log_s[rows, None])  # log p, in place
            p = torch.exp(logp)  # [C, Cv]
            if with_entropy:
                # dz = p ⊙ (h·(log p − H) − Σ_k g_k): reuse the log p buffer for the bracket
                bracket = logp.sub_(neg_entropy[rows, None]).mul_(grad_entropy[rows, None])
                dz = p.mul_(bracket.sub_(grad_total[rows, None]))
            else:
                dz = p.mul_(-grad_total[rows, None])  # −p·Σ_k g_k
            del logp, z
            dz.scatter_add_(1, block_idx[rows], block_grad[rows])  # + g at each id in this block
            if temperature != 1.0:
                dz.div_(temperature)
            dhidden[rows].addmm_(dz, w_compute)  # [C, H], summed over the blocks
            acc.addmm_(dz.T, hidden[rows] if exact else hidden[rows].to(cdtype))  # [Cv, H], over the row chunks
            del dz, p
        if not exact:
            dweight[cols] = acc  # rounded once to weight's dtype
    return dhidden, dweight


@linear_local_grads.register_fake
def _(hidden, weight, local_idx, grad_ids, grad_total, grad_entropy, shift, log_s, neg_entropy, *args):
    return hidden.new_empty(hidden.shape, dtype=compute_dtype(hidden.dtype)), weight.new_empty(weight.shape)

"""Top-k / top-p filtered token log-probs from hidden states, pure: logits never materialised.

    z = head(hidden @ weight.T + bias)             (logits, [N, V]; only ever one [C, Vl] chunk)
    out[n] = log_softmax(where(keep, z, -inf))[n, target[n]]     keep: lossfx.filtering's filter

Pure: plain tensors, a `VocabRange` (this rank's rows of the head) and resolved options in; no
DTensor, no argument validation, no cross-rank check (the public `lossfx.linear_filtering` does
those once, at its boundary).

Design: rows outside, two passes over the vocabulary in all (proofs/linear_filtering.md).
A row's threshold `τ` needs statistics of the whole row (its top-k, its top-p masses) before any
of its logits can be kept or dropped, so the loop is the tile engine's rows-outside walk
(`Tiles.chunks_full`, as `lossfx::linear_objective_rows`): one `[C, Vl]` chunk of this rank's
logits at a time, `C` rows from the device's policy (`filtered_chunk_rows`: `C <= N / 32` on a
CPU). On that chunk the logits path's own kernel runs unchanged
(`lossfx._kernels.filtering._filtered_logprobs_fwd`: the same candidate all-gather or radix
search, the same tie rules, the same NaN rule, the same collectives, per chunk), so the threshold,
the kept set and the log-sum are those of `filtered_token_logprobs(z)` on the same logits, row
for row, with no sort, at every TP size. Saved per row: `τ`, the id cut (`ties="sorted"`), the
filtered `shift` and `log_s` (4 scalars). The backward recomputes each chunk once and applies the
logits path's backward to it (`_filtered_logprobs_bwd`: `keep ⊙ (onehot − p)·dout`), then the
head's derivative and the two matmuls. So:

* forward: 1 pass (one `[C, H] @ [H, Vl]` matmul per chunk); backward: 1 pass (the same matmul
  recomputed, then `dhidden += dz W`, `dweight += dzᵀ h`). No value-dependent branch, no extra pass
  for any row, eager or compiled.
* memory: the chunk, its gradient in the backward, and the filter's temporaries (row-chunked by
  the device policy's `row_bytes` inside the chunk); nothing `[N, V]`.

Both loops are opaque `torch.library` custom ops (`lossfx::linear_filtered_rows`,
`lossfx::linear_filtered_grads`): under `torch.compile` each is one node, so the compiler can
neither merge the chunks back into `[N, V]` logits nor share the forward's logits with the
backward's recomputation. Under tensor parallelism the per-chunk collectives of the filter run
inside the op (eager functional collectives on the group resolved from its name); every rank
walks the same chunks (the chunk size is derived from `N` and `ceil(V / R)`, never this rank's
width, and `active` is replicated). Dense equivalent: `lossfx.reference.linear_filtered_token_logprobs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lossfx._core.chunking import policy_for
from lossfx._core.distributed import all_gather_stack, all_reduce, is_distributed, reduce_scatter_sum
from lossfx._core.host_reads import settle_before
from lossfx._core.tiles import (
    MIN_CHUNK_ROWS,
    HeadOptions,
    LogitHead,
    Tiles,
    add_rows_,
    compute_dtype,
    itemsize,
    matmul_dtype,
)
from lossfx._core.vocab import VocabRange
from lossfx._kernels.filtering import _filtered_logprobs_bwd, _filtered_logprobs_fwd, dropped_gradient
from lossfx._kernels.fused_linear import linear_rows

__all__ = ["filtered_chunk_rows", "linear_filtered_grads", "linear_filtered_rows"]


def filtered_chunk_rows(n_rows: int, shard_width: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows `C` per chunk, from the device's policy: at most `N / tile_share` rows, and a `[C, shard_width]`
    compute-dtype chunk near the larger of `row_bytes` (one logits-side temporary) and half of
    `chunk_bytes` (the chunk and its gradient together), at least 16.

    CPU (`tile_share = 32`): `N / 32` rows, so the backward's chunk and gradient stay near 1/16 of one
    logits tensor (issue 26's 0.1x). GPU (`tile_share = 1`): 2 GiB chunks, as the logits path's own
    row loops, since each chunk pays the filter's fixed ~110 (top-k) to ~200 (top-p search) launched
    ops: 5 chunks at `[16384, 151936]` fp32. `shard_width = ceil(V / R)` (rank-independent: every
    rank walks the same chunks, each chunk runs the same collectives)."""
    policy = policy_for(device)
    size = max(1, shard_width * itemsize(compute_dtype(dtype)))
    by_bytes = max(policy.chunk_bytes // (2 * size), policy.row_bytes // size)
    return max(MIN_CHUNK_ROWS, min(-(-n_rows // policy.tile_share), by_bytes))


def _resolve_group(group_name: str) -> Any:
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # type: ignore[arg-type]


def _tiles(hidden, weight, bias, head, active, chunk_rows, shard_width, scratch) -> Tiles:
    policy = policy_for(hidden.device)
    n_rows = hidden.shape[0]
    rows = chunk_rows or filtered_chunk_rows(n_rows, shard_width, matmul_dtype(hidden, weight), hidden.device)
    # the elementwise passes of the head's derivative and the bf16 matmuls walk the chunk in blocks
    return Tiles(
        hidden,
        weight,
        bias,
        head,
        active=active,
        rows=max(1, min(n_rows, rows)),
        block=policy.max_block,
        scratch=scratch,
        chunk_width=weight.shape[0],
    )


@torch.library.custom_op("lossfx::linear_filtered_rows", mutates_args=())
def linear_filtered_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    active: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    top_k: int,
    top_p: float,
    ties: str,
    vocab_start: int,
    vocab_size: int,
    chunk_rows: int,
    shard_width: int,
    group_name: str,
) -> tuple[Tensor, Tensor]:
    """-> (rows `[4, N]` compute dtype: out, shift, log_s, τ; cut `[N]` int64, this rank's id cut).

    hidden `[N, H]` (all rows), weight `[Vl, H]`, bias `[Vl]` or None, target `[N]` global ids (any
    valid id at inactive rows), active (the rows to compute: an int64 index or a bool mask);
    `top_k = 0` disables top-k. Inactive rows: `out = 0`, never computed. Each chunk's logits
    `[C, Vl]` go through the logits path's forward (`_filtered_logprobs_fwd`) unchanged.
    """
    head = LogitHead(temperature, logit_scale, softcap)
    group = _resolve_group(group_name)
    tiles = _tiles(hidden, weight, bias, head, active, chunk_rows, shard_width, scratch=0)
    n_rows = hidden.shape[0]
    rows_out = torch.zeros(4, n_rows, dtype=tiles.cdtype, device=hidden.device)
    cut_out = torch.zeros(n_rows, dtype=torch.int64, device=hidden.device)
    k = top_k if top_k > 0 else None
    for rows, _h, z in tiles.chunks_full():  # z [C, Vl], the chunk buffer (reused)
        out, shift, log_s, tau, cut = _filtered_logprobs_fwd(
            z, target[rows], vocab_start, vocab_size, k, top_p, None, group, "auto", ties
        )
        rows_out[:, rows] = torch.stack([out, shift, log_s, tau])
        cut_out[rows] = cut
    return rows_out, cut_out


@linear_filtered_rows.register_fake
def _(hidden, weight, *args):
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    n_rows = hidden.shape[0]
    return hidden.new_empty((4, n_rows), dtype=cdtype), hidden.new_empty((n_rows,), dtype=torch.int64)


@torch.library.custom_op("lossfx::linear_filtered_grads", mutates_args=())
def linear_filtered_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    active: Tensor,
    rows_saved: Tensor,
    cut: Tensor,
    dout: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    sort_ties: bool,
    vocab_start: int,
    chunk_rows: int,
    shard_width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dhidden `[N, H]` compute dtype, dweight `[Vl, H]` weight's dtype, dbias `[Vl]` compute
    dtype or `[0]`); no collective.

    Each chunk's logits are recomputed (the forward's chunks, so bit-identical logits) and turned
    into `dz = keep ⊙ (onehot − p)·dout` by the logits path's backward (`_filtered_logprobs_bwd`),
    times the soft-cap's `1 − tanh²`; then `dhidden += (s/T)·dz W`, `dweight += (s/T)·dzᵀ h`
    (bf16/fp16: input-dtype products of each rounded block, summed in the compute dtype).
    """
    n_rows, hidden_size = hidden.shape
    local_vocab = weight.shape[0]
    device = hidden.device
    head = LogitHead(temperature, logit_scale, softcap)
    tiles = _tiles(hidden, weight, bias, head, active, chunk_rows, shard_width, scratch=int(softcap is not None))
    cdtype, exact = tiles.cdtype, tiles.exact
    shift, log_s, tau = rows_saved[1], rows_saved[2], rows_saved[3]
    dout = dout.to(cdtype)
    dhidden = torch.zeros(n_rows, hidden_size, dtype=cdtype, device=device)
    in_place = exact and weight.dtype == cdtype
    dweight = torch.zeros_like(weight) if in_place else torch.zeros(weight.shape, dtype=cdtype, device=device)
    dbias = torch.zeros(local_vocab if bias is not None else 0, dtype=cdtype, device=device)
    scale = head.scale  # dz/dr = s/T (· (1 − tanh²) with a soft-cap)
    blocks = tiles.block_slices
    w_mm = tiles.mm_weights()[0]
    dropped = dropped_gradient(tau)  # [N, 1], made once: NaN on a row holding a NaN
    for rows, h_rows, z in tiles.chunks_full():  # z [C, Vl]
        dz = _filtered_logprobs_bwd(
            z,
            target[rows],
            shift[rows],
            log_s[rows],
            tau[rows],
            cut[rows] if sort_ties else None,
            dout[rows],
            vocab_start,
            None,
            dropped[rows],
        )  # [C, Vl] compute dtype: a new buffer, z is kept
        if softcap is not None:  # 1 − tanh², from the logits (blockwise scratch)
            for cols in blocks:
                dz[:, cols].mul_(head.cap_derivative(z[:, cols], tiles.scratch(0, z[:, cols])))
        if dbias.numel():
            dbias.add_(dz.sum(dim=0), alpha=scale)
        if exact:
            if isinstance(rows, slice):
                dhidden[rows].addmm_(dz, w_mm, alpha=scale)  # [C, H]
            else:
                dhidden.index_add_(0, rows, dz @ w_mm, alpha=scale)
            dweight.addmm_(dz.T, h_rows, alpha=scale)
        else:
            for cols in blocks:  # input-dtype matmuls of each rounded block, summed in the compute dtype
                dz_low = tiles.low(dz[:, cols]).copy_(dz[:, cols])
                add_rows_(dhidden, rows, dz_low @ w_mm[cols], alpha=scale)
                dweight[cols].add_(dz_low.T @ h_rows, alpha=scale)
        del dz
    return dhidden, dweight if in_place else dweight.to(weight.dtype), dbias


@linear_filtered_grads.register_fake
def _(hidden, weight, bias, *args):
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    return (
        hidden.new_empty(hidden.shape, dtype=cdtype),
        weight.new_empty(weight.shape),
        hidden.new_empty((0 if bias is None else weight.shape[0],), dtype=cdtype),
    )


class _LinearFilteredFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, target, active, head, top_k, top_p, ties, start, size, group, chunk_rows, seq_par
    ):
        # hidden [N or N/R, H], weight [Vl, H], bias [Vl] or None, target [N] (valid ids), active: rows to compute
        full_hidden = hidden
        if seq_par and is_distributed(group):
            full_hidden = all_gather_stack(hidden, group).flatten(0, 1)  # [N, H], rank order
        shard_width = -(-size // (group.size() if is_distributed(group) else 1))
        group_name = group.group_name if is_distributed(group) else ""
        rows, cut = linear_filtered_rows(
            full_hidden,
            weight,
            bias,
            target,
            active,
            *head,
            top_k or 0,
            top_p,
            ties,
            start,
            size,
            chunk_rows,
            shard_width,
            group_name,
        )
        ctx.save_for_backward(full_hidden, weight, bias, target, active, rows, cut)
        ctx.head, ctx.chunk_rows, ctx.shard_width = head, chunk_rows, shard_width
        ctx.group, ctx.seq_par = group, seq_par
        ctx.sort_ties = ties == "sorted" and top_p < 1.0
        ctx.vocab_start, ctx.hidden_dtype = start, hidden.dtype
        return rows[0]

    @staticmethod
    def backward(ctx, dout):
        full_hidden, weight, bias, target, active, rows, cut = ctx.saved_tensors
        dhidden, dweight, dbias = linear_filtered_grads(
            full_hidden,
            weight,
            bias,
            target,
            active,
            rows,
            cut,
            dout,
            *ctx.head,
            ctx.sort_ties,
            ctx.vocab_start,
            ctx.chunk_rows,
            ctx.shard_width,
        )
        dbias = None if bias is None else dbias.to(bias.dtype)
        nones = (None,) * 11
        if not ctx.needs_input_grad[0]:  # the same on every rank, so the collective is skipped by all
            return None, dweight, dbias, *nones
        if ctx.seq_par:
            dhidden = reduce_scatter_sum(dhidden, ctx.group)  # [N/R, H]: this rank's rows, summed
        else:
            dhidden = all_reduce(dhidden, "sum", ctx.group)  # [N, H]: the full gradient on every rank
        return dhidden.to(ctx.hidden_dtype), dweight, dbias, *nones


def linear_filtered_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    vocab: VocabRange,
    *,
    top_k: int | None,
    top_p: float,
    ties: str = "together",
    head: HeadOptions,
    chunk_rows: int = 0,
    sequence_parallel: bool = False,
    count: list[int] | None = None,
) -> Tensor:
    """hidden `[..., H]` (this rank's `[N/R, H]` rows with `sequence_parallel`), weight `[Vl, H]`,
    target `[...]` -> `[...]` in the compute dtype: the target's log-prob under the top-k/top-p
    filtered, renormalised softmax of `z = head(hidden @ W_full.T + b_full)` (`HeadOptions`).

    Dense equivalent: ``lossfx.filtered_token_logprobs(z, target, top_k=..., top_p=..., ties=...)``,
    with 0 (and zero gradient) where `target == head.ignore_index` (those rows are never computed).
    `top_k`: an int > 0 or None; `top_p` in `(0, 1]`; `chunk_rows = 0`: the default; `count`: the
    count of targets that are not `head.ignore_index`, deferred ahead (`fused_linear.defer_active_rows`).
    """
    rows = linear_rows(hidden, target.unsqueeze(-1), vocab, weight.shape[0], head.ignore_index, count)
    valid = rows.valid[:, 0]  # [N]
    flat_target = torch.where(valid, target.reshape(-1).to(torch.int64), 0)  # [N] (0: never read)
    if sequence_parallel:
        flat_target = settle_before(flat_target)  # the call's checks before the forward's all-gather
    out = _LinearFilteredFn.apply(
        rows.hidden,
        weight,
        head.bias,
        flat_target,
        rows.active_rows,
        head.logits,
        top_k,
        float(top_p),
        ties,
        vocab.start,
        vocab.size,
        vocab.group,
        chunk_rows,
        sequence_parallel,
    )
    return torch.where(valid, out, torch.zeros_like(out)).view(target.shape)

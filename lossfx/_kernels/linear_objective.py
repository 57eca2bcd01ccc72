"""The fused weighted objective of token log-probs, pure: its gradient formed in the forward pass.

    objective = Σ_n a_n · log p_n(t_n) + Σ_n b_n · Σ_v p_n(v) log p_n(v),   z = hidden @ weight.T / T

Pure: plain tensors, a `lossfx._core.vocab.VocabRange` and resolved options in; no DTensor, no
argument validation, no cross-rank check (the public `lossfx.linear_objective` does those once).
One pass over chunks of `C` rows (`lossfx::linear_objective_rows`, an opaque custom op on the tile
engine `lossfx._core.tiles`) forms each chunk's logits, merges its row statistics over the
tensor-parallel ranks, turns the chunk into `dlogits` in place and adds its products to `dhidden`
and `dweight`: three matmuls per logits element (proofs/linear_objective.md). The backward only
scales the saved gradients. Dense equivalent: `lossfx.reference.linear_logprob_objective`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lossfx._core.chunking import policy_for
from lossfx._core.distributed import all_gather_stack, all_reduce, group_size, is_distributed, reduce_scatter_sum
from lossfx._core.host_reads import settle_before
from lossfx._core.numerics import finite_or_zero, log_s_for_softmax
from lossfx._core.tiles import HeadOptions, LogitHead, Tiles, add_rows_, chunk_rows_for, compute_dtype, matmul_dtype
from lossfx._core.vocab import VocabRange
from lossfx._kernels.fused_linear import linear_rows
from lossfx._kernels.linear_chunks import clamp_log_, merge_row_stats

__all__ = ["default_objective_chunk_rows", "linear_logprob_objective", "linear_objective_rows"]


def default_objective_chunk_rows(
    n_rows: int, shard_width: int, dtype: torch.dtype, device: torch.device | None = None
) -> int:
    """Rows per chunk when the caller gives none (`lossfx._core.tiles.chunk_rows_for` under the device's
    policy; on CPU `min(N / 16, a [C, shard_width] compute-dtype chunk near 96 MiB)`, at least 16).

    The three matmuls of a chunk are `[C, H] x [H, Vl]`-shaped with the whole head streamed once
    each, so C trades memory for speed (measured, N = 2048, H = 512, V = 151936 fp32, one core:
    C = 128 / 165 / 256 -> 1.14 / 1.11 / 1.05x the unfused time). Each chunk runs one all-gather,
    so every rank must walk the same chunks: `shard_width` is `ceil(V / R)` (the same on every
    rank, also with uneven shards), never this rank's width.
    """
    return chunk_rows_for(n_rows, shard_width, dtype, policy_for(device or torch.device("cpu")))


def _resolve_group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)  # type: ignore[arg-type]


@torch.library.custom_op("lossfx::linear_objective_rows", mutates_args=())
def linear_objective_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    local_idx: Tensor,
    owned: Tensor,
    active: Tensor,
    logprob_weight: Tensor,
    entropy_weight: Tensor,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    with_entropy: bool,
    need_dhidden: bool,
    need_dweight: bool,
    chunk_rows: int,
    shard_width: int,
    group_name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (rows `[2, N]`: log p(t) and `Σ p log p`, merged over the group (0 at inactive rows); this
    shard's `dhidden [N, H]` (compute dtype), `dweight [Vl, H]` (weight's dtype) and `dbias [Vl]`
    (compute dtype) of the objective).

    hidden `[N, H]` (all rows), weight `[Vl, H]`, bias `[Vl]` or None, local_idx/owned `[N]` (the
    target's column in this shard and whether it is here), active `[N]` (the rows to compute: the
    others are skipped), logprob_weight/entropy_weight `[N]` in the compute dtype (`a`, `b`);
    temperature, logit_scale, softcap as `LogitHead`. `chunk_rows = 0` picks the default
    from `N` and `shard_width = ceil(V / R)`, both rank-independent. `group_name` is `""` without a
    tensor-parallel group; else each chunk's per-row statistics are all-gathered over that group
    (eager c10d: the op is opaque to the compiler; every rank has the same `active`, so the same
    chunks). A gradient that is not needed is returned empty (`[0, H]`, `[0]`) and its work skipped.
    """
    n_rows, hidden_size = hidden.shape
    local_vocab = weight.shape[0]
    device = hidden.device
    mm_dtype = matmul_dtype(hidden, weight)
    head = LogitHead(temperature, logit_scale, softcap)
    group = _resolve_group(group_name) if group_name else None
    world = 1 if group is None else group.size()
    policy = policy_for(device)
    chunk_rows = min(n_rows, chunk_rows or chunk_rows_for(n_rows, shard_width, mm_dtype, policy)) or 1
    # the elementwise passes walk the chunk in blocks of `max_block` columns (cache-sized on a CPU)
    tiles = Tiles(
        hidden,
        weight,
        bias,
        head,
        active=active,
        rows=chunk_rows,
        block=policy.max_block,
        scratch=1 + int(softcap is not None),
        chunk_width=local_vocab,
    )
    cdtype, exact = tiles.cdtype, tiles.exact
    rows_out = torch.zeros(2, n_rows, dtype=cdtype, device=device)
    dhidden = torch.zeros(n_rows if need_dhidden else 0, hidden_size, dtype=cdtype, device=device)
    dweight = weight.new_empty((local_vocab if need_dweight else 0, hidden_size))
    if need_dweight:
        dweight.zero_()
    dbias = torch.zeros(local_vocab if need_dweight and bias is not None else 0, dtype=cdtype, device=device)
    # dweight is summed over the row chunks in the compute dtype (a bf16/fp16 one rounded once)
    in_place = exact and weight.dtype == cdtype
    acc = dweight if in_place else torch.zeros(dweight.shape, dtype=cdtype, device=device)
    scale = head.scale  # dz/dr = s/T (· (1 − tanh²) with a soft-cap)
    blocks = tiles.block_slices
    whole = len(blocks) == 1
    w_mm = tiles.mm_weights()[0]  # a copy only for a head of a lower dtype than hidden's
    for rows, h_rows, z in tiles.chunks_full():  # z [C, Vl]
        n = h_rows.shape[0]
        idx, own = local_idx[rows, None], owned[rows]
        m = z.amax(dim=1)  # [C], -inf for a row whose shard is all -inf
        m_safe = finite_or_zero(m)  # z − m_safe is −inf exactly where z is: e = 0 there
        # e·(z − m): 0·(−inf) = NaN only where e = 0, so nansum drops exactly those terms (0·log 0 = 0)
        if whole:  # s = Σ exp(z − m), u = Σ exp(z − m)(z − m) in one tile
            shifted = torch.sub(z, m_safe[:, None], out=tiles.scratch(0, z))
            e = torch.exp(shifted) if with_entropy else shifted.exp_()
            s = e.sum(dim=1)
            u = e.mul_(shifted).nansum(dim=1) if with_entropy else torch.zeros_like(s)
        else:  # ... per block in a small tile
            s = torch.zeros(n, dtype=cdtype, device=device)
            u = torch.zeros(n, dtype=cdtype, device=device)
            for cols in blocks:
                shifted = torch.sub(z[:, cols], m_safe[:, None], out=tiles.scratch(0, z[:, cols]))
                if with_entropy:
                    e = torch.exp(shifted)
                    s += e.sum(dim=1)
                    u += e.mul_(shifted).nansum(dim=1)
                else:
                    s += shifted.exp_().sum(dim=1)
        z_t = z.gather(1, idx)[:, 0]  # [C], the logit of the target (where owned)
        picked = torch.where(own, z_t, torch.zeros_like(m))
        local = torch.stack([m, s, u, picked])  # [4, C]
        if group is None:
            every = local[None]
        else:
            every = torch.empty(world * 4, n, dtype=cdtype, device=device)  # rank-major, as c10d fills it
            gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
            gather(every, local, group=group)
            every = every.view(world, 4, n)
        logprob, neg_entropy, shift, log_s = merge_row_stats(every, 1)
        rows_out[0, rows], rows_out[1, rows] = logprob[:, 0], neg_entropy
        if not (need_dhidden or need_dweight):
            continue
        # a row whose logits are all -inf is constant: p = 0 (log_s := +inf) and a := 0 (no one-hot)
        dead = torch.isneginf(log_s)[:, None]  # [C, 1]
        log_s = log_s_for_softmax(log_s)
        a = torch.where(dead, 0.0, logprob_weight[rows, None])
        b = entropy_weight[rows, None]
        # dz = p ⊙ (b·(log p − Σ p log p) − a) + a·onehot(t)        (proofs/linear_objective.md §1)
        if softcap is None and not with_entropy:
            z.sub_(shift[:, None]).sub_(log_s[:, None]).exp_().mul_(-a)  # −a·p, in place
        for cols in blocks if softcap is not None or with_entropy else ():
            zc = z[:, cols]
            cap = None
            if softcap is not None:  # 1 − tanh², from the logits before they are overwritten
                cap = head.cap_derivative(zc, tiles.scratch(1, zc))
            logp = zc.sub_(shift[:, None]).sub_(log_s[:, None])  # log p, in place
            if with_entropy:
                p = torch.exp(logp, out=tiles.scratch(0, zc))
                # clamped where z = −inf (p = 0): a finite bracket there, so the term is 0, not 0·inf
                clamp_log_(logp).sub_(neg_entropy[:, None]).mul_(b).sub_(a).mul_(p)
            else:
                logp.exp_().mul_(-a)
            if cap is not None:
                logp.mul_(cap)
        dz = z  # dz/dr up to the factor s/T
        onehot = a if softcap is None else a * head.cap_derivative(z_t, torch.empty_like(z_t))[:, None]
        dz.scatter_add_(1, idx, torch.where(own[:, None], onehot, torch.zeros_like(onehot)))
        if dbias.numel():
            dbias.add_(dz.sum(dim=0), alpha=scale)
        if exact:
            if need_dhidden:
                if isinstance(rows, slice):
                    dhidden[rows].addmm_(dz, w_mm, alpha=scale)  # [C, H]
                else:
                    dhidden.index_add_(0, rows, dz @ w_mm, alpha=scale)
            if need_dweight:
                acc.addmm_(dz.T, h_rows, alpha=scale)  # [Vl, H], summed over the row chunks
            continue
        for cols in blocks:  # input-dtype matmuls of each rounded tile, summed in the compute dtype
            dz_low = tiles.low(dz[:, cols]).copy_(dz[:, cols])
            if need_dhidden:
                add_rows_(dhidden, rows, dz_low @ w_mm[cols], alpha=scale)
            if need_dweight:
                acc[cols].add_(dz_low.T @ h_rows, alpha=scale)
    if need_dweight and not in_place:
        dweight.copy_(acc)  # rounded once to weight's dtype
    return rows_out, dhidden, dweight, dbias


@linear_objective_rows.register_fake
def _(hidden, weight, bias, local_idx, owned, active, lw, ew, t, s, c, with_entropy, need_dhidden, need_dweight, *args):
    n_rows, hidden_size = hidden.shape
    cdtype = compute_dtype(matmul_dtype(hidden, weight))
    n_bias = weight.shape[0] if need_dweight and bias is not None else 0
    return (
        hidden.new_empty((2, n_rows), dtype=cdtype),
        hidden.new_empty((n_rows if need_dhidden else 0, hidden_size), dtype=cdtype),
        weight.new_empty((weight.shape[0] if need_dweight else 0, hidden_size)),
        hidden.new_empty((n_bias,), dtype=cdtype),
    )


class _LinearObjectiveFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        local_idx,
        owned,
        active,
        lw,
        ew,
        head,
        with_entropy,
        chunk_rows,
        shard_width,
        group,
        seq_par,
        repeat,
    ):
        full_hidden = hidden
        if seq_par and is_distributed(group):
            full_hidden = all_gather_stack(hidden, group).flatten(0, 1)  # [N, H], rank order
        need_dhidden = ctx.needs_input_grad[0]
        need_dweight = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])
        cdtype = compute_dtype(matmul_dtype(hidden, weight))
        rows, dhidden, dweight, dbias = linear_objective_rows(
            full_hidden,
            weight,
            bias,
            local_idx,
            owned,
            active,
            lw.detach().to(cdtype),
            ew.detach().to(cdtype),
            *head,
            with_entropy,
            need_dhidden,
            need_dweight,
            chunk_rows,
            shard_width,
            group.group_name if is_distributed(group) else "",
        )
        logprobs, neg_entropy = rows[0], rows[1]
        objective = (lw.to(cdtype) * logprobs).sum()
        if with_entropy:
            objective = objective + (ew.to(cdtype) * neg_entropy).sum()
        if need_dhidden:  # the gradient of the objective, formed now: the collective runs in the forward
            if seq_par:
                dhidden = reduce_scatter_sum(dhidden, group)  # [N/R, H]: this rank's rows, summed
            else:
                dhidden = all_reduce(dhidden, "sum", group)  # [N, H]: the full gradient on every rank
        ctx.save_for_backward(dhidden, dweight, dbias, logprobs, neg_entropy)
        ctx.hidden_dtype, ctx.with_entropy, ctx.repeat = hidden.dtype, with_entropy, repeat
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(logprobs, neg_entropy)
        return objective, logprobs, neg_entropy

    @staticmethod
    def backward(ctx, dobjective, _dlogprobs, _dneg_entropy):
        dhidden, dweight, dbias, logprobs, neg_entropy = ctx.saved_tensors
        dh = dw = db = dlw = dew = None
        if ctx.needs_input_grad[0]:
            dh = (dhidden * dobjective.to(dhidden.dtype)).to(ctx.hidden_dtype)
        if ctx.needs_input_grad[1]:
            # by default scaled where it lies (a second [Vl, H] buffer would double the gradient's
            # memory); saved tensors are version-checked, so a second backward then raises
            scale = dobjective.to(dweight.dtype)
            dw = dweight * scale if ctx.repeat else dweight.mul_(scale)
        if ctx.needs_input_grad[2] and ctx.bias_dtype is not None:
            db = (dbias * dobjective.to(dbias.dtype)).to(ctx.bias_dtype)
        if ctx.needs_input_grad[6]:
            dlw = logprobs * dobjective
        if ctx.needs_input_grad[7] and ctx.with_entropy:
            dew = neg_entropy * dobjective
        return dh, dw, db, None, None, None, dlw, dew, None, None, None, None, None, None, None


def linear_logprob_objective(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    logprob_weight: Tensor,
    neg_entropy_weight: Tensor | None,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    chunk_rows: int = 0,
    sequence_parallel: bool = False,
    allow_repeated_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`(objective, logprobs [...], neg_entropy [...] or None)` for hidden `[..., H]` (this rank's
    `[N/R, H]` rows with `sequence_parallel`), this rank's head rows `weight [Vl, H]`, the options `head`,
    target `[...]` (any int dtype) and coefficients `a`, `b` `[...]` (target's shape).

    Dense equivalent, `lp = head(hidden @ W_full.T + b_full).log_softmax(-1)` (`HeadOptions`)::

        logprobs, neg_entropy = lp.gather(-1, target[..., None])[..., 0], (lp.exp() * lp).sum(-1)
        objective = (a * logprobs).sum() + (b * neg_entropy).sum()

    `logprobs` / `neg_entropy` carry no gradient; targets equal to `head.ignore_index` give 0.
    `chunk_rows = 0`: `default_objective_chunk_rows` with the rank-independent width `ceil(V / R)`.
    """
    rows = linear_rows(hidden, target[..., None], vocab, weight.shape[0], head.ignore_index)
    lw = logprob_weight.reshape(-1)
    with_entropy = neg_entropy_weight is not None
    ew = neg_entropy_weight.reshape(-1) if neg_entropy_weight is not None else torch.zeros_like(lw)
    shard_width = -(-vocab.size // group_size(vocab.group))  # sizes the default chunk: rank-independent
    # the call's checks come before its collectives, which run inside an op opaque to the compiler
    # (and traced, here rather than in the autograd.Function's forward subgraph)
    local_idx = settle_before(rows.local_idx)
    objective, logprobs, neg_entropy = _LinearObjectiveFn.apply(
        rows.hidden,
        weight,
        head.bias,
        local_idx[:, 0],
        rows.owned[:, 0],
        rows.active_rows,
        lw,
        ew,
        head.logits,
        with_entropy,
        chunk_rows,
        shard_width,
        vocab.group,
        sequence_parallel,
        allow_repeated_backward,
    )
    return objective, logprobs.view(target.shape), (neg_entropy.view(target.shape) if with_entropy else None)

"""A weighted sum of token log-probs from hidden states, its gradient formed in the forward pass.

    objective = Σ_n a_n · log p_n(t_n) + Σ_n b_n · Σ_v p_n(v) log p_n(v),   z = hidden @ weight.T / T

with per-token coefficients `a` (and optionally `b`) known before the forward: a negative
log-likelihood (`a = −mask / Σ mask`), an on-policy policy gradient (`a = −advantage · mask / norm`,
the gradient of GRPO's or PPO's clipped ratio loss when the ratio is 1), an entropy bonus (`b`,
the coefficient of the negative entropy `Σ p log p`: a bonus β is `b = −β · mask / norm`).

Why: `linear_token_logprobs` does not know the upstream gradient of its log-probs in the forward,
so its backward must recompute every logits tile: four matmuls against the unfused path's three.
Here the upstream gradient of every logit is known as soon as the row's softmax is, so one pass
over the rows forms `dlogits` and both gradients (three matmuls, as unfused), and the backward only
scales them by the upstream gradient of the scalar.

The loop (`lossfx::linear_objective_rows`, one opaque custom op under `torch.compile`, on the tile
engine `lossfx._core.tiles`, rows outside) walks chunks of `C` rows of `hidden` and keeps one `[C, Vl]`
chunk of logits of this rank's vocabulary shard, the most any design with three matmuls needs: per
chunk it forms the logits (in vocabulary blocks), the row statistics, merges them over the
tensor-parallel ranks (one all-gather of `[R, 4, C]` per-row scalars, inside the op), turns the
chunk into `dlogits` in place and adds its products to `dhidden` and `dweight`
(proofs/linear_objective.md). The dense equivalent: `lossfx.reference.linear_logprob_objective`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import boundary
from lossfx._boundary.dtensor import replicated
from lossfx._boundary.validation import check_floating, check_integer_ids
from lossfx._core.chunking import policy_for
from lossfx._core.distributed import (
    ProcessGroup,
    all_gather_stack,
    all_reduce,
    group_size,
    is_distributed,
    reduce_scatter_sum,
)
from lossfx._core.tiles import LogitHead, Tiles, add_rows_, chunk_rows_for, compute_dtype, matmul_dtype
from lossfx.fused_linear import (  # _ROLES: the cross-rank check's view of the LM-head parameters, shared
    _ROLES,
    _local_arguments,
    _options,
    local_view,
    prepare_linear_rows,
    renamed_keyword,
)
from lossfx.linear_chunks import merge_row_stats

__all__ = ["linear_logprob_objective"]


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
        m = z.amax(dim=1)  # [C]
        if whole:  # s = Σ exp(z − m), u = Σ exp(z − m)(z − m) in one tile
            shifted = torch.sub(z, m[:, None], out=tiles.scratch(0, z))
            e = torch.exp(shifted) if with_entropy else shifted.exp_()
            s = e.sum(dim=1)
            u = e.mul_(shifted).sum(dim=1) if with_entropy else torch.zeros_like(s)
        else:  # ... per block in a small tile
            s = torch.zeros(n, dtype=cdtype, device=device)
            u = torch.zeros(n, dtype=cdtype, device=device)
            for cols in blocks:
                shifted = torch.sub(z[:, cols], m[:, None], out=tiles.scratch(0, z[:, cols]))
                if with_entropy:
                    e = torch.exp(shifted)
                    s += e.sum(dim=1)
                    u += e.mul_(shifted).sum(dim=1)
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
        a, b = logprob_weight[rows, None], entropy_weight[rows, None]
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
                logp.sub_(neg_entropy[:, None]).mul_(b).sub_(a).mul_(p)
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


@boundary(roles=_ROLES, vocab="tiled", local=local_view(seq_dim=0))
def linear_logprob_objective(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    logprob_weight: Tensor,
    *,
    neg_entropy_weight: Tensor | None = None,
    entropy_weight: Tensor | None = None,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    sequence_parallel: bool = False,
    chunk_size: int | None = None,
    allow_repeated_backward: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """`Σ a·log p(target) (+ Σ b·Σ p log p)` from hidden states, gradients formed in the forward.

    Equivalent, on the full LM head (all ranks' shards in rank order), to::

        lp = (hidden @ weight.T / temperature).log_softmax(-1)
        logprobs, neg_entropy = lp.gather(-1, target[..., None])[..., 0], (lp.exp() * lp).sum(-1)
        objective = (logprob_weight * logprobs).sum() + (neg_entropy_weight * neg_entropy).sum()
        return objective, logprobs.detach(), neg_entropy.detach()

    in three matmuls per logits element (the unfused path's count; `linear_token_logprobs` needs
    four, because its backward recomputes the logits) and one `[C, Vl]` chunk of logits alive.
    Use it when the per-token coefficients are known before the forward: negative log-likelihood
    (`a = −mask / Σ mask`, then minimise `−objective`), on-policy policy gradients (`a = −A·mask /
    norm`: the gradient of a clipped-ratio loss at ratio 1), entropy bonuses (`b = −β·mask/norm`:
    `b` multiplies the negative entropy, so minimising `−objective` then raises the entropy). When the
    coefficient depends on the log-prob itself (an off-policy clipped ratio), use
    `linear_token_logprobs` and any loss.

    Args:
        hidden: `[..., H]` last hidden states, replicated on every TP rank (each rank's
            `hidden.grad` is the full gradient: the all-reduce of `[N, H]` runs in the forward),
            or with `sequence_parallel=True` this rank's rows of the flattened `[N, H]` (all-gathered
            in the forward, the gradient reduce-scattered in the forward). DTensor layouts as in
            `linear_token_logprobs`.
        weight: `[Vl, H]` this rank's rows of the LM head (the whole head without a group), or a
            `Shard(0)` DTensor head; any floating dtype (matmuls in the promoted dtype).
        target: `[...]` integer global ids in `[0, V)`; the full `N` positions on every rank.
        logprob_weight: `[...]` float coefficients `a` of the log-probs (the target's shape; the
            full `N` on every rank). Its gradient is `logprobs` (scaled).
        neg_entropy_weight: `[...]` float coefficients `b` of `Σ_v p log p` (the negative
            entropy), or `None` (no entropy term, and `neg_entropy` is not computed).
        entropy_weight: deprecated name of `neg_entropy_weight` (same meaning; a FutureWarning).
        group: tensor-parallel group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl`.
        vocab_size: global vocabulary size `V`; default `world_size · Vl`.
        temperature: divides the logits (> 0).
        bias: `[Vl]` this rank's rows of the LM head's bias (or a `Shard(0)` DTensor), or `None`;
            its gradient is returned in its dtype.
        logit_scale: `s > 0`, multiplies `hidden @ weight.T + bias` (before the soft-cap).
        softcap: `c > 0` or `None`: the logits are `c · tanh(s · (hidden @ weight.T + bias) / c) / T`
            (TRL's order; without it `s · (hidden @ weight.T + bias) / T`).
        ignore_index: targets equal to it get log-prob 0, zero gradient and `Σ p log p = 0` (nothing in the objective),
            and their rows are never computed (docs/fused_linear.md, "Options").
        sequence_parallel: the hidden layout described above.
        chunk_size: rows per chunk; one `[C, Vl]` chunk of logits in the compute dtype is alive
            (results do not depend on it). Default: `N / 16` rows, at most a `[C, ceil(V/R)]`
            chunk near the device policy's `chunk_bytes` (96 MiB on CPU), at least 16 rows: the
            same on every rank, uneven shards included (each chunk runs one all-gather over the group).
        allow_repeated_backward: `False`: the backward scales the `weight` gradient formed in the
            forward in place (no second `[Vl, H]` buffer), and a second backward through the same
            graph raises; `True`: it scales a copy, so `retain_graph=True` and `gradcheck` work,
            at one more `[Vl, H]` buffer during the backward.

    Returns:
        `(objective, logprobs, neg_entropy)`: the scalar objective in
        `promote_types(dtype, float32)` (differentiable with respect to `hidden`, `weight` and the
        coefficients), and the values `logprobs [...]` and `neg_entropy [...]` (or `None`) without
        gradient, replicated over the TP group.

    Gradient contract: `hidden`/`weight` gradients are formed in the forward and scaled by the
    objective's upstream gradient in the backward (`weight`'s in its dtype: exact when that
    gradient is 1; in place unless `allow_repeated_backward`). Extra
    memory: the gradients themselves from the forward on, one `[C, Vl]` chunk, and for bf16/fp16
    weights one `[Vl, H]` fp32 accumulator of `dweight` (the rows-outer loop revisits every
    vocabulary row once per chunk).

    Raises:
        TypeError: non-float `hidden`/`weight`/`bias`/coefficients, non-integer `target`,
            a non-bool `allow_repeated_backward`.
        ValueError: shape mismatches, `temperature <= 0`, `chunk_size <= 0`, target ids outside
            `[0, V)` (eager only).

    Example:
        >>> import torch, lossfx
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> objective, lp, _ = lossfx.linear_logprob_objective(h, w, torch.tensor([2]), torch.tensor([-1.0]))
        >>> objective, lp
        (tensor(0.4076), tensor([-0.4076]))

    See also: docs/fused_linear.md, proofs/linear_objective.md, lossfx.reference.linear_logprob_objective.
    """
    hidden, weight, group, vocab_start, vocab_size = _local_arguments(
        hidden, weight, group, vocab_start, vocab_size, sequence_parallel, seq_dim=0
    )
    target = replicated(target, "target")
    check_integer_ids("target", target)
    coefficients = {"logprob_weight": replicated(logprob_weight, "logprob_weight")}
    b_name = "neg_entropy_weight" if entropy_weight is None else "entropy_weight"  # as the caller named it
    b = renamed_keyword("neg_entropy_weight", neg_entropy_weight, "entropy_weight", entropy_weight)
    if b is not None:
        coefficients[b_name] = replicated(b, b_name)
    for name, value in coefficients.items():
        check_floating(name, value)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{name} must have the target's shape {tuple(target.shape)}, got {tuple(value.shape)}")
    options = _options(bias, group, vocab_start, vocab_size, temperature, logit_scale, softcap)
    options.update(ignore_index=ignore_index, sequence_parallel=sequence_parallel, chunk_size=chunk_size)
    rows = prepare_linear_rows(hidden, weight, target.unsqueeze(-1), **options)
    if not isinstance(allow_repeated_backward, bool):
        raise TypeError(f"allow_repeated_backward must be a bool, got {allow_repeated_backward!r}")
    lw = coefficients["logprob_weight"].reshape(-1)
    with_entropy = b is not None
    ew = coefficients[b_name].reshape(-1) if with_entropy else torch.zeros_like(lw)
    world = group_size(group)
    vocab = vocab_size if vocab_size is not None else world * weight.shape[0]
    shard_width = -(-vocab // world)  # sizes the default chunk: rank-independent, unlike weight.shape[0]
    objective, logprobs, neg_entropy = _LinearObjectiveFn.apply(
        rows.hidden,
        weight,
        options["bias"],
        rows.local_idx[:, 0],
        rows.owned[:, 0],
        rows.active_rows,
        lw,
        ew,
        rows.head,
        with_entropy,
        rows.chunk_rows,
        shard_width,
        group,
        sequence_parallel,
        allow_repeated_backward,
    )
    return objective, logprobs.view(target.shape), (neg_entropy.view(target.shape) if with_entropy else None)

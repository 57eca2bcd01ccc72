"""Token log-probabilities over a vocabulary that may be sharded across tensor-parallel ranks.

    out[n] = logits[n, target[n]] - logsumexp_v logits[n, v]          (v over the global vocab)

Pipeline of the forward (one streaming read of the logits):

1. per row chunk, the local statistics `(m, s)`: max and `Σ exp(z − m)` over this rank's columns;
   the target logit is gathered once, on the rank that owns the target's column (0 elsewhere);
2. one all-gather of the stacked `[3, N]` statistics over the tensor-parallel group, then an exact
   max-shifted merge into the row log-sum-exp `lse [N]` and the target logit (`_numerics`).

Saved for backward: the logits themselves (no copy) and `lse` (`N` floats). The backward needs no
collective: with the global `lse` known, each rank's slice of the softmax is local, so

    dlogits = dout[:, None] * (onehot(target) − exp(logits − lse[:, None]))

is written chunk by chunk into one buffer of the logits' dtype: one read, one write.
Derivation and the merge proof: proofs/logprobs.md. Reference: lossfx.reference.token_logprobs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._chunking import row_chunks
from lossfx._consistency import checked_collective
from lossfx._distributed import ProcessGroup, all_gather_stack, group_rank, group_size, local_columns
from lossfx._dtensor import replicated, vocab_shard
from lossfx._numerics import compute_dtype, lse_for_softmax, merge_max_sumexp, row_max_sumexp
from lossfx._validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
)

__all__ = ["token_logprobs"]


def _token_logprobs_fwd(
    logits: Tensor, target: Tensor, vocab_start: int, chunk_rows: int | None, group: ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """logits `[N, Vl]`, target `[N]` (global ids) -> (out `[N]`, lse `[N]`) in the compute dtype."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(target, vocab_start, local_vocab)
    # 1. local statistics, one chunk of rows at a time
    maxes, sums = [], []
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype):
        m, s = row_max_sumexp(logits[start:end], cdtype)  # [C], [C]; no converted copy of the chunk
        maxes.append(m)
        sums.append(s)
    picked = logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1).to(cdtype)  # [N]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    local_stats = torch.stack([torch.cat(maxes), torch.cat(sums), picked])  # [3, N]
    # 2. merge across ranks: one all-gather of per-row scalars
    stats = all_gather_stack(local_stats, group)  # [R, 3, N]
    lse = merge_max_sumexp(stats[:, 0], stats[:, 1])  # [N]
    target_logit = stats[:, 2].sum(dim=0)  # [N], exactly one rank contributes
    out = torch.where(torch.isneginf(lse), torch.full_like(lse, float("-inf")), target_logit - lse)
    return out, lse


def _token_logprobs_bwd(
    logits: Tensor, target: Tensor, lse: Tensor, dout: Tensor, vocab_start: int, chunk_rows: int | None
) -> Tensor:
    """-> dlogits `[N, Vl]` in the logits' dtype; no collective."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(target, vocab_start, local_vocab)
    shift = lse_for_softmax(lse)  # [N]
    # An all -inf row has a constant output (-inf): its gradient is 0.
    grad = torch.where(torch.isneginf(lse), torch.zeros_like(lse), dout.to(cdtype))  # [N]
    grad_target = torch.where(owned, grad, torch.zeros_like(grad))  # [N]
    if torch.compiler.is_compiling():
        # One expression over the whole tensor: Inductor fuses it into a single loop that reads the
        # logits once and writes dlogits once, in the logits' dtype, with no [N, Vl] temporary.
        columns = torch.arange(local_vocab, device=logits.device)  # [Vl]
        probs = torch.exp(logits.to(cdtype) - shift[:, None])  # [N, Vl]
        onehot = columns == local_idx[:, None]  # [N, Vl]
        return (torch.where(onehot, grad_target[:, None], 0.0) - probs * grad[:, None]).to(logits.dtype)
    # Eager: per chunk, one fresh [C, Vl] buffer (the output rows themselves when the logits are in
    # the compute dtype), updated in place. The same values as the expression above (IEEE addition
    # commutes: -(p·g) + g_t == g_t - p·g); only the sign of an exact zero may differ.
    neg_grad = -grad  # [N]
    direct = logits.dtype == cdtype
    dlogits = torch.empty_like(logits)
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype):
        rows = slice(start, end)
        d = torch.sub(logits[rows], shift[rows, None], out=dlogits[rows] if direct else None)  # [C, Vl]
        d.exp_().mul_(neg_grad[rows, None])  # -dout · softmax
        d.scatter_add_(1, local_idx[rows, None], grad_target[rows, None])  # + dout at the target
        if not direct:
            dlogits[rows] = d  # rounds once to the logits' dtype
    return dlogits


class _TokenLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(logits, target, vocab_start, chunk_rows, group):
        return _token_logprobs_fwd(logits, target, vocab_start, chunk_rows, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, target, vocab_start, chunk_rows, _group = inputs
        ctx.save_for_backward(logits, target, output[1])
        ctx.vocab_start, ctx.chunk_rows = vocab_start, chunk_rows
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    @once_differentiable  # the backward treats the saved lse as a constant: see proofs/logprobs.md §5
    def backward(ctx, dout, _dlse):
        logits, target, lse = ctx.saved_tensors
        dlogits = _token_logprobs_bwd(logits, target, lse, dout, ctx.vocab_start, ctx.chunk_rows)
        return dlogits, None, None, None, None  # one entry per forward input


@checked_collective(vocab="tiled")
def token_logprobs_with_lse(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` that also returns the row log-sum-exp `[...]` (not differentiable)."""
    logits, group, _, vocab_start, vocab_size, *_ = vocab_shard(
        logits, group=group, vocab_start=vocab_start, vocab_size=vocab_size
    )
    target = replicated(target, "target")
    check_floating("logits", logits)
    check_integer_ids("target", target)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"logits must be [..., V_local] with leading dims equal to target's; got logits.shape="
            f"{tuple(logits.shape)} and target.shape={tuple(target.shape)}"
        )
    local_vocab = logits.shape[-1]
    if local_vocab < 1:
        raise ValueError(f"logits must have at least one vocabulary column, got shape {tuple(logits.shape)}")
    if vocab_start is None:
        vocab_start = group_rank(group) * local_vocab
    if vocab_size is None:
        vocab_size = group_size(group) * local_vocab
    check_ids_in_range("target", target, vocab_size)
    flat_logits = logits.reshape(-1, local_vocab)  # [N, Vl], a view when the layout allows
    # int64 ids: gather needs int32/int64, and `target - vocab_start` must not wrap (uint8/int16)
    flat_target = target.reshape(-1).to(torch.int64)  # [N]
    out, lse = _TokenLogprobsFn.apply(flat_logits, flat_target, vocab_start, chunk_size, group)
    return out.view(target.shape), lse.view(target.shape)


@checked_collective(vocab="tiled")
def token_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Log-probability of each target token under softmax over the (possibly sharded) vocabulary.

    Equivalent to ``logits.log_softmax(-1).gather(-1, target[..., None])[..., 0]`` on the
    full-vocabulary logits (all ranks' shards concatenated in rank order), computed in
    `promote_types(logits.dtype, float32)` without materialising a `[N, V]` float32 tensor.

    .. math::
        \\mathrm{out}_n = z_{n, t_n} - \\log \\sum_v e^{z_{n,v}}

    Args:
        logits: `[..., Vl]` this rank's vocabulary shard (the full vocabulary without a group).
            Any float dtype; never modified.
        target: `[...]` integer global token ids in `[0, V)`.
        group: tensor-parallel process group over the vocabulary, or `None`. The output is the
            same on every rank; the gradient each rank receives is for its own shard only.
        vocab_start: first global id of this shard; default `rank · Vl` (uniform contiguous
            shards). Pass it with `vocab_size` for uneven shards.
        vocab_size: global vocabulary size `V`; default `world_size · Vl`.
        chunk_size: rows of the flattened `[N, Vl]` logits processed at once in eager mode
            (a memory bound; results do not depend on it). Default: about 1 MiB of temporaries.
            Under `torch.compile` the whole tensor is one fused pass.

    Returns:
        `[...]` log-probabilities in the compute dtype (fp32 for bf16/fp16/fp32, float64 for
        float64). The gradient flows back to `logits` in its own dtype.

    Raises:
        TypeError: non-float `logits`, non-integer `target`, non-int `chunk_size`.
        ValueError: shape mismatch, `chunk_size <= 0`, ids outside `[0, V)` (eager mode only:
            that check reads values and is skipped while compiling).

    Note:
        `-inf` logits are allowed: a `-inf` target logit gives `-inf`; a row that is `-inf`
        everywhere gives `-inf` with a zero gradient (never NaN). Double backward is not
        supported (`once_differentiable`).

    Example:
        >>> import torch, lossfx
        >>> z = torch.tensor([[0.0, 1.0, 2.0]])
        >>> lossfx.token_logprobs(z, torch.tensor([2]))
        tensor([-0.4076])

    See also: proofs/logprobs.md, lossfx.reference.token_logprobs.
    """
    return token_logprobs_with_lse(
        logits, target, group=group, vocab_start=vocab_start, vocab_size=vocab_size, chunk_size=chunk_size
    )[0]

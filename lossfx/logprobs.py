"""Token log-probabilities over a vocabulary that may be sharded across tensor-parallel ranks.

    out[n] = logits[n, target[n]] - logsumexp_v logits[n, v]          (v over the global vocab)

Pipeline of the forward (one streaming read of the logits):

1. per row chunk, the local statistics `(m, s)`: max and `Σ exp(z − m)` over this rank's columns;
   the target logit is gathered once, on the rank that owns the target's column (0 elsewhere);
2. one all-gather of the stacked `[3, N]` statistics over the tensor-parallel group, then an exact
   max-shifted merge into the row's `(shift, log_s)` (`lse = shift + log_s`, kept as two parts) and
   the target logit (`_numerics.merge_max_logsum`).

The output is `(z_t − shift) − log_s`, never `z_t − lse`: once `|shift|` dwarfs `log_s`, the sum
`shift + log_s` rounds `log_s` away, while subtracting the large part first is exact to a few ulps at
any magnitude, like `torch.log_softmax` (proofs/logprobs.md §4.1).

Saved for backward: the logits themselves (no copy) and `shift, log_s` (`2N` floats). The backward
needs no collective: with the global `(shift, log_s)` known, each rank's slice of the softmax is
local, so

    dlogits = dout[:, None] * (onehot(target) − exp((logits − shift[:, None]) − log_s[:, None]))

is written chunk by chunk into one buffer of the logits' dtype: one read, one write.
Derivation and the merge proof: proofs/logprobs.md. Reference: lossfx.reference.token_logprobs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import check_view, replicated, vocab_shard
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
)
from lossfx._core.chunking import cat_chunks, resolve_chunk_rows, row_chunks
from lossfx._core.distributed import ProcessGroup, all_gather_stack, group_rank, group_size, local_columns
from lossfx._core.numerics import compute_dtype, log_s_for_softmax, merge_max_logsum, row_max_sumexp, tracing

__all__ = ["token_logprobs"]


def _token_logprobs_fwd(
    logits: Tensor, target: Tensor, vocab_start: int, chunk_rows: int | None, group: ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """logits `[N, Vl]`, target `[N]` (global ids) -> (out, shift, log_s), each `[N]` in the compute dtype."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(target, vocab_start, local_vocab)
    # 1. local statistics, one chunk of rows at a time
    maxes, sums = [], []
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device):
        m, s = row_max_sumexp(logits[start:end], cdtype)  # [C], [C]; no converted copy of the chunk
        maxes.append(m)
        sums.append(s)
    picked = logits.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1).to(cdtype)  # [N]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    local_stats = torch.stack([cat_chunks(maxes), cat_chunks(sums), picked])  # [3, N]
    # 2. merge across ranks: one all-gather of per-row scalars
    stats = all_gather_stack(local_stats, group)  # [R, 3, N]
    shift, log_s = merge_max_logsum(stats[:, 0], stats[:, 1])  # [N], [N]; lse = shift + log_s
    target_logit = stats[:, 2].sum(dim=0)  # [N], exactly one rank contributes
    # the large part first: (z_t − shift) is exact or rounded once, as in torch.log_softmax
    logprob = (target_logit - shift) - log_s  # [N]
    out = torch.where(torch.isneginf(log_s), torch.full_like(log_s, float("-inf")), logprob)
    return out, shift, log_s


def _token_logprobs_bwd(
    logits: Tensor,
    target: Tensor,
    shift: Tensor,
    log_s: Tensor,
    dout: Tensor,
    vocab_start: int,
    chunk_rows: int | None,
) -> Tensor:
    """-> dlogits `[N, Vl]` in the logits' dtype; no collective."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(target, vocab_start, local_vocab)
    log_s_sm = log_s_for_softmax(log_s)  # [N], +inf for an all -inf row: its softmax is 0
    # An all -inf row has a constant output (-inf): its gradient is 0.
    grad = torch.where(torch.isneginf(log_s), torch.zeros_like(log_s), dout.to(cdtype))  # [N]
    grad_target = torch.where(owned, grad, torch.zeros_like(grad))  # [N]
    if tracing():
        # One expression over the whole tensor: Inductor fuses it into a single loop that reads the
        # logits once and writes dlogits once, in the logits' dtype, with no [N, Vl] temporary.
        columns = torch.arange(local_vocab, device=logits.device)  # [Vl]
        probs = torch.exp((logits.to(cdtype) - shift[:, None]) - log_s_sm[:, None])  # [N, Vl]
        onehot = columns == local_idx[:, None]  # [N, Vl]
        return (torch.where(onehot, grad_target[:, None], 0.0) - probs * grad[:, None]).to(logits.dtype)
    # Eager: per chunk, one fresh [C, Vl] buffer (the output rows themselves when the logits are in
    # the compute dtype), updated in place. The same values as the expression above (IEEE addition
    # commutes: -(p·g) + g_t == g_t - p·g); only the sign of an exact zero may differ.
    neg_grad = -grad  # [N]
    direct = logits.dtype == cdtype
    dlogits = torch.empty_like(logits)
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device):
        rows = slice(start, end)
        d = torch.sub(logits[rows], shift[rows, None], out=dlogits[rows] if direct else None)  # [C, Vl]
        d.sub_(log_s_sm[rows, None]).exp_().mul_(neg_grad[rows, None])  # -dout · softmax
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
        _out, shift, log_s = output
        ctx.save_for_backward(logits, target, shift, log_s)
        ctx.vocab_start, ctx.chunk_rows = vocab_start, chunk_rows
        ctx.mark_non_differentiable(shift, log_s)

    @staticmethod
    @once_differentiable  # the backward treats the saved (shift, log_s) as constants: proofs/logprobs.md §5
    def backward(ctx, dout, _dshift, _dlog_s):
        logits, target, shift, log_s = ctx.saved_tensors
        dlogits = _token_logprobs_bwd(logits, target, shift, log_s, dout, ctx.vocab_start, ctx.chunk_rows)
        return dlogits, None, None, None, None  # one entry per forward input


_ROLES = Roles(
    tp="group", shards=("logits",), start="vocab_start", size="vocab_size"
)  # the cross-rank check's view of the parameters


@boundary(roles=_ROLES, vocab="tiled", local=check_view("logits"))
def token_logprobs_with_lse(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`token_logprobs` that also returns the row log-sum-exp `[...]` (not differentiable).

    The log-probabilities are formed from the max and the log-sum kept apart (exact at any
    magnitude); the returned `lse = shift + log_s` is their rounded sum, for callers that need it.
    `chunk_size` is the deprecated name of `chunk_rows` (same value, a FutureWarning).
    """
    logits, group, _, vocab_start, vocab_size, *_ = vocab_shard(
        logits, group=group, vocab_start=vocab_start, vocab_size=vocab_size
    )
    target = replicated(target, "target")
    check_floating("logits", logits)
    check_integer_ids("target", target)
    chunk_rows = check_positive_int("chunk_rows", resolve_chunk_rows(chunk_rows, chunk_size))
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
    out, shift, log_s = _TokenLogprobsFn.apply(flat_logits, flat_target, vocab_start, chunk_rows, group)
    return out.view(target.shape), (shift + log_s).view(target.shape)


@boundary(roles=_ROLES, vocab="tiled", local=check_view("logits"))
def token_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_rows: int | None = None,
    ignore_index: int | None = None,
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
        chunk_rows: rows of the flattened `[N, Vl]` logits processed at once in eager mode
            (a memory bound; results do not depend on it). Default: the device's
            `lossfx.ChunkPolicy` (CPU: about 2 MiB per temporary). Under `torch.compile` the
            whole tensor is one fused pass.
        ignore_index: a target id that scores nothing (Hugging Face's `-100`): those positions
            give 0 with a zero gradient and are no range error. Default `None`: every target
            must lie in `[0, V)` (NeMo's contract). Dense equivalent:
            ``torch.where(target == ignore_index, 0, out)`` with any valid id in their place.
        chunk_size: deprecated name of `chunk_rows` (same value; a FutureWarning).

    Returns:
        `[...]` log-probabilities in the compute dtype (fp32 for bf16/fp16/fp32, float64 for
        float64). The gradient flows back to `logits` in its own dtype.

    Raises:
        TypeError: non-float `logits`, non-integer `target`, non-int `chunk_rows`.
        ValueError: shape mismatch, `chunk_rows <= 0`, ids outside `[0, V)` (eager mode only:
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
    ignored = None
    if ignore_index is not None:
        check_ignore_index(ignore_index)
        target = replicated(target, "target")
        check_integer_ids("target", target)
        ignored = target == ignore_index
        target = target.masked_fill(ignored, 0)  # any valid id; its result is replaced below
    chunk_rows = resolve_chunk_rows(chunk_rows, chunk_size)
    out = token_logprobs_with_lse(
        logits, target, group=group, vocab_start=vocab_start, vocab_size=vocab_size, chunk_rows=chunk_rows
    )[0]
    return out if ignored is None else torch.where(ignored, torch.zeros_like(out), out)


def check_ignore_index(ignore_index: object) -> int:
    """`ignore_index` as an int (TypeError for a bool or a non-int, naming it)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int or None, got {ignore_index!r}")
    return ignore_index

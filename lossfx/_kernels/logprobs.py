"""Token log-probabilities over a vocabulary that may be sharded across tensor-parallel ranks: the pure kernel.

    out[n] = logits[n, target[n]] - logsumexp_v logits[n, v]          (v over the global vocab)

Pipeline of the forward (one streaming read of the logits):

1. per row chunk, the local statistics `(m, s)`: max and `Σ exp(z − m)` over this rank's columns;
   the target logit is gathered once, on the rank that owns the target's column (0 elsewhere);
2. one all-gather of the stacked `[3, N]` statistics over the tensor-parallel group, then an exact
   max-shifted merge into the row's `(shift, log_s)` (`lse = shift + log_s`, kept as two parts) and
   the target logit (`_core.numerics.merge_max_logsum`).

The output is `(z_t − shift) − log_s`, never `z_t − lse`: once `|shift|` dwarfs `log_s`, the sum
`shift + log_s` rounds `log_s` away, while subtracting the large part first is exact to a few ulps at
any magnitude, like `torch.log_softmax` (proofs/logprobs.md §4.1).

Saved for backward: the logits themselves (no copy) and `shift, log_s` (`2N` floats). The backward
needs no collective: with the global `(shift, log_s)` known, each rank's slice of the softmax is
local, so

    dlogits = dout[:, None] * (onehot(target) − exp((logits − shift[:, None]) − log_s[:, None]))

is written chunk by chunk into one buffer of the logits' dtype: one read, one write.
Derivation and the merge proof: proofs/logprobs.md. Reference: lossfx.reference.token_logprobs.

Pure: plain tensors and a `VocabRange` resolved by the public `lossfx.token_logprobs` (its
boundary: DTensor unwrapping, argument checks, the cross-rank check); nothing is validated here.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._core.chunking import cat_chunks, row_chunks
from lossfx._core.distributed import ProcessGroup, all_gather_stack, local_columns
from lossfx._core.numerics import compute_dtype, log_s_for_softmax, merge_max_logsum, row_max_sumexp, tracing
from lossfx._core.vocab import VocabRange

__all__ = ["token_logprobs", "token_logprobs_with_lse"]


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


def _apply(logits: Tensor, target: Tensor, vocab: VocabRange, chunk_rows: int | None) -> tuple[Tensor, Tensor]:
    """logits `[..., Vl]`, target `[...]` -> (out, lse) `[...]`, the autograd Function applied once."""
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N, Vl], a view when the layout allows
    # int64 ids: gather needs int32/int64, and `target - start` must not wrap (uint8/int16)
    flat_target = target.reshape(-1).to(torch.int64)  # [N]
    out, shift, log_s = _TokenLogprobsFn.apply(flat_logits, flat_target, vocab.start, chunk_rows, vocab.group)
    return out.view(target.shape), (shift + log_s).view(target.shape)


def token_logprobs_with_lse(
    logits: Tensor, target: Tensor, vocab: VocabRange, *, chunk_rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """logits `[..., Vl]` (this rank's columns `vocab.start + [0, Vl)`), target `[...]` global ids in
    `[0, vocab.size)`, any int dtype -> `(logprobs [...], lse [...])` in the compute dtype.

    Dense: ``lp = full_logits.log_softmax(-1); (lp.gather(-1, target[..., None])[..., 0],
    full_logits.logsumexp(-1))``. `lse` is not differentiable.
    """
    return _apply(logits, target, vocab, chunk_rows)


def token_logprobs(
    logits: Tensor,
    target: Tensor,
    vocab: VocabRange,
    *,
    chunk_rows: int | None = None,
    ignore_index: int | None = None,
) -> Tensor:
    """logits `[..., Vl]`, target `[...]` -> log-probs `[...]` in the compute dtype.

    Dense: ``full_logits.log_softmax(-1).gather(-1, target[..., None])[..., 0]``; positions whose
    target equals `ignore_index` give 0 with a zero gradient (their id is replaced by 0).
    """
    if ignore_index is None:
        return _apply(logits, target, vocab, chunk_rows)[0]
    ignored = target == ignore_index
    out = _apply(logits, target.masked_fill(ignored, 0), vocab, chunk_rows)[0]
    return torch.where(ignored, torch.zeros_like(out), out)

"""Log-probabilities at arbitrary global token ids, and the negative entropy, in one streaming pass: the pure kernel.

    out[n, k] = logits[n, ids[n, k]] − lse[n]           neg_entropy[n] = Σ_v p[n, v] log p[n, v]

over a vocabulary that may be sharded across tensor-parallel ranks. Pipeline of the forward:

1. per row chunk, this shard's statistics `(m, s, u)`: max, `Σ exp(z − m)` and
   `Σ exp(z − m)·(z − m)` (the last only when the entropy is requested); the logits at the ids this
   rank owns (0 elsewhere);
2. one all-gather of the stacked per-row scalars `[2 + K (+1), N]`, then an exact max-shifted merge
   into `(shift, log_s)` (`lse = shift + log_s`, kept apart), `Σ p (z − shift)` and the gathered
   logits (`_core.numerics`). Log-probs are `(z − shift) − log_s`: exact at any magnitude.

Saved for backward: the logits (no copy), the ids, `shift`, `log_s` and the negative entropy `H`
(per row).
The backward needs no collective (proofs/gather.md):

    dlogits = scatter_add_k(ids, g) − p · Σ_k g_k + h · p ⊙ (log p − H)

where `g [N, K]` and `h [N]` are the upstream gradients of the two outputs. Duplicate ids
accumulate exactly through the scatter-add. Reference: lossfx.reference.gather_logprobs.

Pure: plain tensors and a `VocabRange` resolved by the public `lossfx.gather_logprobs` /
`lossfx.gather_logits` (their boundary: DTensor unwrapping, argument checks, the cross-rank
check); nothing is validated here.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lossfx._core.chunking import cat_chunks, row_chunks
from lossfx._core.distributed import all_gather_stack, all_reduce, local_columns
from lossfx._core.numerics import compute_dtype, finite_or_zero, log_s_for_softmax, merge, merge_moment, tracing
from lossfx._core.vocab import VocabRange

__all__ = ["gather_logits", "gather_logprobs"]


def _shifted_terms(z: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """`(e, e·d)` with `d = z − shift`, `e = exp(d)`, and `e·d = 0` where `z = −inf` (0·log 0 = 0)."""
    d = z - shift.unsqueeze(-1)  # [C, Vl]
    e = torch.exp(d)  # [C, Vl]
    ed = torch.where(torch.isneginf(z), torch.zeros_like(e), e * d)  # [C, Vl]
    return e, ed


def _chunk_stats(z: Tensor, cdtype: torch.dtype, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Rows `z [C, Vl]` -> `(m, s, u)` `[C]` in `cdtype`: max, `Σ e`, `Σ e·(z − m)`, `e = exp(z − m)`.

    Eager: `z − m` promotes to `cdtype` into one fresh `[C, Vl]` buffer (no converted copy of `z`),
    and the exponentials into one more, updated in place. Compiled: one fused expression.
    """
    if tracing():
        z = z.to(cdtype)
        m = z.amax(dim=-1)
        e, ed = _shifted_terms(z, finite_or_zero(m))
        return m, e.sum(dim=-1), ed.sum(dim=-1) if with_entropy else None
    m = z.amax(dim=-1).to(cdtype)  # exact in any dtype
    d = z - finite_or_zero(m).unsqueeze(-1)  # [C, Vl] in cdtype
    e = torch.exp(d)  # [C, Vl]
    s = e.sum(dim=-1)
    if not with_entropy:
        return m, s, None
    d.masked_fill_(torch.isneginf(d), 0.0)  # 0·log 0 = 0 (d = −∞ exactly where z = −∞)
    return m, s, e.mul_(d).sum(dim=-1)


def _gather_logprobs_fwd(logits, ids, vocab_start, with_entropy, chunk_rows, group):
    """logits `[N, Vl]`, ids `[N, K]` -> (logprobs `[N, K]`, neg_entropy `[N]`, shift `[N]`, log_s `[N]`)."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(ids, vocab_start, local_vocab)
    # 1. local statistics per chunk: max, Σ exp(z − m), and Σ exp(z − m)·(z − m) for the entropy
    maxes, sums, weighted = [], [], []
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device):
        m, s, u = _chunk_stats(logits[start:end], cdtype, with_entropy)
        maxes.append(m)
        sums.append(s)
        if u is not None:
            weighted.append(u)
    picked = logits.gather(-1, local_idx).to(cdtype)  # [N, K]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    rows = [cat_chunks(maxes).unsqueeze(0), cat_chunks(sums).unsqueeze(0), picked.transpose(0, 1)]
    if with_entropy:
        rows.append(cat_chunks(weighted).unsqueeze(0))
    # 2. merge across ranks: one all-gather of per-row scalars
    stats = all_gather_stack(torch.cat(rows), group)  # [R, 2 + K (+1), N]
    n_ids = ids.shape[-1]
    merged = merge(stats[:, 0], stats[:, 1])  # the one (max, Σexp) merge, `_core.numerics`
    shift, log_s = merged.shift, torch.log(merged.total)  # [N], [N]; lse = shift + log_s
    gathered = stats[:, 2 : 2 + n_ids].sum(dim=0).transpose(0, 1)  # [N, K], one owner per id
    finite_row = ~torch.isneginf(log_s)
    # the large part first: (z − shift) − log_s, exact at any magnitude (proofs/logprobs.md §4.1)
    logprobs = (gathered - shift.unsqueeze(-1)) - log_s.unsqueeze(-1)  # [N, K]
    logprobs = torch.where(finite_row.unsqueeze(-1), logprobs, float("-inf"))
    if not with_entropy:
        return logprobs, torch.zeros_like(log_s), shift, log_s
    # Σ p log p = Σ p (z − shift) − log_s, every term relative to the row max (proofs/gather.md §4)
    neg_entropy = merge_moment(merged, stats[:, 1], stats[:, -1]) / merged.total - log_s
    neg_entropy = torch.where(finite_row, neg_entropy, torch.zeros_like(neg_entropy))
    return logprobs, neg_entropy, shift, log_s


def _dense_grad(z, shift, log_s_sm, neg_entropy, h, g_total):
    """`p · (h (log p − H) − Σg)` `[..]` from logits `z` in the compute dtype (no scatter term).

    `shift, log_s_sm, neg_entropy, h, g_total` broadcast against `z` (trailing dim 1). A `−∞`
    logit has `p = 0` and contributes 0 (its `log p − H` is taken as 0, so no `0·∞`).
    """
    log_p = (z - shift) - log_s_sm
    log_p_minus_h = torch.where(torch.isneginf(z), torch.zeros_like(z), log_p - neg_entropy)
    return torch.exp(log_p) * (h * log_p_minus_h - g_total)


def _gather_logprobs_bwd(logits, ids, shift, log_s, neg_entropy, dlogprobs, dneg_entropy, vocab_start, chunk_rows):
    """-> dlogits `[N, Vl]` in the logits' dtype, rounded once; no collective."""
    n_rows, local_vocab = logits.shape
    cdtype = compute_dtype(logits.dtype)
    local_idx, owned = local_columns(ids, vocab_start, local_vocab)
    finite_row = ~torch.isneginf(log_s)  # all -inf rows are constant: zero gradient
    g = torch.where(finite_row.unsqueeze(-1), dlogprobs.to(cdtype), 0.0)  # [N, K]
    h = torch.where(finite_row, dneg_entropy.to(cdtype), 0.0)  # [N]
    g_owned = torch.where(owned, g, torch.zeros_like(g))  # [N, K]
    g_total = g.sum(dim=-1)  # [N]
    log_s_sm = log_s_for_softmax(log_s)  # [N], +inf for an all -inf row: p = 0
    if tracing():
        # A scatter-add cannot fuse into the dense loop, and would need the whole [N, Vl] in the
        # compute dtype (an fp32 copy of bf16 logits). Instead: the dense part in one fused loop
        # straight into the logits' dtype, then the K id columns recomputed and overwritten with
        # dense + Σ (owned g at that column), rounded once. Duplicate ids get identical values.
        stats = (shift[:, None], log_s_sm[:, None], neg_entropy[:, None], h[:, None], g_total[:, None])
        dlogits = _dense_grad(logits.to(cdtype), *stats).to(logits.dtype)  # [N, Vl]
        at_ids = _dense_grad(logits.gather(-1, local_idx).to(cdtype), *stats)  # [N, K]
        same_column = local_idx[:, :, None] == local_idx[:, None, :]  # [N, K, K]
        g_column = torch.where(same_column, g_owned[:, None, :], 0.0).sum(dim=-1)  # [N, K]
        return dlogits.scatter(-1, local_idx, (at_ids + g_column).to(logits.dtype))
    # Eager: per chunk one [C, Vl] buffer in the compute dtype (the gradient rows themselves when the
    # logits are in it), updated in place, plus one exp and one mask of the chunk.
    direct = logits.dtype == cdtype
    dlogits = torch.empty_like(logits)
    for start, end in row_chunks(n_rows, chunk_rows, local_vocab, cdtype, logits.device):
        rows = slice(start, end)
        d = torch.sub(logits[rows], shift[rows, None], out=dlogits[rows] if direct else None)  # [C, Vl]
        d.sub_(log_s_sm[rows, None])  # log p
        p = torch.exp(d)  # [C, Vl]
        d.sub_(neg_entropy[rows, None]).masked_fill_(torch.isneginf(d), 0.0)  # log p − H, 0 where p = 0
        d.mul_(h[rows, None]).sub_(g_total[rows, None]).mul_(p)  # p (h (log p − H) − Σg)
        del p
        d.scatter_add_(1, local_idx[rows], g_owned[rows])  # + g at the ids (duplicates add)
        if not direct:
            dlogits[rows] = d  # rounds once to the logits' dtype
    return dlogits


class _GatherLogprobsFn(torch.autograd.Function):
    @staticmethod
    def forward(logits, ids, vocab_start, with_entropy, chunk_rows, group):
        return _gather_logprobs_fwd(logits, ids, vocab_start, with_entropy, chunk_rows, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, ids, vocab_start, _with_entropy, chunk_rows, _group = inputs
        _logprobs, neg_entropy, shift, log_s = output
        ctx.save_for_backward(logits, ids, shift, log_s, neg_entropy)
        ctx.vocab_start, ctx.chunk_rows = vocab_start, chunk_rows
        ctx.mark_non_differentiable(shift, log_s)

    @staticmethod
    @once_differentiable  # (shift, log_s) and H are saved constants: see proofs/gather.md §5
    def backward(ctx, dlogprobs, dneg_entropy, _dshift, _dlog_s):
        logits, ids, shift, log_s, neg_entropy = ctx.saved_tensors
        dlogits = _gather_logprobs_bwd(
            logits, ids, shift, log_s, neg_entropy, dlogprobs, dneg_entropy, ctx.vocab_start, ctx.chunk_rows
        )
        return dlogits, None, None, None, None, None  # one entry per forward input


class _GatherColumnsFn(torch.autograd.Function):
    """`logits.gather(-1, idx)` in the compute dtype, with a lean backward.

    torch's own gather backward scatter-adds into a zero tensor of the logits' shape; for bf16 on CPU
    that scatter-add works in a float32 buffer of the whole logits (3× their bytes in all). Here the
    duplicate columns of a row are summed first, on `[..., K]` in the compute dtype, and one indexed
    write puts each column's total (rounded once) into a zero gradient of the logits' dtype.
    Duplicates write identical values, so the write is deterministic.
    """

    @staticmethod
    def forward(logits, idx):
        return logits.gather(-1, idx).to(compute_dtype(logits.dtype))  # [..., K]

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, idx = inputs
        # the logits' shape and dtype as a stride-0 view of one element (no memory): a saved tensor's
        # sizes stay traceable when they are dynamic, a saved `torch.Size` of SymInts did not
        ctx.save_for_backward(idx, logits.new_zeros(()).expand(logits.shape))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        idx, like_logits = ctx.saved_tensors
        same_column = idx.unsqueeze(-1) == idx.unsqueeze(-2)  # [..., K, K]
        column_total = torch.where(same_column, grad.unsqueeze(-2), 0.0).sum(dim=-1)  # [..., K]
        dlogits = torch.zeros(like_logits.shape, dtype=like_logits.dtype, device=grad.device)
        # index_put_ on the [N, V] view: CPU's scatter_ also goes through a float32 copy for bf16
        cols = idx.reshape(-1, idx.shape[-1])  # [N, K]
        rows = torch.arange(cols.shape[0], device=idx.device).unsqueeze(-1).expand_as(cols)  # [N, K]
        values = column_total.to(like_logits.dtype).reshape(cols.shape)
        dlogits.view(-1, like_logits.shape[-1]).index_put_((rows, cols), values)
        return dlogits, None  # one entry per forward input


def gather_logprobs(
    logits: Tensor,
    ids: Tensor,
    vocab: VocabRange,
    *,
    with_neg_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """logits `[..., Vl]` (this rank's columns `vocab.start + [0, Vl)`), ids `[..., K]` global ids in
    `[0, vocab.size)`, any int dtype -> `(logprobs [..., K], neg_entropy [...] or None)` in the
    compute dtype.

    Dense: ``lp = full_logits.log_softmax(-1); (lp.gather(-1, ids), (lp.exp() * lp).sum(-1))``.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N, Vl]
    # int64 ids: gather needs int32/int64, and `ids - start` must not wrap (uint8/int16)
    flat_ids = ids.reshape(-1, ids.shape[-1]).to(torch.int64)  # [N, K]
    logprobs, neg_entropy, _, _ = _GatherLogprobsFn.apply(
        flat_logits, flat_ids, vocab.start, with_neg_entropy, chunk_rows, vocab.group
    )
    return logprobs.view(ids.shape), (neg_entropy.view(ids.shape[:-1]) if with_neg_entropy else None)


def gather_logits(logits: Tensor, ids: Tensor, vocab: VocabRange) -> Tensor:
    """logits `[..., Vl]`, ids `[..., K]` global ids -> `[..., K]` in the compute dtype.

    Dense: ``full_logits.gather(-1, ids)``. Each rank contributes the ids it owns and one
    all-reduce sums them; the gradient reaches only this rank's shard.
    """
    local_idx, owned = local_columns(ids.to(torch.int64), vocab.start, logits.shape[-1])
    local = _GatherColumnsFn.apply(logits, local_idx)  # [..., K] in the compute dtype
    local = torch.where(owned, local, torch.zeros_like(local))
    total = all_reduce(local.detach(), "sum", vocab.group)
    # value: the sum over ranks, which on the owner rank is its own logit exactly (the others add
    # 0); gradient: the identity onto the owner's contribution. (Not `local + (total − local)`:
    # that is NaN at a `-inf` or `+inf` logit, where the reference is not.)
    return torch.where(owned, local, total)

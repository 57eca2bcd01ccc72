"""The fused LM-head kernels, pure: log-probs (and `Σ p log p`) at `K` ids per row from hidden states.

    z = hidden @ weight.T / T                       (logits, [N, V]; only ever one [C, Cv] tile)
    out[n, k] = z[n, ids[n, k]] − logsumexp_v z[n, v]        neg_entropy[n] = Σ_v p log p

Pure: plain tensors, a `lossfx._core.vocab.VocabRange` (this rank's rows of the LM head) and
resolved options (`HeadOptions`: bias, logits map, `ignore_index`; `chunk_rows`, `sequence_parallel`) in; no DTensor,
no argument validation, no cross-rank check (the public `lossfx.fused_linear` does those once, at
its boundary). The only host read is the count of active rows in eager mode (`read_now`, with the
call's deferred checks; or deferred ahead of a read that comes first, `defer_active_rows`).
Forward: all-gather the rows of `hidden` under sequence parallelism, the
per-rank tile loop `lossfx::linear_local_stats` (`lossfx._kernels.linear_chunks`), one all-gather
of the per-row scalars `[R, 3 + K, N]`, the exact merge. Backward: `lossfx::linear_local_grads`,
then one all-reduce (or reduce-scatter under sequence parallelism) of `dhidden`
(proofs/fused_linear.md). Dense equivalent: `lossfx.reference.linear_gather_logprobs`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch
from torch import Tensor

from lossfx._core.distributed import all_gather_stack, all_reduce, is_distributed, local_columns, reduce_scatter_sum
from lossfx._core.host_reads import defer, read_now, settle, settle_before, tracing
from lossfx._core.numerics import log_softmax_rows
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels.linear_chunks import linear_local_grads, linear_local_stats, merge_row_stats

__all__ = ["LinearRows", "defer_active_rows", "linear_gather_logprobs", "linear_rows", "linear_token_logprobs"]


class _FusedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, local_idx, owned, valid, rows, head, with_entropy, chunk_rows, group, seq_par, raw
    ):
        # hidden [N or N/R, H], weight [Vl, H], bias [Vl] or None, local_idx/owned/valid [N, K],
        # rows: the rows to compute (`LinearRows.active_rows`); raw: the logits at the ids, not
        # their log-probs (static: the backward then has no softmax term)
        full_hidden = hidden
        if seq_par and is_distributed(group):
            full_hidden = all_gather_stack(hidden, group).flatten(0, 1)  # [N, H], rank order
        active = valid.any(dim=1)  # [N]: rows with at least one id that is not ignore_index
        stats = linear_local_stats(full_hidden, weight, bias, local_idx, owned, rows, *head, with_entropy, chunk_rows)
        merged = all_gather_stack(stats, group)  # [R, 3 + K, N]: per-row scalars only
        logprobs, neg_entropy, shift, log_s = merge_row_stats(merged, local_idx.shape[1], raw)
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))  # ignored ids: 0
        neg_entropy = torch.where(active, neg_entropy, torch.zeros_like(neg_entropy))  # ignored rows: 0
        ctx.save_for_backward(full_hidden, weight, bias, local_idx, owned, valid, rows, shift, log_s, neg_entropy)
        ctx.head, ctx.with_entropy, ctx.chunk_rows, ctx.raw = head, with_entropy, chunk_rows, raw
        # an output that reaches no loss (the entropy as a metric) gets None, not a zero tensor:
        # the backward then skips its branch in every tile
        ctx.set_materialize_grads(False)
        ctx.group, ctx.seq_par = group, seq_par
        ctx.hidden_dtype = hidden.dtype
        return logprobs, neg_entropy

    @staticmethod
    def backward(ctx, dlogprobs, dneg_entropy):
        full_hidden, weight, bias, local_idx, owned, valid, rows, shift, log_s, neg_entropy = ctx.saved_tensors
        cdtype = shift.dtype
        if dlogprobs is None:  # only the entropy reaches the loss
            g = torch.zeros(local_idx.shape, dtype=cdtype, device=shift.device)
        else:
            # ignored ids, and the rows whose logits are all -inf (constant: -inf log-probs), get no gradient
            live = valid & ~torch.isneginf(log_s)[:, None]  # [N, K]
            g = torch.where(live, dlogprobs.to(cdtype), torch.zeros((), dtype=cdtype, device=shift.device))  # [N, K]
        grad_ids = torch.where(owned, g, torch.zeros_like(g))
        # the entropy's branch of every tile runs only when its gradient reaches a loss (not for a
        # metric: then it arrives as None); with ctx.with_entropy False it is None too
        grad_entropy = None if dneg_entropy is None or not ctx.with_entropy else dneg_entropy.to(cdtype)
        dhidden, dweight, dbias = linear_local_grads(
            full_hidden,
            weight,
            bias,
            local_idx,
            rows,
            grad_ids,
            None if ctx.raw else g.sum(dim=1),  # raw logits: no −p·Σ_k g_k term
            grad_entropy,
            shift,
            log_s,
            neg_entropy,
            *ctx.head,
            ctx.chunk_rows,
        )
        dbias = None if bias is None else dbias.to(bias.dtype)
        nones = (None,) * 10
        if not ctx.needs_input_grad[0]:  # the same on every rank, so the collective is skipped by all
            return None, dweight, dbias, *nones
        if ctx.seq_par:
            dhidden = reduce_scatter_sum(dhidden, ctx.group)  # [N/R, H]: this rank's rows, summed
        else:
            dhidden = all_reduce(dhidden, "sum", ctx.group)  # [N, H]: the full gradient on every rank
        return dhidden.to(ctx.hidden_dtype), dweight, dbias, *nones


class LinearRows(typing.NamedTuple):
    """The fused kernels' flattened rows (`linear_rows`)."""

    hidden: Tensor  # [N or N/R, H]
    local_idx: Tensor  # [N, K] column of each id in this shard (0 where not owned or ignored)
    owned: Tensor  # [N, K] whether this shard owns the id (False where ignored)
    valid: Tensor  # [N, K] whether the id is not ignore_index
    # the rows to compute: eager, the int64 index of the rows with an id that is not ignore_index
    # (its length read with the call's deferred checks, once); compiled, their bool mask [N] (read in the op)
    active_rows: Tensor


def defer_active_rows(ids: Tensor, ignore_index: int, into: list[int]) -> None:
    """Defer (`host_reads.defer`) the count of rows of ids `[..., K]` with an id that is not
    `ignore_index`, which `linear_rows(..., count=into)` of the same ids then takes from `into`
    instead of reading it: a caller whose call reads the host before the kernel runs (the shard
    widths of uneven plain heads, `lossfx.linear_loss_input`) defers it ahead of that read, so one
    read carries both. Eager only (nothing is read while tracing)."""
    if not tracing() and not ids.is_meta:
        defer((ids != ignore_index).any(dim=-1).sum(), into.extend)


class CheckedCount(list[int]):
    """A `defer_active_rows` `into` that `linear_rows` also compares with its own count of the rows
    it gets (one more host read), `check(deferred, own)` raising if they differ: the debug mode's
    (`lossfx._boundary.debug.check_deferred_count`). A plain list reads nothing more."""

    def __init__(self, check: Callable[[int, int], None]) -> None:
        super().__init__()
        self.check = check


def linear_rows(
    hidden: Tensor, ids: Tensor, vocab: VocabRange, local_vocab: int, ignore_index: int, count: list[int] | None = None
) -> LinearRows:
    """Flatten hidden `[..., H]` (or this rank's rows under sequence parallelism) to `[N or N/R, H]`
    and ids `[..., K]` (any int dtype) to this shard's `[N, K]` columns, ownership and validity.
    `count`: the `into` of a `defer_active_rows` of these ids (read with the call's next settle, at
    once if not yet read), or None: read here."""
    hidden_size = hidden.shape[-1]
    n_rows = ids[..., 0].numel()
    hidden_rows = hidden.numel() // hidden_size if hidden_size else hidden[..., 0].numel()
    flat_ids = ids.reshape(n_rows, ids.shape[-1]).to(torch.int64)  # [N, K]
    valid = flat_ids != ignore_index
    local_idx, owned = local_columns(torch.where(valid, flat_ids, -1), vocab.start, local_vocab)
    active = valid.any(dim=1)  # [N]
    if not tracing() and not ids.is_meta:  # the kernel's own value need: which rows to compute
        if count is not None and not count:
            settle()  # deferred, not read yet
        n_active = count[0] if count else read_now(active.sum())[0]
        if isinstance(count, CheckedCount) and count:
            count.check(n_active, read_now(active.sum())[0])
        active = torch.nonzero_static(active, size=n_active)[:, 0]
    return LinearRows(hidden.reshape(hidden_rows, hidden_size), local_idx, owned, valid, active)


def _fused(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    with_neg_entropy: bool,
    chunk_rows: int,
    sequence_parallel: bool,
    raw: bool = False,
    count: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (logprobs `[..., K]`, neg_entropy `[...]`, valid `[..., K]`) for ids `[..., K]`; `raw`: the
    logits at the ids in place of the log-probs."""
    rows = linear_rows(hidden, ids, vocab, weight.shape[0], head.ignore_index, count)
    local_idx = rows.local_idx
    if sequence_parallel:
        # the call's checks before the forward's first collective, the all-gather of the rows it
        # saves for backward: emitted there, inside the autograd.Function's traced forward, Dynamo
        # rejects the graph (an intermediate that aliases an output, reached by a side effect)
        local_idx = settle_before(local_idx)
    logprobs, neg_entropy = _FusedLinearFn.apply(
        rows.hidden,
        weight,
        head.bias,
        local_idx,
        rows.owned,
        rows.valid,
        rows.active_rows,
        head.logits,
        with_neg_entropy,
        chunk_rows,
        vocab.group,
        sequence_parallel,
        raw,
    )
    return logprobs.view(ids.shape), neg_entropy.view(ids.shape[:-1]), rows.valid.view(ids.shape)


def linear_gather_logprobs(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    with_neg_entropy: bool = False,
    zero_outside_topk: bool = True,
    chunk_rows: int = 0,
    sequence_parallel: bool = False,
    count: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs at ids `[..., K]` (any int dtype) from hidden `[..., H]` (this rank's `[N/R, H]`
    rows with `sequence_parallel`) and this rank's head rows `weight [Vl, H]`, with the options `head`.

    Dense equivalent, `z = head(hidden @ W_full.T + b_full)` (`HeadOptions`)::

        lp = z.log_softmax(-1)
        out = lp.gather(-1, ids) if zero_outside_topk else z.gather(-1, ids).log_softmax(-1)
        return out, ((lp.exp() * lp).sum(-1) if with_neg_entropy else None)

    ids equal to `head.ignore_index` give 0 (their rows are not computed); `chunk_rows = 0`: the default;
    `count`: their count, deferred ahead (`defer_active_rows`), or None: read here.
    """
    logprobs, neg_entropy, valid = _fused(
        hidden,
        weight,
        ids,
        vocab,
        head=head,
        with_neg_entropy=with_neg_entropy,
        chunk_rows=chunk_rows,
        sequence_parallel=sequence_parallel,
        raw=not zero_outside_topk,
        count=count,
    )
    if not zero_outside_topk:
        # log_softmax over the logits at the K ids alone, as the reference: a NaN or +inf logit
        # elsewhere in the row (which makes its full softmax NaN) does not reach them; ignored ids
        # take no part (-inf), and a row without any keeps its zeros
        zero = torch.zeros_like(logprobs)
        fill = torch.where(valid.any(dim=-1, keepdim=True), torch.full_like(logprobs, float("-inf")), zero)
        logprobs = torch.where(valid, log_softmax_rows(torch.where(valid, logprobs, fill)), zero)
    return logprobs, (neg_entropy if with_neg_entropy else None)


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    with_neg_entropy: bool = False,
    chunk_rows: int = 0,
    sequence_parallel: bool = False,
    count: list[int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token log-probs `[...]` of target `[...]` (any int dtype): `linear_gather_logprobs` at
    `K = 1`. Dense: ``z.log_softmax(-1).gather(-1, target[..., None])[..., 0]`` (and `Σ p log p`)."""
    logprobs, neg_entropy, _ = _fused(
        hidden,
        weight,
        target.unsqueeze(-1),
        vocab,
        head=head,
        with_neg_entropy=with_neg_entropy,
        chunk_rows=chunk_rows,
        sequence_parallel=sequence_parallel,
        count=count,
    )
    return logprobs.squeeze(-1), (neg_entropy if with_neg_entropy else None)

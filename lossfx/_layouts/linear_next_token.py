"""Pure: next-token log-probs from hidden states in a sequence layout (the fused head's pipeline).

    out[b, t] = log softmax(head(hidden[b, t] @ weight.T))[input_ids[b, t+1]]      t < S − 1

The one next-token pipeline (`lossfx._layouts.sequence_layout.score_next_tokens`) around the
fused kernel (`lossfx._kernels.fused_linear.linear_token_logprobs`): the shift on the canonical
ids, the targets laid out like `hidden`, the kernel, the gather back to canonical order. Each
sequence's last position, the dropped last column and any padding are `ignore_index` rows
(skipped: 0 with a zero gradient). Plain tensors in, validated by the public boundary
(`lossfx.fused_linear.linear_next_token_logprobs`: shapes, the head, the ids range-checked once).
"""

from __future__ import annotations

from torch import Tensor

from lossfx._core.distributed import group_size
from lossfx._core.tiles import HeadOptions
from lossfx._core.vocab import VocabRange
from lossfx._kernels import fused_linear as _kernel
from lossfx._kernels import linear_filtering as _filtered
from lossfx._layouts.next_token import TopKTopP
from lossfx._layouts.sequence_layout import SequenceLayout, score_next_tokens

__all__ = ["defer_active_rows", "linear_next_token_logprobs"]


def linear_next_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    input_ids: Tensor,
    layout: SequenceLayout,
    vocab: VocabRange,
    *,
    head: HeadOptions,
    with_neg_entropy: bool = False,
    chunk_rows: int = 0,
    sequence_parallel: bool = False,
    position_ids: Tensor | None = None,
    top: TopKTopP | None = None,
    fill: int | None = None,
    count: list[int] | None = None,
) -> list[Tensor]:
    """hidden `[B, S_l, H]` (`[B, S_l/R, H]` under sequence parallelism over `vocab.group`, `R`
    ranks), weight `[Vl, H]`, input_ids `[B, S]` canonical -> `[logprobs [B, S−1]]`, and
    `Σ p log p [B, S−1]` after it when `with_neg_entropy`. With `top` (a top-k/top-p filter, no
    entropy), the log-probs under the filtered, renormalised softmax
    (`lossfx._kernels.linear_filtering`).

    Dense equivalent (no parallelism): ``linear_token_logprobs(hidden[:, :-1], weight,
    input_ids[:, 1:])``, 0 where `input_ids[:, t+1] == head.ignore_index` or `position_ids[:, t+1] == 0`.
    `fill`: the id the layout's slots without a next token score (default `head.ignore_index`:
    skipped; the packed rows' rule is 0, `lossfx.packing`). `count`: the `into` of this pipeline's
    `defer_active_rows` (its targets' active rows, deferred ahead of the call's first read).
    """
    tp_size = group_size(vocab.group) if sequence_parallel else 1
    seq_major = tp_size > 1
    # under sequence parallelism the rows are taken sequence-major, so that each TP rank's
    # [B, S_l/R] positions are one contiguous block of the flattened rows
    rows = hidden.transpose(0, 1) if seq_major else hidden  # [S_l/R, B, H] under sequence parallelism

    def score(target: Tensor) -> list[Tensor]:  # [B, S_l] -> [B, S_l] each
        target = target.transpose(0, 1) if seq_major else target  # [S_l, B]
        if top is not None:
            filtered = _filtered.linear_filtered_token_logprobs(
                rows,
                weight,
                target,
                vocab,
                top_k=top.top_k,
                top_p=top.top_p,
                ties=top.ties,
                head=head,
                sequence_parallel=sequence_parallel,
                count=count,
            )
            return [filtered.transpose(0, 1) if seq_major else filtered]
        logprobs, neg_entropy = _kernel.linear_token_logprobs(
            rows,
            weight,
            target,
            vocab,
            head=head,
            with_neg_entropy=with_neg_entropy,
            chunk_rows=chunk_rows,
            sequence_parallel=sequence_parallel,
            count=count,
        )
        outputs = [logprobs] if neg_entropy is None else [logprobs, neg_entropy]
        return [x.transpose(0, 1) for x in outputs] if seq_major else outputs

    local_len = hidden.shape[1] * tp_size  # this CP rank's positions
    ids = input_ids.to(hidden.device)
    fill = head.ignore_index if fill is None else fill
    return score_next_tokens(layout, ids, local_len, score, fill=fill, position_ids=position_ids)


def defer_active_rows(
    hidden: Tensor,
    input_ids: Tensor,
    layout: SequenceLayout,
    ignore_index: int,
    into: list[int],
    fill: int | None = None,
) -> None:
    """Defer the kernel's count of active rows (`fused_linear.defer_active_rows`) of the targets
    `linear_next_token_logprobs(hidden, ..., input_ids, layout, fill=fill)` lays out (no sequence
    parallelism, no `position_ids`: the front doors' calls), into `into`, its `count`."""
    fill = ignore_index if fill is None else fill
    target, _ = layout.next_token_targets(input_ids.to(hidden.device), hidden.shape[1], fill=fill)
    _kernel.defer_active_rows(target.unsqueeze(-1), ignore_index, into)

"""Pure: draft-model (Eagle/MTP) targets from hidden states, the target logits never held.

    teacher_logits[:, t] = head(hidden[:, t+1] @ W[target_ids].T + b[target_ids])   t < S − 1
    teacher_logits[:, S-1] = 0

Only the `D` rows of the LM head that the draft vocabulary maps to are used: under tensor
parallelism each rank writes the rows it owns into a `[D, H]` buffer (zeros elsewhere) and one
reduce-scatter (sum) hands every rank the `D/R` rows of its draft shard (exactly one rank owns each
target id, so the sum is exact): traffic `D·H`, never `N·D`. The hidden states are shifted (not
the logits: `[B, S_l, H]`, the layout's `shift_left`), projected onto those rows, and the positions
without a next token (the canonical last one and layout padding) are zeroed. Detached, like the
logits path (`lossfx._layouts.draft`). Validated by the public boundary (`lossfx.linear_loss_input`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.distributed import group_size, local_columns, reduce_scatter_sum
from lossfx._core.tiles import HeadOptions, matmul_dtype
from lossfx._core.vocab import VocabRange
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = ["draft_head_rows", "linear_draft_targets"]


def draft_head_rows(
    weight: Tensor, bias: Tensor | None, target_ids: Tensor, vocab: VocabRange
) -> tuple[Tensor, Tensor | None]:
    """This rank's `[D/R, H]` rows of the full head at `target_ids [D]` (and `[D/R]` bias), from its
    rows `weight [Vl, H]` (ids `vocab.start + [0, Vl)`). Dense: ``W_full[target_ids]`` cut in `R`."""
    target_ids = target_ids.to(weight.device)
    if group_size(vocab.group) == 1:
        return weight[target_ids], None if bias is None else bias[target_ids]
    local_idx, owned = local_columns(target_ids, vocab.start, weight.shape[0])  # [D]
    rows = torch.where(owned[:, None], weight[local_idx], torch.zeros((), dtype=weight.dtype, device=weight.device))
    rows = reduce_scatter_sum(rows, vocab.group)  # [D/R, H]
    if bias is None:
        return rows, None
    picked = torch.where(owned, bias[local_idx], torch.zeros((), dtype=bias.dtype, device=bias.device))
    return rows, reduce_scatter_sum(picked, vocab.group)


def linear_draft_targets(
    hidden: Tensor,
    weight: Tensor,
    token_mask: Tensor,
    target_ids: Tensor | None,
    vocab: VocabRange,
    layout: SequenceLayout,
    *,
    head: HeadOptions,
) -> tuple[Tensor, Tensor]:
    """hidden `[B, S_l, H]` (this rank's positions), weight `[Vl, H]`, token_mask `[B, S]`
    canonical, `target_ids [D]` (`None`: the target vocabulary, `D = V`) -> `(teacher_logits
    [B, S_l, D/R] in the logits' dtype, token_mask [B, S_l])` in this rank's layout, detached.

    Dense equivalent: ``lossfx.reference.draft_targets(z, token_mask, d2t)`` with
    ``z = head(hidden @ W_full.T + b_full)``.
    """
    seq, local_len = token_mask.shape[1], hidden.shape[1]
    dtype = matmul_dtype(hidden, weight)
    with torch.no_grad():
        if target_ids is None:
            rows, row_bias = weight, head.bias  # this rank's shard of the target vocabulary
        else:
            rows, row_bias = draft_head_rows(weight, head.bias, target_ids, vocab)
        shifted = layout.shift_left(hidden.detach(), seq)  # [B, S_l, H]
        teacher = shifted.to(dtype) @ rows.to(dtype).T  # [B, S_l, D/R]
        if row_bias is not None:
            teacher += row_bias.to(dtype)
        head.logits.apply_(teacher)
        has_next = (torch.arange(seq, device=hidden.device) < seq - 1).expand(token_mask.shape[0], seq)
        keep = layout.to_local(has_next, local_len, fill=False)  # [B, S_l]
        teacher.masked_fill_(~keep[..., None], 0)
    mask = torch.cat([token_mask[:, 1:], torch.zeros_like(token_mask[:, :1])], dim=1)
    return teacher, layout.to_local(mask, local_len)

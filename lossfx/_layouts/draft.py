"""Pure: draft-model (Eagle/MTP) targets on plain tensors, a `SequenceLayout` and a `VocabRange`.

    teacher_logits[:, t] = logits[:, t+1, target_ids]   (target_ids[i] = i + d2t[i])
    teacher_logits[:, S-1] = 0

The public boundary (`lossfx.draft`) unwraps DTensors, validates the arguments, range-checks
`target_ids` once and builds the layout; the functions here only compute.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.distributed import group_size, local_columns, reduce_scatter_sum
from lossfx._core.vocab import VocabRange
from lossfx._layouts.sequence_layout import SequenceLayout

__all__ = ["draft_targets", "map_to_draft_vocab", "shift_left"]


def shift_left(x: Tensor, layout: SequenceLayout) -> Tensor:
    """This rank's part `[B, S_l, ...]` of the canonical left shift along dim 1 (last row zero).

    Dense equivalent: ``torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)`` on the canonical tensor.
    """
    return layout.shift_left(x)


def map_to_draft_vocab(teacher_logits: Tensor, target_ids: Tensor, vocab: VocabRange) -> Tensor:
    """`teacher_logits [..., Vl]` (this rank's columns `[vocab.start, vocab.start + Vl)`) ->
    `[..., D/R]`, this rank's draft shard; `target_ids [D]` int64 in `[0, vocab.size)`, `D`
    divisible by the group's size `R`.

    Dense equivalent: ``full_logits[..., target_ids]`` cut into `R` equal draft shards. Under
    tensor parallelism each rank writes the target columns it owns into `[D, ...]` (zeros
    elsewhere) and one reduce-scatter (sum) hands every rank its shard; exactly one rank owns
    each id, so the sum is exact.
    """
    target_ids = target_ids.to(teacher_logits.device)
    if group_size(vocab.group) == 1:
        return teacher_logits[..., target_ids]
    local_idx, owned = local_columns(target_ids, vocab.start, teacher_logits.shape[-1])  # [D]
    picked = teacher_logits[..., local_idx]  # [..., D]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    mine = reduce_scatter_sum(picked.movedim(-1, 0), vocab.group)  # [D/R, ...]
    return mine.movedim(0, -1)


def draft_targets(
    logits: Tensor, token_mask: Tensor, target_ids: Tensor | None, vocab: VocabRange, layout: SequenceLayout
) -> tuple[Tensor, Tensor]:
    """`(teacher_logits [B, S_l, D/R], token_mask [B, S_l])` in this rank's layout, detached.

    `logits [B, S_l, Vl]` are this rank's part (it covers the canonical `token_mask [B, S]`);
    `target_ids` `None` keeps the target vocabulary. Dense equivalent:
    ``(shift(logits)[..., target_ids], shift(token_mask))`` with ``shift(x) = cat([x[:, 1:], 0·x[:, :1]], 1)``.
    """
    seq, local_len = token_mask.shape[1], logits.shape[1]
    shifted = layout.shift_left(logits.detach(), seq)
    teacher = shifted if target_ids is None else map_to_draft_vocab(shifted, target_ids, vocab)
    mask = torch.cat([token_mask[:, 1:], torch.zeros_like(token_mask[:, :1])], dim=1)
    return teacher, layout.to_local(mask, local_len)

"""Draft-model (Eagle/MTP) targets: the policy's own logits, shifted one position, in draft vocab.

    teacher_logits[:, t] = logits[:, t+1, i + d2t[i]]   (draft id i ↦ target id i + d2t[i])
    teacher_logits[:, S-1] = 0                          (zero logits: a uniform target)

1. **Shift** (`SequenceLayout.shift_left` of the call's layout, `lossfx.sequence_layout`). Without
   context parallelism a left shift with a zero last row. In lossfx's load-balanced layout each
   rank's two chunks shift internally and take their new last row from the first row of the next
   chunk in canonical order, which another rank may hold: one all-gather of every rank's two
   first rows (`[R, 2, B, Vl]`) provides them; the canonical last row becomes zeros. In another
   layout (an external `cp_sharder`, a padded CP sequence) the logits are gathered to canonical
   order, shifted and laid out again (one all-gather of this rank's logits).
2. **Draft vocabulary.** Without tensor parallelism a column gather. With it, each rank writes the
   target columns it owns into a `[D, B, S]` buffer (zeros elsewhere) and one reduce-scatter (sum)
   hands every rank its `D/TP` draft shard: traffic `B·S·D`, never the full target vocabulary.
   Exactly one rank owns each target id, so the sum is exact.

The targets are detached: no gradient flows into them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.dtensor import check_view, is_dtensor, replicated, vocab_shard
from lossfx._boundary.validation import check_floating, check_ids_in_range, check_integer_ids, check_tensor
from lossfx._core.distributed import (
    ProcessGroup,
    check_group,
    group_rank,
    group_size,
    local_columns,
    reduce_scatter_sum,
)
from lossfx.sequence_layout import ContextParallelSharder, sequence_layout

__all__ = ["draft_targets", "map_to_draft_vocab", "shift_left"]


@renamed_keywords(cp_group="context_parallel_group")
@boundary(roles=Roles(cp="context_parallel_group", cp_from="cp_sharder", cp_shards=("x",)))
def shift_left(
    x: Tensor,
    context_parallel_group: ProcessGroup | None = None,
    *,
    cp_sharder: ContextParallelSharder | None = None,
) -> Tensor:
    """Shift `x [B, S_l, ...]` one position left along dim 1 in canonical order; last row zero.

    Equivalent to ``torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)`` on the canonical tensor,
    applied to this rank's part of it.

    Args:
        x: `[B, S_l, ...]` this CP rank's shard (the canonical tensor without CP).
        context_parallel_group: the CP group of the load-balanced layout, or `None` (no context
            parallelism; formerly `cp_group=`, which still works with a FutureWarning).
        cp_sharder: an external layout (`shard_token_tensor` / `gather_token_tensor`) or a
            `lossfx.sequence_layout.SequenceLayout`; takes precedence over the group. The
            canonical sequence is then the sharder's gathered (trimmed) one.
    """
    cp_group = context_parallel_group
    if is_dtensor(x):  # shifts along the sequence: a vocabulary-sharded DTensor stays one (lossfx/_boundary/dtensor.py)
        s = vocab_shard(x, name="x")
        return s.wrap(shift_left(s.local, cp_group, cp_sharder=cp_sharder))
    check_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(f"x must have a sequence dim 1, got shape {tuple(x.shape)}")
    return sequence_layout(cp_group, cp_sharder).shift_left(x)


@boundary(
    roles=Roles(tp="vocab_parallel_group", shards=("teacher_logits",), rank="vocab_parallel_rank"),
    vocab="equal",
    local=check_view("teacher_logits", group_arg="vocab_parallel_group", rank_arg="vocab_parallel_rank", even=True),
)
def map_to_draft_vocab(
    teacher_logits: Tensor,
    d2t: Tensor | None,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
) -> Tensor:
    """Columns of the target-vocabulary logits in draft-vocabulary order.

    Equivalent to ``teacher_logits[..., torch.arange(D) + d2t]`` on the full target vocabulary;
    under tensor parallelism each rank receives its draft shard `[..., D/TP]` (rank order).

    Args:
        teacher_logits: `[..., Vl]` this rank's target-vocabulary shard.
        d2t: `[D]` integer offsets (draft id `i` maps to target id `i + d2t[i]`), or `None` to
            return `teacher_logits` unchanged.
        vocab_parallel_rank, vocab_parallel_group: tensor parallelism over the vocabularies.

    Raises:
        ValueError: a target id outside `[0, V)` (eager only), `D` not divisible by TP.
    """
    check_group("vocab_parallel_group", vocab_parallel_group)
    if is_dtensor(teacher_logits):  # the draft-vocabulary shard comes back as a DTensor (lossfx/_boundary/dtensor.py)
        s = vocab_shard(
            teacher_logits, name="teacher_logits", group=vocab_parallel_group, rank=vocab_parallel_rank, even=True
        )
        out = map_to_draft_vocab(
            s.local, replicated(d2t, "d2t"), vocab_parallel_rank=s.rank, vocab_parallel_group=s.group
        )
        return s.wrap(out) if d2t is None else s.wrap_other_vocab(out, d2t.shape[0])
    if d2t is None:
        return teacher_logits
    check_integer_ids("d2t", d2t)
    if d2t.dim() != 1:
        raise ValueError(f"d2t must be 1-D [D], got shape {tuple(d2t.shape)}")
    world, local_vocab = group_size(vocab_parallel_group), teacher_logits.shape[-1]
    if vocab_parallel_group is not None and vocab_parallel_rank is None:
        raise ValueError("vocab_parallel_rank must be provided when vocab_parallel_group is provided")
    draft_vocab = d2t.shape[0]
    if draft_vocab % world:
        raise ValueError(f"len(d2t)={draft_vocab} must be divisible by the tensor-parallel size {world}")
    target_ids = torch.arange(draft_vocab, device=d2t.device) + d2t.to(torch.int64)  # [D]
    check_ids_in_range("d2t targets (i + d2t[i])", target_ids, world * local_vocab)
    if world == 1:
        return teacher_logits[..., target_ids.to(teacher_logits.device)]
    vocab_start = group_rank(vocab_parallel_group) * local_vocab
    local_idx, owned = local_columns(target_ids.to(teacher_logits.device), vocab_start, local_vocab)  # [D]
    picked = teacher_logits[..., local_idx]  # [..., D]
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    draft_major = picked.movedim(-1, 0)  # [D, ...]
    mine = reduce_scatter_sum(draft_major, vocab_parallel_group)  # [D/TP, ...]
    return mine.movedim(0, -1)


@boundary(
    roles=Roles(
        tp="vocab_parallel_group",
        cp="context_parallel_group",
        cp_from="cp_sharder",
        shards=("logits",),
        rank="vocab_parallel_rank",
    ),
    vocab="equal",
    local=check_view("logits", group_arg="vocab_parallel_group", rank_arg="vocab_parallel_rank", even=True),
)
def draft_targets(
    logits: Tensor,
    token_mask: Tensor,
    d2t: Tensor | None = None,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: ContextParallelSharder | None = None,
) -> tuple[Tensor, Tensor]:
    """Shifted, draft-vocabulary teacher logits and the shifted token mask.

    Equivalent (no parallelism) to
    ``(torch.cat([logits[:, 1:], 0 * logits[:, :1]], 1)[..., arange(D) + d2t],
    torch.cat([token_mask[:, 1:], 0 * token_mask[:, :1]], 1))``.

    Args:
        logits: `[B, S_l, Vl]` the policy's logits (this rank's TP/CP shard); detached here.
        token_mask: `[B, S]` canonical mask.
        d2t: `[D]` draft-to-target offsets or `None`.
        vocab_parallel_rank, vocab_parallel_group: tensor parallelism over the vocabulary (`None`
            without).
        context_parallel_group: CP group (load-balanced layout), or `None`.
        cp_sharder: an external layout (`shard_token_tensor` / `gather_token_tensor`) or a
            `lossfx.sequence_layout.SequenceLayout`; takes precedence over `context_parallel_group`.

    Returns:
        `(teacher_logits [B, S_l, D/TP] in the logits' dtype, token_mask [B, S_l])`, both in this
        rank's CP layout (positions past the canonical `S`, where the layout pads: zeros).
    """
    check_group("vocab_parallel_group", vocab_parallel_group)
    check_group("context_parallel_group", context_parallel_group)
    if is_dtensor(logits):  # the draft-vocabulary shard comes back as a DTensor (lossfx/_boundary/dtensor.py)
        s, d2t = (
            vocab_shard(logits, group=vocab_parallel_group, rank=vocab_parallel_rank, even=True),
            replicated(d2t, "d2t"),
        )
        teacher, mask = draft_targets(
            s.local,
            replicated(token_mask, "token_mask"),
            d2t,
            vocab_parallel_rank=s.rank,
            vocab_parallel_group=s.group,
            context_parallel_group=context_parallel_group,
            cp_sharder=cp_sharder,
        )
        return (s.wrap(teacher) if d2t is None else s.wrap_other_vocab(teacher, d2t.shape[0])), mask
    token_mask, d2t = replicated(token_mask, "token_mask"), replicated(d2t, "d2t")
    check_floating("logits", logits)
    check_tensor("token_mask", token_mask)
    if logits.dim() != 3 or token_mask.dim() != 2 or logits.shape[0] != token_mask.shape[0]:
        raise ValueError(
            f"logits must be [B, S_local, V_local] and token_mask [B, S]; got {tuple(logits.shape)} "
            f"and {tuple(token_mask.shape)}"
        )
    layout = sequence_layout(context_parallel_group, cp_sharder)
    seq, local_len = token_mask.shape[1], logits.shape[1]
    got = f"logits.shape={tuple(logits.shape)} and token_mask.shape={tuple(token_mask.shape)}"
    layout.check_covers("logits", local_len, seq, got, canonical="token_mask")
    shifted = layout.shift_left(logits.detach(), seq)
    teacher = map_to_draft_vocab(
        shifted, d2t, vocab_parallel_rank=vocab_parallel_rank, vocab_parallel_group=vocab_parallel_group
    )
    mask = torch.cat([token_mask[:, 1:], torch.zeros_like(token_mask[:, :1])], dim=1)
    return teacher, layout.to_local(mask, local_len)

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

The boundary: each public function here unwraps its DTensors, validates its arguments, range-checks
the draft-to-target ids once and builds the call's layout, then calls the pure code in
`lossfx._layouts.draft` once (the public functions never call each other).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.dtensor import VocabShard, local_view, resolved_shard
from lossfx._boundary.validation import check_floating, check_ids_in_range, check_integer_ids, check_tensor
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._core.vocab import VocabRange
from lossfx._layouts import draft as _pure
from lossfx.next_token import resolved_vocab
from lossfx.sequence_layout import (
    ContextParallelSharder,
    LoadBalancedLayout,
    SequenceLayout,
    check_covers,
    sequence_layout,
)

__all__ = ["draft_targets", "map_to_draft_vocab", "shift_left"]


@renamed_keywords(cp_group="context_parallel_group")
@boundary(
    roles=Roles(cp="context_parallel_group", cp_from="cp_sharder", cp_shards=("x",)),
    local=local_view(Roles(shards=("x",))),  # a vocabulary-sharded DTensor `x`: its local shard, placed back
)
def shift_left(
    x: Tensor,
    context_parallel_group: ProcessGroup | None = None,
    *,
    cp_sharder: ContextParallelSharder | None = None,
    _view: dict[str, Any] | None = None,
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
    # shifts along the sequence: a vocabulary-sharded DTensor stays one (lossfx/_boundary/dtensor.py)
    shard, local = resolved_shard(_view), x
    check_tensor("x", local)
    if local.dim() < 2:
        raise ValueError(f"x must have a sequence dim 1, got shape {tuple(local.shape)}")
    layout = sequence_layout(context_parallel_group, cp_sharder)
    if isinstance(layout, LoadBalancedLayout) and layout.cp_size > 1 and local.shape[1] % 2:
        raise ValueError(f"a context-parallel shard has an even length (two chunks), got {local.shape[1]}")
    return shard.wrap(_pure.shift_left(local, layout))


def _validated_target_ids(
    d2t: Tensor, group: ProcessGroup | None, rank: int | None, local_vocab: int, **vocab: Any
) -> tuple[Tensor, VocabRange]:
    """`(arange(D) + d2t` (int64 `[D]`), this rank's `VocabRange`), checked once: `d2t` 1-D
    integer, `D` divisible by the tensor-parallel size, every target id in `[0, V)` (`vocab`:
    `resolved_vocab`'s `vocab_start`, `vocab_size`, `widths`; default uniform shards)."""
    check_integer_ids("d2t", d2t)
    if d2t.dim() != 1:
        raise ValueError(f"d2t must be 1-D [D], got shape {tuple(d2t.shape)}")
    world = group_size(group)
    if group is not None and rank is None:
        raise ValueError("vocab_parallel_rank must be provided when vocab_parallel_group is provided")
    draft_vocab = d2t.shape[0]
    if draft_vocab % world:
        raise ValueError(f"len(d2t)={draft_vocab} must be divisible by the tensor-parallel size {world}")
    target_ids = torch.arange(draft_vocab, device=d2t.device) + d2t.to(torch.int64)  # [D]
    check = lambda size: check_ids_in_range("d2t targets (i + d2t[i])", target_ids, size)  # noqa: E731
    return target_ids, resolved_vocab(group, local_vocab, check, **vocab)


def _wrap_draft(shard: VocabShard, out: Tensor, d2t: Tensor | None) -> Tensor:
    """A result in the draft vocabulary (or the target one without `d2t`), placed like the input."""
    return shard.wrap(out) if d2t is None else shard.wrap_other_vocab(out, d2t.shape[0])


_ROLES_MAP = Roles(tp="vocab_parallel_group", shards=("teacher_logits",), rank="vocab_parallel_rank")


@boundary(roles=_ROLES_MAP, vocab="equal", local=local_view(_ROLES_MAP, even=True))
def map_to_draft_vocab(
    teacher_logits: Tensor,
    d2t: Tensor | None,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    _view: dict[str, Any] | None = None,
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
        ValueError: a target id outside `[0, V)` (compiled: an in-graph `RuntimeError`), `D` not divisible by TP.
    """
    shard = resolved_shard(_view)  # the boundary's one unwrap (a DTensor's draft-vocabulary shard comes back as one)
    if d2t is None:
        return teacher_logits
    target_ids, vocab = _validated_target_ids(d2t, shard.group, shard.rank, shard.local.shape[-1])
    return _wrap_draft(shard, _pure.map_to_draft_vocab(shard.local, target_ids, vocab), d2t)


_ROLES_TARGETS = Roles(
    tp="vocab_parallel_group",
    cp="context_parallel_group",
    cp_from="cp_sharder",
    shards=("logits",),
    rank="vocab_parallel_rank",
)


@boundary(roles=_ROLES_TARGETS, vocab="equal", local=local_view(_ROLES_TARGETS, even=True))
def draft_targets(
    logits: Tensor,
    token_mask: Tensor,
    d2t: Tensor | None = None,
    *,
    vocab_parallel_rank: int | None = None,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: ContextParallelSharder | None = None,
    _view: dict[str, Any] | None = None,
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
    shard = resolved_shard(_view)  # the boundary's one unwrap (a DTensor's draft-vocabulary shard comes back as one)
    layout = sequence_layout(context_parallel_group, cp_sharder)
    target_ids, vocab = validated_draft(shard.local, token_mask, d2t, shard.group, shard.rank, layout)
    teacher, mask = _pure.draft_targets(shard.local, token_mask, target_ids, vocab, layout)
    return _wrap_draft(shard, teacher, d2t), mask


def validated_draft(
    logits: Tensor,
    token_mask: Tensor,
    d2t: Tensor | None,
    group: ProcessGroup | None,
    rank: int | None,
    layout: SequenceLayout,
    logits_name: str = "logits",
    **vocab: Any,
) -> tuple[Tensor | None, VocabRange]:
    """The boundary work of a `draft_targets` call on local tensors, once: `(target_ids or None,
    vocab)` as `lossfx._layouts.draft.draft_targets` takes them (shapes checked against the
    layout, `d2t` checked and its target ids range-checked once). Shared with the `DRAFT`
    branches of `lossfx.prepare_loss_input` and of the fused front door (`logits_name`: its
    stand-in for the logits of its hidden states; `vocab`: its head's `vocab_start`,
    `vocab_size`, `widths`, as `lossfx.next_token.resolved_vocab` takes them)."""
    check_floating(logits_name, logits)
    check_tensor("token_mask", token_mask)
    if logits.dim() != 3 or token_mask.dim() != 2 or logits.shape[0] != token_mask.shape[0]:
        raise ValueError(
            f"{logits_name} must be [B, S_local, V_local] and token_mask [B, S]; got {tuple(logits.shape)} "
            f"and {tuple(token_mask.shape)}"
        )
    seq, local_len = token_mask.shape[1], logits.shape[1]
    got = f"{logits_name}.shape={tuple(logits.shape)} and token_mask.shape={tuple(token_mask.shape)}"
    check_covers(layout, logits_name, local_len, seq, got, canonical="token_mask")
    if d2t is None:
        return None, resolved_vocab(group, logits.shape[-1], **vocab)
    return _validated_target_ids(d2t, group, rank, logits.shape[-1], **vocab)

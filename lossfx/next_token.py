"""Next-token log-probs in every sequence layout: plain, context-parallel, an external sharder.

    out[b, t] = log p(input_ids[b, t+1] | logits[b, t])          t < S − 1

`sharded_next_token_logprobs` (beneath the entry point `lossfx.next_token_logprobs`) runs the
token log-prob kernel (`logprobs.token_logprobs`, or
`filtering.filtered_token_logprobs` under a top-k/top-p filter) on this rank's `[B, S_l, Vl]`
logits, run inside the one next-token pipeline of `lossfx.sequence_layout.score_next_tokens`:
the shift on the canonical ids (never a slice of the logits; the dropped last column scores id 0,
so `input_ids[:, 0]` is never read), the targets in the logits' layout, the kernel, the gather
back to canonical order (gradient summed over CP ranks: divide the loss by `C`), `[:, :S−1]`.

Padding-free rows (`position_ids=`, several sequences in one row, positions restarting at 0): the
shift must not cross a sequence boundary, so `mask_sequence_ends` blanks the target of each
sequence's last position (where `position_ids[:, t+1] == 0`) and `zero_sequence_ends` sets its
result to 0 (zero gradient), as the packed path treats a sequence's last slot.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import replicated, vocab_shard
from lossfx._boundary.validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
    mark_checked,
)
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx.filtering import filtered_token_logprobs
from lossfx.interfaces import TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.logprobs import token_logprobs
from lossfx.sequence_layout import (
    ContextParallelSharder,
    LoadBalancedLayout,
    mask_sequence_ends,
    score_next_tokens,
    sequence_layout,
    zero_sequence_ends,
)

__all__ = [
    "ContextParallelSharder",
    "LoadBalancedSharder",
    "check_position_ids",
    "mask_sequence_ends",
    "next_token_filtered_logprobs",
    "sharded_next_token_logprobs",
    "target_logprobs",
    "zero_sequence_ends",
]


def check_position_ids(position_ids: object, input_ids: Tensor) -> Tensor | None:
    """`None`, or `position_ids` checked: an integer tensor of `input_ids`' shape `[B, S]`."""
    if position_ids is None:
        return None
    position_ids = check_integer_ids("position_ids", replicated(position_ids, "position_ids"))
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids must have input_ids' shape [B, S]; got position_ids.shape={tuple(position_ids.shape)} "
            f"and input_ids.shape={tuple(input_ids.shape)}"
        )
    return position_ids


LoadBalancedSharder = LoadBalancedLayout  # the load-balanced layout is itself a `ContextParallelSharder`


@boundary(roles=Roles(tp="group", shards=("logits",), start="vocab_start", size="vocab_size"), vocab="tiled")
def target_logprobs(
    logits: Tensor,
    target: Tensor,
    *,
    sampling_params: TrainingSamplingParams | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """`token_logprobs`, or `filtered_token_logprobs` when `sampling_params` asks for a filter.

    Args:
        logits: `[..., Vl]`; target: `[...]` global ids; group: TP group; chunk_size: rows per
        eager chunk; vocab_start, vocab_size: this shard's first id and `V` (defaults: uniform
        shards). Returns `[...]` in the compute dtype (`−inf` where a filter drops the target).
    """
    if need_top_k_or_top_p_filtering(sampling_params):
        return filtered_token_logprobs(
            logits,
            target,
            top_k=sampling_params.top_k,
            top_p=sampling_params.top_p,
            ties=sampling_params.ties,
            group=group,
            chunk_rows=chunk_size,
            vocab_start=vocab_start,
            vocab_size=vocab_size,
        )
    return token_logprobs(
        logits, target, group=group, chunk_rows=chunk_size, vocab_start=vocab_start, vocab_size=vocab_size
    )


@boundary(
    roles=Roles(
        tp="vocab_parallel_group",
        cp="context_parallel_group",
        cp_from="cp_sharder",
        shards=("logits",),
        start="vocab_start",
        size="vocab_size",
    ),
    vocab="tiled",
)
def sharded_next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    vocab_parallel_group: ProcessGroup | None = None,
    context_parallel_group: ProcessGroup | None = None,
    cp_sharder: ContextParallelSharder | None = None,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """Next-token log-probs `[B, S−1]` from logits in any sequence layout.

    The layout pipeline behind `lossfx.next_token_logprobs`, which resolves `vocab_parallel_rank`,
    uneven shard widths (as `vocab_start` / `vocab_size` here) and `ignore_index` before calling it.
    Equivalent to ``lossfx.reference.next_token_logprobs(full_logits, input_ids)`` (or its filtered
    twin) on the canonical, full-vocabulary logits.

    Args:
        logits: `[B, S_l, Vl]`: this rank's vocabulary shard (TP) and sequence part (CP:
            load-balanced, `S_l = S_pad / C`, or the sharder's layout); `S_l = S` without CP.
        input_ids: `[B, S]` canonical ids; the scored ones, `input_ids[:, 1:]`, in `[0, V)`
            (`input_ids[:, 0]` is never read).
        vocab_parallel_group: TP group over the vocabulary, or `None`.
        context_parallel_group: CP group for the load-balanced layout, or `None`.
        cp_sharder: an object with `shard_token_tensor`/`gather_token_tensor`
            (`ContextParallelSharder`) or a `lossfx.sequence_layout.SequenceLayout`; takes
            precedence over `context_parallel_group`.
        sampling_params: top-k/top-p filter (`−inf` where the next token is filtered out).
        chunk_size: sequence positions per eager chunk (memory bound only).
        vocab_start, vocab_size: this shard's first id and `V`, for uneven shards (defaults
            `rank · Vl` and `TP · Vl`).
        position_ids: `[B, S]` canonical positions of padding-free rows (several sequences per
            row, each restarting at 0), or `None`. Position `t` with `position_ids[:, t+1] == 0`
            is a sequence's last and gets 0 with a zero gradient (it would score the next
            sequence's first token); the dense equivalent is
            ``torch.where(position_ids[:, 1:] == 0, 0, next_token_logprobs(logits, input_ids))``.

    Returns:
        `[B, S−1]` in the compute dtype, replicated on every TP and CP rank.

    Raises:
        ValueError: shape mismatches (`position_ids` must be `input_ids`' shape); with CP, `C·S_l < S`
            or an odd local length (the
            load-balanced layout needs a multiple of `2C`); an id of `input_ids[:, 1:]` outside
            `[0, V)` (eager only; the message gives its `(b, t)` in `input_ids` and its value).
    """
    check_floating("logits", logits)
    check_integer_ids("input_ids", input_ids)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    layout = sequence_layout(context_parallel_group, cp_sharder)
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"logits must be [B, S_local, V_local] and input_ids [B, S] with the same B; got "
            f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        )
    position_ids = check_position_ids(position_ids, input_ids)
    batch, seq = input_ids.shape
    local_len = logits.shape[1]
    layout.check_covers(
        "logits", local_len, seq, f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
    )
    # only the scored ids input_ids[:, 1:] must be in range; positions are reported as input_ids'
    vocab = vocab_size if vocab_size is not None else group_size(vocab_parallel_group) * logits.shape[-1]
    check_ids_in_range("input_ids", input_ids[:, 1:], vocab, column_offset=1)
    rows = None if chunk_size is None else chunk_size * batch

    def kernel(target: Tensor) -> list[Tensor]:  # [B, S_l] -> [B, S_l]
        mark_checked(target, vocab)  # input_ids[:, 1:] (checked above) and zeros
        return [
            target_logprobs(
                logits,
                target,
                sampling_params=sampling_params,
                group=vocab_parallel_group,
                chunk_size=rows,
                vocab_start=vocab_start,
                vocab_size=vocab_size,
            )
        ]

    (out,) = score_next_tokens(layout, input_ids.to(logits.device), local_len, kernel, position_ids=position_ids)
    return out


@boundary(roles=Roles(tp="group", shards=("logits",)), vocab="equal")
def next_token_filtered_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    top_k: int | None = None,
    top_p: float = 1.0,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    ties: Literal["together", "sorted"] = "together",
) -> Tensor:
    """Filtered next-token log-probs `[B, S-1]`: position `t` scores `input_ids[:, t+1]`.

    Equivalent to ``lossfx.reference.next_token_filtered_logprobs(logits, input_ids, top_k,
    top_p, ties)`` (the dense filter of `logits[:, :-1]`), without slicing or copying the logits.

    Args:
        logits: `[B, S, Vl]` this rank's vocabulary shard.
        input_ids: `[B, S]` integer ids in `[0, V)`.
        top_k, top_p, group: as in `filtered_token_logprobs`.
        ties: top-p's rule among equal logits, `"together"` or `"sorted"` (`TrainingSamplingParams.ties`).
        chunk_size: sequence positions per eager chunk.

    Returns:
        `[B, S-1]` in the compute dtype; `-inf` where the next token was filtered out.
    """
    logits, group, *_ = vocab_shard(logits, group=group, even=True)  # lossfx/_boundary/dtensor.py
    input_ids = replicated(input_ids, "input_ids")
    return sharded_next_token_logprobs(
        logits,
        input_ids,
        vocab_parallel_group=group,
        sampling_params=TrainingSamplingParams(top_k=top_k, top_p=top_p, ties=ties),
        chunk_size=chunk_size,
    )

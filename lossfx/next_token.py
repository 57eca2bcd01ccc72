"""Next-token log-probs in every sequence layout: plain, context-parallel, an external sharder.

    out[b, t] = log p(input_ids[b, t+1] | logits[b, t])          t < S − 1

The boundary: each public function here unwraps DTensor arguments, validates its arguments once
(`validated_next_token_call`: types, shapes, the layout's coverage, `position_ids`, ONE range
check of the scored ids `input_ids[:, 1:]`), builds the sequence layout and this rank's
`VocabRange` once, then calls the pure pipeline `lossfx._layouts.next_token` once. That pipeline
is `lossfx.sequence_layout.score_next_tokens` around the token log-prob kernel
(`lossfx._kernels.logprobs`, or `lossfx._kernels.filtering` under a top-k/top-p filter): the shift
on the canonical ids (never a slice of the logits; the dropped last column scores id 0, so
`input_ids[:, 0]` is never read), the targets in the logits' layout, the kernel, the gather back
to canonical order (gradient summed over CP ranks: divide the loss by `C`), `[:, :S−1]`.

Padding-free rows (`position_ids=`, several sequences in one row, positions restarting at 0): the
shift must not cross a sequence boundary, so `mask_sequence_ends` blanks the target of each
sequence's last position (where `position_ids[:, t+1] == 0`) and `zero_sequence_ends` sets its
result to 0 (zero gradient), as the packed path treats a sequence's last slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from torch import Tensor

from lossfx._boundary.consistency import Roles, ShardWidths, boundary
from lossfx._boundary.dtensor import local_view
from lossfx._boundary.validation import (
    check_floating,
    check_group_rank,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
)
from lossfx._core.distributed import ProcessGroup
from lossfx._core.vocab import VocabRange
from lossfx._layouts import next_token as _pure
from lossfx._layouts.next_token import TopKTopP
from lossfx.filtering import check_filter_params
from lossfx.interfaces import TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.logprobs import _validated as validated_token_call
from lossfx.sequence_layout import (
    ContextParallelSharder,
    LoadBalancedLayout,
    SequenceLayout,
    check_covers,
    mask_sequence_ends,
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
    position_ids = check_integer_ids("position_ids", position_ids)
    if tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids must have input_ids' shape [B, S]; got position_ids.shape={tuple(position_ids.shape)} "
            f"and input_ids.shape={tuple(input_ids.shape)}"
        )
    return position_ids


def resolve_filter(sampling_params: TrainingSamplingParams | None) -> TopKTopP | None:
    """The filter `sampling_params` asks for (its type checked; its fields were, by the frozen
    `TrainingSamplingParams`: `check_filter_params` here only resolves them), or `None`."""
    if sampling_params is not None and not isinstance(sampling_params, TrainingSamplingParams):
        raise TypeError(f"sampling_params must be TrainingSamplingParams or None, got {sampling_params!r}")
    if not need_top_k_or_top_p_filtering(sampling_params):
        return None
    top_k, top_p = check_filter_params(sampling_params.top_k, sampling_params.top_p)
    return TopKTopP(top_k, top_p, sampling_params.ties)


class NextTokenCall(NamedTuple):
    """A validated next-token call, as the pure pipeline `lossfx._layouts.next_token` takes it (the
    fields are `next_token_logprobs`' arguments, by name)."""

    logits: Tensor  # [B, S_l, Vl]
    input_ids: Tensor  # [B, S]
    layout: SequenceLayout
    vocab: VocabRange
    chunk_size: int | None
    position_ids: Tensor | None  # [B, S]
    ignore_index: int | None = None  # an id of input_ids that scores 0 (not range-checked)


def validated_next_token_call(
    logits: Tensor,
    input_ids: Tensor,
    *,
    group: ProcessGroup | None,
    layout: SequenceLayout,
    chunk_size: int | None,
    position_ids: object = None,
    ids_name: str = "input_ids",
    ignore_index: int | None = None,
    logits_name: str = "logits",
    **vocab: Any,
) -> NextTokenCall:
    """The boundary work of a next-token call on local tensors, once.

    Checks the types and shapes (`logits [B, S_l, Vl]`, `input_ids [B, S]`, `position_ids`), that
    `layout` covers `S` with `S_l` positions, and range-checks the scored ids `input_ids[:, 1:]`
    once (those equal to `ignore_index` excepted). This rank's `VocabRange` from `vocab`
    (`resolved_vocab`'s `vocab_start` / `vocab_size` when given, the widths the ranks reported to
    the cross-rank check when given `widths`, eager, read with the range check; else uniform shards).
    `logits_name`: the logits in the messages (the fused front doors' zero-stride stand-in for
    the logits of their hidden states, whose shape is all these checks read).
    """
    check_floating(logits_name, logits)
    check_integer_ids(ids_name, input_ids)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    shapes = f"{logits_name}.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{logits_name} must be [B, S_local, V_local] and input_ids [B, S], one B; got {shapes}")
    position_ids = check_position_ids(position_ids, input_ids)
    local_len, width = logits.shape[1], logits.shape[-1]
    check_covers(layout, logits_name, local_len, input_ids.shape[1], shapes)
    # only the scored ids input_ids[:, 1:] must be in range; positions are reported as input_ids'
    scored = input_ids[:, 1:]
    if ignore_index is not None:
        scored = scored.masked_fill(scored == ignore_index, 0)
    check = lambda size: check_ids_in_range(ids_name, scored, size, column_offset=1)  # noqa: E731
    resolved = resolved_vocab(group, width, check, **vocab)
    return NextTokenCall(logits, input_ids, layout, resolved, chunk_size, position_ids, ignore_index)


def resolved_vocab(
    group: ProcessGroup | None,
    width: int,
    check: Callable[[int | Callable[[], int]], None] | None = None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    widths: ShardWidths | None = None,
) -> VocabRange:
    """This rank's `VocabRange` of `width` columns, after the call's range check `check(V)` of its
    ids (if any): `vocab_start` / `vocab_size` when given; else the widths the ranks reported to the
    cross-rank check (`widths`, the call's `ShardWidths`: `V` is read with the range check's own
    host read, uneven shards in eager mode); else uniform shards (`rank · width`, `R · width`)."""
    check = check or (lambda size: None)
    if widths is not None and vocab_start is None and vocab_size is None:
        check(widths.size_when_read(width, group))
        return VocabRange.of(group, width, *widths.range(width, group))
    vocab = VocabRange.of(group, width, vocab_start, vocab_size)
    check(vocab.size)
    return vocab


def tp_rank(vocab_parallel_rank: int | None, group: ProcessGroup | None) -> int:
    """This rank's index in the tensor-parallel `group`, validated against it; without a group the
    given rank (default 0: the vocabulary window of an OPD_FULL logits payload)."""
    if group is None:
        return 0 if vocab_parallel_rank is None else vocab_parallel_rank
    return check_group_rank("vocab_parallel_rank", vocab_parallel_rank, "vocab_parallel_group", group)


def next_token_logprobs_of(call: NextTokenCall, top: TopKTopP | None = None) -> Tensor:
    """The pure pipeline on a validated call, under the filter `top` (or none): `[B, S−1]`."""
    return _pure.next_token_logprobs(**call._asdict(), top=top)  # the call's fields are its arguments


LoadBalancedSharder = LoadBalancedLayout  # the load-balanced layout is itself a `ContextParallelSharder`


_ROLES_TARGET = Roles(tp="group", shards=("logits",), start="vocab_start", size="vocab_size")


@boundary(roles=_ROLES_TARGET, vocab="tiled", local=local_view(_ROLES_TARGET))
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
    top = resolve_filter(sampling_params)
    # as `lossfx.token_logprobs` takes it (its `chunk_rows` is this `chunk_size`)
    vocab, chunk_rows = validated_token_call(logits, target, group, vocab_start, vocab_size, chunk_size, None)
    return _pure.target_logprobs(logits, target, vocab, top=top, chunk_rows=chunk_rows)


# the roles of the layout pipelines taking explicit shard offsets (this one and `lossfx.packing`'s)
ROLES_TILED = Roles(
    tp="vocab_parallel_group", cp="context_parallel_group", shards=("logits",), start="vocab_start", size="vocab_size"
)


@boundary(roles=dataclasses.replace(ROLES_TILED, cp_from="cp_sharder"), vocab="tiled")
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
            `[0, V)` (the message gives its `(b, t)` in `input_ids` and its value; compiled: an
            in-graph `RuntimeError`).
    """
    call = validated_next_token_call(
        logits,
        input_ids,
        group=vocab_parallel_group,
        layout=sequence_layout(context_parallel_group, cp_sharder),
        chunk_size=chunk_size,
        position_ids=position_ids,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
    )
    return next_token_logprobs_of(call, resolve_filter(sampling_params))


_ROLES_FILTERED = Roles(tp="group", shards=("logits",))


@boundary(roles=_ROLES_FILTERED, vocab="equal", local=local_view(_ROLES_FILTERED, even=True))
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
    top = resolve_filter(TrainingSamplingParams(top_k=top_k, top_p=top_p, ties=ties))
    call = validated_next_token_call(logits, input_ids, group=group, layout=sequence_layout(), chunk_size=chunk_size)
    return next_token_logprobs_of(call, top)

"""Next-token log-probs in every sequence layout: plain, context-parallel, or an external sharder.

    out[b, t] = log p(input_ids[b, t+1] | logits[b, t])          t < S − 1

Pipeline (`next_token_logprobs`):

1. the shift happens on the **canonical** sequence, on the targets (never a slice of the logits,
   which would copy them): `target[:, t] = input_ids[:, t+1]`, and the last column, whose result
   is dropped, is id 0 (so `input_ids[:, 0]`, never scored, is never read);
2. with context parallelism the targets are zero-padded to `C·S_l` and laid out like the logits:
   this rank's load-balanced part (`context_parallel.shard_padded_for_cp`), or the sharder's
   `shard_token_tensor`;
3. the token log-prob kernel (`logprobs.token_logprobs`, or `filtering.filtered_token_logprobs`
   under a top-k/top-p filter) on this rank's `[B, S_l, Vl]` logits, tensor parallel and chunked;
4. back to canonical order (`allgather_cp`, or the sharder's `gather_token_tensor`), replicated on
   every CP rank; the gradient is summed over CP ranks (divide the loss by `C`); then `[:, :S−1]`.

Padding-free rows (`position_ids=`, several sequences in one row, positions restarting at 0): the
shift must not cross a sequence boundary, so `mask_sequence_ends` blanks the target of each
sequence's last position (where `position_ids[:, t+1] == 0`) in step 1 and `zero_sequence_ends`
sets its result to 0 (zero gradient) after step 4, as the packed path treats a sequence's last slot.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from lossfx._consistency import boundary
from lossfx._distributed import ProcessGroup, group_rank, group_size
from lossfx._dtensor import replicated, vocab_shard
from lossfx._validation import (
    check_floating,
    check_ids_in_range,
    check_integer_ids,
    check_positive_int,
    mark_checked,
)
from lossfx.context_parallel import allgather_cp, check_covers_sequence, shard_for_cp_rank, shard_padded_for_cp
from lossfx.filtering import filtered_token_logprobs
from lossfx.interfaces import TrainingSamplingParams, need_top_k_or_top_p_filtering
from lossfx.logprobs import token_logprobs

__all__ = [
    "ContextParallelSharder",
    "LoadBalancedSharder",
    "check_position_ids",
    "mask_sequence_ends",
    "next_token_filtered_logprobs",
    "next_token_logprobs",
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


def mask_sequence_ends(target: Tensor, position_ids: Tensor | None, fill: int = 0) -> tuple[Tensor, Tensor | None]:
    """Padding-free rows: the next-token shift must not cross into the next sequence.

    Args:
        target: `[B, S]` shifted targets, `target[:, t]` scores `input_ids[:, t+1]` (canonical order).
        position_ids: `[B, S]` positions restarting at 0 where a sequence starts (transformers'
            and TRL's padding-free collators), or `None` (then nothing changes).
        fill: the id written at each sequence's last position (a placeholder whose result is
            discarded by `zero_sequence_ends`).

    Returns:
        `(target, ends)`: `target` with `fill` where `ends`; `ends [B, S]` bool, `True` at each
        sequence's last position (`position_ids[:, t+1] == 0`, and the row's last column), or
        `None` without `position_ids`. Tensor ops only (no host sync).
    """
    if position_ids is None:
        return target, None
    starts = position_ids[:, 1:].to(target.device) == 0  # [B, S-1]: t+1 opens a new sequence
    ends = torch.cat([starts, torch.ones_like(starts[:, :1])], dim=1)  # [B, S]
    return torch.where(ends, torch.full_like(target, fill), target), ends


def zero_sequence_ends(x: Tensor, ends: Tensor | None) -> Tensor:
    """`x [B, S']` (`S' <= S`) with 0 (and a zero gradient) where `ends[:, :S']`; `x` when `ends` is `None`."""
    if ends is None:
        return x
    return torch.where(ends[:, : x.shape[1]], torch.zeros_like(x), x)


@runtime_checkable
class ContextParallelSharder(Protocol):
    """What `prepare_loss_input(cp_sharder=...)` needs of a context-parallel sequence layout.

    `logits` are then this rank's CP-local shard while `data` stays canonical. The layout itself
    is the sharder's business (for example automodel's `ContextParallelSharder`).
    """

    def shard_token_tensor(self, x: Tensor, seq_dim: int, fill: int) -> Tensor:
        """Canonical `x` -> this rank's local part along `seq_dim` (padding with `fill`)."""
        ...

    def gather_token_tensor(self, x: Tensor, seq_dim: int, trim: bool) -> Tensor:
        """This rank's local part -> canonical order on every rank, differentiable; `trim`
        removes the padding `shard_token_tensor` added."""
        ...


class LoadBalancedSharder:
    """A `ContextParallelSharder` for lossfx's own load-balanced layout (chunks `r`, `2C−1−r`).

    Pads the sequence to a multiple of `2C` on `shard_token_tensor` and trims it on
    `gather_token_tensor`; the gather follows the summed-gradient convention of `allgather_cp`.
    """

    def __init__(self, cp_group: ProcessGroup | None):
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self._length: int | None = None

    def shard_token_tensor(self, x: Tensor, seq_dim: int = 1, fill: int = 0) -> Tensor:
        seq_dim = seq_dim % x.dim()
        length = x.shape[seq_dim]
        self._length = length
        pad = (-length) % (2 * self.cp_size) if self.cp_size > 1 else 0
        if pad:
            widths = [0, 0] * (x.dim() - 1 - seq_dim) + [0, pad]
            x = torch.nn.functional.pad(x, widths, value=fill)
        return shard_for_cp_rank(x, self.cp_rank, self.cp_size, seq_dim=seq_dim)

    def gather_token_tensor(self, x: Tensor, seq_dim: int = 1, trim: bool = True) -> Tensor:
        full = allgather_cp(x, self.cp_group, seq_dim=seq_dim)
        if trim and self._length is not None:
            full = full.narrow(seq_dim % x.dim(), 0, self._length)
        return full


@boundary(vocab="tiled")
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


@boundary(vocab="tiled")
def next_token_logprobs(
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
            (`ContextParallelSharder`); takes precedence over `context_parallel_group`.
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
    cp_size = 1 if cp_sharder is not None else group_size(context_parallel_group)
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"logits must be [B, S_local, V_local] and input_ids [B, S] with the same B; got "
            f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
        )
    position_ids = check_position_ids(position_ids, input_ids)
    batch, seq = input_ids.shape
    local_len = logits.shape[1]
    shapes = f"logits.shape={tuple(logits.shape)} and input_ids.shape={tuple(input_ids.shape)}"
    check_covers_sequence("logits", local_len, seq, cp_size, cp_sharder is not None, shapes)
    # only the scored ids input_ids[:, 1:] must be in range; positions are reported as input_ids'
    vocab = vocab_size if vocab_size is not None else group_size(vocab_parallel_group) * logits.shape[-1]
    check_ids_in_range("input_ids", input_ids[:, 1:], vocab, column_offset=1)
    # 1. the shift, on the canonical sequence; the last column (dropped) scores id 0
    target = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1).to(logits.device)  # [B, S]
    target, ends = mask_sequence_ends(target, position_ids)  # padding-free rows: no shift across sequences
    # 2. the targets in the logits' layout
    if cp_sharder is not None:
        target = cp_sharder.shard_token_tensor(target, seq_dim=1, fill=0)
    elif cp_size > 1:
        target = shard_padded_for_cp(target, local_len, context_parallel_group)  # [B, S_l]
    # 3. the kernel on this rank's logits
    rows = None if chunk_size is None else chunk_size * batch
    mark_checked(target, vocab)  # input_ids[:, 1:] (checked above) and zeros
    local = target_logprobs(
        logits,
        target,
        sampling_params=sampling_params,
        group=vocab_parallel_group,
        chunk_size=rows,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
    )  # [B, S_l]
    # 4. canonical order
    if cp_sharder is not None:
        local = cp_sharder.gather_token_tensor(local, seq_dim=1, trim=True)
    elif cp_size > 1:
        local = allgather_cp(local, context_parallel_group, seq_dim=1)  # [B, C·S_l]
    return zero_sequence_ends(local[:, : max(seq - 1, 0)], ends)


@boundary(vocab="equal")
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
    logits, group, *_ = vocab_shard(logits, group=group, even=True)  # lossfx/_dtensor.py
    input_ids = replicated(input_ids, "input_ids")
    return next_token_logprobs(
        logits,
        input_ids,
        vocab_parallel_group=group,
        sampling_params=TrainingSamplingParams(top_k=top_k, top_p=top_p, ties=ties),
        chunk_size=chunk_size,
    )

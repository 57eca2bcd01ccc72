"""The sequence layout: which canonical positions this rank's logits hold, as one object.

`input_ids`, teacher columns and every output are **canonical** `[B, S, ...]` (the same on every
rank); the logits (or hidden states) are this rank's **local** `[B, S_l, ...]`. A layout maps
between the two along dim 1, so that every consumer is written once for all layouts:

- `to_local(x, local_len, fill)`: canonical -> this rank's `[B, local_len, ...]`, padding the
  canonical tensor with `fill` first where the layout pads (no communication);
- `to_canonical(x, length)`: this rank's part -> canonical `[B, length, ...]` on every rank
  (`None`: all the layout's canonical positions), differentiable (gradient rule: the layout's
  gather, see each class);
- `shift_left(x, length)`: this rank's part of the canonical left shift (last row zero);
- `local_len(seq)`: the fewest local positions per rank that hold a length-`seq` canonical
  sequence (the boundary's `check_covers(layout, ...)` here raises unless the logits' can);
- `next_token_targets` / `next_token_outputs`: the two halves of the one next-token pipeline
  (shift the canonical ids -> targets in the local layout; kernel; gather -> drop the last
  column), which `score_next_tokens` runs around a kernel.

One class per layout: `PlainLayout` (no context parallelism), `LoadBalancedLayout` (lossfx's CP
layout, chunks `r` and `2C−1−r` of `2C`), `ShardedLayout` (an external sharder:
`shard_token_tensor` / `gather_token_tensor`, e.g. automodel's), and `lossfx.packing.PackedLayout`
(packed rows from `cu_seqlens`, each sequence load-balanced on its own). Entry points build one
with `sequence_layout(context_parallel_group, cp_sharder)` from their public arguments and hand it
down; a layout is itself a `ContextParallelSharder`, so it travels through every consumer's
`cp_sharder=` keyword and `sequence_layout` returns it unchanged (built once per call).

The layouts are the small value objects that the boundary hands to pure code: the classes live
in `lossfx._layouts.sequence_layout` (pure: plain tensors in, no validation) and are re-exported
here. This module is the boundary's part: `sequence_layout(...)` checks a user's `cp_sharder`
and builds the layout once per call, `check_covers(layout, ...)` checks that the logits' local
length fits the layout, and `ShardedLayout` is the pure one plus the checks of what
the user's sharder returns (its local and canonical lengths).
"""

from __future__ import annotations

from torch import Tensor

from lossfx._boundary.validation import check_group
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._layouts import sequence_layout as _pure
from lossfx._layouts.sequence_layout import (
    ContextParallelSharder,
    LoadBalancedLayout,
    PlainLayout,
    SequenceLayout,
    mask_sequence_ends,
    score_next_tokens,
    zero_sequence_ends,
)

__all__ = [
    "ContextParallelSharder",
    "LoadBalancedLayout",
    "PlainLayout",
    "SequenceLayout",
    "ShardedLayout",
    "check_covers",
    "mask_sequence_ends",
    "score_next_tokens",
    "sequence_layout",
    "zero_sequence_ends",
]


class ShardedLayout(_pure.ShardedLayout):
    """An external sharder's layout (`ContextParallelSharder`: automodel's, or any object with
    `shard_token_tensor` / `gather_token_tensor`), as `lossfx._layouts.sequence_layout.ShardedLayout`,
    with the boundary's checks of the sharder's results: the local length it produces must be
    the logits', and its gather must cover the positions the call needs (`ValueError` naming
    `cp_sharder`; shapes only, no host read)."""

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        local = super().to_local(x, local_len, fill)
        if local.shape[1] != local_len:
            raise ValueError(
                f"cp_sharder={type(self.sharder).__name__}.shard_token_tensor turned a canonical tensor of shape "
                f"{tuple(x.shape)} into {tuple(local.shape)} local positions, but the local logits hold "
                f"{local_len}: the sharder's layout must be the one the logits are in"
            )
        return local

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        full = self.sharder.gather_token_tensor(x, seq_dim=1, trim=True)
        if length is not None and full.shape[1] < length:
            raise ValueError(
                f"cp_sharder={type(self.sharder).__name__}.gather_token_tensor returned {full.shape[1]} canonical "
                f"positions (shape {tuple(full.shape)}); the call needs {length}"
            )
        return full[:, :length]


def check_covers(
    layout: SequenceLayout, what: str, local_len: int, seq: int, got: str, canonical: str = "input_ids"
) -> None:
    """The boundary's question to a layout: `ValueError` unless `local_len` local positions per
    rank can hold the `seq` positions of the canonical tensor named `canonical` (`got` describes
    the offending shapes). No context parallelism: equal lengths; the load-balanced layout over
    `C > 1` ranks: `C·S_l >= S` with an even `S_l`; an external sharder: only it knows
    (`ShardedLayout` checks the lengths it produces); a layout with its own rule (packed rows):
    its `check_covers` method (the public `lossfx.packing.PackedLayout`)."""
    if isinstance(layout, _pure.ShardedLayout):
        return
    if isinstance(layout, LoadBalancedLayout) and layout.cp_size > 1:
        if local_len * layout.cp_size < seq or local_len % 2:
            raise ValueError(
                f"context-parallel {what} hold {local_len} positions on each of {layout.cp_size} ranks; they must "
                f"cover {canonical}' {seq} positions with an even local length (a multiple of 2·{layout.cp_size} "
                f"in all; pad the sequence to it); got {got}"
            )
        return
    if type(layout) in (PlainLayout, LoadBalancedLayout):
        if local_len != seq:
            raise ValueError(f"{what} must cover {canonical}' {seq} positions without context parallelism; got {got}")
        return
    own_rule = getattr(layout, "check_covers", None)  # a layout with its own rule (packed rows)
    if own_rule is None:
        raise TypeError(f"{type(layout).__name__} is not a layout the boundary can check")
    own_rule(what, local_len, seq, got, canonical)


def sequence_layout(context_parallel_group: ProcessGroup | None = None, cp_sharder: object = None) -> SequenceLayout:
    """The sequence layout of a call's public arguments (built once, at the entry point).

    A `SequenceLayout` given as `cp_sharder` is returned as is (it was built by an outer call);
    another `cp_sharder` becomes a `ShardedLayout` (it takes precedence over the group); else
    `LoadBalancedLayout(context_parallel_group)` for a group of more than one rank, else
    `PlainLayout()`.

    Raises:
        TypeError: a `context_parallel_group` that is not a `ProcessGroup` or `None` (checked here
            for every entry point), a `cp_sharder` without `shard_token_tensor` / `gather_token_tensor`.
    """
    check_group("context_parallel_group", context_parallel_group)
    if isinstance(cp_sharder, SequenceLayout):
        return cp_sharder
    if cp_sharder is not None:
        methods = ("shard_token_tensor", "gather_token_tensor")
        missing = [m for m in methods if not callable(getattr(cp_sharder, m, None))]
        if missing:
            raise TypeError(
                f"cp_sharder must have the methods shard_token_tensor and gather_token_tensor (a "
                f"ContextParallelSharder); {type(cp_sharder).__name__} {cp_sharder!r} lacks {missing}"
            )
        return ShardedLayout(cp_sharder)  # type: ignore[arg-type]
    if group_size(context_parallel_group) > 1:
        return LoadBalancedLayout(context_parallel_group)
    return PlainLayout()

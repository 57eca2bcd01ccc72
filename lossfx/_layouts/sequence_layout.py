"""Pure: the sequence layouts, small value objects that say which canonical positions this
rank's logits hold (`lossfx.sequence_layout` documents the interface).

`PlainLayout`, `LoadBalancedLayout`, `ShardedLayout` (and `lossfx.packing.PackedLayout`) take
plain tensors whose shapes the public boundary has checked (whether the logits cover the
sequence is the boundary's question, `lossfx.sequence_layout.check_covers`). A layout is built once per call by the
boundary (`lossfx.sequence_layout.sequence_layout`, which also checks a user's `cp_sharder`)
and handed down to every consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lossfx._core.distributed import ProcessGroup, all_gather_stack, group_rank, group_size
from lossfx._layouts.context_parallel import allgather, shard

__all__ = [
    "ContextParallelSharder",
    "LoadBalancedLayout",
    "PlainLayout",
    "SequenceLayout",
    "ShardedLayout",
    "mask_sequence_ends",
    "score_next_tokens",
    "zero_sequence_ends",
]


@runtime_checkable
class ContextParallelSharder(Protocol):
    """What `cp_sharder=` needs of a context-parallel sequence layout.

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


def _pad_seq(x: Tensor, length: int, fill: float) -> Tensor:
    """`x [B, S', ...]` padded with `fill` along dim 1 to `length >= S'`."""
    pad = length - x.shape[1]
    if pad <= 0:
        return x
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, pad], value=fill)


class SequenceLayout:
    """Base class: one sequence layout (see the module docstring for the interface).

    The next-token pipeline (`next_token_targets`, `next_token_outputs`) is written here once on
    top of `to_local` / `to_canonical`; a layout whose targets are not a shift of the canonical
    row (packed sequences) overrides those two.
    """

    cp_group: ProcessGroup | None = None  # read by the cross-rank check (as `cp_sharder.cp_group`)
    cp_size: int = 1
    describe = "no context parallelism"

    def window(self, local_len: int) -> int | None:
        """The canonical positions `local_len` local ones cover (`C·S_l`), `None` if unknown."""
        return local_len * self.cp_size

    def local_len(self, seq: int) -> int | None:
        """The fewest local positions that hold a length-`seq` canonical sequence (`None`: only
        the layout's sharding knows, e.g. an external sharder)."""
        return seq

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        raise NotImplementedError

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        raise NotImplementedError

    def shift_left(self, x: Tensor, length: int | None = None) -> Tensor:
        """This rank's part of the canonical left shift of a length-`length` sequence (the last
        row zero; `None`: all the layout's canonical positions), from this rank's part
        `x [B, S_l, ...]`. Default: gather, shift, lay out again."""
        full = self.to_canonical(x, length)
        shifted = torch.cat([full[:, 1:], torch.zeros_like(full[:, :1])], dim=1)
        return self.to_local(shifted, x.shape[1])

    def next_token_targets(
        self, input_ids: Tensor, local_len: int, *, fill: int = 0, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Step 1-2 of the pipeline: `(targets [B, S_l] in the local layout, ends or None)`.

        `target[:, t] = input_ids[:, t+1]` on the canonical row (the shift never slices the
        logits); the last column, whose result is dropped, and each padding-free sequence's last
        position (`mask_sequence_ends`) hold `fill`; padding added by the layout holds `fill`.
        """
        target = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], fill)], dim=1)  # [B, S]
        target, ends = mask_sequence_ends(target, position_ids, fill)
        return self.to_local(target, local_len, fill), ends

    def next_token_outputs(self, local: Tensor, input_ids: Tensor, ends: Tensor | None) -> Tensor:
        """Step 4: a per-token kernel result `[B, S_l]` -> canonical `[B, S−1]` (0 at `ends`)."""
        return zero_sequence_ends(self.to_canonical(local, max(input_ids.shape[1] - 1, 0)), ends)

    # the `ContextParallelSharder` protocol, so that a layout goes wherever a sharder goes
    def shard_token_tensor(self, x: Tensor, seq_dim: int = 1, fill: int = 0) -> Tensor:
        return x

    def gather_token_tensor(self, x: Tensor, seq_dim: int = 1, trim: bool = True) -> Tensor:
        return x


class PlainLayout(SequenceLayout):
    """No context parallelism: local is canonical (`S_l = S`); `to_canonical` is the identity
    (cut to `length`), so the gradient is the upstream one."""

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        return _pad_seq(x, local_len, fill)

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        return x[:, :length]


class LoadBalancedLayout(SequenceLayout):
    """lossfx's context-parallel layout over `cp_group` (`C` ranks): the canonical sequence,
    zero-padded (`fill`) to `C·S_l`, is cut into `2C` chunks and rank `r` holds chunks `r` and
    `2C−1−r` (`lossfx.context_parallel`).

    `to_canonical` is one all-gather (`lossfx.context_parallel.allgather_cp`) whose backward **sums the upstream
    gradients over the CP ranks**: when every CP rank computes the same loss, divide it by `C`.
    As a `ContextParallelSharder` (`shard_token_tensor` pads to a multiple of `2C`, remembering
    the length that `gather_token_tensor` trims back to) it is `lossfx.next_token.LoadBalancedSharder`.
    """

    def __init__(self, cp_group: ProcessGroup | None):
        self.cp_group = cp_group
        self.cp_size, self.cp_rank = group_size(cp_group), group_rank(cp_group)
        self.describe = f"the load-balanced context-parallel layout over {self.cp_size} ranks"
        self._length: int | None = None

    def local_len(self, seq: int) -> int | None:
        """`S` padded to a multiple of `2C`, over `C` ranks."""
        return seq if self.cp_size == 1 else (seq + (-seq) % (2 * self.cp_size)) // self.cp_size

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        if self.cp_size == 1:
            return _pad_seq(x, local_len, fill)
        return shard(_pad_seq(x, local_len * self.cp_size, fill), self.cp_rank, self.cp_size)

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        return allgather(x, self.cp_group, seq_dim=1)[:, :length]

    def shift_left(self, x: Tensor, length: int | None = None) -> Tensor:
        """Without padding (`length` `None` or `C·S_l`), each chunk takes its new last row from
        the first row of the next chunk in canonical order: one all-gather of every rank's two
        first rows `[C, 2, B, ...]`, instead of the whole tensor. With padding, the base class's.
        `S_l` is even under context parallelism (the boundary checks it)."""
        local_len = x.shape[1]
        if self.cp_size == 1 or length not in (None, local_len * self.cp_size):
            return super().shift_left(x, length)
        n, rank, cp = local_len // 2, self.cp_rank, self.cp_size
        zero_row = torch.zeros_like(x[:, :1])
        firsts = all_gather_stack(torch.stack([x[:, 0], x[:, n]]), self.cp_group)  # [C, 2, B, ...]
        # chunk j < C starts rank j's shard; chunk j >= C is the second half of rank 2C-1-j's shard
        after_first = firsts[rank + 1, 0] if rank + 1 < cp else firsts[cp - 1, 1]
        after_second = zero_row[:, 0] if rank == 0 else firsts[rank - 1, 1]
        return torch.cat([x[:, 1:n], after_first.unsqueeze(1), x[:, n + 1 :], after_second.unsqueeze(1)], dim=1)

    def shard_token_tensor(self, x: Tensor, seq_dim: int = 1, fill: int = 0) -> Tensor:
        seq_dim = seq_dim % x.dim()
        self._length = x.shape[seq_dim]
        pad = (-self._length) % (2 * self.cp_size) if self.cp_size > 1 else 0
        if pad:
            x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - seq_dim) + [0, pad], value=fill)
        return shard(x, self.cp_rank, self.cp_size, seq_dim=seq_dim)

    def gather_token_tensor(self, x: Tensor, seq_dim: int = 1, trim: bool = True) -> Tensor:
        seq_dim = seq_dim % x.dim()
        full = allgather(x, self.cp_group, seq_dim=seq_dim)
        if trim and self._length is not None:
            full = full.narrow(seq_dim, 0, self._length)
        return full


class ShardedLayout(SequenceLayout):
    """An external sharder's layout (`ContextParallelSharder`: automodel's, or any object with
    `shard_token_tensor` / `gather_token_tensor`). The sharder pads and splits; `to_canonical`
    is its `gather_token_tensor` (its gradient rule), cut to `length`. Pure: the public
    `lossfx.sequence_layout.ShardedLayout` adds the boundary's checks of what the sharder returns."""

    def __init__(self, sharder: ContextParallelSharder):
        self.sharder = sharder
        self.cp_group = getattr(sharder, "cp_group", None)
        self.describe = f"the layout of cp_sharder={type(sharder).__name__}"

    def window(self, local_len: int) -> int | None:
        return None

    def local_len(self, seq: int) -> int | None:
        return None

    def to_local(self, x: Tensor, local_len: int, fill: float = 0) -> Tensor:
        return self.sharder.shard_token_tensor(x, seq_dim=1, fill=fill)  # type: ignore[arg-type]

    def to_canonical(self, x: Tensor, length: int | None = None) -> Tensor:
        return self.sharder.gather_token_tensor(x, seq_dim=1, trim=True)[:, :length]


def score_next_tokens(
    layout: SequenceLayout,
    input_ids: Tensor,
    local_len: int,
    kernel: Callable[[Tensor], Sequence[Tensor]],
    *,
    fill: int = 0,
    position_ids: Tensor | None = None,
) -> list[Tensor]:
    """The one next-token pipeline: shift -> lay out -> kernel -> gather -> drop the last column.

    Dense equivalent (no parallelism): ``[out[:, :-1] for out in kernel(roll(input_ids, -1))]``.

    Args:
        layout: the call's sequence layout.
        input_ids: `[B, S]` canonical ids on the logits' device (a packed layout reads its own).
        local_len: `S_l`, this rank's positions.
        kernel: local targets `[B, S_l]` -> per-token results, each `[B, S_l]`.
        fill: the target id of positions whose result is dropped or zeroed.
        position_ids: `[B, S]` padding-free positions, or `None` (see `mask_sequence_ends`).

    Returns:
        each kernel result in canonical order, `[B, S−1]` (or the packed layout's shape).
    """
    target, ends = layout.next_token_targets(input_ids, local_len, fill=fill, position_ids=position_ids)
    return [layout.next_token_outputs(out, input_ids, ends) for out in kernel(target)]

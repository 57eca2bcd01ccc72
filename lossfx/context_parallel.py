"""The load-balanced context-parallel (CP) sequence layout, and the differentiable gather out of it.

With `C` CP ranks a sequence of length `L` (a multiple of `2C`) is cut into `2C` equal chunks;
rank `r` holds chunks `r` and `2C−1−r`, concatenated, so every rank gets an equal share of a
causal-attention workload. Example, `C = 2`, `L = 8`: rank 0 holds positions `[0, 1, 6, 7]` and
rank 1 holds `[2, 3, 4, 5]`.

- `shard_for_cp_rank(x, cp_rank, cp_size)`: canonical -> this rank's local `[.., 2L/(2C), ..]`.
- `unshard(shards)`: every rank's local tensor (rank order) -> canonical (no communication).
- `allgather_cp(x, group)`: the same as `unshard` with the shards gathered over `group` by one
  functional all-gather (it compiles with `fullgraph=True` and runs on gloo). Differentiable, with
  the **summed-gradient convention**: the gradient reaching rank `r`'s local tensor is the sum,
  over all CP ranks, of their upstream gradients at `r`'s positions (one all-reduce in the
  backward). When every CP rank computes the same loss from the gathered tensor, each local
  gradient is therefore `C×` the true one: callers divide the loss by `C`
  (`(loss / cp_size).backward()`), as NeMo RL's loss wrappers do.

Lengths that do not split evenly raise `ValueError` (the reference silently drops tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._consistency import Roles, boundary
from lossfx._distributed import ProcessGroup, all_gather_stack_summed_grad, group_rank, group_size
from lossfx._dtensor import replicated
from lossfx._validation import check_tensor

__all__ = ["allgather_cp", "cp_positions", "shard_for_cp_rank", "shard_padded_for_cp", "unshard"]


def _check_seq_dim(x: Tensor, seq_dim: int) -> int:
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        raise ValueError(f"seq_dim={seq_dim!r} is not a dim of a tensor of shape {tuple(x.shape)}")
    return seq_dim % x.dim()


def _check_cp(cp_rank: int, cp_size: int) -> None:
    for name, value in (("cp_rank", cp_rank), ("cp_size", cp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size; got cp_rank={cp_rank}, cp_size={cp_size}")


def cp_positions(length: int, cp_rank: int, cp_size: int) -> list[int]:
    """The canonical positions, in local order, that CP rank `cp_rank` holds of a length-`length` axis."""
    _check_cp(cp_rank, cp_size)
    if length % (2 * cp_size) and cp_size > 1:
        raise ValueError(f"sequence length {length} is not divisible by 2·cp_size = {2 * cp_size}")
    if cp_size == 1:
        return list(range(length))
    n = length // (2 * cp_size)
    first, second = cp_rank * n, (2 * cp_size - 1 - cp_rank) * n
    return list(range(first, first + n)) + list(range(second, second + n))


@boundary(collectives=False)
def shard_for_cp_rank(x: Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> Tensor:
    """This CP rank's part of the canonical `x`: chunks `cp_rank` and `2C−1−cp_rank` of `2C`.

    Equivalent to ``torch.cat([x.chunk(2C, seq_dim)[r], x.chunk(2C, seq_dim)[2C-1-r]], seq_dim)``.

    Args:
        x: canonical tensor; `x.shape[seq_dim]` must be a multiple of `2·cp_size`.
        cp_rank: this rank's index in the CP group, `0 <= cp_rank < cp_size`.
        cp_size: CP world size `C`; `1` returns `x` itself.
        seq_dim: the sequence dim.

    Returns:
        `x` with `seq_dim` of length `L / C` (a new tensor; differentiable).

    Raises:
        ValueError: length not divisible by `2C`, bad rank/size or `seq_dim`.
    """
    x = replicated(x, "x")  # a canonical tensor may be a Replicate() DTensor (lossfx/_dtensor.py)
    check_tensor("x", x)
    _check_cp(cp_rank, cp_size)
    seq_dim = _check_seq_dim(x, seq_dim)
    if cp_size == 1:
        return x
    length = x.shape[seq_dim]
    if length % (2 * cp_size):
        raise ValueError(
            f"the sequence length {length} (dim {seq_dim} of shape {tuple(x.shape)}) must be divisible by "
            f"2·cp_size = {2 * cp_size} for the load-balanced context-parallel layout; pad it first"
        )
    n = length // (2 * cp_size)
    first = x.narrow(seq_dim, cp_rank * n, n)
    second = x.narrow(seq_dim, (2 * cp_size - 1 - cp_rank) * n, n)
    return torch.cat([first, second], dim=seq_dim)


def _unshard_stacked(stacked: Tensor, seq_dim: int) -> Tensor:
    """`[C, *local]` (rank order) -> canonical, with local seq length `2n` along `seq_dim`."""
    cp_size = stacked.shape[0]
    half = stacked.shape[seq_dim + 1] // 2
    firsts = [stacked[r].narrow(seq_dim, 0, half) for r in range(cp_size)]  # chunks 0 .. C−1
    seconds = [stacked[r].narrow(seq_dim, half, half) for r in reversed(range(cp_size))]  # chunks C .. 2C−1
    return torch.cat(firsts + seconds, dim=seq_dim)


def _check_local(x: Tensor, seq_dim: int) -> int:
    seq_dim = _check_seq_dim(x, seq_dim)
    if x.shape[seq_dim] % 2:
        raise ValueError(
            f"a load-balanced CP shard holds two equal chunks, so its length must be even; got "
            f"{x.shape[seq_dim]} (dim {seq_dim} of shape {tuple(x.shape)})"
        )
    return seq_dim


@boundary(collectives=False)
def unshard(shards: list[Tensor] | tuple[Tensor, ...], seq_dim: int = 1) -> Tensor:
    """Canonical tensor from every CP rank's local tensor (rank order); inverse of `shard_for_cp_rank`.

    Args:
        shards: every CP rank's local tensor, in rank order, all of one shape.
        seq_dim: the sequence dim.

    Raises:
        ValueError: no shards, unequal shapes, or an odd local length (with more than one shard).
    """
    if len(shards) == 0:
        raise ValueError("unshard needs at least one shard")
    if len(shards) == 1:
        return shards[0]
    shapes = {tuple(s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"all CP shards must have one shape; got {sorted(shapes)}")
    seq_dim = _check_local(shards[0], seq_dim)
    return _unshard_stacked(torch.stack(list(shards)), seq_dim)


def check_covers_sequence(what: str, local_len: int, seq: int, cp_size: int, has_sharder: bool, got: str) -> None:
    """Raise `ValueError` unless `local_len` positions per CP rank can hold the `seq` tokens of
    `input_ids`: exactly `seq` without context parallelism (and no external sharder), otherwise
    `C·S_l ≥ seq` with an even `S_l` (the load-balanced layout's two halves). `got` describes the
    offending shapes for the message."""
    if not has_sharder and cp_size == 1 and local_len != seq:
        raise ValueError(f"{what} must cover input_ids' {seq} positions without context parallelism; got {got}")
    if cp_size > 1 and (local_len * cp_size < seq or local_len % 2):
        raise ValueError(
            f"context-parallel {what} hold {local_len} positions on each of {cp_size} ranks; they must "
            f"cover input_ids' {seq} positions with an even local length (a multiple of 2·{cp_size} "
            "in all; pad the sequence to it)"
        )


def shard_padded_for_cp(x: Tensor, local_len: int, group: ProcessGroup | None) -> Tensor:
    """Canonical `x [B, S, ...]` zero-padded along dim 1 to `C·local_len`, then this rank's part.

    Equivalent to ``shard_for_cp_rank(pad(x, C·local_len), rank, C)``; without a CP group (or of
    size 1) only the padding to `local_len` applies. The caller checks `S <= C·local_len` with its
    own message.
    """
    cp_size = group_size(group)
    pad = local_len * cp_size - x.shape[1]
    if pad:
        x = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])  # [B, C·S_l, ...]
    return shard_for_cp_rank(x, group_rank(group), cp_size, seq_dim=1)


@boundary(roles=Roles(cp="group"))
def allgather_cp(x: Tensor, group: ProcessGroup | None, seq_dim: int = 1) -> Tensor:
    """Gather CP-sharded (load-balanced) tensors back into canonical sequence order.

    Equivalent to ``unshard([x_0, ..., x_{C-1}], seq_dim)`` where `x_r` is rank `r`'s `x`.

    Args:
        x: this rank's local tensor, same shape on every rank, even length along `seq_dim`.
        group: the CP process group; `None` or size 1 returns `x` unchanged.
        seq_dim: the sequence dim.

    Returns:
        The canonical tensor, `C·x.shape[seq_dim]` long along `seq_dim`, on every rank.

    Note:
        Gradient convention: the gradient of rank `r`'s `x` is the **sum over CP ranks** of the
        upstream gradients at `r`'s positions (one all-reduce of the gathered gradient). If every
        CP rank computes the same loss from the gathered tensor, divide that loss by `C`.
        Compiles with `fullgraph=True` (functional collectives); runs on gloo.

    Raises:
        ValueError: odd local length, bad `seq_dim`.
    """
    check_tensor("x", x)
    if group_size(group) == 1:
        return x
    seq_dim = _check_local(x, seq_dim)
    # one all-gather [C, *x.shape] whose backward sums the ranks' gradients, then canonical order
    return _unshard_stacked(all_gather_stack_summed_grad(x, group), seq_dim)

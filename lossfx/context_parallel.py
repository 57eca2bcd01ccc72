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

The split and its inverse are einops `rearrange` patterns (`"a0 (k n) ... -> k a0 n ..."` with
`k = 2C`, for any dims before and after the sequence dim); they trace under
`torch.compile(fullgraph=True)`. `lossfx.sequence_layout.LoadBalancedLayout` is this layout as
an object handed to every consumer.

Lengths that do not split evenly raise `ValueError` (the reference silently drops tokens).

The boundary: each public function here unwraps a replicated DTensor, validates its arguments
(ranks, sizes, `seq_dim`, lengths) once and calls the pure code in `lossfx._layouts.context_parallel`
once; the layouts (`lossfx.sequence_layout`) call that pure code directly.
"""

from __future__ import annotations

from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.deprecation import renamed_keywords
from lossfx._boundary.dtensor import replicated
from lossfx._boundary.validation import check_tensor
from lossfx._core.distributed import ProcessGroup, group_size
from lossfx._layouts import context_parallel as _pure

__all__ = ["allgather_cp", "cp_positions", "shard_for_cp_rank", "unshard"]


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
    return _pure.positions(length, cp_rank, cp_size)


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
    x = replicated(x, "x")  # a canonical tensor may be a Replicate() DTensor (lossfx/_boundary/dtensor.py)
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
    return _pure.shard(x, cp_rank, cp_size, seq_dim)


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
    return _pure.unshard(shards, _check_local(shards[0], seq_dim))


@renamed_keywords(group="context_parallel_group")
@boundary(roles=Roles(cp="context_parallel_group", cp_shards=("x",)))
def allgather_cp(x: Tensor, context_parallel_group: ProcessGroup | None, seq_dim: int = 1) -> Tensor:
    """Gather CP-sharded (load-balanced) tensors back into canonical sequence order.

    Equivalent to ``unshard([x_0, ..., x_{C-1}], seq_dim)`` where `x_r` is rank `r`'s `x`.

    Args:
        x: this rank's local tensor, same shape on every rank, even length along `seq_dim`.
        context_parallel_group: the CP process group; `None` or size 1 returns `x` unchanged
            (formerly `group=`, which still works with a FutureWarning).
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
    if group_size(context_parallel_group) == 1:
        return x
    seq_dim = _check_local(x, seq_dim)
    # one all-gather [C, *x.shape] whose backward sums the ranks' gradients, then canonical order
    return _pure.allgather(x, context_parallel_group, seq_dim)

"""Pure: the load-balanced context-parallel split, its inverse and the differentiable gather.

With `C` CP ranks a canonical sequence of length `L` (a multiple of `2C`) is cut into `2C`
equal chunks; rank `r` holds chunks `r` and `2C−1−r`, concatenated. The split and its inverse
are einops `rearrange` patterns (`"a0 (k n) ... -> k a0 n ..."` with `k = 2C`, for any dims before
and after the sequence dim); they trace under `torch.compile(fullgraph=True)`.

Plain tensors and ints in, already validated by the public boundary (`lossfx.context_parallel`):
`seq_dim` is non-negative, lengths split evenly, ranks and sizes are in range.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from lossfx._core.distributed import ProcessGroup, all_gather_stack_summed_grad, group_size

__all__ = ["allgather", "positions", "shard", "unshard", "unshard_stacked"]


def _lead(seq_dim: int) -> str:
    """The einops names of the `seq_dim` dims before the sequence dim: `"a0 a1"` for `seq_dim = 2`."""
    return " ".join(f"a{i}" for i in range(seq_dim))


def positions(length: int, cp_rank: int, cp_size: int) -> list[int]:
    """The canonical positions, in local order, that CP rank `cp_rank` holds of a length-`length`
    axis (`length` a multiple of `2·cp_size`, or `cp_size = 1`)."""
    if cp_size == 1:
        return list(range(length))
    n = length // (2 * cp_size)
    first, second = cp_rank * n, (2 * cp_size - 1 - cp_rank) * n
    return list(range(first, first + n)) + list(range(second, second + n))


def shard(x: Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> Tensor:
    """`x [..., L, ...]` -> this rank's `[..., L/C, ...]` (`seq_dim >= 0`, `L` a multiple of `2C`).

    Dense equivalent: ``torch.cat([x.chunk(2C, seq_dim)[r], x.chunk(2C, seq_dim)[2C-1-r]], seq_dim)``;
    `cp_size = 1` returns `x` itself.
    """
    if cp_size == 1:
        return x
    lead = _lead(seq_dim)
    chunks = rearrange(x, f"{lead} (k n) ... -> k {lead} n ...", k=2 * cp_size)  # [2C, ..., L/2C, ...]
    pair = torch.stack([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])
    return rearrange(pair, f"two {lead} n ... -> {lead} (two n) ...")


def unshard_stacked(stacked: Tensor, seq_dim: int) -> Tensor:
    """`[C, *local]` (rank order, local length `2n` along `seq_dim` of `local`) -> canonical."""
    lead = _lead(seq_dim)
    halves = rearrange(stacked, f"c {lead} (two n) ... -> two c {lead} n ...", two=2)  # [2, C, ..., n, ...]
    # rank r's first half is chunk r, its second half chunk 2C−1−r: chunks C .. 2C−1 are ranks C−1 .. 0
    chunks = torch.cat([halves[0], halves[1].flip(0)])  # [2C, ..., n, ...]
    return rearrange(chunks, f"k {lead} n ... -> {lead} (k n) ...")


def unshard(shards: list[Tensor] | tuple[Tensor, ...], seq_dim: int = 1) -> Tensor:
    """Every rank's local tensor (rank order, one shape) -> canonical; no communication.

    Dense equivalent: the inverse of `shard` over `r = 0 .. C−1`; one shard is returned as is.
    """
    if len(shards) == 1:
        return shards[0]
    return unshard_stacked(torch.stack(list(shards)), seq_dim)


def allgather(x: Tensor, group: ProcessGroup | None, seq_dim: int = 1) -> Tensor:
    """This rank's local `x` -> the canonical tensor on every rank of `group` (`None` or size 1: `x`).

    Dense equivalent: ``unshard([x_0, ..., x_{C-1}], seq_dim)``. One functional all-gather
    `[C, *x.shape]` whose backward sums the ranks' gradients (the summed-gradient convention of
    `lossfx.context_parallel.allgather_cp`).
    """
    if group_size(group) == 1:
        return x
    return unshard_stacked(all_gather_stack_summed_grad(x, group), seq_dim)

"""Process-group helpers that `torch.compile(fullgraph=True)` traces.

Every collective here is a functional collective (`torch.distributed._functional_collectives`):
Dynamo traces them into the graph, they run on gloo, and they never mutate their input. A `group`
of `None` or of world size 1 means "no collective": the callers take the same code path and skip
the communication, so the single-process result is bit-for-bit the world-1 result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather_stack",
    "all_reduce",
    "group_rank",
    "group_size",
    "is_distributed",
]

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of `group`; 1 for `None`."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in `group`; 0 for `None`."""
    return 0 if group is None else group.rank()


def is_distributed(group: ProcessGroup | None) -> bool:
    """True iff `group` has more than one rank, so collectives must run."""
    return group_size(group) > 1


def all_gather_stack(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Stack every rank's `x` along a new leading dim: `[*]` -> `[R, *]` (rank order)."""
    if not is_distributed(group):
        return x.unsqueeze(0)
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.8
    gathered = gather(x.contiguous(), 0, group)  # [R*d0, ...]
    gathered = funcol.wait_tensor(gathered)
    return gathered.view(group_size(group), *x.shape)


def all_reduce(x: Tensor, op: str, group: ProcessGroup | None) -> Tensor:
    """Out-of-place all-reduce (`op` in `"sum"`, `"max"`, `"min"`); identity without a group."""
    if not is_distributed(group):
        return x
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, group=group))


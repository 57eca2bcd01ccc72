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
from typing_extensions import TypeIs

from lossfx._core import host_reads as _host_reads

__all__ = [
    "all_gather_stack",
    "all_gather_stack_summed_grad",
    "all_reduce",
    "group_rank",
    "group_size",
    "is_distributed",
    "local_columns",
    "reduce_scatter_sum",
]

ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """World size of `group`; 1 for `None`."""
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in `group`; 0 for `None`."""
    return 0 if group is None else group.rank()


def is_distributed(group: ProcessGroup | None) -> TypeIs[ProcessGroup]:
    """True iff `group` has more than one rank, so collectives must run."""
    return group_size(group) > 1


def all_gather_stack(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Stack every rank's `x` along a new leading dim: `[*]` -> `[R, *]` (rank order)."""
    if not is_distributed(group):
        return x.unsqueeze(0)
    x = _host_reads.settle_before(x)  # the call's checks are read before its first collective
    # imported on first use, here and below: `import lossfx` loads no torch module that `import torch`
    # does not (tests/test_import.py)
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.8
    gathered = gather(x.contiguous(), 0, group)  # [R*d0, ...]
    gathered = funcol.wait_tensor(gathered)
    return gathered.view(group_size(group), *x.shape)


def all_reduce(x: Tensor, op: str, group: ProcessGroup | None) -> Tensor:
    """Out-of-place all-reduce (`op` in `"sum"`, `"max"`, `"min"`); identity without a group."""
    if not is_distributed(group):
        return x
    x = _host_reads.settle_before(x)
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), op, group=group))


def reduce_scatter_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum `x [R·d0, ...]` over ranks and keep this rank's `d0` rows; identity without a group."""
    if not is_distributed(group):
        return x
    x = _host_reads.settle_before(x)
    import torch.distributed._functional_collectives as funcol

    scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # torch < 2.8
    return funcol.wait_tensor(scatter(x.contiguous(), "sum", 0, group))


class _AllGatherStackFn(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return all_gather_stack(x, group)  # [R, *x.shape]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, dout):
        # every rank used every rank's x: sum the upstream gradients, keep this rank's slot
        total = all_reduce(dout.contiguous(), "sum", ctx.group)  # [R, *x.shape]
        return total[group_rank(ctx.group)], None  # one entry per forward input


def all_gather_stack_summed_grad(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Differentiable `all_gather_stack`: `[*]` -> `[R, *]`; the gradient of this rank's `x` is the
    sum over ranks of their upstream gradients at this rank's slot (the summed-gradient convention
    of context parallelism: when every rank computes the same loss, divide it by `R`)."""
    if not is_distributed(group):
        return x.unsqueeze(0)
    return _AllGatherStackFn.apply(x, group)


def local_columns(ids: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """`(local_idx, owned)` for global `ids` (any shape): the column inside this rank's shard
    `[vocab_start, vocab_start + local_vocab)`, 0 where the id is not owned, and the ownership."""
    local = ids - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    return torch.where(owned, local, torch.zeros_like(local)), owned

"""Top-k values and global ids over a vocabulary sharded across tensor-parallel ranks.

1. each rank takes its local top `min(k, Vl)` values and turns their columns into global ids,
   padded to `k' = min(k, R·Vl)` candidates with `(-inf, sentinel id)` (the sentinel sorts after
   every real id, so padding is never chosen while real candidates remain: there are at least
   `min(k', V)` of them), so that every rank sends the same number even when `k` exceeds a shard;
2. one all-gather of the candidates `[R, N, k']` (values and ids, a few scalars per row);
3. the global top-k is the top-k of the union of the candidates: every member of the global top-k
   is in its own shard's local top-k, since fewer than k values of that shard exceed it.

Ties are broken deterministically by the smaller global id (the result does not depend on the TP
size, on the chunking, or on `torch.topk`'s unspecified tie order). No gradient (a selection).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lossfx._boundary.consistency import Roles, boundary
from lossfx._boundary.dtensor import check_view, vocab_shard
from lossfx._boundary.validation import check_floating, check_positive_int
from lossfx._core.distributed import ProcessGroup, all_gather_stack, group_rank, group_size
from lossfx._core.numerics import compute_dtype

__all__ = ["vocab_topk"]


def _local_topk_columns(z: Tensor, k: int) -> Tensor:
    """Columns of the first `k` of each row of `z [N, Vl]` in (value desc, column asc) order."""
    kth = torch.topk(z, k, dim=-1).values[..., -1:]  # [N, 1], the k-th largest value
    above, tied = z > kth, z == kth  # [N, Vl]
    room = k - above.sum(dim=-1, keepdim=True)  # [N, 1], tied slots left
    take = above | (tied & (torch.cumsum(tied.to(torch.int32), dim=-1) <= room))  # exactly k per row
    columns = torch.arange(z.shape[-1], device=z.device)
    key = torch.where(take, -columns, -z.shape[-1] - 1)  # distinct keys on the taken columns
    return torch.topk(key, k, dim=-1).indices  # [N, k]


def _sorted_by_value_then_id(values: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """First `k` of `(values [N, M], ids [N, M])` ordered by value descending, then id ascending."""
    by_id = torch.argsort(ids, dim=-1, stable=True)  # [N, M]
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    by_value = torch.argsort(values, dim=-1, descending=True, stable=True)[..., :k]  # [N, k]
    return values.gather(-1, by_value), ids.gather(-1, by_value)


def _vocab_policy(arguments: Mapping[str, Any]) -> str:
    """The `vocab` policy of `vocab_topk`: shards tile the vocabulary, `min(k, R·Vl)` is equal."""
    k = arguments.get("k")
    return f"topk:{k}" if isinstance(k, int) and not isinstance(k, bool) and k > 0 else "free"


@boundary(
    roles=Roles(tp="group", shards=("logits",), start="vocab_start"),
    vocab=_vocab_policy,
    local=check_view("logits", even=True),
)
@torch.no_grad()
def vocab_topk(
    logits: Tensor,
    k: int,
    *,
    group: ProcessGroup | None = None,
    vocab_start: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The `k` largest logits per row of a (possibly sharded) vocabulary and their global ids.

    Equivalent to ``torch.topk(logits, k, dim=-1)`` on the full-vocabulary logits, with ties
    ordered by the smaller id, values in `promote_types(logits.dtype, float32)`.

    Args:
        logits: `[..., Vl]` this rank's shard (the full vocabulary without a group).
        k: how many per row; clamped to `V` (a `k` larger than the vocabulary returns all of it).
            With uneven plain shards (no DTensor), `k <= world_size · the smallest shard width`
            (checked across ranks).
        group: tensor-parallel group over the vocabulary, or `None`.
        vocab_start: first global id of this shard; default `rank · Vl`.

    Returns:
        `(values [..., min(k, V)], ids [..., min(k, V)] int64)`, identical on every rank,
        sorted by value descending.

    Raises:
        TypeError: non-float logits or non-int `k`. ValueError: `k <= 0`.

    Example:
        >>> import torch, lossfx
        >>> lossfx.vocab_topk(torch.tensor([[0.5, 2.0, 2.0, -1.0]]), 2)
        (tensor([[2., 2.]]), tensor([[1, 2]]))
    """
    s = vocab_shard(logits, group=group, vocab_start=vocab_start, even=True)  # lossfx/_boundary/dtensor.py
    logits, group, vocab_start, k = s.local, s.group, None if s.padded else s.vocab_start, s.at_most_vocab(k)
    check_floating("logits", logits)
    k = check_positive_int("k", k, allow_none=False)
    local_vocab = logits.shape[-1]
    if logits.dim() < 1 or local_vocab < 1:
        raise ValueError(f"logits must be [..., V_local] with V_local >= 1, got shape {tuple(logits.shape)}")
    world = group_size(group)
    if vocab_start is None:
        vocab_start = group_rank(group) * local_vocab
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, local_vocab).to(compute_dtype(logits.dtype))  # [N, Vl]
    k_out = min(k, world * local_vocab)  # equal on every rank (the consistency check enforces it)
    k_local = min(k_out, local_vocab)
    # 1. local candidates, ties broken by the smaller id (torch.topk's tie order is unspecified)
    columns = _local_topk_columns(flat, k_local)  # [N, k_local]
    values, ids = flat.gather(-1, columns), columns + vocab_start
    if k_local < k_out:  # k wider than this shard: pad to the common candidate count
        pad = (flat.shape[0], k_out - k_local)
        values = torch.cat([values, values.new_full(pad, float("-inf"))], dim=-1)
        ids = torch.cat([ids, ids.new_full(pad, torch.iinfo(torch.int64).max)], dim=-1)
    # 2. the union over ranks
    values = all_gather_stack(values, group)  # [R, N, k_out]
    ids = all_gather_stack(ids, group)  # [R, N, k_out]
    values = values.permute(1, 0, 2).reshape(flat.shape[0], world * k_out)  # [N, R·k_out]
    ids = ids.permute(1, 0, 2).reshape(flat.shape[0], world * k_out)
    # 3. the global top-k of the union
    values, ids = _sorted_by_value_then_id(values, ids, k_out)
    return values.view(*lead, k_out), ids.view(*lead, k_out)

"""Top-k values and global ids over a vocabulary sharded across tensor-parallel ranks: the pure kernel.

1. each rank takes its local top `min(k, Vl)` values and turns their columns into global ids,
   padded to `k' = min(k, R·Vl)` candidates with `(-inf, sentinel id)` (the sentinel sorts after
   every real id, so padding is never chosen while real candidates remain: there are at least
   `min(k', V)` of them), so that every rank sends the same number even when `k` exceeds a shard;
2. one all-gather of the candidates `[R, N, k']` (values and ids, a few scalars per row);
3. the global top-k is the top-k of the union of the candidates: every member of the global top-k
   is in its own shard's local top-k, since fewer than k values of that shard exceed it.

Ties are broken deterministically by the smaller global id (the result does not depend on the TP
size, on the chunking, or on `torch.topk`'s unspecified tie order). No gradient (a selection).

Pure: plain tensors and a `VocabRange` resolved by the public `lossfx.vocab_topk` (its boundary:
DTensor unwrapping and padding, argument checks, the cross-rank check); nothing is validated here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lossfx._core.distributed import all_gather_stack, group_size
from lossfx._core.numerics import compute_dtype
from lossfx._core.vocab import VocabRange

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


@torch.no_grad()
def vocab_topk(logits: Tensor, k: int, vocab: VocabRange) -> tuple[Tensor, Tensor]:
    """logits `[..., Vl]` (this rank's columns `vocab.start + [0, Vl)`), `k >= 1` ->
    `(values [..., k'], ids [..., k'] int64)`, `k' = min(k, R · Vl)`, the same on every rank.

    Dense: ``torch.topk(full_logits, k', dim=-1)`` with ties ordered by the smaller id, values in
    the compute dtype. `k'` must be equal on every rank (equal widths, or `k` small enough).
    """
    group, vocab_start = vocab.group, vocab.start
    local_vocab = logits.shape[-1]
    world = group_size(group)
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
